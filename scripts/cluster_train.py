"""Train the multimodal demo model on one or many nodes: the script every multi-node recipe launches.

One node, or each node of a cluster (``scripts/torchrun_multinode.sh`` builds this command; the SLURM
wrapper ``scripts/slurm_train.sbatch`` runs it once per node with ``srun``)::

    torchrun --nnodes=2 --nproc-per-node=4 --rdzv-backend=c10d --rdzv-endpoint=$HEAD:29500 --rdzv-id=job1 \\
        scripts/cluster_train.py --sp 4 --backend auto --steps 300

``num_nodes`` and ``devices`` come from torchrun (``WORLD_SIZE / LOCAL_WORLD_SIZE`` and
``LOCAL_WORLD_SIZE``), so the strategy knows which ranks share a node: Ulysses all-to-alls (``ulysses``,
``usp``'s inner axis) stay inside a node and ``backend="auto"`` prices cross-node traffic at the network's
bandwidth. Without torchrun it trains in one process (``--devices N``: Lightning starts N local ranks).

The global batch is ``--global-batch-size`` samples per step whatever the degrees (each data-parallel
replica reads ``global / dp``), so every run of the same arguments is the same optimization problem:
``tests/distributed/test_multinode.py`` launches two simulated nodes x two ranks on 127.0.0.1 and checks
the losses and parameters against one process (``--reference``).

``--report DIR`` writes ``DIR/<run>-rank<r>.json`` per rank (node, groups, ``auto``'s decision, per-step
global losses) and ``DIR/<run>-params.pt`` (rank 0's final parameters). ``--also BACKEND:SP`` trains
again after the first run, in the same processes, with another backend and degree.

Surviving faults (``docs/guides/preemption.md``): every ``--ckpt-every`` steps each run writes
``<ckpt-dir>/<run>/last.ckpt`` (``--ckpt-format``: one file, or a sharded directory), and a run that
finds a checkpoint there resumes from the newest one (``last.ckpt`` or a SLURM requeue's
``hpc_ckpt_<n>.ckpt``), mid-epoch included: the data module's loader restores its position, so a
resumed run trains on the same samples in the same order as one that never stopped. A restarted
torchrun (``--max-restarts``, set by ``scripts/torchrun_multinode.sh``) or a requeued SLURM job
therefore just runs the same command again. Under SLURM (``SLURM_JOB_ID`` set) the ranks keep
torchrun's numbering and Lightning's SLURM requeue on the signal ``--signal=USR1@...`` asks for
(``SlurmRequeueUnderTorchrun``).

``CLUSTER_TRAIN_FAULT=RANK:STEP[:node]`` (tests): on torchrun's first attempt only, rank ``RANK`` dies
(``os._exit``) in the middle of step ``STEP``, between its forward and its backward; with ``:node`` it
first kills its torchrun agent (``SIGKILL``), as if its node were lost.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import signal
import socket
import sys
from pathlib import Path

import lightning as L
import torch
import torch.distributed as dist
from lightning.fabric.plugins.environments import SLURMEnvironment, TorchElasticEnvironment

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))  # run from a checkout even without `pip install -e .`


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--sp", type=int, default=None, help="sequence-parallel degree (default: ranks per node)")
    p.add_argument("--backend", default="auto", help="attention backend (default: %(default)s)")
    p.add_argument("--ulysses-degree", type=int, default=None, help="usp's inner degree (default: the strategy's)")
    p.add_argument("--also", action="append", default=[], metavar="BACKEND:SP",
                   help="train again afterwards with this backend and degree (repeatable)")
    p.add_argument("--steps", type=int, default=300)
    p.add_argument("--global-batch-size", type=int, default=8, help="samples per optimizer step, all replicas")
    p.add_argument("--n-images", type=int, default=32, help="images per sequence (21 tokens each, + 9)")
    p.add_argument("--d-model", type=int, default=64)
    p.add_argument("--n-layers", type=int, default=2)
    p.add_argument("--n-heads", type=int, default=4)
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--precision", default="32-true", help="Lightning precision (64-true, bf16-mixed, ...)")
    p.add_argument("--accelerator", default="auto")
    p.add_argument("--devices", type=int, default=1, help="ranks to start without torchrun (ignored under it)")
    p.add_argument("--hardware", default=None,
                   help="cost-model preset backend='auto' prices with (e.g. h100-80gb; default: the device's)")
    p.add_argument("--timeout", type=float, default=300, help="seconds a collective may wait before failing")
    p.add_argument("--reference", action="store_true", help="one process, no strategy (the exactness reference)")
    p.add_argument("--report", type=Path, default=None, help="directory for per-rank reports and final parameters")
    p.add_argument("--log-dir", default="runs/cluster_train", help="TensorBoard directory (default: %(default)s)")
    p.add_argument("--samples-per-epoch", type=int, default=None,
                   help="samples per epoch, all replicas (default: enough for every step in one epoch, at least 64)")
    p.add_argument("--ckpt-dir", type=Path, default=Path("checkpoints/cluster_train"),
                   help="checkpoints go to CKPT_DIR/<run>/; a run resumes from the newest there (default: %(default)s)")
    p.add_argument("--ckpt-every", type=int, default=50,
                   help="write CKPT_DIR/<run>/last.ckpt every this many steps, and at the end; 0: never "
                        "(default: %(default)s)")
    p.add_argument("--ckpt-format", choices=("auto", "single", "sharded"), default="auto",
                   help="one file (rank 0 writes the whole state) or a sharded directory (every rank writes its "
                        "chunks; resumes under any layout); auto: the strategy's choice (default: %(default)s)")
    p.add_argument("--fresh", action="store_true", help="start from scratch even if CKPT_DIR/<run> holds a checkpoint")
    args = p.parse_args(argv)
    if args.ckpt_every < 0:
        p.error(f"--ckpt-every must be >= 0 (0: no checkpoints), got {args.ckpt_every}")
    runs = [(args.backend, args.sp)]
    for spec in args.also:
        backend, _, sp = spec.partition(":")
        if not backend or not sp.isdigit():
            p.error(f"--also wants BACKEND:SP such as usp:4, got {spec!r}")
        runs.append((backend, int(sp)))
    args.runs = runs
    return args


def launched_by_torchrun() -> bool:
    """torchrun (and any elastic launcher) sets ``WORLD_SIZE`` and ``LOCAL_WORLD_SIZE`` for every rank."""
    return "LOCAL_WORLD_SIZE" in os.environ and "WORLD_SIZE" in os.environ


def launch_topology(devices: int) -> tuple[int, int]:
    """``(num_nodes, devices per node)``: torchrun's (``WORLD_SIZE``, ``LOCAL_WORLD_SIZE``) when it launched
    us, else one node of ``devices``."""
    if launched_by_torchrun():
        world, local = int(os.environ["WORLD_SIZE"]), int(os.environ["LOCAL_WORLD_SIZE"])
        if world % local:
            raise SystemExit(f"cluster_train: WORLD_SIZE={world} is not a multiple of LOCAL_WORLD_SIZE={local}: "
                             "every node must start the same number of ranks (--nproc-per-node)")
        return world // local, local
    return 1, devices


class SlurmRequeueUnderTorchrun(SLURMEnvironment):
    """SLURM's requeue on its warning signal, torchrun's ranks: for ``srun ... torchrun`` (one torchrun per
    node, ``scripts/slurm_train.sbatch``).

    Lightning picks ``TorchElasticEnvironment`` under torchrun, even inside a SLURM job, so its SLURM
    auto-requeue (a handler for ``SIGUSR1``: checkpoint to ``hpc_ckpt_<n>.ckpt``, then rank 0 runs
    ``scontrol requeue``) never switches on; ``SLURMEnvironment`` itself would number the ranks by SLURM's
    tasks (one per node here). This is a ``SLURMEnvironment`` (so Lightning's signal connector installs the
    handler) whose ranks, world and rendezvous are torchrun's."""

    def __init__(self, auto_requeue: bool = True, requeue_signal: signal.Signals | None = None) -> None:
        super().__init__(auto_requeue=auto_requeue, requeue_signal=requeue_signal)
        self._torchrun = TorchElasticEnvironment()

    @property
    def creates_processes_externally(self) -> bool:
        return True

    @property
    def main_address(self) -> str:
        return self._torchrun.main_address

    @property
    def main_port(self) -> int:
        return self._torchrun.main_port

    @staticmethod
    def detect() -> bool:
        return launched_by_torchrun() and "SLURM_JOB_ID" in os.environ

    def world_size(self) -> int:
        return self._torchrun.world_size()

    def set_world_size(self, size: int) -> None:
        self._torchrun.set_world_size(size)

    def global_rank(self) -> int:
        return self._torchrun.global_rank()

    def set_global_rank(self, rank: int) -> None:
        self._torchrun.set_global_rank(rank)

    def local_rank(self) -> int:
        return self._torchrun.local_rank()

    def node_rank(self) -> int:
        return self._torchrun.node_rank()

    def validate_settings(self, num_devices: int, num_nodes: int) -> None:
        self._torchrun.validate_settings(num_devices, num_nodes)


