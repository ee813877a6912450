"""Where a layer's measured time goes, beside where the cost model puts it: the kernel calls, and the rest.

    .venv/bin/python -m experiments.cost_model.split --world 2 --seq 1024                # grid 1's P = 2, N = 1024 rows
    .venv/bin/python -m experiments.cost_model.split --world 2 --seq 1024 --stub-kernel  # the rest alone

Each backend runs fwd+bwd on ``--world`` gloo ranks (CPU, one thread per rank, fp32, causal; rounds over the
backends, the order rotated by one per round, medians, as ``measure.py`` times the validation rows) with its
kernel wrapped: the wall time spent inside the kernel's calls is recorded per rank, and the rest of the step
(collectives, ring exchanges, copies, merges, Python, waiting for the other ranks) is the step minus that.
``--stub-kernel`` replaces each kernel call by zeros of the shapes the real call returned (the first call per
signature runs the real kernel, untimed): what the layer costs beyond its kernel, on idle ranks. The model's
side is the same split of ``predict_attention`` on the committed calibration (``results/``): the schedule's
kernel calls priced by the kernel table, and the rest of its total (including the two barriers the measured
interval holds). Measured and model columns stay apart; the split itself feeds nothing, while its stubbed runner
(``split_steps_worker``) is also the layer-latency primitive (``measure_stubbed_layers``)."""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

import torch

from experiments.common.launch import keep_freed_memory, run_on_ranks
from experiments.cost_model.calibrate import LATENCY_SHAPE, load_profile
from experiments.cost_model.measure import _inputs

ROOT = Path(__file__).resolve().parents[2]
BACKENDS = ("ulysses", "zigzag_ring", "allgather_kv", "ring")


class SplitKernel:
    """Wraps a ``LocalKernel``: sums the wall time of its calls (``seconds``); with ``stub``, each call returns
    zeros shaped as the real call's results (the real call made once per signature, outside the sum)."""

    def __init__(self, inner, *, stub: bool) -> None:
        self.inner, self.stub, self.seconds, self._shapes = inner, stub, 0.0, {}
        self.name = f"split({getattr(inner, 'name', type(inner).__name__)})"

    def prefers_heads_major(self, device) -> bool:
        prefers = getattr(self.inner, "prefers_heads_major", None)
        return prefers is not None and bool(prefers(device))

    def _run(self, fn, args, kwargs):
        if self.stub:
            key = (fn.__name__, str(kwargs.get("kind")), *((a.shape, a.stride(), a.dtype) for a in args
                                                          if isinstance(a, torch.Tensor)))
            if key not in self._shapes:
                self._shapes[key] = [torch.zeros_like(r) for r in fn(*args, **kwargs)]
        start = time.perf_counter()
        out = tuple(torch.zeros_like(r) for r in self._shapes[key]) if self.stub else fn(*args, **kwargs)
        self.seconds += time.perf_counter() - start
        return out

    def forward(self, q, k, v, **kwargs):
        return self._run(self.inner.forward, (q, k, v), kwargs)

    def backward(self, dout, q, k, v, out, lse, **kwargs):
        return self._run(self.inner.backward, (dout, q, k, v, out, lse), kwargs)


def split_steps_worker(rank, world, cases, reps, stub):
    """Per case ``(backend, ulysses_degree, N, H, H_kv, D, kv_pieces)``: ``(step seconds, kernel seconds)`` per rep,
    the kernel wrapped (``stub``: stubbed), every case warmed up once then timed in rotated rounds."""
    import torch.distributed as dist

    from lightning_sp import SequenceParallelAttention, shard_sequence

    torch.set_num_threads(1)
    group = dist.group.WORLD
    steps = []
    for i, (backend, u, n, h, h_kv, d, pieces) in enumerate(cases):
        attn = SequenceParallelAttention(causal=True, backend=backend, group=group, ulysses_degree=u, kv_pieces=pieces)
        q, k, v, dout = (shard_sequence(t, group, layout=attn.layout) for t in _inputs(i, n, h, h_kv, d, torch.float32))
        q, k, v = (t.detach().requires_grad_() for t in (q, k, v))
        split = SplitKernel(attn._make_kernel(q), stub=stub)
        attn._make_kernel = lambda q, split=split: split  # this instance's kernel, wrapped
        attn(q, k, v, seq_len=n).backward(dout)  # warm-up (and the stub's shapes)
        steps.append((attn, q, k, v, dout, n, split))
    times = [[] for _ in cases]
    for r in range(reps):
        order = list(range(len(cases)))
        for i in order[r % len(order):] + order[:r % len(order)]:
            attn, q, k, v, dout, n, split = steps[i]
            dist.barrier()
            split.seconds, start = 0.0, time.perf_counter()
            attn(q, k, v, seq_len=n).backward(dout)
            dist.barrier()
            times[i].append((time.perf_counter() - start, split.seconds))
    return times


