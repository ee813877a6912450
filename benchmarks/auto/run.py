#!/usr/bin/env python
"""auto's regret: fwd+bwd time of ``backend="auto"`` as a user gets it (defaults, a fresh decision cache, so
its first call measures the candidates: Note [auto measures its candidates] in ``lightning_sp/choices.py``)
against the fastest exact backend on the same layout, side by side in one run.

    .venv/bin/python -m benchmarks.auto.run                 # the grid below, about 10 min on a quiet 2-core CPU
    .venv/bin/python -m benchmarks.auto.run --quick         # one small shape per P (smoke test)

Gloo ranks on CPU (one thread each), fp32, ``kernel="sdpa"``. Per shape: ``auto``'s first call (timed: what
the decision costs once per shape bucket and machine), then ``auto`` and every candidate (``ulysses`` where the
heads split, ``zigzag_ring``, ``allgather_kv``, ``usp(U)`` for each inner degree) alternate rep by rep
(``experiments.throughput.time_alternating``: rotated order, barriers); medians after one warm-up rep.
Prints one row per shape: what auto ran, the fastest, ``regret = time(auto) / time(fastest)``, then the mean
and worst regret. The shapes are not in the cost model's calibration or validation grids.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]

from experiments.common.launch import run_on_ranks

# (P, N, H, H_kv, D, causal): the grid of the regret table
GRID = [
    (2, 4096, 8, 8, 64, True), (2, 2048, 16, 4, 32, True), (2, 3000, 8, 2, 64, False),
    (4, 4096, 8, 8, 64, True), (4, 2048, 16, 2, 64, True), (4, 1536, 4, 4, 128, False),
]
QUICK = [(2, 512, 4, 2, 32, True), (4, 512, 4, 4, 32, False)]


def _candidates(world: int, h: int) -> list[tuple[str, str, int | None]]:
    """``(label, backend, ulysses_degree)`` of every backend exact on auto's zigzag layout."""
    out = [("ulysses", "ulysses", None)] if h % world == 0 else []
    out += [("zigzag_ring", "zigzag_ring", None), ("allgather_kv", "allgather_kv", None)]
    out += [(f"usp(ulysses={u})", "usp", u) for u in range(2, world) if world % u == 0 and h % u == 0]
    return out


def _worker(rank: int, world: int, shapes: list[tuple], reps: int, cache_dir: str) -> list[dict]:
    import torch
    import torch.distributed as dist

    from experiments.throughput import time_alternating
    from lightning_sp import SequenceParallelAttention, shard_sequence

    os.environ["LIGHTNING_SP_CACHE_DIR"] = cache_dir  # a fresh machine: auto measures at its first call
    group = dist.group.WORLD
    rows = []
    for i, (_, n, h, h_kv, d, causal) in enumerate(shapes):
        g = torch.Generator().manual_seed(i)
        full = [torch.randn(1, n, hh, d, generator=g) for hh in (h, h_kv, h_kv, h)]  # q, k, v, dout: [1, N, H, D]
        mods = {"auto": SequenceParallelAttention(causal=causal, backend="auto", group=group, kernel="sdpa")}
        for label, backend, u in _candidates(world, h):
            mods[label] = SequenceParallelAttention(causal=causal, backend=backend, group=group, kernel="sdpa",
                                                    ulysses_degree=u)
        shards = [shard_sequence(t, group, layout=mods["auto"].layout) for t in full]  # zigzag for every one

        def fwd_bwd(mod):
            q, k, v = (t.detach().clone().requires_grad_() for t in shards[:3])
            mod(q, k, v, seq_len=n).backward(shards[3])

        dist.barrier(group)
        start = time.perf_counter()
        fwd_bwd(mods["auto"])  # the decision (measured once per shape bucket) plus one call
        first_call_s = time.perf_counter() - start
        timings = time_alternating({k: (lambda m=m: fwd_bwd(m)) for k, m in mods.items()}, warmup=1, reps=reps,
                                   group=group)
        medians = {k: t.median_s for k, t in timings.items()}
        fastest = min((k for k in medians if k != "auto"), key=medians.get)
        rows.append({"P": world, "N": n, "H": h, "H_kv": h_kv, "D": d, "causal": causal,
                     "auto_ran": mods["auto"].context.resolved_backend, "fastest": fastest,
                     "regret": medians["auto"] / medians[fastest], "first_call_s": first_call_s,
                     "median_s": medians, "wall_s": {k: t.wall_s for k, t in timings.items()},
                     "auto_measured_s": dict(mods["auto"].context.auto_choice.measured)})
    return rows


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="one small shape per P")
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--out", type=Path, default=None, help="also write the rows as JSON here")
    a = ap.parse_args(argv)
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    grid = QUICK if a.quick else GRID
    load_before = os.getloadavg()[0]
    rows = []
    with tempfile.TemporaryDirectory() as cache_dir:
        for world in sorted({s[0] for s in grid}):
            shapes = [s for s in grid if s[0] == world]
            rows += run_on_ranks(_worker, world, (shapes, a.reps, cache_dir), timeout_s=3000, pg_timeout_s=600)[0]
    print(f"load average before: {load_before:.2f}, after: {os.getloadavg()[0]:.2f}")
    print("| P | N | H / H_kv | D | mask | auto ran | fastest | regret | auto's first call (s) |")
    print("|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['P']} | {r['N']} | {r['H']} / {r['H_kv']} | {r['D']} | {'causal' if r['causal'] else 'bidirectional'} "
              f"| {r['auto_ran']} | {r['fastest']} | {r['regret']:.3f} | {r['first_call_s']:.2f} |")
    regrets = [r["regret"] for r in rows]
    print(f"mean regret {sum(regrets) / len(regrets):.3f}, worst {max(regrets):.3f}")
    if a.out:
        a.out.parent.mkdir(parents=True, exist_ok=True)
        a.out.write_text(json.dumps({"rows": rows, "load_before": load_before, "command": " ".join(sys.argv)}, indent=1))


if __name__ == "__main__":
    main()
