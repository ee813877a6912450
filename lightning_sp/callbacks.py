"""``SequenceParallelMonitor``: tokens/s, model TFLOP/s, MFU, peak memory and communication per step.

Logged to the Trainer's loggers in three tag groups (the run name, e.g. ``runs/<experiment>/
zigzag_ring-P4-N2048``, says the backend, so runs overlay in one chart per tag):

- ``throughput/tokens_per_s``: global tokens of the step (all dp replicas, unpadded) / wall time of the
  step; ``throughput/step_time_s``; ``throughput/tflops``: model FLOP/s of the whole job in TFLOP/s;
  ``throughput/mfu``: that over ``peak_flops * world`` (``throughput/measured_peak_tflops`` with
  ``peak_flops="measure"``);
- ``memory/peak_gib``: CUDA peak allocated memory of this rank (reset every step), or the process's
  peak RSS on CPU;
- ``communication/mib``: MiB this rank sent during the step in sequence-parallel (``context.comm``)
  and tensor-parallel (``tensor_parallel_context.comm``) collectives; ``communication/sp_mib`` and
  ``communication/tp_mib`` the two parts; ``communication/sp/<op>_mib``, ``communication/tp/<op>_mib``
  per operation (byte convention: ``lightning_sp.comm.stats``). Data-parallel gradient traffic
  (DDP/FSDP) is not counted.

TensorBoard's default tab (Time Series) groups tags by their first path component, sorts the groups
(digits, then upper case, then lower case) and expands the first two. The project's modules therefore
log their loss as ``Loss/train`` and ``Loss/val`` (capital ``L``: the group sorts before every lower-case
one, Lightning's ``epoch`` included), so a run opens on the loss; the monitor's groups follow. At fit start
the monitor also writes a Custom Scalars layout (``TENSORBOARD_LAYOUT``) with the categories in a fixed
order: Loss, Throughput, Memory, Communication (``tensorboard --logdir runs/<experiment>``, *Custom
Scalars* tab).

Model FLOPs follow Megatron (Korthikanti et al. 2022), per iteration of a decoder with ``L`` layers,
hidden ``h``, vocabulary ``V``, batch ``B`` and sequence ``s``:
``72 * B * L * s * h^2 * (1 + s / (6h) + V / (12 h L))`` (forward + backward).
"""

from __future__ import annotations

import resource
import sys
import time
from collections.abc import Callable
from typing import Any

import lightning.pytorch as pl
import torch
from lightning.pytorch.callbacks import Callback
from typing_extensions import override

from lightning_sp.flops import megatron_flops_per_iteration

__all__ = ["TENSORBOARD_LAYOUT", "SequenceParallelMonitor", "megatron_flops_per_iteration", "write_tensorboard_layout"]

# Custom Scalars layout: category -> chart title -> ["Multiline", [tag regexes]]; categories in this order.
TENSORBOARD_LAYOUT: dict[str, dict[str, list]] = {
    "Loss": {
        "train loss": ["Multiline", [r"^Loss/train$", r"^train.*loss"]],  # the project's tag, then the usual ones
        "validation loss": ["Multiline", [r"^Loss/val$", r"^val.*loss"]],
    },
    "Throughput": {
        "tokens/s (global)": ["Multiline", [r"^throughput/tokens_per_s$"]],
        "model TFLOP/s (job)": ["Multiline", [r"^throughput/tflops$"]],
        "MFU": ["Multiline", [r"^throughput/mfu$"]],
        "step time (s)": ["Multiline", [r"^throughput/step_time_s$"]],
    },
    "Memory": {
        "peak memory per rank (GiB)": ["Multiline", [r"^memory/peak_gib$"]],
    },
    "Communication": {
        "MiB sent per rank and step": ["Multiline", [r"^communication/(sp_|tp_)?mib$"]],
        "by operation (MiB)": ["Multiline", [r"^communication/(sp|tp)/"]],
    },
}


def write_tensorboard_layout(trainer: "pl.Trainer", layout: dict | None = None) -> int:
    """Write ``layout`` (default ``TENSORBOARD_LAYOUT``) into every ``TensorBoardLogger`` of ``trainer``
    (rank zero writes; others are no-ops); returns how many loggers got it."""
    from lightning.pytorch.loggers import TensorBoardLogger

    n = 0
    for logger in trainer.loggers:
        if isinstance(logger, TensorBoardLogger):
            writer = logger.experiment  # a SummaryWriter on rank zero, a no-op stand-in elsewhere
            if hasattr(writer, "add_custom_scalars"):
                writer.add_custom_scalars(layout or TENSORBOARD_LAYOUT)
                writer.flush()
            n += 1
    return n