def model_split(backend, u, n, h, h_kv, d, pieces, world, hw, barrier_s) -> dict:
    """The model's total (with the two barriers) and its kernel part (the slowest rank's kernel calls), seconds."""
    from lightning_sp.cost_model import AttentionShape, predict_attention
    from lightning_sp.ops.schedule import rank_schedule

    shape = AttentionShape(seq_len=n, num_heads=h, num_kv_heads=h_kv, head_dim=d, causal=True, batch=1, dtype_bytes=4)
    total = predict_attention(backend, shape, world, hw, ulysses_degree=u, kv_pieces=pieces).total_s + 2 * barrier_s
    kernel = max(sum(hw.kernel_time(c, d) for phase in ("forward", "backward") for step in getattr(sched, phase)
                     for c in step.calls)
                 for sched in (rank_schedule(backend, seq_len=n, world=world, rank=r, heads=h, kv_heads=h_kv,
                                             head_dim=d, causal=True, ulysses_degree=u, kv_pieces=pieces)
                               for r in range(world)))
    return {"total_s": total, "kernel_s": kernel}


def run(args) -> dict:

    keep_freed_memory()
    cases = [(b, args.ulysses_degree if b == "usp" else None, args.seq, args.heads, args.kv_heads, args.head_dim,
              args.kv_pieces) for b in args.backends]
    per_rank = run_on_ranks(split_steps_worker, args.world, (cases, args.reps, args.stub_kernel), timeout_s=1800, pg_timeout_s=300)
    hw, barriers = load_profile(args.profile)
    rows = []
    for i, case in enumerate(cases):
        steps = [statistics.median(t for t, _ in rank[i]) for rank in per_rank]
        kernels = [statistics.median(kt for _, kt in rank[i]) for rank in per_rank]
        model = model_split(*case, args.world, hw, barriers[args.world])
        rows.append({"backend": case[0], "P": args.world, "N": args.seq, "heads": args.heads, "kv_heads": args.kv_heads,
                     "head_dim": args.head_dim, "kv_pieces": args.kv_pieces, "stub_kernel": args.stub_kernel,
                     "measured_step_ms": max(steps) * 1e3, "measured_kernel_ms": max(kernels) * 1e3,
                     "measured_rest_ms": max(s - k for s, k in zip(steps, kernels)) * 1e3,
                     "model_total_ms": model["total_s"] * 1e3, "model_kernel_ms": model["kernel_s"] * 1e3,
                     "model_rest_ms": (model["total_s"] - model["kernel_s"]) * 1e3})
    return {"command": " ".join([Path(sys.executable).name, "-m", "experiments.cost_model.split", *sys.argv[1:]]),
            "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "reps": args.reps,
            "columns": {"measured_*": "measured here: medians over the reps, the slowest rank",
                        "model_*": "cost-model output from the calibration in --profile (not measured)"},
            "results": rows}


LATENCY_REPS = 15


def latency_cases(world: int) -> list[tuple]:
    """``split_steps_worker``'s cases at ``LATENCY_SHAPE``: every backend the model times by its schedule
    (``usp`` from 4 ranks, with 2 Ulysses ranks); not ``colossal``, whose primitive is its own."""
    n, h, h_kv, d, pieces = LATENCY_SHAPE
    backends = [("ulysses", None), ("ring", None), ("zigzag_ring", None), ("allgather_kv", None)]
    return [(b, u, n, h, h_kv, d, pieces) for b, u in backends + ([("usp", 2)] if world >= 4 else [])]


def measure_stubbed_layers(worlds, reps: int = LATENCY_REPS) -> dict:
    """``{world: {backend: seconds}}``: fwd+bwd of each of ``latency_cases(world)`` with the kernel stubbed, the
    slowest rank's median over ``reps`` rounds (the order rotated per round), idle ranks."""
    out = {}
    for world in worlds:
        cases = latency_cases(world)
        per_rank = run_on_ranks(split_steps_worker, world, (cases, reps, True), timeout_s=600, pg_timeout_s=300)
        out[int(world)] = {case[0]: max(statistics.median(step for step, _ in rank[i]) for rank in per_rank)
                           for i, case in enumerate(cases)}
    return out


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--world", type=int, default=2)
    p.add_argument("--seq", type=int, default=1024)
    p.add_argument("--heads", type=int, default=8)
    p.add_argument("--kv-heads", type=int, default=4)
    p.add_argument("--head-dim", type=int, default=32)
    p.add_argument("--kv-pieces", type=int, default=8, help="grid 1's (default 8)")
    p.add_argument("--ulysses-degree", type=int, default=2, help="usp's inner degree")
    p.add_argument("--backends", nargs="+", default=list(BACKENDS))
    p.add_argument("--reps", type=int, default=15)
    p.add_argument("--stub-kernel", action="store_true", help="zeros in place of every kernel call: the rest alone")
    p.add_argument("--profile", type=Path, default=ROOT / "experiments" / "cost_model" / "results",
                   help="directory holding cost_model_calibration.json")
    p.add_argument("--out", type=Path, help="write the rows here (json)")
    args = p.parse_args(argv)
    result = run(args)
    print(f"{'backend':13s} {'step':>7s} {'kernel':>7s} {'rest':>7s} | {'model':>7s} {'kernel':>7s} {'rest':>7s}   (ms)")
    for r in result["results"]:
        print(f"{r['backend']:13s} {r['measured_step_ms']:7.1f} {r['measured_kernel_ms']:7.1f} {r['measured_rest_ms']:7.1f} | "
              f"{r['model_total_ms']:7.1f} {r['model_kernel_ms']:7.1f} {r['model_rest_ms']:7.1f}")
    if args.out:
        args.out.write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    main()
