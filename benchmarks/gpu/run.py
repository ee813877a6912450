#!/usr/bin/env python
"""The GPU measurements in one command: per-rank schedule efficiency, kernels, longest context,
model throughput (MFU). Smoke-tested on CPU (``--smoke``); run on one H200 (``results/2026-11-28_h200/``).

    PYTHONPATH=. python -m benchmarks.gpu.run                     # one GPU, the defaults (sized for one 10-minute call)
    PYTHONPATH=. python -m benchmarks.gpu.run --sections schedule --local-lens 8192 16384 32768 65536 131072
    PYTHONPATH=. python -m benchmarks.gpu.run --sections longest --model-lens 262144 524288 786432
    PYTHONPATH=. python -m benchmarks.gpu.run --sections longest --model-worlds 8 16 32 --model-lens 4194304
    .venv/bin/python -m benchmarks.gpu.run --smoke --out /tmp/x   # CPU, tiny shapes (tests/experiments)

The defaults are guesses at what fits one call of about ten minutes on an H100: ``schedule`` at P =
4, 8, 16 with 16K tokens per rank, ``longest`` up to 131K at P = 1, ``mfu`` at 32K and 131K.
A full step of the 33-layer model at 500K tokens should take several minutes by itself, because
bidirectional attention is quadratic. Give the long lengths their own call, and keep ``--budget-s``
under the call's limit.

Other ranks are simulated: one process joins a *fake* process group (``torch.testing._internal.
distributed.fake_pg.FakeStore``, backend ``"fake"``) of ``P`` ranks as rank ``r``. Collectives return at
once and move no data (received buffers hold whatever memory they got), while this rank's compute and
memory are real. Every row from a simulated rank says so (``simulated_ranks``); its output values
are meaningless, only its time and memory count.

Sections (``--sections``):

- ``kernels``: one local attention fwd+bwd per kernel (``sdpa``, ``efficient``, ``cudnn``,
  ``flash_attn`` when installed) at each ``--local-lens`` length, bf16, causal: TFLOP/s. This is what
  ``kernel="auto"`` should choose from. Exactness is ``make test-gpu``'s job.
- ``schedule``: one rank's complete fwd+bwd for each backend at P = ``--worlds``,
  N_local = ``--local-lens``, causal and bidirectional, GQA (``--heads``/``--kv-heads``). It is set
  against one FULL-mask kernel call doing the same useful work: ``N_local`` queries against
  ``N/2`` keys (causal) or ``N`` keys (bidirectional), the same number of visible (query, key) pairs
  as one rank's share. ``efficiency = t(one call) / t(rank)``. The rank time is the slower of ranks
  0 and P-1, since a contiguous causal ring is not balanced and its last rank sets the step time.
- ``longest`` (item 3): the protein encoder at ESM-2 650M shape (``--model-layers`` 33, d_model 1280,
  20 heads), bf16 parameters and AdamW state, full activation checkpointing, sequence-tiled MLP and
  the chunked loss. One optimizer step at each ``--model-lens`` global length; it records the peak
  allocated bytes (``torch.cuda.max_memory_allocated``), or "OOM". At P = 1 the step is real; at P > 1
  it runs on a simulated rank. With ``--model-layers`` below 33 the peak at 33 layers is also
  *predicted* from two layer counts, and that column is labelled as a prediction.
- ``mfu`` (item 4): the same model trained for a few steps on one device by a Lightning ``Trainer``
  with ``SequenceParallelMonitor`` (so TensorBoard shows ``throughput/mfu``) at ``--mfu-lens``. MFU is
  Megatron's model FLOPs (no recompute counted) over the dense bf16 matmul rate measured on the same
  device in the same run.

Results: ``<out>/gpu_<date>_<device>.json`` and ``.csv`` (device, torch and CUDA versions, UTC date,
command), written after every row so a run stopped by a time limit keeps what it measured.
``--budget-s`` stops a section before it starts a row once that many seconds have passed.
"""

from __future__ import annotations

import argparse
import csv
import datetime
import json
import math
import os
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]

import torch
import torch.distributed as dist

SECTIONS = ("kernels", "schedule", "longest", "mfu")
SCHEDULE_BACKENDS = ("zigzag_ring", "allgather_kv", "usp", "ulysses", "ring")
ESM2_650M = dict(d_model=1280, n_heads=20, mlp_ratio=4.0)


# ----------------------------------------------------------------------------------------------
# helpers
# ----------------------------------------------------------------------------------------------


