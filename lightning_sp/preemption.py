"""Preemption that loses nothing: a requeue signal (SLURM's ``--signal=USR1@<seconds>``) makes every rank
save together at the next optimizer-step boundary; then rank 0 requeues the job and the run stops.

What survives what (with ``SequenceParallelStrategy``, single-file and sharded checkpoints alike):

- **A preemption signal** (to any rank or all of them, at any moment of a step): every optimizer step
  taken before it; the step it interrupted finishes first. The restarted job resumes from
  ``<default_root_dir>/hpc_ckpt_<n>.ckpt`` through Lightning's own lookup (automatically on SLURM, or
  ``trainer.fit(..., ckpt_path="hpc")``) exactly where the uninterrupted run would be.
- **A save killed mid-way** (the job killed before the save completed): the previous checkpoint. The
  half-written copy is staged under ``.lightning_sp-staging/``, never taken for a checkpoint by Lightning's
  lookups, and removed at the next setup or load (``lightning_sp.checkpoint.clean_stale_staging``).
- **A full disk or a read-only directory**: the save raises ``CheckpointSaveError`` on every rank naming
  the checkpoint and the cause, and leaves nothing under the checkpoint's name; an unwritable directory is
  found at setup, before any training time is spent (``lightning_sp.checkpoint.probe_directories``).

Note [Preemption at a step boundary]
    Lightning's own SLURM handler saves inside the signal handler, and each rank is wherever the signal
    found it (a ring receive, backward, the batch agreement, the loss all-reduce): the save's collectives
    pair with the step's, and the ranks stall for the process-group timeout (under FSDP2 the parameters
    are unsharded mid-forward and the save fails). Here the signal only sets a flag::

        signal (any rank, any moment)     ->  flag = 1
        end of every optimizer step, every rank at the same point:
            requested = all-reduce MAX(flag)                      one int64 on the group's device
            if requested:
                n = all-reduce MAX(next hpc number)               each rank has listed the folder
                trainer.save_checkpoint(<root>/hpc_ckpt_<n>.ckpt) the strategy's save: every format
                rank 0: requeue (``scontrol requeue <job id>``)   after the save completed everywhere
                every rank: trainer.should_stop = True

    Whether a rank joins the flag all-reduce depends only on the step counters, the same on every rank
    (STYLE 17); the save number is agreed, so the ranks never write two names for one save.
"""

from __future__ import annotations

import logging
import os
import re
import signal as signal_module
import subprocess
import threading
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
from lightning.pytorch.callbacks import Callback
from typing_extensions import override

from lightning_sp.comm.release import collective

if TYPE_CHECKING:
    import lightning.pytorch as pl

log = logging.getLogger(__name__)

__all__ = ["Preemption", "PreemptionCallback", "slurm_requeue"]


@dataclass(kw_only=True)
class Preemption:
    """What a requeue signal does under ``SequenceParallelStrategy`` (Note [Preemption at a step boundary])."""

    enabled: bool | None = None
    """``None``: when Lightning's cluster environment is ``SLURMEnvironment(auto_requeue=True)`` (its default
    on SLURM); ``True`` anywhere (the signal is then handled without SLURM); ``False``: never."""
    signal: int | None = None
    """The requeue signal; ``None``: the SLURM environment's ``requeue_signal`` (``SIGUSR1`` elsewhere)."""
    requeue: Callable[[], Any] | None = None
    """Called on rank 0 once the checkpoint is saved; ``None``: ``scontrol requeue`` of this SLURM job."""

    def __post_init__(self) -> None:
        if self.enabled not in (None, True, False):
            raise ValueError(f"Preemption(enabled=...) is True, False or None (on SLURM with auto-requeue), got {self.enabled!r}")
        if self.signal is not None and self.signal not in signal_module.valid_signals():
            raise ValueError(f"Preemption(signal={self.signal!r}) is not a signal of this platform; SLURM sends "
                             f"SIGUSR1 by default (sbatch --signal=USR1@90)")
        if self.signal in (signal_module.SIGKILL, getattr(signal_module, "SIGSTOP", None)):
            raise ValueError(f"Preemption(signal={self.signal!r}) cannot be caught; use SIGUSR1 (sbatch --signal=USR1@90)")
        if self.requeue is not None and not callable(self.requeue):
            raise ValueError(f"Preemption(requeue=...) is a callable run on rank 0, got {type(self.requeue).__name__}")


