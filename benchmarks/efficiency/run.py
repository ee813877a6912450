#!/usr/bin/env python
"""Per-rank efficiency of the context-parallel backends against one local kernel call, side by side in one run.

    .venv/bin/python -m benchmarks.efficiency.run --seq-lens 4096 8192 --reps 5 --name efficiency-before

Setup: P = 2 gloo ranks on CPU (one thread each), causal, B = 1, H = 8, D = 64, fp32, every backend with
its default settings (``kernel="auto"``: the CPU ``sdpa`` kernel; ``kv_pieces="auto"``). Each rank times,
alternating rep by rep (``experiments.throughput.time_alternating``: the order rotates every rep, a
barrier before and after each call), fwd+bwd of:

- every backend in ``--backends`` on this rank's shard of a global ``[1, N, H, D]`` q, k, v;
- ``causal_call``: one local kernel call, causal, on ``N/P`` tokens (``backend="local"``, same kernel);
- ``full_call``: one local kernel call, not causal, ``N/P`` queries x ``N/P`` keys.

Both ranks run the reference calls at the same time as each other (as they run the backends), so the
two cores are equally busy in every timed call. A rep's time is the slowest rank's (the barriers make
them equal up to the barrier itself); reported: median over reps after one warm-up rep.

Definitions (``t`` = median fwd+bwd time):

- ``share = P * t(causal_call) / t(backend)`` ("P x one kernel call"): the causal work of the
  whole sequence is ``N^2/2`` query-key pairs, ``N^2/(2P)`` per rank when balanced, exactly ``P`` causal
  calls on ``N/P`` tokens. 1.0 = the backend costs no more than its balanced share of kernel work.
- ``own_work = t(the kernel calls the slowest rank must make at the least) / t(backend)``: for ``ring``
  (contiguous layout, causal) the last rank attends to every earlier block: ``t(causal_call) +
  (P - 1) * t(full_call)``; for the balanced backends it equals ``share``. The contiguous ring's share is
  capped by its imbalance: at P = 2 the last rank does 1.5 of the average rank's work, so
  ``share <= own_work * 2/3``.

Results: ``<out>/<date>_<host kind>_<name>.json`` (every rep's time, load before/after, command).
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import statistics
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]

from experiments.common.launch import run_on_ranks

BALANCED = {"zigzag_ring", "allgather_kv", "ulysses", "usp"}


def _worker(rank: int, world: int, seq_len: int, backends: list[str], reps: int, heads: int, head_dim: int) -> dict:
    import torch
    import torch.distributed as dist

    from experiments.throughput import time_alternating
    from lightning_sp import SequenceParallelAttention, shard_sequence

    group = dist.group.WORLD
    local = seq_len // world
    g = torch.Generator().manual_seed(0)
    full = [torch.randn(1, seq_len, heads, head_dim, generator=g) for _ in range(4)]  # q, k, v, dout: [1, N, H, D]
    mods = {b: SequenceParallelAttention(causal=True, backend=b, group=group) for b in backends}
    shards = {b: [shard_sequence(t, group, layout=m.layout) for t in full] for b, m in mods.items()}  # [1, N/P, H, D]
    ref_inputs = [t[:, :local] for t in full]  # [1, N/P, H, D]: the reference calls' tokens
    refs = {"causal_call": SequenceParallelAttention(causal=True, backend="local"),
            "full_call": SequenceParallelAttention(causal=False, backend="local")}

    def fwd_bwd(mod, tensors, **kw):
        q, k, v = (t.detach().clone().requires_grad_() for t in tensors[:3])
        mod(q, k, v, **kw).backward(tensors[3])

    calls = {b: (lambda b=b: fwd_bwd(mods[b], shards[b], seq_len=seq_len)) for b in backends}
    calls.update({name: (lambda m=m: fwd_bwd(m, ref_inputs)) for name, m in refs.items()})
    timings = time_alternating(calls, warmup=1, reps=reps, group=group)
    return {name: t.wall_s for name, t in timings.items()}


def summarize(seq_len: int, world: int, walls_by_rank: list[dict]) -> list[dict]:
    """Rows per backend: slowest rank per rep, medians, ``share`` and ``own_work`` (module docstring)."""
    names = list(walls_by_rank[0])
    per_rep = {n: [max(r[n][i] for r in walls_by_rank) for i in range(len(walls_by_rank[0][n]))] for n in names}
    med = {n: statistics.median(v) for n, v in per_rep.items()}
    t_causal, t_full = med["causal_call"], med["full_call"]
    rows = []
    for name in names:
        if name in ("causal_call", "full_call"):
            continue
        own_ref = world * t_causal if name in BALANCED else t_causal + (world - 1) * t_full
        rows.append({
            "backend": name, "world": world, "seq_len": seq_len, "local_tokens": seq_len // world,
            "median_s": med[name], "causal_call_s": t_causal, "full_call_s": t_full,
            "share": world * t_causal / med[name], "own_work": own_ref / med[name],
            "wall_s_all": per_rep[name], "causal_call_s_all": per_rep["causal_call"], "full_call_s_all": per_rep["full_call"],
        })
    return rows


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--seq-lens", type=int, nargs="+", default=[4096, 8192])
    ap.add_argument("--backends", default="zigzag_ring,ring,allgather_kv,ulysses")
    ap.add_argument("--world", type=int, default=2)
    ap.add_argument("--heads", type=int, default=8)
    ap.add_argument("--head-dim", type=int, default=64)
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--out", default=str(Path(__file__).resolve().parent / "results"))
    ap.add_argument("--name", default="efficiency", help="file stem suffix: <date>_<host>_<name>.json")
    a = ap.parse_args(argv)
    if a.reps < 1 or any(n % (2 * a.world) for n in a.seq_lens):
        ap.error(f"--reps must be >= 1 and every --seq-lens divisible by 2 * world = {2 * a.world} (zigzag chunks)")
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    backends = a.backends.split(",")
    load_start = os.getloadavg()
    print(f"load average at start: {load_start[0]:.2f}", flush=True)
    rows = []
    for n in a.seq_lens:
        load_before = os.getloadavg()[0]
        walls = run_on_ranks(_worker, a.world, (n, backends, a.reps, a.heads, a.head_dim), timeout_s=1200)
        load_after = os.getloadavg()[0]
        for r in summarize(n, a.world, walls):
            r.update(load_1m_before=load_before, load_1m_after=load_after)
            rows.append(r)
            print(f"N={n} P={a.world} {r['backend']:12s} median {r['median_s']:.3f} s | causal call on N/P "
                  f"{r['causal_call_s']:.3f} s, full call {r['full_call_s']:.3f} s | share {r['share']:.3f} | "
                  f"own_work {r['own_work']:.3f}", flush=True)
    import torch

    meta = {
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "command": " ".join([Path(sys.argv[0]).name, *(argv if argv is not None else sys.argv[1:])]),
        "host": platform.node(), "cpu": platform.processor() or platform.machine(), "cores": os.cpu_count(),
        "torch": torch.__version__, "dtype": "float32", "causal": True, "batch": 1,
        "heads": a.heads, "head_dim": a.head_dim, "reps": a.reps, "warmup": 1,
        "load_1m_5m_15m_start": load_start, "load_1m_5m_15m_end": os.getloadavg(),
        "definitions": {"share": "P * t(causal call on N/P tokens) / t(backend fwd+bwd, slowest rank)",
                        "own_work": "t(least kernel calls of the slowest rank) / t(backend); ring: causal + (P-1) full calls"},
    }
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    day = datetime.date.today().isoformat()
    path = out / f"{day}_cpu-{'amd-epyc' if 'AMD' in _cpu_name() else platform.machine()}-{os.cpu_count()}c_{a.name}.json"
    path.write_text(json.dumps({"meta": meta, "rows": rows}, indent=1))
    print(f"load average at end: {os.getloadavg()[0]:.2f}\nwrote {path}")


def _cpu_name() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor()


if __name__ == "__main__":
    main()