def cluster_plugins() -> list:
    """The cluster environment to hand the Trainer: SLURM's requeue with torchrun's ranks inside a SLURM job
    launched by torchrun; Lightning's own choice otherwise."""
    return [SlurmRequeueUnderTorchrun()] if SlurmRequeueUnderTorchrun.detect() else []


_HPC_CHECKPOINT = re.compile(r"hpc_ckpt_(\d+)\.ckpt")  # the whole name: never a staging ``.hpc_ckpt_...saving-...``


def newest_checkpoint(ckpt_dir: Path) -> Path | None:
    """The checkpoint a restarted run resumes from: the most recently written of ``last.ckpt`` (the periodic
    one) and Lightning's SLURM requeue checkpoints ``hpc_ckpt_<n>.ckpt`` in ``ckpt_dir``; None if there is
    none. Both formats are written whole or not at all under these names (a sharded save stages in a hidden
    ``.<name>.saving-<id>`` directory and swaps it in complete; a single file is renamed into place), so
    the newest one found is complete."""
    if not ckpt_dir.is_dir():
        return None
    found = [p for p in ckpt_dir.iterdir() if p.name == "last.ckpt" or _HPC_CHECKPOINT.fullmatch(p.name)]
    return max(found, key=lambda p: p.stat().st_mtime, default=None)