def slurm_requeue() -> int:
    """``scontrol requeue`` this SLURM job (an array task as ``<array job>_<task>``); its exit status."""
    array_job = os.environ.get("SLURM_ARRAY_JOB_ID")
    job = f"{array_job}_{os.environ['SLURM_ARRAY_TASK_ID']}" if array_job else os.environ.get("SLURM_JOB_ID")
    if not job or not re.fullmatch(r"[0-9_]+", job):
        raise RuntimeError(f"cannot requeue: SLURM_JOB_ID is {job!r}; outside SLURM pass Preemption(requeue=...)")
    return subprocess.call(["scontrol", "requeue", job])


def _on_group_device(value: int, device: torch.device | None) -> torch.Tensor:
    """``value`` as a one-element int64 tensor where the world group's backend takes it (NCCL: CUDA only)."""
    t = torch.tensor([value], dtype=torch.int64)
    if dist.get_backend() == "nccl":
        on_gpu = device is not None and device.type == "cuda"
        t = t.to(device if on_gpu else torch.device("cuda", torch.cuda.current_device()))
    return t


def agree_max(value: int, device: torch.device | None = None) -> int:
    """The largest ``value`` over every rank of the world (one all-reduce every rank must join)."""
    if not (dist.is_available() and dist.is_initialized()):
        return value
    t = _on_group_device(value, device)
    collective(dist.all_reduce, t, op=dist.ReduceOp.MAX)
    return int(t.item())


def _hpc_number(root: str) -> int:
    """The number Lightning would give the next ``hpc_ckpt_<n>.ckpt`` in ``root`` (its own lookup)."""
    from lightning.pytorch.trainer.connectors.checkpoint_connector import _CheckpointConnector

    path = _CheckpointConnector.hpc_save_path(root)
    return int(re.search(r"hpc_ckpt_(\d+)\.ckpt$", str(path)).group(1))