def _device() -> torch.device:
    return torch.device("cuda" if torch.cuda.is_available() else "cpu")


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def timed(fn, *, device: torch.device, warmup: int, reps: int) -> list[float]:
    """Seconds per call of ``fn`` (CUDA events on a GPU, ``perf_counter`` on CPU), after ``warmup`` calls."""
    for _ in range(warmup):
        fn()
    _sync(device)
    times = []
    for _ in range(reps):
        if device.type == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end) / 1e3)
        else:
            t0 = time.perf_counter()
            fn()
            times.append(time.perf_counter() - t0)
    return times


def join_fake_group(world: int, rank: int):
    """Make this process rank ``rank`` of a fake ``world``-rank process group (collectives move nothing)."""
    from torch.testing._internal.distributed.fake_pg import FakeStore

    if dist.is_initialized():
        dist.destroy_process_group()
    dist.init_process_group("fake", rank=rank, world_size=world, store=FakeStore())
    return dist.group.WORLD


def leave_group() -> None:
    if dist.is_initialized():
        dist.destroy_process_group()


def attention_flops(pairs: float, heads: int, head_dim: int) -> float:
    """Forward + backward FLOPs of attention over ``pairs`` visible (query, key) pairs: 4 per pair and
    head dim in the forward (two matmuls), 2.5x that in the backward (flash-attention convention)."""
    return 3.5 * 4.0 * pairs * heads * head_dim


class Results:
    """Rows by section, written to JSON and CSV after every row."""

    def __init__(self, out: Path, name: str, meta: dict) -> None:
        out.mkdir(parents=True, exist_ok=True)
        self.json_path, self.csv_path = out / f"{name}.json", out / f"{name}.csv"
        self.meta, self.rows = meta, {}

    def add(self, section: str, row: dict) -> None:
        self.rows.setdefault(section, []).append(row)
        print(f"[{section}] " + ", ".join(f"{k}={_short(v)}" for k, v in row.items()), flush=True)
        self.json_path.write_text(json.dumps({"meta": self.meta, "results": self.rows}, indent=1, default=str))
        with self.csv_path.open("w", newline="") as f:
            w = csv.writer(f)
            w.writerow(["section", "key", "value", "row"])
            for sec, rows in self.rows.items():
                for i, r in enumerate(rows):
                    for key, val in r.items():
                        w.writerow([sec, key, val, i])


def _short(v):
    return f"{v:.4g}" if isinstance(v, float) else v


def _meta(args, device: torch.device) -> dict:
    meta = {
        "date_utc": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "command": " ".join([Path(sys.executable).name, *sys.argv]),
        "torch": torch.__version__, "cuda": torch.version.cuda, "device": str(device),
        "simulated_ranks": "P > 1 rows: one real rank in a fake process group (no data moves)",
        "args": {k: v for k, v in vars(args).items() if k != "out"},
    }
    if device.type == "cuda":
        p = torch.cuda.get_device_properties(device)
        meta["device_name"], meta["device_memory_gib"] = p.name, round(p.total_memory / 2**30, 1)
    else:
        meta["device_name"] = f"CPU ({os.cpu_count()} cores)"
    return meta


# ----------------------------------------------------------------------------------------------
# kernels and per-rank schedule (items 1-2)
# ----------------------------------------------------------------------------------------------


def _qkv(n_q: int, n_k: int, heads: int, kv_heads: int, head_dim: int, dtype, device):
    g = torch.Generator(device=device).manual_seed(0)
    q = torch.randn(1, n_q, heads, head_dim, generator=g, device=device, dtype=dtype).requires_grad_()
    k = torch.randn(1, n_k, kv_heads, head_dim, generator=g, device=device, dtype=dtype).requires_grad_()
    v = torch.randn(1, n_k, kv_heads, head_dim, generator=g, device=device, dtype=dtype).requires_grad_()
    dout = torch.randn(1, n_q, heads, head_dim, generator=g, device=device, dtype=dtype)
    return q, k, v, dout


def one_call(kernel_name: str, n_q: int, n_k: int, args, device, *, causal: bool):
    """``fn()`` running one kernel's forward and backward on ``n_q`` queries x ``n_k`` keys (FULL mask, or
    CAUSAL when ``causal`` and ``n_q == n_k``)."""
    from lightning_sp.ops.kernels import make_kernel
    from lightning_sp.ops.plan import MaskKind

    kernel = make_kernel(kernel_name)
    q, k, v, dout = (t.detach() for t in _qkv(n_q, n_k, args.heads, args.kv_heads, args.head_dim, args.dtype, device))
    kind = MaskKind.CAUSAL if causal else MaskKind.FULL
    scale = args.head_dim ** -0.5

    def fn():
        out, lse = kernel.forward(q, k, v, scale=scale, kind=kind, mask=None)
        kernel.backward(dout, q, k, v, out.to(q.dtype), lse, scale=scale, kind=kind, mask=None)

    return fn


