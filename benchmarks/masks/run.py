#!/usr/bin/env python
"""Traffic that follows the mask (Note [Traffic follows the mask] in ``lightning_sp/ops/ring_attention.py``):
bytes each rank sends for one attention layer's forward and backward, counted by ``CommStats``, side by side in
one run: the K/V rows the mask needs (ours), what the rings sent before they followed the mask (``today``: the
same backend with ``follow_mask=False``), and the minimum (every K/V row of another rank that some local query
sees, sent once). CPU gloo ranks, one thread each, fp32, causal.

    python -m benchmarks.masks.run --time --out benchmarks/masks/results/<date>_traffic-and-window.json

1. Packed protein-like documents (lengths uniform in 50..1000, seeded) at N = 16384, P = 2 and 4: ``ring``,
   ``zigzag_ring``, ``allgather_kv``.
2. A causal sliding window W = 512 (``AttentionMask(window=(511, 0))``) on the contiguous ``ring``, N = 16K, 32K,
   64K: bytes per rank constant in N, against the full causal ring's ``(P-1)/P * 2 * N * h_kv * D`` elements.
   ``--time``: also the median fwd+bwd per rank against one local windowed kernel call on the rank's own work
   (its N/P queries and the W - 1 keys before them: the limit).
"""

from __future__ import annotations

import argparse
import json
import os
import random
from pathlib import Path

from experiments.common.launch import run_on_ranks
from experiments.common.results import run_metadata

H, H_KV, D = 4, 4, 32
BYTES = 4  # fp32


def protein_docs(n: int, seed: int = 0) -> list[int]:
    """Cumulative lengths of documents 50..1000 tokens long filling ``n``."""
    rng = random.Random(seed)
    bounds = [0]
    while bounds[-1] < n:
        bounds.append(min(n, bounds[-1] + rng.randint(50, 1000)))
    return bounds


def _minimum_rows(layout, world, rank, n, mask) -> int:
    """What ``rank`` must send at the least: its K/V rows that some query of another rank sees, once per such
    rank (a row that two other ranks see must reach both)."""
    import torch

    from lightning_sp.layout import token_indices

    mine = token_indices(layout, world, n, rank)
    total = 0
    for r in range(world):
        if r == rank:
            continue
        theirs = token_indices(layout, world, n, r)
        seen = torch.zeros(mine.numel(), dtype=torch.bool)
        for i in range(0, theirs.numel(), 1024):
            seen |= mask.visible(theirs[i:i + 1024], mine).any(0)
        total += int(seen.sum())
    return total


