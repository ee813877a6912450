#!/usr/bin/env python
"""Traffic that follows the mask (Note [Traffic follows the mask] in ``lightning_sp/ops/ring_attention.py``):
bytes each rank sends for one attention layer's forward and backward, counted by ``CommStats``, side by side in
one run: the K/V rows the mask needs (ours), what the rings sent before they followed the mask (``today``: the
same backend with ``follow_mask=False``), and the minimum (every K/V row of another rank that some local query
sees, sent once). CPU gloo ranks, one thread each, fp32, causal.

    python -m benchmarks.masks.run --time --worlds 2 --publish
    python -m benchmarks.masks.run --time --worlds 4 --publish

1. Packed protein-like documents (lengths uniform in 50..1000, seeded) at N = 16384, P = 2 and 4: ``ring``,
   ``zigzag_ring``, ``allgather_kv``.
2. A causal sliding window W = 512 (``AttentionMask(window=(511, 0))``) on the contiguous ``ring``, N = 16K, 32K,
   64K: bytes per rank constant in N, against the full causal ring's ``(P-1)/P * 2 * N * h_kv * D`` elements.
   ``--time``: also the median fwd+bwd per rank against one local windowed kernel call on the rank's own work
   (its N/P queries and the W - 1 keys before them: the limit), and against the same ring with the mask ignored
   for traffic (``full ring``: every block passed on, with the whole-block ring's head-major copies and its
   dK/dV transfer behind the next block).
3. Prefix-LM (``AttentionMask(bidirectional_spans=((0, s),))``, s = 10% and 50% of N, then causal) at N = 16K on
   ``ring`` (contiguous layout) and ``zigzag_ring`` on its zigzag layout and on ``SequenceLayout.balanced_for`` the
   span (``layout="balanced"``; Note [Balancing a mask's work] in ``lightning_sp/layout.py``): bytes as above and,
   with ``--time``, the median fwd+bwd per rank against plain causal attention at the same N and backend on the
   backend's own layout, every span and layout of one backend and causal alternating rep by rep in one set; with the plan's kernel
   calls by kind (``dense``: the masked kernel path; 0 when the plan cuts every block at the span's ends) and the
   rank's visible (query, key) pairs, next to causal's on the causal arm's layout.

``--publish`` writes ``benchmarks/masks/results/<date>_traffic-window-prefix.json``, replacing the rows of the
worlds and sections this run measured and keeping the others (so one world at a time fits a short slot).
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import random
from pathlib import Path

from experiments.common.launch import run_on_ranks
from experiments.common.results import run_metadata

H, H_KV, D = 4, 4, 32
BYTES = 4  # fp32
WINDOW = 512
PREFIX_FRACTIONS = (0.1, 0.5)
RESULTS = Path(__file__).resolve().parent / "results"


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


PREFIX_LAYOUTS = {"ring": ("contiguous",), "zigzag_ring": ("zigzag", "balanced")}
"""Layouts each prefix backend runs on: its own, and for ``zigzag_ring`` the table balanced for the span."""


def _prefix_layout(name, backend, world, n, user_mask):
    """The ``SequenceLayout`` a prefix row runs on: the backend's own, or ``balanced_for`` the span."""
    import torch.distributed as dist

    from lightning_sp import SequenceLayout, SequenceParallelAttention

    if name == "balanced":
        return SequenceLayout.balanced_for(n, world, user_mask, causal=True)
    return SequenceParallelAttention(causal=True, backend=backend, group=dist.group.WORLD).layout


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
    prefix_times = {}  # backend -> {arm: Timing}: every span and layout of one backend and causal, timed together
    for what, backend, n, time_it, prefix, layout_name in cases:
        docs = protein_docs(n) if what == "docs" else None
        user_mask = (AttentionMask(window=(WINDOW - 1, 0)) if what == "window" else
                     AttentionMask(bidirectional_spans=((0, prefix),)) if what == "prefix" else None)
        own_layout = SequenceParallelAttention(causal=True, backend=backend, group=group).layout
        layout = _prefix_layout(layout_name, backend, world, n, user_mask) if what == "prefix" else own_layout
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
               **({"prefix": prefix, "prefix_fraction": prefix / n, "layout": layout_name,
                   "layout_table": str(layout)} if what == "prefix" else {}),
               "forward_bytes": sent[True][0], "fwd_bwd_bytes": sent[True][1],
               "today_forward_bytes": sent[False][0], "today_fwd_bwd_bytes": sent[False][1],
               "minimum_forward_bytes": 2 * _minimum_rows(layout, world, rank, n, structured) * H_KV * D * BYTES,
               "full_causal_ring_forward_bytes": (world - 1) * 2 * n // world * H_KV * D * BYTES}
        if what == "prefix":
            row.update(_plan_stats(layout, own_layout, world, rank, n, structured))
        if time_it and what == "window":
            c = n // world
            lo = max(0, rank * c - (WINDOW - 1))
            own = [t[:, lo:(rank + 1) * c].contiguous() for t in full]  # the rank's queries' whole window
            local = SequenceParallelAttention(causal=True, mask=user_mask, kernel="sdpa")
            # the limit: this rank's queries over their windows, one local call (its extra W - 1 queries are the
            # halo rows' share of the work; counted, so the limit is a slight over-estimate of the floor)
            # ours and the full ring: the same backend call, the mask followed for traffic or not
            calls = {follow: backends.AttentionCall(kernel=make_kernel("sdpa"), scale=D ** -0.5, causal=True,
                                                    layout=layout, padded_len=n, doc_bounds=None, stats=None,
                                                    kv_pieces=1, **fields[follow]) for follow in (True, False)}

            def ring(follow):
                def run():
                    q, k, v = (t.detach().clone().requires_grad_() for t in shards[:3])
                    backends.ring_attention(q, k, v, calls[follow], group=group).backward(shards[3])
                return run

            def limit():
                q, k, v = (t.detach().clone().requires_grad_() for t in own[:3])
                local(q, k, v).backward(own[3])

            timings = time_alternating({"ours": ring(True), "full_ring": ring(False), "limit": limit}, warmup=1,
                                       reps=reps, group=group)
            row.update(ours_median_s=timings["ours"].median_s, limit_median_s=timings["limit"].median_s,
                       full_ring_median_s=timings["full_ring"].median_s,
                       ratio_to_limit=timings["ours"].median_s / timings["limit"].median_s,
                       ratio_to_full_ring=timings["ours"].median_s / timings["full_ring"].median_s)
        if time_it and what == "prefix":
            if backend not in prefix_times:  # every span and layout of this backend and plain causal, one set
                arms = {}
                for kind, other, other_n, _, span_end, name in cases:
                    if kind == "prefix" and other == backend:
                        m = AttentionMask(bidirectional_spans=((0, span_end),))
                        lay = _prefix_layout(name, backend, world, other_n, m)
                        arms[(span_end, name)] = (SequenceParallelAttention(
                            causal=True, backend=backend, group=group, mask=m, kv_pieces=1, kernel="sdpa",
                            validate_inputs=False, layout=lay), [shard_sequence(t, group, layout=lay) for t in full])
                arms["causal"] = (SequenceParallelAttention(causal=True, backend=backend, group=group, kv_pieces=1,
                                                            kernel="sdpa", validate_inputs=False),
                                  [shard_sequence(t, group, layout=own_layout) for t in full])

                def module(attn, parts):
                    def run():
                        q, k, v = (t.detach().clone().requires_grad_() for t in parts[:3])
                        attn(q, k, v, seq_len=n).backward(parts[3])
                    return run

                prefix_times[backend] = time_alternating({arm: module(*a) for arm, a in arms.items()}, warmup=1,
                                                         reps=reps, group=group)
            timings = prefix_times[backend]
            mine = timings[(prefix, layout_name)]
            row.update(prefix_lm_median_s=mine.median_s, causal_median_s=timings["causal"].median_s,
                       ratio_to_causal=mine.median_s / timings["causal"].median_s, reps=reps,
                       prefix_lm_times_s=mine.wall_s, causal_times_s=timings["causal"].wall_s)
        rows.append(row)
    return rows