# dense bf16 peak FLOP/s per device, used when peak_flops is not given
_PEAK_BF16 = {"H200": 989e12, "H100": 989e12, "A100": 312e12, "A800": 312e12, "H800": 989e12, "L40S": 362e12,
              "A10G": 125e12, "V100": 125e12}


def _find(config: Any, names: tuple[str, ...]) -> int | None:
    for n in names:
        value = config.get(n) if isinstance(config, dict) else getattr(config, n, None)
        if isinstance(value, int):
            return value
    return None


class SequenceParallelMonitor(Callback):
    """Log throughput, MFU, memory and communication volume every ``log_every_n_steps`` steps.

    Args:
        flops_per_iteration: ``f(batch, seq_len) -> FLOPs`` of one forward+backward over a global
            batch; default: Megatron's formula from the module's config (``pl_module.config`` or
            ``pl_module.hparams`` with ``num_layers``/``n_layer``, ``hidden``/``d_model``/``n_embd``
            and ``vocab_size``); MFU/TFLOP/s are skipped if neither is available.
        peak_flops: peak FLOP/s of one device; default: a table for known GPUs, none on CPU (no MFU).
            ``"measure"``: time a dense matmul in the training dtype on this device at setup and use
            that rate (MFU is then relative to the device's measured matmul rate, not a vendor peak;
            the rate is logged as ``measured_peak_tflops``).
        log_every_n_steps: logging interval in optimizer steps.
    """

    def __init__(
        self,
        *,
        flops_per_iteration: Callable[[int, int], float] | None = None,
        peak_flops: float | str | None = None,
        log_every_n_steps: int = 1,
    ) -> None:
        if isinstance(peak_flops, str) and peak_flops != "measure":
            raise ValueError(f"peak_flops must be a number, None or 'measure', got {peak_flops!r}")
        if log_every_n_steps < 1:
            raise ValueError(f"log_every_n_steps must be >= 1, got {log_every_n_steps}")
        self.flops_per_iteration = flops_per_iteration
        self.peak_flops = peak_flops
        self.log_every_n_steps = log_every_n_steps
        self._t0: float | None = None
        self._batch_shape: tuple[int, int] | None = None
        self.last_metrics: dict[str, float] = {}

    # ------------------------------------------------------------------ helpers
    @staticmethod
    def _strategy_info(trainer: "pl.Trainer") -> tuple[str, Any, int, int]:
        """(backend, context or None, dp degree, sp degree)."""
        from lightning_sp.strategy import SequenceParallelStrategy

        s = trainer.strategy
        if isinstance(s, SequenceParallelStrategy):
            return s.backend, s.context, s.parallel_dims.dp, s.parallel_dims.sp
        return "local", None, trainer.world_size, 1

    @staticmethod
    def _tp_comm(trainer: "pl.Trainer") -> Any:
        """The tensor-parallel byte counters (``CommStats``) when the job has tp > 1, else ``None``."""
        from lightning_sp.strategy import SequenceParallelStrategy

        s = trainer.strategy
        if isinstance(s, SequenceParallelStrategy) and s.tensor_parallel_size > 1:
            return s.tensor_parallel_context.comm
        return None

    def _default_flops(self, pl_module: "pl.LightningModule") -> Callable[[int, int], float] | None:
        config = getattr(pl_module, "config", None) or dict(getattr(pl_module, "hparams", {}))
        n_l = _find(config, ("num_layers", "n_layer", "n_layers", "num_hidden_layers"))
        h = _find(config, ("hidden", "hidden_size", "d_model", "n_embd", "dim"))
        v = _find(config, ("vocab_size", "vocab", "n_vocab"))
        if None in (n_l, h, v):
            return None
        return lambda b, s: megatron_flops_per_iteration(batch=b, seq_len=s, num_layers=n_l, hidden=h, vocab=v)

    @staticmethod
    def measure_matmul_flops(device: torch.device, dtype: torch.dtype = torch.float32, size: int | None = None,
                             seconds: float = 0.5) -> float:
        """Achieved FLOP/s of repeated ``[size, size] @ [size, size]`` matmuls on ``device``. ``size=None``:
        8192 on a GPU (smaller matmuls stay well below the peak there), 1024 on CPU."""
        if size is None:
            size = 8192 if device.type == "cuda" else 1024
        a = torch.randn(size, size, device=device, dtype=dtype)
        b = torch.randn(size, size, device=device, dtype=dtype)
        a @ b  # warm-up
        n, t0 = 0, time.perf_counter()
        while True:
            a @ b
            n += 1
            if device.type == "cuda":
                torch.cuda.synchronize(device)
            dt = time.perf_counter() - t0
            if dt >= seconds:
                return 2.0 * size**3 * n / dt

    @override
    def on_fit_start(self, trainer: "pl.Trainer", pl_module: "pl.LightningModule") -> None:
        write_tensorboard_layout(trainer)
        if self.peak_flops == "measure":  # here, not in setup: the module is on its device, in its final dtype
            dtype = next((p.dtype for p in pl_module.parameters()), torch.float32)
            self._measured_peak = self.measure_matmul_flops(pl_module.device, dtype)

    def _peak(self, device: torch.device) -> float | None:
        if self.peak_flops == "measure":
            return getattr(self, "_measured_peak", None)
        if self.peak_flops is not None:
            return self.peak_flops
        if device.type == "cuda":
            name = torch.cuda.get_device_name(device)
            for key, value in _PEAK_BF16.items():
                if key in name:
                    return value
        return None

    @staticmethod
    def _peak_mem_gib(device: torch.device) -> float:
        if device.type == "cuda":
            return torch.cuda.max_memory_allocated(device) / 2**30
        rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss  # KiB on Linux, bytes on macOS
        return rss / (2**30 if sys.platform == "darwin" else 2**20)

    # ------------------------------------------------------------------ hooks
    @override
    def on_train_batch_start(self, trainer: "pl.Trainer", pl_module: "pl.LightningModule", batch: Any, batch_idx: int) -> None:
        _, context, _, _ = self._strategy_info(trainer)
        if batch_idx % trainer.accumulate_grad_batches == 0:
            for comm in (context.comm if context is not None else None, self._tp_comm(trainer)):
                if comm is not None:
                    comm.reset()
        if pl_module.device.type == "cuda" and batch_idx % trainer.accumulate_grad_batches == 0:
            torch.cuda.reset_peak_memory_stats(pl_module.device)
        if self._t0 is None or batch_idx % trainer.accumulate_grad_batches == 0:
            self._t0 = time.perf_counter()
            self._tokens = 0

        self._tokens += self._global_tokens(trainer, batch)

    def _global_tokens(self, trainer: "pl.Trainer", batch: Any) -> int:
        """Unpadded tokens of this micro-batch over all dp replicas."""
        _, context, dp, _ = self._strategy_info(trainer)
        ids = batch.get("input_ids") if isinstance(batch, dict) else (batch[0] if isinstance(batch, (list, tuple)) else batch)
        if not isinstance(ids, torch.Tensor) or ids.dim() < 2:
            return 0
        seq_len = context.global_seq_len if context is not None and context.global_seq_len else ids.size(1)
        self._batch_shape = (ids.size(0) * dp, seq_len)
        return ids.size(0) * seq_len * dp

    @override
    def on_train_batch_end(self, trainer: "pl.Trainer", pl_module: "pl.LightningModule", outputs: Any, batch: Any, batch_idx: int) -> None:
        if (batch_idx + 1) % trainer.accumulate_grad_batches != 0 or self._t0 is None:
            return
        if pl_module.device.type == "cuda":
            torch.cuda.synchronize(pl_module.device)
        dt = max(time.perf_counter() - self._t0, 1e-9)
        _, context, _, _ = self._strategy_info(trainer)
        if trainer.global_step % self.log_every_n_steps != 0:
            return
        metrics: dict[str, float] = {"throughput/tokens_per_s": self._tokens / dt, "throughput/step_time_s": dt,
                                     "memory/peak_gib": self._peak_mem_gib(pl_module.device)}
        flops_fn = self.flops_per_iteration or self._default_flops(pl_module)
        if flops_fn is not None and self._batch_shape is not None:
            b, s = self._batch_shape
            flops = flops_fn(b * trainer.accumulate_grad_batches, s)
            metrics["throughput/tflops"] = flops / dt / 1e12
            peak = self._peak(pl_module.device)
            if peak:
                metrics["throughput/mfu"] = flops / dt / (peak * trainer.world_size)
                if self.peak_flops == "measure":
                    metrics["throughput/measured_peak_tflops"] = peak / 1e12
        total = 0
        for axis, comm in (("sp", context.comm if context is not None else None), ("tp", self._tp_comm(trainer))):
            if comm is None:
                continue
            total += comm.total_bytes
            metrics[f"communication/{axis}_mib"] = comm.total_bytes / 2**20
            for op, nbytes in comm.snapshot().items():
                metrics[f"communication/{axis}/{op}_mib"] = nbytes / 2**20
        metrics["communication/mib"] = total / 2**20
        self.last_metrics = metrics
        if trainer.logger is not None:
            for logger in trainer.loggers:
                logger.log_metrics(metrics, step=trainer.global_step)