class FaultInjection(L.Callback):
    """``CLUSTER_TRAIN_FAULT=RANK:STEP[:node]``: on torchrun's first attempt (``TORCHELASTIC_RESTART_COUNT`` 0
    or unset), rank ``RANK`` leaves at once (``os._exit``, no cleanup: a killed process) at step ``STEP``, after
    its forward and before its backward, so the other ranks are inside that step's collectives. ``node``: it
    kills its torchrun agent first (``SIGKILL``: the agent's node is gone, its other ranks are orphaned)."""

    def __init__(self, rank: int, step: int, node: bool = False) -> None:
        self.rank, self.step, self.node = rank, step, node

    @classmethod
    def from_env(cls) -> "FaultInjection | None":
        spec = os.environ.get("CLUSTER_TRAIN_FAULT")
        if not spec or os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") != "0":
            return None
        parts = spec.split(":")  # RANK, STEP[, "node"]
        if not (len(parts) in (2, 3) and parts[0].isdigit() and parts[1].isdigit() and parts[2:] in ([], ["node"])):
            raise SystemExit(f"cluster_train: CLUSTER_TRAIN_FAULT wants RANK:STEP or RANK:STEP:node such as 1:3, "
                             f"got {spec!r}")
        return cls(int(parts[0]), int(parts[1]), node=len(parts) == 3)

    def on_before_backward(self, trainer, pl_module, loss) -> None:
        if trainer.global_rank == self.rank and trainer.global_step == self.step:
            what = "its node lost" if self.node else "killed"
            print(f"cluster_train: rank {self.rank} {what} at step {self.step} (CLUSTER_TRAIN_FAULT)", flush=True)
            if self.node:
                os.kill(os.getppid(), signal.SIGKILL)  # the torchrun agent that started this rank
            os._exit(13)


class RunReport(L.Callback):
    """Records, on every rank, where it runs, its groups and the global (all-replica) loss of each step
    this process trained (``first_step``: the global step it started from, > 0 after a resume)."""

    def __init__(self) -> None:
        self.losses: list[float] = []
        self.info: dict = {}
        self.first_step: int | None = None  # stays None when a resume finds the run already done

    def on_train_start(self, trainer, pl_module) -> None:
        self.first_step = trainer.global_step

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        loss = outputs["loss"].detach().clone()
        # every rank joins; the mean over replicas is the global-batch loss because every sample of the digit
        # sequences supervises the same number of tokens (a token-count-weighted mean otherwise)
        if dist.is_initialized():
            dist.all_reduce(loss)
            loss /= dist.get_world_size()
        self.losses.append(float(loss.to(torch.float64)))

    def on_train_end(self, trainer, pl_module) -> None:
        self.info = describe_rank(trainer, pl_module)