def _plan_stats(layout, causal_layout, world, rank, n, structured) -> dict:
    """This rank's kernel calls by kind over every source block, under the prefix-LM mask on ``layout`` and plain
    causal on ``causal_layout`` (the plans the two timed calls run), and the visible (query, key) pairs those calls
    compute (a CAUSAL square: its lower triangle)."""
    from lightning_sp.layout import runs_for_ranks
    from lightning_sp.ops.plan import plan_blocks

    out = {}
    for name, mask, lay in (("prefix_lm", structured, layout), ("causal", None, causal_layout)):
        runs = [runs_for_ranks(lay, world, n, (r,)) for r in range(world)]
        kinds, pairs = {"full": 0, "causal": 0, "dense": 0}, 0
        for src in range(world):
            for c in plan_blocks(runs[rank], runs[src], causal=True, mask=mask):
                kinds[c.kind.value] += 1
                pairs += c.q_len * (c.k_len + 1) // 2 if c.kind.value == "causal" else c.q_len * c.k_len
        out[f"{name}_calls"], out[f"{name}_pairs"] = kinds, pairs
    out["work_ratio"] = out["prefix_lm_pairs"] / out["causal_pairs"]
    return out


def _work_only(worlds, n, fractions) -> list[dict]:
    """Visible (query, key) pairs per rank of the prefix-LM plans (no process group, nothing timed): each
    backend's layouts, ``fractions`` of ``n`` as the span, every world."""
    from lightning_sp import AttentionMask, SequenceLayout

    out = []
    for world in worlds:
        for backend, names in PREFIX_LAYOUTS.items():
            own = SequenceLayout("contiguous") if backend == "ring" else SequenceLayout("zigzag")
            for f in fractions:
                mask = AttentionMask(bidirectional_spans=((0, int(f * n)),))
                structured = mask.structured(causal=True, doc_bounds=None, padded_len=n)
                for name in names:
                    lay = SequenceLayout.balanced_for(n, world, mask) if name == "balanced" else own
                    stats = [_plan_stats(lay, own, world, r, n, structured) for r in range(world)]
                    prefix, causal = [s["prefix_lm_pairs"] for s in stats], [s["causal_pairs"] for s in stats]
                    out.append({"backend": backend, "layout": name, "layout_table": str(lay), "N": n, "P": world,
                                "prefix_fraction": f, "prefix_pairs_per_rank": prefix, "causal_pairs_per_rank": causal,
                                "busiest_over_mean": max(prefix) / (sum(prefix) / world),
                                "busiest_over_causal_busiest": max(prefix) / max(causal),
                                "pairs_over_causal": sum(prefix) / sum(causal)})
    return out


