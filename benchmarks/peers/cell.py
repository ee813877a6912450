#!/usr/bin/env python
"""One cell of ``benchmarks/peers/run.py`` alone: ours, ours without the cross-rank input check, and the peer, side
by side, in fresh launches of the ranks (what a ~1% difference in the peers' grid is made of).

    .venv/bin/python -m benchmarks.peers.cell --pair allgather_kv --seq-len 4096 --launches 3 --reps 24
    .venv/bin/python -m benchmarks.peers.cell --quick          # N=256, 1 launch, 2 reps: a smoke run

P = 2 gloo ranks on CPU (one thread each), B = 1, H = 8, D = 64, fp32, causal, fwd+bwd. The three sides get the same
global ``q, k, v, dout`` (seeded by N, as in ``benchmarks/peers/run.py``), each sharded in its own layout; they alternate rep by
rep with the order rotated (``experiments.throughput.time_alternating``: a barrier before and after each call), after
2 warm-up reps, in every launch. Ours is ``SequenceParallelAttention(backend=pair, causal=True, group=...)`` with
every other argument at its default, and the same with ``validate_inputs=False``; the peer is ``benchmarks/peers/run.py``'s.
Per launch: each side's median (rank 0) and the ratios of medians. Unlike ``benchmarks/peers/run.py`` the cell is timed
alone: no other pair's calls run between its reps. Results: ``<out>/<name>.json``.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]

SIDES = ("ours", "ours_unchecked", "peer")


def _worker(rank: int, world: int, cfg: dict) -> dict[str, list[float]]:
    import torch
    import torch.distributed as dist

    from benchmarks.peers import run as bench_peers
    from experiments.throughput import time_alternating
    from lightning_sp import SequenceParallelAttention, shard_sequence

    torch.set_num_threads(1)
    group, n, pair = dist.group.WORLD, cfg["seq_len"], cfg["pair"]
    g = torch.Generator().manual_seed(n)
    full = [torch.randn(1, n, 8, 64, generator=g) for _ in range(4)]  # q, k, v, dout [B, N, H, D]
    ours = SequenceParallelAttention(backend=pair, causal=True, group=group)
    unchecked = SequenceParallelAttention(backend=pair, causal=True, group=group, validate_inputs=False)
    peer, _name, _version = bench_peers._peer(pair, group)
    ours_pos = shard_sequence(torch.arange(n).view(1, n), group, layout=ours.layout)[0]
    peer_pos = peer.positions(n) if hasattr(peer, "positions") else bench_peers._positions_contiguous(n, group)

    def call(fn, pos):
        q, k, v, dout = (t.index_select(1, pos).contiguous() for t in full)  # [1, N/P, H, D] each
        q, k, v = (t.requires_grad_() for t in (q, k, v))
        return lambda: bench_peers._fwd_bwd(fn, q, k, v, dout, n)

    calls = {"ours": call(ours, ours_pos), "ours_unchecked": call(unchecked, ours_pos), "peer": call(peer, peer_pos)}
    times = time_alternating(calls, warmup=cfg["warmup"], reps=cfg["reps"], group=group)
    return {side: times[side].wall_s for side in SIDES}


def launch_row(launch: int, walls: dict[str, list[float]]) -> dict:
    """One launch's medians and ratios of medians (``walls``: rank 0's reps per side)."""
    med = {side: statistics.median(walls[side]) for side in SIDES}
    return {"launch": launch, **{f"{side}_median_s": med[side] for side in SIDES},
            "ours_over_peer": med["ours"] / med["peer"], "unchecked_over_peer": med["ours_unchecked"] / med["peer"],
            "ours_over_unchecked": med["ours"] / med["ours_unchecked"], **{f"{side}_all_s": walls[side] for side in SIDES}}


def main(argv=None) -> int:
    from experiments.common.results import run_metadata
    from experiments.common.launch import run_on_ranks

    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--pair", default="allgather_kv", choices=("ulysses", "zigzag_ring", "ring", "allgather_kv"))
    p.add_argument("--seq-len", type=int, default=None, help="global N (default 4096; quick 256)")
    p.add_argument("--launches", type=int, default=None, help="fresh starts of the ranks (default 3; quick 1)")
    p.add_argument("--reps", type=int, default=None, help="timed reps per side and launch (default 24; quick 2)")
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--quick", action="store_true")
    p.add_argument("--out", default=str(Path(__file__).resolve().parent / "results"))
    p.add_argument("--name", default=None, help="file stem (default <date>_peer-cell_<pair>_N<N>)")
    args = p.parse_args(argv)
    cfg = {"pair": args.pair, "seq_len": args.seq_len or (256 if args.quick else 4096),
           "reps": args.reps or (2 if args.quick else 24), "warmup": 0 if args.quick else args.warmup}
    launches = args.launches or (1 if args.quick else 3)
    if cfg["reps"] < 1 or launches < 1 or cfg["seq_len"] % 4:
        p.error("--reps and --launches must be >= 1 and --seq-len divisible by 4 (2 ranks x 2 zigzag chunks)")
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    meta = run_metadata(__file__, argv, ranks="gloo, one thread per rank", world=2, heads=8, head_dim=64,
                        dtype="float32", causal=True, config=cfg, launches=launches, load_1m_before=os.getloadavg()[0])
    rows = []
    for launch in range(launches):
        walls = run_on_ranks(_worker, 2, (cfg,), timeout_s=1800)[0]
        rows.append(launch_row(launch + 1, walls))
        r = rows[-1]
        print(f"{args.pair} N={cfg['seq_len']} launch {launch + 1}: medians (s) ours {r['ours_median_s']:.4f}, "
              f"unchecked {r['ours_unchecked_median_s']:.4f}, peer {r['peer_median_s']:.4f} | ours/peer "
              f"{r['ours_over_peer']:.3f}, unchecked/peer {r['unchecked_over_peer']:.3f}, ours/unchecked "
              f"{r['ours_over_unchecked']:.3f}", flush=True)
    meta["load_1m_after"] = os.getloadavg()[0]
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    path = out / f"{args.name or meta['date'][:10] + '_peer-cell_' + args.pair + '_N' + str(cfg['seq_len'])}.json"
    path.write_text(json.dumps({"meta": meta, "rows": rows}, indent=1) + "\n")
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