def describe_rank(trainer, pl_module) -> dict:
    """This rank's place: node, groups (global ranks), ranks per node and what ``auto`` chose."""
    from lightning_sp import SequenceParallelAttention, SequenceParallelStrategy

    info = {"rank": trainer.global_rank, "local_rank": trainer.local_rank, "node_rank": trainer.node_rank,
            "hostname": socket.gethostname(), "launcher_pid": os.getppid(),
            "num_nodes": trainer.num_nodes, "devices": trainer.num_devices}
    strategy = trainer.strategy
    if not isinstance(strategy, SequenceParallelStrategy):
        return info
    ctx = strategy.context

    def ranks(group):
        return None if group is None else dist.get_process_group_ranks(group)

    dims = strategy.parallel_dims
    info.update(dp=dims.dp, sp=dims.sp, ring=dims.ring, ulysses=dims.ulysses, backend=strategy.backend,
                ranks_per_node=ctx.ranks_per_node, sp_group=ranks(ctx.group), dp_group=ranks(strategy.dp_group),
                ulysses_group=ranks(ctx.ulysses_group), ring_group=ranks(ctx.ring_group))
    modules = [m for m in pl_module.modules() if isinstance(m, SequenceParallelAttention)]
    info["resolved_backends"] = sorted({m.resolved_backend() for m in modules})
    choice = ctx.auto_choice
    if choice is not None:
        info["auto"] = {"label": choice.label, "summary": choice.summary(), "hardware": choice.hardware,
                        "predictions": {p.label: p.total_s for p in choice.predictions}}
    return info


def train(args: argparse.Namespace, backend: str, sp: int | None, num_nodes: int, devices: int) -> bool:
    """One run; False when it stopped before ``--steps`` (a preemption's save and requeue stop the ranks:
    the next start resumes it, and the runs after it must wait for that start)."""
    from lightning.pytorch.callbacks import ModelCheckpoint
    from lightning.pytorch.loggers import TensorBoardLogger

    from lightning_sp import SequenceParallelStrategy
    from lightning_sp.data import DigitSequenceDataModule
    from lightning_sp.models import MultimodalDecoder

    world = num_nodes * devices
    sp = sp or devices
    dp = max(world // sp, 1)
    if args.reference:
        strategy, run, dp = "auto", "reference", 1
    else:
        distributed_checkpoint = {"auto": None, "single": False, "sharded": True}[args.ckpt_format]
        strategy = SequenceParallelStrategy(
            sequence_parallel_size=sp, backend=backend, ulysses_degree=args.ulysses_degree,
            sequence_keys=("input_ids", "labels", "position_ids", "answer_mask"), shuffle=True,
            process_group_timeout=args.timeout, hardware=args.hardware, distributed_checkpoint=distributed_checkpoint)
        run = f"{backend}-sp{sp}-dp{dp}"
    if args.global_batch_size % dp:
        raise SystemExit(f"cluster_train: --global-batch-size={args.global_batch_size} must be a multiple of the "
                         f"data-parallel degree dp={dp} (world {world} / sp {sp})")
    L.seed_everything(args.seed, verbose=False)
    samples_per_epoch = args.samples_per_epoch or max(64, args.global_batch_size * args.steps)
    data = DigitSequenceDataModule(n_images=args.n_images, batch_size=args.global_batch_size // dp, val_samples=0,
                                   samples_per_epoch=samples_per_epoch, seed=args.seed)
    model = MultimodalDecoder(d_model=args.d_model, n_layers=args.n_layers, n_heads=args.n_heads, lr=args.lr,
                              warmup_steps=10)
    report = RunReport() if args.report else None
    fault = FaultInjection.from_env()
    ckpt_dir = args.ckpt_dir / run
    callbacks = [c for c in (report, fault) if c is not None]
    if args.ckpt_every:
        # one last.ckpt, replaced whole every ckpt_every steps (no last-v1.ckpt beside a resumed run's)
        callbacks.append(ModelCheckpoint(dirpath=ckpt_dir, every_n_train_steps=args.ckpt_every, save_top_k=0,
                                         save_last=True, enable_version_counter=False))
    resume_from = None if args.fresh else newest_checkpoint(ckpt_dir)

    trainer = L.Trainer(
        accelerator="cpu" if args.reference else args.accelerator,
        devices=1 if args.reference else devices, num_nodes=1 if args.reference else num_nodes,
        strategy=strategy, precision=args.precision, max_steps=args.steps, gradient_clip_val=1.0,
        limit_val_batches=0, enable_checkpointing=bool(args.ckpt_every), enable_model_summary=False,
        log_every_n_steps=1, enable_progress_bar=args.report is None, callbacks=callbacks,
        plugins=None if args.reference else cluster_plugins(),
        default_root_dir=ckpt_dir,  # where Lightning's SLURM requeue writes hpc_ckpt_<n>.ckpt
        logger=TensorBoardLogger(args.log_dir, name=run, default_hp_metric=False),
    )
    if resume_from is not None and trainer.global_rank == 0:
        print(f"cluster_train: {run}: resuming from {resume_from}", flush=True)
    trainer.fit(model, data, ckpt_path=resume_from)
    if trainer.global_step < args.steps:
        if trainer.global_rank == 0:
            print(f"cluster_train: {run}: stopped at step {trainer.global_step} of {args.steps}; the next start "
                  "resumes it", flush=True)
        return False
    if report is None:
        return True
    args.report.mkdir(parents=True, exist_ok=True)
    first_step = trainer.global_step if report.first_step is None else report.first_step
    info = {"rank": trainer.global_rank, **report.info, "run": run, "losses": report.losses, "first_step": first_step,
            "resumed_from": None if resume_from is None else str(resume_from),
            "restart_count": int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))}
    (args.report / f"{run}-rank{trainer.global_rank}.json").write_text(json.dumps(info, indent=1) + "\n")
    if trainer.global_rank == 0:
        params = {k: v.detach().cpu() for k, v in model.state_dict().items()}
        torch.save(params, args.report / f"{run}-params.pt")
    if trainer.global_rank == 0 and report.losses:
        print(f"cluster_train: {run}: steps {first_step + 1}-{first_step + len(report.losses)}, loss "
              f"{report.losses[0]:.4f} -> {report.losses[-1]:.4f}; report in {args.report}", flush=True)
    return True