def _section_rows(rows, worlds, sections, prefix_backends=tuple(PREFIX_LAYOUTS), window_lens=None):
    """``rows`` less those of ``worlds`` x ``sections`` (what a new run replaces; prefix rows: of
    ``prefix_backends`` only; window rows: of ``window_lens`` only, all if ``None``)."""
    return [r for r in rows if not (r["P"] in worlds and r["case"] in sections
                                    and (r["case"] != "prefix" or r["backend"] in prefix_backends)
                                    and (r["case"] != "window" or window_lens is None or r["N"] in window_lens))]


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--worlds", type=int, nargs="+", default=[2, 4])
    ap.add_argument("--sections", nargs="+", choices=("docs", "window", "prefix"), default=["docs", "window", "prefix"])
    ap.add_argument("--work", action="store_true",
                    help="print (and with --publish merge in) the prefix plans' pairs per rank at 10/25/50%% spans; "
                         "no ranks are spawned, nothing is timed")
    ap.add_argument("--docs-len", type=int, default=16384)
    ap.add_argument("--window-lens", type=int, nargs="+", default=[16384, 32768, 65536])
    ap.add_argument("--prefix-len", type=int, default=16384)
    ap.add_argument("--prefix-backends", nargs="+", choices=sorted(PREFIX_LAYOUTS), default=["ring", "zigzag_ring"])
    ap.add_argument("--time", action="store_true", help="also time the window and prefix-LM cases")
    ap.add_argument("--reps", type=int, default=5)
    where = ap.add_mutually_exclusive_group()
    where.add_argument("--out", type=Path, default=None)
    where.add_argument("--publish", action="store_true",
                       help="write (merge into) benchmarks/masks/results/<date>_traffic-window-prefix.json")
    a = ap.parse_args(argv)
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    out = a.out
    if a.publish:
        out = RESULTS / f"{datetime.date.today().isoformat()}_traffic-window-prefix.json"
    if a.work:
        work = _work_only(a.worlds, a.prefix_len, (0.1, 0.25, 0.5))
        for w in work:
            print(f"P={w['P']} {w['backend']:12s} {w['layout']:10s} span {w['prefix_fraction']:.0%}: busiest/mean "
                  f"{w['busiest_over_mean']:.3f}, busiest/causal's busiest {w['busiest_over_causal_busiest']:.3f}, "
                  f"pairs/causal {w['pairs_over_causal']:.3f}  {w['layout_table']}")
        if out is not None:
            data = json.loads(out.read_text()) if out.exists() else {"meta": {}, "runs": [], "rows": []}
            data["work"] = work
            out.write_text(json.dumps(data, indent=1) + "\n")
            print(f"wrote {out}")
        return
    load_before = os.getloadavg()[0]
    rows = []
    for world in a.worlds:
        cases = []
        if "docs" in a.sections:
            cases += [("docs", b, a.docs_len, False, None, None) for b in ("ring", "zigzag_ring", "allgather_kv")]
        if "window" in a.sections:
            cases += [("window", "ring", n, a.time, None, None) for n in a.window_lens]
        if "prefix" in a.sections:
            cases += [("prefix", b, a.prefix_len, a.time, int(f * a.prefix_len), name)
                      for b in a.prefix_backends for f in PREFIX_FRACTIONS for name in PREFIX_LAYOUTS[b]]
        per_rank = run_on_ranks(_worker, world, (cases, a.reps), timeout_s=3000)
        for rank_rows in per_rank:
            rows += rank_rows
    mib = 2 ** 20
    for r in rows:
        what = r["case"] + (f" s={r['prefix']} {r['layout']}" if r["case"] == "prefix" else "")
        line = (f"{what:12s} {r['backend']:12s} N={r['N']:6d} P={r['P']} rank {r['rank']}: forward "
                f"{r['forward_bytes'] / mib:7.3f} MiB (today {r['today_forward_bytes'] / mib:7.3f}, minimum "
                f"{r['minimum_forward_bytes'] / mib:7.3f}, full causal ring {r['full_causal_ring_forward_bytes'] / mib:7.3f}); "
                f"fwd+bwd {r['fwd_bwd_bytes'] / mib:7.3f} MiB (today {r['today_fwd_bwd_bytes'] / mib:7.3f})")
        if "ratio_to_limit" in r:
            line += (f"; fwd+bwd {r['ours_median_s']:.3f} s = {r['ratio_to_limit']:.2f}x the local limit, "
                     f"{r['ratio_to_full_ring']:.2f}x the full ring")
        if "work_ratio" in r:
            line += f"; calls {r['prefix_lm_calls']} (causal {r['causal_calls']}), work {r['work_ratio']:.3f}x causal"
        if "ratio_to_causal" in r:
            line += f"; fwd+bwd {r['prefix_lm_median_s']:.3f} s = {r['ratio_to_causal']:.3f}x causal"
        print(line, flush=True)
    if out is not None:
        meta = run_metadata(__file__, argv, ranks="gloo, one thread per rank", causal=True, heads=H, kv_heads=H_KV,
                            head_dim=D, dtype="float32", load_1m_before=load_before, load_1m_after=os.getloadavg()[0])
        runs, extra = [meta], {}
        if a.publish and out.exists():  # keep the rows of the worlds and sections this run did not measure
            old = json.loads(out.read_text())
            rows = _section_rows(old["rows"], a.worlds, a.sections, a.prefix_backends, a.window_lens) + rows
            extra = {k: v for k, v in old.items() if k not in ("meta", "runs", "rows")}  # e.g. --work's table
            runs = [m for m in old.get("runs", [old["meta"]]) if not (
                set(m.get("worlds", ())) <= set(a.worlds) and set(m.get("sections", ())) <= set(a.sections)
                and ("window" not in m.get("sections", ()) or set(m.get("window_lens", ())) <= set(a.window_lens))
                and ("prefix" not in m.get("sections", ())
                     or set(m.get("prefix_backends", PREFIX_LAYOUTS)) <= set(a.prefix_backends)))] + runs
        meta.update(worlds=a.worlds, sections=a.sections, prefix_backends=a.prefix_backends, window_lens=a.window_lens)
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps({"meta": meta, "runs": runs, "rows": rows, **extra}, indent=1) + "\n")
        print(f"wrote {out}")


if __name__ == "__main__":
    main()