class PreemptionCallback(Callback):
    """Note [Preemption at a step boundary], wired by ``SequenceParallelStrategy`` (``attach``):
    ``on_train_start`` installs the flag, ``on_train_batch_end`` agrees and saves, ``on_exception`` and
    ``teardown`` put the previous handler back."""

    def __init__(self, settings: Preemption, signum: int, device: torch.device | None = None) -> None:
        self.settings, self.signum, self.device = settings, signum, device
        self.requested = False
        """A signal arrived on this rank since the last agreement."""
        self.saved_path: str | None = None
        """Where the preemption checkpoint went (set on every rank once it is saved)."""
        self._previous: Any = None
        self._installed = False

    # ------------------------------------------------------------------------------ the signal
    def _on_signal(self, signum: int, frame: Any) -> None:
        self.requested = True  # nothing else: the ranks act together at the next step boundary

    def attach(self, trainer: "pl.Trainer") -> None:
        """Join ``trainer``'s callbacks (once) and stand in for Lightning's SLURM handler, which would save
        inside the signal handler: Lightning then registers this flag instead (from the sanity check on)."""
        trainer.callbacks[:] = [c for c in trainer.callbacks if not isinstance(c, PreemptionCallback)] + [self]
        trainer._signal_connector._slurm_sigusr_handler_fn = self._on_signal  # read when Lightning registers

    def arm(self) -> None:
        """Install the flag for ``signum`` (main thread only, as Lightning does); Lightning's teardown puts
        back what was there before it registered its own handlers."""
        if threading.current_thread() is not threading.main_thread():
            return
        self._previous = signal_module.signal(self.signum, self._on_signal)
        self._installed = True

    def disarm(self) -> None:
        """Put the previous handler back, unless Lightning's teardown already did."""
        if self._installed and signal_module.getsignal(self.signum) == self._on_signal:
            signal_module.signal(self.signum, self._previous if self._previous is not None else signal_module.SIG_DFL)
        self._installed = False

    @override
    def on_train_start(self, trainer: "pl.Trainer", pl_module: "pl.LightningModule") -> None:
        self.saved_path = None  # (a signal in the sanity check already set the flag: it stays)
        self.arm()

    # ------------------------------------------------------------------------------ the step boundary
    @override
    def on_train_batch_end(self, trainer: "pl.Trainer", pl_module: "pl.LightningModule", outputs: Any, batch: Any,
                           batch_idx: int) -> None:
        if pl_module.automatic_optimization and trainer.fit_loop.epoch_loop._should_accumulate():
            return  # mid-accumulation: the gradients so far are in no checkpoint; wait for the optimizer step
        if self.saved_path is not None or not agree_max(int(self.requested), self.device):
            return
        self.save_requeue_stop(trainer)

    def save_requeue_stop(self, trainer: "pl.Trainer") -> None:
        """Every rank: save ``hpc_ckpt_<n>.ckpt`` under an agreed ``n``; rank 0: requeue; every rank: stop."""
        root = str(trainer.default_root_dir)
        number = agree_max(_hpc_number(root), self.device)
        path = os.path.join(root, f"hpc_ckpt_{number}.ckpt")
        if trainer.is_global_zero:
            log.info("preemption signal: saving %s at global step %d", path, trainer.global_step)
        trainer.save_checkpoint(path)
        self.saved_path = path
        if trainer.is_global_zero:
            self._requeue()
        trainer.should_stop = True
        # min_epochs / min_steps would keep the loop going past a preemption: the checkpoint is saved
        trainer.fit_loop.min_epochs = None
        trainer.fit_loop.epoch_loop.min_steps = None

    def _requeue(self) -> None:
        requeue = self.settings.requeue or slurm_requeue
        try:
            status = requeue()
        except Exception as err:  # noqa: BLE001 - the checkpoint is saved; the other ranks are stopping
            log.error("preemption: the checkpoint is saved but requeueing failed (%s: %s); resubmit the job, it "
                      "resumes from %s", type(err).__name__, err, self.saved_path)
            return
        if isinstance(status, int) and status != 0:
            log.error("preemption: the requeue command exited with status %d; resubmit the job, it resumes from %s",
                      status, self.saved_path)

    # ------------------------------------------------------------------------------ the end of the run
    @override
    def on_exception(self, trainer: "pl.Trainer", pl_module: "pl.LightningModule", exception: BaseException) -> None:
        self.disarm()

    @override
    def teardown(self, trainer: "pl.Trainer", pl_module: "pl.LightningModule", stage: str) -> None:
        self.disarm()


def checkpoint_directories(trainer: "pl.Trainer", preemption: PreemptionCallback | None) -> list[str]:
    """The local directories ``trainer`` will save checkpoints in: each ``ModelCheckpoint``'s, and the
    default root directory where preemption saves ``hpc_ckpt_<n>.ckpt``."""
    dirs = [cb.dirpath for cb in trainer.checkpoint_callbacks if getattr(cb, "dirpath", None)]
    if preemption is not None:
        dirs.append(trainer.default_root_dir)
    local = [str(d) for d in dirs if "://" not in str(d) or str(d).startswith("file://")]
    return list(dict.fromkeys(d.removeprefix("file://") for d in local))


def preemption_callback(settings: Preemption | None, cluster_environment: Any,
                        device: torch.device | None = None) -> PreemptionCallback | None:
    """The callback for ``settings`` under ``cluster_environment`` (``None`` when preemption is off)."""
    from lightning.fabric.plugins.environments import SLURMEnvironment

    settings = settings or Preemption()
    slurm = isinstance(cluster_environment, SLURMEnvironment)
    enabled = settings.enabled if settings.enabled is not None else bool(slurm and cluster_environment.auto_requeue)
    if not enabled:
        return None
    signum = settings.signal
    if signum is None:
        signum = (cluster_environment.requeue_signal if slurm else None) or signal_module.SIGUSR1
    return PreemptionCallback(settings, int(signum), device)
