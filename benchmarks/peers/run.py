#!/usr/bin/env python
"""lightning-sp against every peer that runs here, on time and memory at once, side by side in one run.

    .venv/bin/python -m benchmarks.peers.run             # P=2, N=4096 and 8192, H=8, D=64, fp32 causal (~5 min on 2 cores; rings only ~4 min)
    .venv/bin/python -m benchmarks.peers.run --quick     # N=256, 1 rep: a smoke run (15-30 s)

Pairs (ours = ``SequenceParallelAttention(backend=..., causal=True, group=...)`` with every other argument at
its default: ``kernel="auto"``, ``kv_pieces="auto"``, ``validate_inputs=True``; peers in ``experiments/common/peers.py``):

- ``ulysses`` vs DeepSpeed ``deepspeed.sequence.layer.DistributedAttention`` around ``F.scaled_dot_product_attention``;
- ``zigzag_ring`` vs PyTorch's ``_templated_ring_attention``, head-tail load-balanced, ``rotate_method=ALL_TO_ALL``;
- ``ring`` vs PyTorch's ``_templated_ring_attention``, no load balancing, ``rotate_method=ALL_TO_ALL``;
- ``allgather_kv`` vs PyTorch's ``_templated_ring_attention``, head-tail load-balanced, ``rotate_method=ALL_GATHER``
  (PyTorch's defaults).

PyTorch's ring runs the CPU flash kernel (``aten._scaled_dot_product_flash_attention_for_cpu``), the kernel SDPA
picks on CPU, so on both sides the same kernel is underneath and only the distributed algorithm differs.

Per (pair, N), on gloo ranks with one thread each: both sides get the same global ``q, k, v, dout`` (one seed),
each sharded in its own layout (for the load-balanced pairs PyTorch's ``_HeadTailLoadBalancer`` indices); out,
dq, dk, dv are gathered to global positions and must agree within ``--tol`` (a shifted copy must not: the
negative control) before anything is timed. Time: fwd+bwd, ``experiments.throughput.time_alternating``
(the two sides alternate with the order rotated each rep, barriers before and after each call), warm-up reps
first, the whole grid timed ``--rounds`` times over (interleaved, odd rounds starting with the peer); median and
best-of over the timed reps of all rounds (rank 0; the barriers align the ranks), and the spread of the per-rep
ratios (median, interquartile range, min-max, share of reps <= 1.0), so "<= 1.0" is a measured statement.
``--launches K`` starts the ranks afresh K times, each timing all rounds; the reps pool, and the verdict ("ahead" /
"behind" where a ratio's bootstrap interval excludes 1.0) must hold in every launch (``launch_verdict``): one
launch's interval does not see what moves between launches. Memory: the PyTorch
allocator's peak during one fwd+bwd over what existed before (``experiments.common.memory.attention_peak_bytes``:
the backward seeded without holding the output; the same measure on both sides; not gloo's own buffers), the
max over ranks. Ratios are ours / peer: time goal <= 1.0, memory goal < 1.0.

Results: ``<out>/<date>_<host kind>_peers[-quick].json`` and ``.csv`` (device, versions, command, load).
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]

import torch

PAIRS = ["ulysses", "zigzag_ring", "ring", "allgather_kv"]
# ours -> PyTorch ring options (ulysses is DeepSpeed's)
TORCH_RING_OPTIONS = {
    "zigzag_ring": {"load_balance": True, "rotate": "alltoall"},
    "ring": {"load_balance": False, "rotate": "alltoall"},
    "allgather_kv": {"load_balance": True, "rotate": "allgather"},
}


def _peer(backend: str, group):
    """``(call, name, version)`` of the peer paired with ``backend``; ``call.positions(N)`` where it has its
    own layout, else ``None`` (DeepSpeed: contiguous)."""
    from experiments.common.peers import TorchRing, deepspeed_ulysses

    if backend == "ulysses":
        call, version = deepspeed_ulysses(group, causal=True)
        return call, "deepspeed.sequence.layer.DistributedAttention + F.scaled_dot_product_attention", version
    ring = TorchRing(group, causal=True, **TORCH_RING_OPTIONS[backend])
    return ring, ring.name, torch.__version__


def _short(peer_name: str) -> str:
    """The peer in a table cell."""
    if peer_name.startswith("deepspeed"):
        return "DeepSpeed DistributedAttention"
    balance = "head-tail" if "head-tail" in peer_name else "no balance"
    return f"torch ring, {balance}, {peer_name.rsplit('rotate=', 1)[1].rstrip(')')}"


def _positions_contiguous(seq_len: int, group) -> torch.Tensor:
    world, rank = torch.distributed.get_world_size(group), torch.distributed.get_rank(group)
    return torch.arange(seq_len).view(world, -1)[rank]


def _to_global(x_local: torch.Tensor, positions: torch.Tensor, seq_len: int, group) -> torch.Tensor:
    """``[B, S/P, H, D]`` shards at ``positions [S/P]`` on every rank -> ``[B, N, H, D]`` on every rank."""
    world = torch.distributed.get_world_size(group)
    shards = [torch.empty_like(x_local) for _ in range(world)]
    where = [torch.empty_like(positions) for _ in range(world)]
    torch.distributed.all_gather(shards, x_local.contiguous(), group=group)
    torch.distributed.all_gather(where, positions.contiguous(), group=group)
    full = x_local.new_empty(x_local.size(0), seq_len, *x_local.shape[2:])
    full.index_copy_(1, torch.cat(where), torch.cat(shards, dim=1))
    return full


def agreement(ours: list[torch.Tensor], peer: list[torch.Tensor], tol: float, what: str) -> tuple[float, float]:
    """``(max |ours - peer|, negative control)`` over ``[out, dq, dk, dv]``, each ``[B, N, H, D]`` at global
    positions; raises ``AssertionError`` (before anything is timed) if they differ by more than ``tol``, or if
    ``out`` shifted by one position is not 100x farther (then the comparison could not fail)."""
    max_diff = max(float((a - c).abs().max()) for a, c in zip(ours, peer))
    control = float((ours[0] - peer[0].roll(1, dims=1)).abs().max())
    if not max_diff <= tol:
        raise AssertionError(f"{what} disagree: max |diff| over out, dq, dk, dv {max_diff:.3g} > tol {tol:.3g}")
    if not control > 100 * tol:
        raise AssertionError(f"{what}: negative control {control:.3g} is not > 100 x tol {tol:.3g} (the comparison "
                             "cannot fail at this tolerance)")
    return max_diff, control


def _fwd_bwd(fn, q, k, v, dout, seq_len):
    for t in (q, k, v):
        t.grad = None
    out = fn(q, k, v, seq_len=seq_len)
    out.backward(dout)
    return out


CI_LEVEL = 0.95
CI_RESAMPLES = 4000
CI_MIN_REPS = 5
"""Fewer reps than this get no verdict (``"few reps"``): resampling 1-4 reps says nothing about the noise."""


def ratio_ci(ours_s: list[float], peer_s: list[float], *, level: float = CI_LEVEL, resamples: int = CI_RESAMPLES,
             seed: int = 0) -> tuple[float, float]:
    """Bootstrap confidence interval of the time ratio ``median(ours) / median(peer)``: the reps are resampled
    with replacement in pairs (rep ``i`` of both sides ran back to back, so a slow spell of the machine stays on
    both sides of the ratio), percentiles of the ``resamples`` ratios. Seeded: the same reps give the same
    interval."""
    import random
    import statistics

    rng = random.Random(seed)
    n = len(ours_s)
    got = []
    for _ in range(resamples):
        idx = [rng.randrange(n) for _ in range(n)]
        got.append(statistics.median(ours_s[i] for i in idx) / statistics.median(peer_s[i] for i in idx))
    got.sort()
    tail = (1.0 - level) / 2
    return got[int(tail * resamples)], got[min(resamples - 1, int((1.0 - tail) * resamples))]


def time_verdict(ci: tuple[float, float]) -> str:
    """``"ahead"`` where the whole interval is below 1.0, ``"behind"`` where it is above, else ``"parity"``."""
    return "ahead" if ci[1] < 1.0 else "behind" if ci[0] > 1.0 else "parity"


def ratio_spread(ours_s: list[float], peer_s: list[float]) -> dict:
    """Per-rep time ratios ``ours[i] / peer[i]`` (the two sides of rep ``i`` ran back to back) summarised:
    their median, quartiles (``statistics.quantiles``, inclusive method), min, max, and the share of reps at
    or below 1.0; and the ratio of medians' bootstrap interval (``ratio_ci``) with its verdict
    (``time_verdict``; ``"few reps"`` below ``CI_MIN_REPS``)."""
    import statistics

    if len(ours_s) != len(peer_s) or not ours_s:
        raise ValueError(f"need as many ours as peer reps (>= 1), got {len(ours_s)} and {len(peer_s)}")
    ratios = [a / b for a, b in zip(ours_s, peer_s)]
    q1, _, q3 = statistics.quantiles(ratios, n=4, method="inclusive") if len(ratios) > 1 else (ratios[0],) * 3
    ci = ratio_ci(ours_s, peer_s)
    return {
        "time_ratio_rep_median": statistics.median(ratios), "time_ratio_q1": q1, "time_ratio_q3": q3,
        "time_ratio_min": min(ratios), "time_ratio_max": max(ratios),
        "time_ratio_share_le_1": sum(r <= 1.0 for r in ratios) / len(ratios), "time_ratios": ratios,
        "time_ratio_ci95": list(ci), "time_verdict": time_verdict(ci) if len(ratios) >= CI_MIN_REPS else "few reps",
    }


def time_stats(ours_s: list[float], peer_s: list[float]) -> dict:
    """A cell's time figures from its paired reps: each side's median and best, their ratios, the per-rep spread
    and interval (``ratio_spread``), and the reps themselves."""
    import statistics

    med, best = (statistics.median(ours_s), statistics.median(peer_s)), (min(ours_s), min(peer_s))
    return {"ours_median_s": med[0], "peer_median_s": med[1], "time_ratio": med[0] / med[1],
            **ratio_spread(ours_s, peer_s),
            "ours_best_s": best[0], "peer_best_s": best[1], "time_ratio_best": best[0] / best[1],
            "ours_all_s": ours_s, "peer_all_s": peer_s, "reps": len(ours_s)}


def launch_verdict(verdicts: list[str]) -> str:
    """The verdict over fresh launches of the ranks: ``"ahead"`` / ``"behind"`` only where every launch's own
    verdict (``time_verdict`` of its reps' interval) says so, else ``"parity"`` (``"few reps"`` if any launch had
    too few reps for one). One launch's interval counts the noise between its reps, not what differs from one
    launch to the next (run 11 of benchmarks/README.md section 8 read two cells "behind" that read parity when
    launched again): a lead or a lag is claimed only where it survives a relaunch."""
    if not verdicts or "few reps" in verdicts:
        return "few reps"
    return verdicts[0] if verdicts[0] in ("ahead", "behind") and len(set(verdicts)) == 1 else "parity"


def pool_launches(launches: list[list[dict]]) -> list[dict]:
    """One row per cell from the rows of every launch (each a list of rows in grid order, from ``_worker``):
    times, ratios and the pooled interval over all launches' reps (``ratio_spread``), peaks the max over launches,
    and per launch its ratio of medians, interval and verdict; ``time_verdict`` is ``launch_verdict`` of those
    (with one launch: that launch's own verdict, as before ``--launches``)."""
    cells = [[launch[i] for launch in launches] for i in range(len(launches[0]))]
    rows = []
    for runs in cells:
        first = runs[0]
        if any((r["pair"], r["seq_len"]) != (first["pair"], first["seq_len"]) for r in runs):
            raise ValueError("launches timed different grids")
        peaks = {side: max(r[f"{side}_peak_bytes"] for r in runs) for side in ("ours", "peer")}
        pooled = time_stats([t for r in runs for t in r["ours_all_s"]], [t for r in runs for t in r["peer_all_s"]])
        row = {
            **first,
            "ours_peak_bytes": peaks["ours"], "peer_peak_bytes": peaks["peer"],
            "memory_ratio": peaks["ours"] / peaks["peer"],
            "peaks_by_rank": [{side: max(r["peaks_by_rank"][rank][side] for r in runs) for side in ("ours", "peer")}
                              for rank in range(len(first["peaks_by_rank"]))],  # each rank's max over launches
            "max_abs_diff_out_and_grads": max(r["max_abs_diff_out_and_grads"] for r in runs),
            "negative_control_diff": min(r["negative_control_diff"] for r in runs),
            **pooled,
            "launches": len(runs), "reps_per_launch": [len(r["ours_all_s"]) for r in runs],
            "launch_time_ratios": [r["time_ratio"] for r in runs],
            "launch_ci95": [r["time_ratio_ci95"] for r in runs],
            "launch_verdicts": [r["time_verdict"] for r in runs],
            "time_verdict_pooled": pooled["time_verdict"],
            "time_verdict": launch_verdict([r["time_verdict"] for r in runs]),
            "load_average_1m": runs[-1]["load_average_1m"],
            "load_average_1m_by_round": [x for r in runs for x in r["load_average_1m_by_round"]],
        }
        rows.append(row)
    return rows


def _worker(rank, world, cfg):
    import torch.distributed as dist

    from experiments.common.memory import attention_peak_bytes
    from experiments.throughput import time_alternating
    from lightning_sp import SequenceParallelAttention, shard_sequence
    from lightning_sp.ops.kernels import make_kernel

    group = dist.group.WORLD
    torch.set_num_threads(cfg["threads_per_rank"])
    b, h, d = cfg["batch"], cfg["heads"], cfg["head_dim"]
    cells = []  # (row, {side: fwd+bwd call}) per (N, pair), in grid order
    for n in cfg["seq_lens"]:
        g = torch.Generator().manual_seed(n)
        full = [torch.randn(b, n, h, d, generator=g) for _ in range(4)]  # q, k, v, dout [B, N, H, D]
        for backend in cfg["pairs"]:
            ours = SequenceParallelAttention(backend=backend, causal=True, group=group)  # defaults otherwise
            peer, peer_name, peer_version = _peer(backend, group)
            ours_pos = shard_sequence(torch.arange(n).view(1, n), group, layout=ours.layout)[0]
            peer_pos = peer.positions(n) if hasattr(peer, "positions") else _positions_contiguous(n, group)
            sides = {}
            for side, fn, pos in (("ours", ours, ours_pos), ("peer", peer, peer_pos)):
                q, k, v, dout = (t.index_select(1, pos).contiguous() for t in full)
                q, k, v = (t.requires_grad_() for t in (q, k, v))
                sides[side] = (fn, (q, k, v, dout), pos)
            # correctness first: out, dq, dk, dv at global positions
            results = {}
            for side, (fn, (q, k, v, dout), pos) in sides.items():
                out = _fwd_bwd(fn, q, k, v, dout, n).detach()
                results[side] = [_to_global(t, pos, n, group) for t in (out, q.grad, k.grad, v.grad)]
            max_diff, control = agreement(results["ours"], results["peer"], cfg["tol"],
                                          f"{backend} and {peer_name} at N={n}, P={world}")
            del results
            peaks = {}
            for side, (fn, (q, k, v, dout), _) in sides.items():
                peak, _inputs = attention_peak_bytes(fn, q, k, v, dout, seq_len=n, group=group)
                peaks[side] = peak
            all_peaks = [None] * world
            dist.all_gather_object(all_peaks, peaks, group=group)
            peak_max = {side: max(p[side] for p in all_peaks) for side in peaks}
            calls = {side: (lambda fn=fn, t=t, n=n: _fwd_bwd(fn, *t, n)) for side, (fn, t, _) in sides.items()}
            row = {
                "pair": backend, "peer": peer_name, "peer_version": peer_version, "world": world, "seq_len": n,
                "batch": b, "heads": h, "head_dim": d, "dtype": "float32", "causal": True,
                "ours_settings": "defaults (kernel='auto', kv_pieces='auto', validate_inputs=True)",
                "ours_kernel": type(make_kernel(ours.kernel)).__name__,  # what kernel="auto" resolved to
                "ours_kv_pieces": ours._kv_pieces(backend, *sides["ours"][1][:2], world, None),  # "auto" resolved
                "same_positions": bool(torch.equal(ours_pos, peer_pos)),
                "ours_peak_bytes": peak_max["ours"], "peer_peak_bytes": peak_max["peer"],
                "memory_ratio": peak_max["ours"] / peak_max["peer"],
                "peaks_by_rank": all_peaks,
                "max_abs_diff_out_and_grads": max_diff, "negative_control_diff": control,
            }
            cells.append((row, calls))
            del sides
    # Time: the whole grid `rounds` times over, so a slow spell of the machine lands on every cell rather than on
    # one; within a cell the sides alternate rep by rep, and odd rounds start with the peer (with an odd number
    # of reps per round, neither side goes first more often over an even number of rounds)
    walls = [{"ours": [], "peer": []} for _ in cells]
    loads = [[] for _ in cells]
    for rnd in range(cfg["rounds"]):
        for (row, calls), wall, load in zip(cells, walls, loads):
            order = ("ours", "peer") if rnd % 2 == 0 else ("peer", "ours")
            times = time_alternating({s: calls[s] for s in order}, warmup=cfg["warmup"], reps=cfg["reps"], group=group)
            for side in wall:
                wall[side].extend(times[side].wall_s)
            load.append(os.getloadavg()[0])
    rows = []
    for (row, _calls), wall, load in zip(cells, walls, loads):
        rows.append({
            **row,
            **time_stats(wall["ours"], wall["peer"]),  # reps = rounds x reps per round
            "reps_per_round": cfg["reps"], "rounds": cfg["rounds"],
            "warmup": cfg["warmup"], "load_average_1m": load[-1], "load_average_1m_by_round": load,
        })
    return rows


def _table(rows) -> str:
    lines = ["pair          peer                                P      N  time ratio  (best)  95% CI         verdict  "
             "per-rep: median [IQR]          min-max        <=1  mem ratio  ours s  peer s  ours MiB  peer MiB  max|diff|"]
    for r in rows:
        lines.append(
            f"{r['pair']:<13} {_short(r['peer']):<35} {r['world']:>2} {r['seq_len']:>6} {r['time_ratio']:>10.3f} "
            f"({r['time_ratio_best']:.3f}) [{r['time_ratio_ci95'][0]:.3f}-{r['time_ratio_ci95'][1]:.3f}] "
            f"{r['time_verdict']:<8} {r['time_ratio_rep_median']:>14.3f} [{r['time_ratio_q1']:.3f}-"
            f"{r['time_ratio_q3']:.3f}] {r['time_ratio_min']:.3f}-{r['time_ratio_max']:.3f} "
            f"{r['time_ratio_share_le_1']:>4.0%} {r['memory_ratio']:>9.3f} {r['ours_median_s']:>7.3f} {r['peer_median_s']:>7.3f} "
            f"{r['ours_peak_bytes'] / 2**20:>9.1f} {r['peer_peak_bytes'] / 2**20:>9.1f} {r['max_abs_diff_out_and_grads']:>10.1e}"
        )
    reps = rows[0]["reps"] if rows else 0
    launches = rows[0].get("launches", 1) if rows else 1
    if launches > 1:
        for r in rows:
            lines.append(f"  {r['pair']:<13} N={r['seq_len']:<6} launches: ratio " +
                         ", ".join(f"{x:.3f}" for x in r["launch_time_ratios"]) + "; verdicts " +
                         ", ".join(r["launch_verdicts"]) + f" -> {r['time_verdict']} (pooled reps: {r['time_verdict_pooled']})")
    lines.append(f"ratios = ours / peer; time: median fwd+bwd over {reps} reps ({launches} launch(es) x rounds x reps "
                 "per round), its 95% bootstrap interval (reps resampled in pairs) and the per-rep ratios (median, "
                 "interquartile range, min-max, share <= 1.0), goal <= 1.0; verdict: ahead / behind where the interval "
                 "excludes 1.0 in every launch, else parity; mem: allocator peak added "
                 "per rank, max over ranks and launches, goal < 1.0; ours with default settings")
    return "\n".join(lines)


def rank_timeout(rounds: int) -> float:
    """Default seconds for the rank processes: a round of the default grid took ~130 s on the 2-core CPU
    (2026-11-24: 5 rounds in 672 s, 8 in 992 s), and ``--rounds 8`` ran past the fixed 900 s of before."""
    return 300.0 + 200.0 * rounds


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true", help="N=256, no warm-up, 1 rep: a smoke run")
    p.add_argument("--pairs", default=",".join(PAIRS), help=f"comma-separated subset of {PAIRS}")
    p.add_argument("--world", type=int, default=2, help="ranks (P)")
    p.add_argument("--seq-lens", default=None, help="global N, comma-separated (default 4096,8192; quick 256)")
    p.add_argument("--heads", type=int, default=8)
    p.add_argument("--head-dim", type=int, default=64)
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--reps", type=int, default=None, help="timed reps per pair and round (default 4; quick 1)")
    p.add_argument("--rounds", type=int, default=None,
                   help="times the whole grid of pairs x lengths is timed, interleaved, odd rounds starting with the "
                        "peer (default 2; quick 1); a cell's statistics pool its reps over the rounds")
    p.add_argument("--launches", type=int, default=1,
                   help="times the ranks are started afresh, each timing --rounds rounds; a verdict (ahead / behind) "
                        "must hold in every launch (launch_verdict)")
    p.add_argument("--warmup", type=int, default=None, help="warm-up reps per pair and round (default 1; quick 0)")
    p.add_argument("--tol", type=float, default=1e-3, help="max |ours - peer| over out, dq, dk, dv")
    p.add_argument("--threads-per-rank", type=int, default=1)
    p.add_argument("--out", default=str(Path(__file__).resolve().parent / "results"), help="directory for the JSON/CSV results")
    p.add_argument("--name", default=None, help="file stem (default <date>_<host kind>_peers[-quick])")
    p.add_argument("--timeout", type=float, default=None,
                   help="seconds for the rank processes (default: 300 + 200 per round; a round takes ~130 s here)")
    args = p.parse_args(argv)
    unknown = set(args.pairs.split(",")) - set(PAIRS)
    if unknown:
        p.error(f"unknown pairs {sorted(unknown)}; choose from {PAIRS}")
    for name in ("reps", "rounds", "launches"):
        if getattr(args, name) is not None and getattr(args, name) < 1:
            p.error(f"--{name} must be >= 1, got {getattr(args, name)}")
    if args.world < 2:
        p.error(f"--world must be >= 2 (a peer comparison needs ranks), got {args.world}")
    return args


def main(argv=None) -> int:
    from experiments.common.results import run_metadata, write_results
    from experiments.common.launch import run_on_ranks

    args = parse_args(argv)
    t_start = time.perf_counter()
    cfg = {
        "pairs": args.pairs.split(","),
        "seq_lens": [int(x) for x in args.seq_lens.split(",")] if args.seq_lens else ([256] if args.quick else [4096, 8192]),
        "heads": args.heads, "head_dim": args.head_dim, "batch": args.batch,
        "reps": args.reps or (1 if args.quick else 4),
        "rounds": args.rounds or (1 if args.quick else 2),
        "warmup": args.warmup if args.warmup is not None else (0 if args.quick else 1), "tol": args.tol,
        "threads_per_rank": args.threads_per_rank, "launches": args.launches,
    }
    meta = run_metadata(__file__, argv, config=cfg, load_average_1m_start=os.getloadavg()[0],
                        time_method="fwd+bwd between barriers, sides alternating (experiments.throughput.time_alternating)",
                        memory_method="PyTorch allocator peak of one fwd+bwd over what existed before "
                                      "(experiments.common.memory.attention_peak_bytes), max over ranks")
    print(f"device: {meta['hardware']['device']}, torch {torch.__version__}; command: {meta['command']}", flush=True)
    timeout = args.timeout or rank_timeout(cfg["rounds"])
    launches = []
    for launch in range(args.launches):  # fresh rank processes each time: what differs between launches shows
        launches.append(run_on_ranks(_worker, args.world, (cfg,), timeout_s=timeout, pg_timeout_s=timeout)[0])
        if args.launches > 1:
            print(f"launch {launch + 1} of {args.launches} done ({time.perf_counter() - t_start:.0f} s)", flush=True)
    rows = pool_launches(launches)
    meta["runtime_s"] = time.perf_counter() - t_start
    meta["load_average_1m_end"] = os.getloadavg()[0]
    print(_table(rows))
    hw = meta["hardware"]
    kind = "".join(c if c.isalnum() else "-" for c in hw["cpu_model"].lower()).strip("-")
    kind = "-".join(w for w in kind.split("-") if w)
    name = args.name or f"{meta['date'][:10]}_cpu-{kind}-{hw['cpu_cores']}c_peers{'-quick' if args.quick else ''}"
    path = write_results(name, meta, rows, out=args.out)
    print(f"wrote {path} and .csv; total runtime {meta['runtime_s']:.1f}s; load {meta['load_average_1m_start']:.2f} -> "
          f"{meta['load_average_1m_end']:.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
