#!/usr/bin/env python
"""Ulysses under the zigzag layout (what ``backend="auto"`` shards for) against Ulysses under its own contiguous
layout, side by side in one run: fwd+bwd of ``ulysses_attention`` (and ``usp_attention`` on its zigzag(U) layout
where P > 2) on the same shapes, alternated rep by rep.

    .venv/bin/python -m benchmarks.ulysses_layout.run --reps 7     # about 1 min on a quiet 2-core CPU

Gloo ranks on CPU (one thread each), fp32, ``kernel="sdpa"``, whole blocks (``kv_pieces=1``). Prints one row per
shape and layout with the median and ``ratio = median / median(ulysses, contiguous)``.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]

from experiments.common.launch import run_on_ranks

# (P, N, H, H_kv, D, causal): the bench_auto grid's rows whose heads split over P
GRID = [
    (2, 4096, 8, 8, 64, True), (2, 2048, 16, 4, 32, True), (2, 3000, 8, 2, 64, False),
    (4, 4096, 8, 8, 64, True), (4, 2048, 16, 2, 64, True), (4, 1536, 4, 4, 128, False),
]


def _worker(rank: int, world: int, shapes: list[tuple], reps: int) -> list[dict]:
    import torch
    import torch.distributed as dist

    from experiments.throughput.measure import time_alternating
    from lightning_sp.attention import make_usp_groups
    from lightning_sp.layout import SequenceLayout, padded_length, shard_sequence
    from lightning_sp.ops import backends
    from lightning_sp.ops.kernels import make_kernel

    group = dist.group.WORLD
    kernel = make_kernel("sdpa")
    usp_groups = make_usp_groups(group, 2) if world > 2 else None
    rows = []
    for i, (_, n, h, h_kv, d, causal) in enumerate(shapes):
        layouts = {"ulysses, contiguous": SequenceLayout("contiguous"), "ulysses, zigzag": SequenceLayout("zigzag")}
        if usp_groups is not None:
            layouts["usp(2), zigzag(2)"] = SequenceLayout("zigzag", ulysses_degree=2)
        g = torch.Generator().manual_seed(i)
        full = [torch.randn(1, n, hh, d, generator=g) for hh in (h, h_kv, h_kv, h)]  # q, k, v, dout: [1, N, H, D]
        calls = {}
        for label, layout in layouts.items():
            shards = [shard_sequence(t, group, layout=layout) for t in full]
            call = backends.AttentionCall(kernel=kernel, scale=d ** -0.5, causal=causal, layout=layout,
                                          padded_len=padded_length(n, world, layout), doc_bounds=None, stats=None)
            if padded_length(n, world, layout) != n:  # padding is a document of its own
                call = backends.AttentionCall(kernel=kernel, scale=d ** -0.5, causal=causal, layout=layout,
                                              padded_len=call.padded_len, doc_bounds=[0, n, call.padded_len],
                                              stats=None)

            def fwd_bwd(shards=shards, call=call, label=label):
                q, k, v = (t.detach().clone().requires_grad_() for t in shards[:3])
                if label.startswith("usp"):
                    out = backends.usp_attention(q, k, v, call, ulysses_group=usp_groups[0], ring_group=usp_groups[1])
                else:
                    out = backends.ulysses_attention(q, k, v, call, group=group)
                out.backward(shards[3])

            calls[label] = fwd_bwd
        medians = {k: t.median_s for k, t in time_alternating(calls, warmup=1, reps=reps, group=group).items()}
        base = medians["ulysses, contiguous"]
        for label, m in medians.items():
            rows.append({"P": world, "N": n, "H": h, "H_kv": h_kv, "D": d, "causal": causal, "run": label,
                         "median_s": m, "ratio": m / base})
    return rows


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--reps", type=int, default=7)
    ap.add_argument("--out", type=Path, default=None, help="also write the rows as JSON here")
    a = ap.parse_args(argv)
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    load_before = os.getloadavg()[0]
    rows = []
    for world in sorted({s[0] for s in GRID}):
        shapes = [s for s in GRID if s[0] == world]
        rows += run_on_ranks(_worker, world, (shapes, a.reps), timeout_s=1200, pg_timeout_s=600)[0]
    print(f"load average before: {load_before:.2f}, after: {os.getloadavg()[0]:.2f}")
    print("| P | N | H / H_kv | D | mask | run | median (ms) | ratio to ulysses, contiguous |")
    print("|---|---|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['P']} | {r['N']} | {r['H']} / {r['H_kv']} | {r['D']} | {'causal' if r['causal'] else 'bidirectional'} "
              f"| {r['run']} | {1e3 * r['median_s']:.1f} | {r['ratio']:.3f} |")
    if a.out:
        a.out.parent.mkdir(parents=True, exist_ok=True)
        a.out.write_text(json.dumps({"rows": rows, "load_before": load_before, "command": " ".join(sys.argv)}, indent=1))


if __name__ == "__main__":
    main()