def kernels_section(args, device, results: Results, deadline: float) -> None:
    from lightning_sp.ops.kernels import flash_attn_available

    names = ["auto", "sdpa", "efficient", "cudnn"] + (["flash_attn"] if flash_attn_available() else [])
    if device.type != "cuda":
        names = ["sdpa"]  # the CUDA ops do not run on CPU
    for causal in args.kernel_causal:
        for n in args.local_lens:
            for name in names:
                if time.time() > deadline:
                    return
                try:
                    times = timed(one_call(name, n, n, args, device, causal=causal), device=device, warmup=1,
                                  reps=args.reps)
                except Exception as e:  # noqa: BLE001  (a kernel the device cannot run: say so, go on)
                    results.add("kernels", {"kernel": name, "seq_len": n, "causal": causal,
                                            "error": f"{type(e).__name__}: {e}"[:300]})
                    continue
                t = statistics.median(times)
                flops = attention_flops(n * (n + 1) / 2 if causal else n * n, args.heads, args.head_dim)
                results.add("kernels", {"kernel": name, "seq_len": n, "causal": causal, "dtype": str(args.dtype),
                                        "median_s": t, "tflops": flops / t / 1e12})


def _rank_time(backend: str, world: int, rank: int, n_local: int, causal: bool, args, device) -> float:
    from lightning_sp import SequenceParallelAttention

    group = join_fake_group(world, rank)
    attn = SequenceParallelAttention(causal=causal, backend=backend, group=group, kernel=args.kernel,
                                     validate_inputs=False, kv_pieces=args.kv_pieces)
    q, k, v, dout = _qkv(n_local, n_local, args.heads, args.kv_heads, args.head_dim, args.dtype, device)

    def fn():
        attn(q, k, v, seq_len=n_local * world).backward(dout)
        q.grad = k.grad = v.grad = None

    try:
        return statistics.median(timed(fn, device=device, warmup=1, reps=args.reps))
    finally:
        leave_group()


def schedule_section(args, device, results: Results, deadline: float) -> None:
    for world in args.worlds:
        for n_local in args.local_lens:
            for causal in (True, False):
                n = n_local * world
                keys = n // 2 if causal else n  # the same visible pairs as one rank's share, in one FULL call
                t_one = statistics.median(timed(one_call(args.kernel, n_local, keys, args, device, causal=False),
                                                device=device, warmup=1, reps=args.reps))
                for backend in args.backends:
                    if time.time() > deadline:
                        return
                    if backend in ("ulysses", "usp") and args.heads % (world if backend == "ulysses" else 2):
                        continue
                    try:
                        t_rank = max(_rank_time(backend, world, r, n_local, causal, args, device) for r in {0, world - 1})
                    except Exception as e:  # noqa: BLE001
                        results.add("schedule", {"backend": backend, "world": world, "local_len": n_local,
                                                 "causal": causal, "error": f"{type(e).__name__}: {e}"[:300]})
                        continue
                    results.add("schedule", {
                        "backend": backend, "world": world, "local_len": n_local, "causal": causal,
                        "heads": args.heads, "kv_heads": args.kv_heads, "head_dim": args.head_dim,
                        "kernel": args.kernel, "kv_pieces": args.kv_pieces, "rank_s": t_rank, "one_call_s": t_one,
                        "efficiency": t_one / t_rank, "simulated_ranks": world > 1,
                    })


# ----------------------------------------------------------------------------------------------
# the protein encoder: longest context (item 3) and MFU (item 4)
# ----------------------------------------------------------------------------------------------


def protein_encoder(args, layers: int):
    from lightning_sp.models import ProteinEncoder

    shape = ESM2_650M if not args.smoke else dict(d_model=64, n_heads=4, mlp_ratio=4.0)
    return ProteinEncoder(n_layers=layers, activation_checkpointing=True, mlp_chunk_size=args.mlp_chunk,
                          lr=1e-4, warmup_steps=0, **shape)


