#!/usr/bin/env python
"""What K/V in pieces costs in time: fwd+bwd of one attention call with ``kv_pieces=8`` (what a tight
memory budget asks for) against whole blocks (``kv_pieces=1``), side by side in one run (Note [K/V in pieces]; for
``ulysses``, head groups against one group, Note [Heads in groups]). ``--pieces auto``: the default
(``kv_pieces="auto"``, no budget) against ``kv_pieces=1``: what the default costs where memory does not bind.

    .venv/bin/python -m benchmarks.kv_pieces.run --seq-lens 4096 8192 --reps 7
    .venv/bin/python -m benchmarks.kv_pieces.run --pieces auto --backends ulysses --reps 9

Two gloo ranks on CPU (one thread each), causal, H=8, D=64, fp32, ``kernel="sdpa"``; the two variants
alternate rep by rep (``experiments.throughput.time_alternating``: the order rotates every rep, a
barrier before and after each call); median and minimum over reps after one warm-up rep. Prints ``time(pieces) / time(whole blocks)`` per backend and N.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]

from experiments.common.results import run_metadata
from experiments.common.launch import run_on_ranks

def _worker(rank: int, world: int, seq_len: int, backends: list[str], reps: int, pieces: int | str = 8) -> dict:
    import torch
    import torch.distributed as dist

    from experiments.throughput import time_alternating
    from lightning_sp import SequenceParallelAttention, shard_sequence
    group = dist.group.WORLD
    g = torch.Generator().manual_seed(0)
    full = [torch.randn(1, seq_len, 8, 64, generator=g) for _ in range(4)]  # q, k, v, dout: [1, N, H, D]
    results = {}
    for backend in backends:
        mods = {p: SequenceParallelAttention(causal=True, backend=backend, group=group, kernel="sdpa", kv_pieces=p)
                for p in (pieces, 1)}
        shards = [shard_sequence(t, group, layout=mods[1].layout) for t in full]  # [1, N/P, H, D] each

        def fwd_bwd(mod):
            q, k, v = (t.detach().clone().requires_grad_() for t in shards[:3])
            mod(q, k, v, seq_len=seq_len).backward(shards[3])

        timings = time_alternating({p: (lambda m=m: fwd_bwd(m)) for p, m in mods.items()}, warmup=1, reps=reps, group=group)
        results[backend] = {p: (t.median_s, min(t.wall_s)) for p, t in timings.items()}
    return results


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--seq-lens", type=int, nargs="+", default=[4096, 8192])
    ap.add_argument("--backends", default="ring,zigzag_ring,allgather_kv,ulysses")
    ap.add_argument("--reps", type=int, default=7)
    ap.add_argument("--pieces", default="8", help='the variant timed against kv_pieces=1: an int, or "auto" (the default)')
    ap.add_argument("--out", type=Path, default=None, help="also write the rows (every median and minimum) as JSON here")
    a = ap.parse_args(argv)
    pieces = a.pieces if a.pieces == "auto" else int(a.pieces)
    if a.reps < 1 or any(n % 4 for n in a.seq_lens):
        ap.error("--reps must be >= 1 and every --seq-lens divisible by 4 (2 ranks x 2 zigzag chunks)")
    os.environ.setdefault("OMP_NUM_THREADS", "1")

    load_before = os.getloadavg()[0]
    print(f"load average before: {load_before:.2f}")
    rows = []
    for n in a.seq_lens:
        res = run_on_ranks(_worker, 2, (n, a.backends.split(","), a.reps, pieces), timeout_s=1200)[0]
        for backend, r in res.items():
            (pm, pmin), (wm, wmin) = r[pieces], r[1]
            print(f"N={n} P=2 {backend:12s} kv_pieces={pieces}: median {pm:.3f} s (min {pmin:.3f}) | "
                  f"kv_pieces=1: median {wm:.3f} s (min {wmin:.3f}) | ratio median {pm / wm:.3f}, min {pmin / wmin:.3f}",
                  flush=True)
            rows.append({"N": n, "P": 2, "backend": backend, "kv_pieces": pieces, "median_s": pm, "min_s": pmin,
                         "whole_median_s": wm, "whole_min_s": wmin, "ratio_median": pm / wm, "ratio_min": pmin / wmin})
    print(f"load average after: {os.getloadavg()[0]:.2f}")
    if a.out is not None:
        a.out.parent.mkdir(parents=True, exist_ok=True)
        meta = run_metadata(__file__, argv, ranks="gloo, one thread per rank", causal=True, heads=8, head_dim=64,
                            dtype="float32", reps=a.reps, warmup=1, load_1m_before=load_before,
                            load_1m_after=os.getloadavg()[0])
        a.out.write_text(json.dumps({"meta": meta, "rows": rows}, indent=1) + "\n")
        print(f"wrote {a.out}")


if __name__ == "__main__":
    main()
