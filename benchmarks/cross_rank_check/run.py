#!/usr/bin/env python
"""What the cross-rank input check costs, measured side by side in one run.

    .venv/bin/python -m benchmarks.cross_rank_check.run                 # N=8192, P=4, fp32, CPU/gloo
    .venv/bin/python -m benchmarks.cross_rank_check.run --quick         # N=1024 smoke run

``SequenceParallelAttention`` runs its check (one all-gather of a 20-number row that every rank joins:
Note [Cross-rank checks are decided together] in ``lightning_sp/comm/agree.py``) at every call. Per
backend, one causal fwd+bwd with ``validate_inputs=True`` and one with ``False`` alternate rep by rep,
each between barriers; reported: the median of each, their ratio, and the check alone (the median of
``--check-reps`` calls of ``_check_across_ranks``) as a fraction of the unchecked fwd+bwd. The check
runs once per attention call (forward only), so this fraction bounds its share of a training step.
Results go to ``<out>/cross_rank_check_<date>.json`` with the command, date, machine and load.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]

import torch


def _worker(rank: int, world: int, cfg: dict) -> list[dict]:
    import torch.distributed as dist

    from lightning_sp import SequenceParallelAttention, shard_sequence
    from lightning_sp.attention import _check_across_ranks, _fingerprints, _signature

    torch.set_num_threads(cfg["threads_per_rank"])
    group = dist.group.WORLD
    rows = []
    for backend in cfg["backends"]:
        modules = {checked: SequenceParallelAttention(causal=True, backend=backend, group=group, kernel="sdpa",
                                                      validate_inputs=checked) for checked in (True, False)}
        g = torch.Generator().manual_seed(0)
        shape = (1, cfg["seq_len"], cfg["heads"], cfg["head_dim"])  # [B, N, H, D]
        q, k, v, dout = (shard_sequence(torch.randn(shape, generator=g), group, layout=modules[True].layout)
                         for _ in range(4))
        times = {True: [], False: []}
        for rep in range(cfg["warmup"] + cfg["reps"]):
            for checked in ((True, False) if rep % 2 == 0 else (False, True)):  # alternate the order
                qq, kk, vv = (t.detach().requires_grad_() for t in (q, k, v))
                dist.barrier()
                start = time.perf_counter()
                modules[checked](qq, kk, vv, seq_len=cfg["seq_len"]).backward(dout)
                dist.barrier()
                if rep >= cfg["warmup"]:
                    times[checked].append(time.perf_counter() - start)
        layout = modules[True].layout
        attn = modules[True]
        sig = _signature(q, k, None, True, backend, attn._decision_inputs(backend), layout, None, cfg["seq_len"],
                         q.size(-1) ** -0.5, attn.kv_pieces)
        check = []
        for _ in range(cfg["check_reps"]):
            dist.barrier()
            start = time.perf_counter()
            _check_across_ranks(sig, None, group, q, fingerprints=_fingerprints(q, k, v, None))
            check.append(time.perf_counter() - start)
        with_check, without = statistics.median(times[True]), statistics.median(times[False])
        rows.append({
            "backend": backend, "rank": rank, "fwd_bwd_checked_s": with_check, "fwd_bwd_unchecked_s": without,
            "ratio_checked_over_unchecked": with_check / without, "check_alone_s": statistics.median(check),
            "check_alone_fraction_of_fwd_bwd": statistics.median(check) / without,
            "reps_checked_s": times[True], "reps_unchecked_s": times[False],
        })
    return rows


def main(argv=None) -> int:
    from tests.distributed.harness import run_on_ranks

    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--quick", action="store_true", help="N=1024, 2 reps: a smoke run")
    p.add_argument("--world", type=int, default=4)
    p.add_argument("--seq-len", type=int, default=None, help="global N (default 8192; quick 1024)")
    p.add_argument("--heads", type=int, default=8)
    p.add_argument("--head-dim", type=int, default=64)
    p.add_argument("--backends", default="zigzag_ring,ulysses")
    p.add_argument("--reps", type=int, default=None, help="timed reps per variant (default 5; quick 2)")
    p.add_argument("--warmup", type=int, default=1)
    p.add_argument("--check-reps", type=int, default=200)
    p.add_argument("--threads-per-rank", type=int, default=1)
    p.add_argument("--out", default=str(Path(__file__).resolve().parent / "results"))
    p.add_argument("--timeout", type=float, default=1800.0)
    args = p.parse_args(argv)
    cfg = {"seq_len": args.seq_len or (1024 if args.quick else 8192), "heads": args.heads, "head_dim": args.head_dim,
           "backends": args.backends.split(","), "reps": args.reps or (2 if args.quick else 5), "warmup": args.warmup,
           "check_reps": 20 if args.quick else args.check_reps, "threads_per_rank": args.threads_per_rank}
    now = datetime.datetime.now(datetime.timezone.utc)
    meta = {"date": now.isoformat(timespec="seconds"), "command": " ".join([sys.executable, *sys.argv]),
            "machine": f"{platform.processor() or platform.machine()}, {os.cpu_count()} cores, torch {torch.__version__}",
            "load_before": os.getloadavg(), "world": args.world, "config": cfg, "dtype": "float32", "device": "cpu/gloo"}
    per_rank = run_on_ranks(_worker, args.world, (cfg,), timeout_s=args.timeout, pg_timeout_s=args.timeout)
    meta["load_after"] = os.getloadavg()
    rows = [r for rank_rows in per_rank for r in rank_rows]
    print(f"{meta['date']}  {meta['machine']}  load {meta['load_before']} -> {meta['load_after']}")
    print(f"N={cfg['seq_len']} P={args.world} H={cfg['heads']} D={cfg['head_dim']} fp32 causal, medians of {cfg['reps']} reps")
    for backend in cfg["backends"]:
        mine = [r for r in rows if r["backend"] == backend]
        worst = max(mine, key=lambda r: r["check_alone_fraction_of_fwd_bwd"])
        print(f"{backend:12s} fwd+bwd checked {statistics.median(r['fwd_bwd_checked_s'] for r in mine):.3f}s "
              f"unchecked {statistics.median(r['fwd_bwd_unchecked_s'] for r in mine):.3f}s "
              f"ratio {statistics.median(r['ratio_checked_over_unchecked'] for r in mine):.4f}; check alone "
              f"{1e3 * statistics.median(r['check_alone_s'] for r in mine):.3f} ms = "
              f"{100 * worst['check_alone_fraction_of_fwd_bwd']:.3f}% of fwd+bwd (worst rank)")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    path = out / f"cross_rank_check_{now.date().isoformat()}{'_quick' if args.quick else ''}.json"
    path.write_text(json.dumps({"meta": meta, "results": rows}, indent=1))
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