def _step_peak(args, device, layers: int, seq_len: int, world: int) -> int | str | None:
    """Peak allocated bytes of one training step (fwd, bwd, AdamW) on rank 0 of ``world``, "OOM", or
    ``None`` on CPU (runs the step, measures nothing)."""
    from lightning_sp import shard_sequence
    from lightning_sp.context import SequenceParallelContext
    from lightning_sp.models._attention import SequenceParallelAttention

    model = protein_encoder(args, layers).to(device=device, dtype=args.dtype)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(4, 29, (1, seq_len), generator=g)
    labels = torch.where(torch.rand(1, seq_len, generator=g) < 0.15, ids, torch.full_like(ids, -100))
    positions = torch.arange(seq_len)[None]
    if world > 1:
        group = join_fake_group(world, 0)
        ctx = SequenceParallelContext(group=group, backend=args.model_backend, kernel=args.kernel, global_seq_len=seq_len)
        attn_modules = [m for m in model.modules() if isinstance(m, SequenceParallelAttention)]
        for m in attn_modules:
            m.bind(ctx)
        layout = attn_modules[0].layout
        ids, labels, positions = (shard_sequence(t, group, layout=layout, pad_value=p)
                                  for t, p in ((ids, 0), (labels, -100), (positions, seq_len - 1)))
    ids, labels, positions = ids.to(device), labels.to(device), positions.to(device)
    try:
        if device.type == "cuda":
            torch.cuda.empty_cache()
            torch.cuda.reset_peak_memory_stats(device)
        loss = model.net.cross_entropy(model(ids, positions), labels)
        loss.backward()
        opt.step()
        _sync(device)
        return torch.cuda.max_memory_allocated(device) if device.type == "cuda" else None
    except torch.cuda.OutOfMemoryError:
        return "OOM"
    finally:
        del model, opt
        leave_group()
        if device.type == "cuda":
            torch.cuda.empty_cache()


def longest_section(args, device, results: Results, deadline: float) -> None:
    for world in args.model_worlds:
        for n in args.model_lens:
            if time.time() > deadline:
                return
            row = {"world": world, "seq_len": n, "layers": args.model_layers, "dtype": str(args.dtype),
                   "activation_checkpointing": True, "mlp_chunk": args.mlp_chunk, "backend": args.model_backend,
                   "simulated_ranks": world > 1}
            t0 = time.time()
            peak = _step_peak(args, device, args.model_layers, n, world)
            row.update(peak_bytes=peak, peak_gib=peak / 2**30 if isinstance(peak, int) else None, step_s=time.time() - t0)
            fewer = args.model_layers // 2
            if args.model_layers < args.full_layers and fewer >= 1 and peak != "OOM":
                # per-layer slope from a second, smaller layer count (a prediction, not a measurement)
                peak_fewer = _step_peak(args, device, fewer, n, world)
                if isinstance(peak_fewer, int):
                    slope = (peak - peak_fewer) / (args.model_layers - fewer)
                    row["predicted_peak_gib_full_layers"] = (peak + slope * (args.full_layers - args.model_layers)) / 2**30
                    row["prediction"] = f"linear in layers from {fewer} and {args.model_layers} layers (model, not measured)"
            results.add("longest", row)
            if peak == "OOM":
                break  # longer ones will not fit either


def mfu_section(args, device, results: Results, deadline: float) -> None:
    import lightning as L
    from lightning.pytorch.loggers import TensorBoardLogger
    from torch.utils.data import DataLoader

    from lightning_sp.callbacks import SequenceParallelMonitor

    for n in args.mfu_lens:
        if time.time() > deadline:
            return
        g = torch.Generator().manual_seed(0)
        ids = torch.randint(4, 29, (n,), generator=g)
        sample = {"input_ids": ids, "labels": torch.where(torch.rand(n, generator=g) < 0.15, ids, -100),
                  "position_ids": torch.arange(n)}
        monitor = SequenceParallelMonitor(peak_flops="measure")
        trainer = L.Trainer(
            accelerator=device.type, devices=1, precision="bf16-true" if args.dtype == torch.bfloat16 else "32-true",
            max_steps=args.mfu_steps, logger=TensorBoardLogger(args.out / "tensorboard", name=f"mfu_{n}"),
            callbacks=[monitor], enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
            log_every_n_steps=1, limit_val_batches=0,
        )
        model = protein_encoder(args, args.full_layers if not args.smoke else 2)
        trainer.fit(model, DataLoader([sample] * args.mfu_steps, batch_size=1))
        m = monitor.last_metrics
        results.add("mfu", {"seq_len": n, "layers": model.config.n_layers, "steps": args.mfu_steps,
                            "step_s": m.get("throughput/step_time_s"), "tflops": m.get("throughput/tflops"),
                            "mfu": m.get("throughput/mfu"), "measured_peak_tflops": m.get("throughput/measured_peak_tflops"),
                            "peak_memory_gib": m.get("memory/peak_gib")})