def restore_requeue_signal() -> None:
    """``torchrun_multinode.sh`` starts torchrun ignoring SIGUSR1 (SLURM's warning signal reaches every process
    of the step, and its default action would end the agent) and the ranks inherit that; Lightning installs
    its requeue handler only over the default disposition, so the ranks put the default back."""
    if signal.getsignal(signal.SIGUSR1) is signal.SIG_IGN:
        signal.signal(signal.SIGUSR1, signal.SIG_DFL)


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    restore_requeue_signal()
    if not torch.cuda.is_available():
        torch.set_num_threads(1)  # ranks of a node share its cores
    num_nodes, devices = launch_topology(args.devices)
    if os.environ.get("RANK", "0") == "0":
        print(f"cluster_train: num_nodes={num_nodes} x devices={devices}; runs {args.runs}", flush=True)
    for backend, sp in args.runs[: 1 if args.reference else None]:
        if not train(args, backend, sp, num_nodes, devices):
            break


def leave_without_finalizing() -> None:
    """Under torchrun, once every run is done and written: flush and leave without the interpreter's
    finalization. Lightning's and DDP's own gloo collectives (gradient all-reduces, barriers) do not go through
    ``lightning_sp.comm.release.collective``, so gloo's worker thread may still be letting go of one's tensors
    when the interpreter finalizes, and then the process aborts ("terminate called without an active exception",
    SIGABRT) after correct output: Note [gloo drops a collective's tensors on its worker thread]. Seen once in
    ``tests/distributed/test_multinode.py`` under the full suite's load (2026-11-28: one rank of a simulated node,
    after all three runs had trained and reported), which torchrun reports as a failed job. Everything this
    script writes is closed by then (reports by ``write_text``/``torch.save``, TensorBoard by the logger's
    ``finalize`` at the end of ``fit``)."""
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


if __name__ == "__main__":
    main()
    if launched_by_torchrun():
        leave_without_finalizing()