def _worker(rank, world, cases, reps):
    import torch
    import torch.distributed as dist

    from experiments.throughput import time_alternating
    from lightning_sp import AttentionMask, SequenceParallelAttention, shard_sequence
    from lightning_sp.attention import _mask_fields
    from lightning_sp.comm.stats import CommStats
    from lightning_sp.ops import backends
    from lightning_sp.ops.kernels import make_kernel

    group = dist.group.WORLD
    rows = []
    for what, backend, n, time_it in cases:
        docs = protein_docs(n) if what == "docs" else None
        user_mask = AttentionMask(window=(511, 0)) if what == "window" else None
        layout = SequenceParallelAttention(causal=True, backend=backend, group=group).layout
        g = torch.Generator().manual_seed(0)
        full = [torch.randn(1, n, hh, D, generator=g) for hh in (H, H_KV, H_KV, H)]
        shards = [shard_sequence(t, group, layout=layout) for t in full]
        doc_bounds = list(docs) if docs is not None else None
        fields = {}
        for follow in (True, False):
            f = _mask_fields(user_mask, None, True, doc_bounds, n, follow=docs is not None)
            f["follow_mask"] = follow and f["follow_mask"]
            fields[follow] = f
        structured = (user_mask or AttentionMask()).structured(causal=True, doc_bounds=doc_bounds, padded_len=n)
        sent = {}
        for follow in (True, False):
            stats = CommStats()
            call = backends.AttentionCall(kernel=make_kernel("sdpa"), scale=D ** -0.5, causal=True, layout=layout,
                                          padded_len=n, doc_bounds=doc_bounds, stats=stats, kv_pieces=1, **fields[follow])
            run = backends.allgather_kv_attention if backend == "allgather_kv" else backends.ring_attention
            q, k, v = (t.detach().clone().requires_grad_() for t in shards[:3])
            out = run(q, k, v, call, group=group)
            fwd = stats.total_bytes
            out.backward(shards[3])
            sent[follow] = (fwd, stats.total_bytes)
        row = {"case": what, "backend": backend, "N": n, "P": world, "rank": rank,
               "forward_bytes": sent[True][0], "fwd_bwd_bytes": sent[True][1],
               "today_forward_bytes": sent[False][0], "today_fwd_bwd_bytes": sent[False][1],
               "minimum_forward_bytes": 2 * _minimum_rows(layout, world, rank, n, structured) * H_KV * D * BYTES,
               "full_causal_ring_forward_bytes": (world - 1) * 2 * n // world * H_KV * D * BYTES}
        if time_it:
            attn = SequenceParallelAttention(causal=True, backend=backend, group=group, mask=user_mask, kv_pieces=1,
                                             kernel="sdpa", validate_inputs=False)
            c = n // world
            lo = max(0, rank * c - 511)
            own = [t[:, lo:(rank + 1) * c].contiguous() for t in full]  # the rank's queries' whole window
            local = SequenceParallelAttention(causal=True, mask=user_mask, kernel="sdpa")
            # the limit: this rank's queries over their windows, one local call (its extra W - 1 queries are the
            # halo rows' share of the work; counted, so the limit is a slight over-estimate of the floor)

            def ours():
                q, k, v = (t.detach().clone().requires_grad_() for t in shards[:3])
                attn(q, k, v, seq_len=n).backward(shards[3])

            def limit():
                q, k, v = (t.detach().clone().requires_grad_() for t in own[:3])
                local(q, k, v).backward(own[3])

            timings = time_alternating({"ours": ours, "limit": limit}, warmup=1, reps=reps, group=group)
            row.update(ours_median_s=timings["ours"].median_s, limit_median_s=timings["limit"].median_s,
                       ratio_to_limit=timings["ours"].median_s / timings["limit"].median_s)
        rows.append(row)
    return rows


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--worlds", type=int, nargs="+", default=[2, 4])
    ap.add_argument("--docs-len", type=int, default=16384)
    ap.add_argument("--window-lens", type=int, nargs="+", default=[16384, 32768, 65536])
    ap.add_argument("--time", action="store_true", help="also time the window cases against the local limit")
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--out", type=Path, default=None)
    a = ap.parse_args(argv)
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    load_before = os.getloadavg()[0]
    rows = []
    for world in a.worlds:
        cases = [("docs", b, a.docs_len, False) for b in ("ring", "zigzag_ring", "allgather_kv")]
        cases += [("window", "ring", n, a.time) for n in a.window_lens]
        per_rank = run_on_ranks(_worker, world, (cases, a.reps), timeout_s=3000)
        for rank_rows in per_rank:
            rows += rank_rows
    mib = 2 ** 20
    for r in rows:
        line = (f"{r['case']:6s} {r['backend']:12s} N={r['N']:6d} P={r['P']} rank {r['rank']}: forward "
                f"{r['forward_bytes'] / mib:7.3f} MiB (today {r['today_forward_bytes'] / mib:7.3f}, minimum "
                f"{r['minimum_forward_bytes'] / mib:7.3f}, full causal ring {r['full_causal_ring_forward_bytes'] / mib:7.3f}); "
                f"fwd+bwd {r['fwd_bwd_bytes'] / mib:7.3f} MiB (today {r['today_fwd_bwd_bytes'] / mib:7.3f})")
        if "ratio_to_limit" in r:
            line += f"; fwd+bwd {r['ours_median_s']:.3f} s = {r['ratio_to_limit']:.2f}x the local limit"
        print(line, flush=True)
    if a.out is not None:
        meta = run_metadata(__file__, argv, ranks="gloo, one thread per rank", causal=True, heads=H, kv_heads=H_KV,
                            head_dim=D, dtype="float32", load_1m_before=load_before, load_1m_after=os.getloadavg()[0])
        a.out.parent.mkdir(parents=True, exist_ok=True)
        a.out.write_text(json.dumps({"meta": meta, "rows": rows}, indent=1) + "\n")
        print(f"wrote {a.out}")


if __name__ == "__main__":
    main()