# ----------------------------------------------------------------------------------------------
# driver
# ----------------------------------------------------------------------------------------------


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--sections", default=",".join(SECTIONS), help=f"comma-separated subset of {SECTIONS}")
    p.add_argument("--smoke", action="store_true", help="CPU-sized shapes: checks the code paths, measures nothing")
    p.add_argument("--out", type=Path, default=Path(__file__).resolve().parent / "results")
    p.add_argument("--name", default=None, help="results file stem (default gpu_<date>_<device>)")
    p.add_argument("--budget-s", type=float, default=540.0, help="start no new row after this many seconds")
    p.add_argument("--reps", type=int, default=3)
    p.add_argument("--kernel", default="auto")
    p.add_argument("--kernel-masks", default="causal", help="kernels section: comma-separated causal,full")
    p.add_argument("--kv-pieces", type=int, default=8)
    p.add_argument("--heads", type=int, default=32)
    p.add_argument("--kv-heads", type=int, default=8)
    p.add_argument("--head-dim", type=int, default=128)
    p.add_argument("--worlds", type=int, nargs="+", default=[4, 8, 16])
    p.add_argument("--local-lens", type=int, nargs="+", default=[16384])
    p.add_argument("--backends", nargs="+", default=list(SCHEDULE_BACKENDS))
    p.add_argument("--model-layers", type=int, default=33, help="layers of the model actually run")
    p.add_argument("--full-layers", type=int, default=33, help="ESM-2 650M depth (for the prediction column)")
    p.add_argument("--model-lens", type=int, nargs="+", default=[32768, 65536, 131072])
    p.add_argument("--model-worlds", type=int, nargs="+", default=[1])
    p.add_argument("--model-backend", default="zigzag_ring")
    p.add_argument("--mlp-chunk", type=int, default=8192)
    p.add_argument("--mfu-lens", type=int, nargs="+", default=[32768, 131072])
    p.add_argument("--mfu-steps", type=int, default=4)
    args = p.parse_args(argv)
    args.sections = [s for s in args.sections.split(",") if s]
    masks = [m for m in args.kernel_masks.split(",") if m]
    if set(masks) - {"causal", "full"}:
        p.error(f"--kernel-masks takes causal and/or full, got {args.kernel_masks!r}")
    args.kernel_causal = [m == "causal" for m in masks]
    bad = set(args.sections) - set(SECTIONS)
    if bad:
        p.error(f"unknown sections {sorted(bad)}; choose from {SECTIONS}")
    if args.smoke:  # shapes a 2-core CPU runs in seconds
        args.heads, args.kv_heads, args.head_dim, args.reps = 4, 2, 16, 1
        args.worlds, args.local_lens = [4], [512]
        args.model_layers, args.full_layers, args.model_lens, args.model_worlds = 2, 3, [256], [1, 4]
        args.mlp_chunk, args.mfu_lens, args.mfu_steps, args.kernel = 64, [256], 2, "sdpa"
    args.dtype = torch.bfloat16 if torch.cuda.is_available() else torch.float32
    return args


def main(argv=None) -> int:
    args = parse_args(argv)
    device = _device()
    if device.type != "cuda" and not args.smoke:
        print("no CUDA device: the GPU benchmarks need one (use --smoke to check the code paths on CPU)")
        return 0
    meta = _meta(args, device)
    day = meta["date_utc"][:10]
    device_slug = "".join(c if c.isalnum() else "-" for c in meta["device_name"]).strip("-")
    name = args.name or f"gpu_{day}_{device_slug}"
    results = Results(args.out, name, meta)
    start = time.time()
    for section in args.sections:
        fn = {"kernels": kernels_section, "schedule": schedule_section, "longest": longest_section, "mfu": mfu_section}[section]
        fn(args, device, results, deadline=start + args.budget_s)
    results.meta["runtime_s"] = round(time.time() - start, 1)
    results.json_path.write_text(json.dumps({"meta": results.meta, "results": results.rows}, indent=1, default=str))
    print(f"wrote {results.json_path} and .csv in {results.meta['runtime_s']} s")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
