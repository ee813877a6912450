#!/usr/bin/env python
"""Longest sequence under a per-rank memory budget (Ring Attention Table 3; ColossalAI SP's "3.0x longer
than tensor parallelism"; DeepSpeed-Ulysses's "4x longer"), measured on CPU.

    .venv/bin/python -m experiments.longest_sequence.run            # full run (~15 min on 2 cores)
    .venv/bin/python -m experiments.longest_sequence.run --quick    # tiny smoke run (~15 s)
    .venv/bin/python -m experiments.longest_sequence.plot                  # figure from the result file

For every method and degree P the largest global length N (a multiple of the granularity) is found
for which ONE TRAINING STEP of ``lightning_sp.models.ProteinEncoder`` (forward, backward, gradient
all-reduce, AdamW step) keeps the measured peak memory of every rank within the budget: N doubles from
a start until a step does not fit, then the interval is bisected down to the granularity. Every probe
builds a fresh model and optimizer and measures one step (``experiments.common.memory.PeakRSS``; what is
counted: see ``MEASURED``). Results: ``<out>/longest_sequence.{json,csv}`` (one row per method and P,
with every probe), TensorBoard runs under ``runs/longest_sequence/``.
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
import time
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]

from experiments.common.memory import method, mmap_threshold

NAME = "longest_sequence"
MMAP_THRESHOLD = 16 * 1024
"""The ranks ``mmap`` every allocation of 16 KiB or more (set only for the ranks this script spawns): with
the 128 KiB default, the ``[N_local, d]`` activations of these small models live on the heap, whose
fragmentation made the peak jump by up to 0.5 MiB between neighbouring N."""
MEASURED = (
    "per rank, one training step on a freshly built model: parameters, the input batch, gradients, AdamW state "
    "(created by the step), every activation and temporary of forward and backward, and gloo's buffers. Baseline "
    "(not counted): the process with torch imported, the process group up and one warm-up step of the same "
    "method already run (code pages faulted in). " + method(MMAP_THRESHOLD)
)


@dataclass(frozen=True, kw_only=True)
class Method:
    name: str
    """Row label."""
    parallel: str
    """``"none"`` (P = 1), ``"sp"`` (sequence parallel, ``backend``) or ``"tp"`` (Megatron tensor parallel)."""
    backend: str | None = None
    """Sequence-parallel backend (``parallel="sp"``)."""
    dense_attention: bool = False
    """Vanilla attention: the ``[B, H, N, N]`` scores materialised."""
    chunked_ffn: bool = False
    """Sequence-tiled MLP (``mlp_chunk_size``)."""
    tp_sequence_parallel: bool = False
    """Megatron-SP (norms/residuals on ``N/t`` rows) on top of TP."""
    label: str = ""
    """Plain words for tables and figures."""


METHODS = {m.name: m for m in (
    Method(name="vanilla", parallel="none", dense_attention=True, label="vanilla attention (scores materialised)"),
    Method(name="memory_efficient", parallel="none", label="memory-efficient attention (CPU flash kernel)"),
    Method(name="memory_efficient+chunked_ffn", parallel="none", chunked_ffn=True,
           label="memory-efficient attention + chunked FFN"),
    Method(name="ring", parallel="sp", backend="ring", chunked_ffn=True, label="ring attention (+ chunked FFN)"),
    Method(name="zigzag_ring", parallel="sp", backend="zigzag_ring", chunked_ffn=True, label="zigzag ring (+ chunked FFN)"),
    Method(name="ulysses", parallel="sp", backend="ulysses", chunked_ffn=True, label="Ulysses (+ chunked FFN)"),
    Method(name="tp", parallel="tp", label="Megatron tensor parallel (no SP)"),
    Method(name="tp_sp", parallel="tp", tp_sequence_parallel=True, label="Megatron tensor + sequence parallel"),
)}


@dataclass(kw_only=True)
class SearchConfig:
    budget_mib: float
    """Per-rank memory budget for one training step (MiB, as measured by ``PeakRSS``)."""
    granularity: int
    """Search resolution in tokens *per rank*: global N moves in steps of ``granularity * P``."""
    start: int
    """First probe, tokens per rank (global ``start * P``)."""
    max_tokens: int
    """Give up above this many global tokens (a method that still fits is reported as ``>= max``)."""
    d_model: int = 64
    """Protein encoder width."""
    n_layers: int = 2
    """Transformer blocks."""
    n_heads: int = 8
    """Attention heads (P and t must divide them for Ulysses and TP)."""
    mlp_ratio: float = 4.0
    """MLP hidden width / d_model."""
    mlp_chunk_size: int = 128
    """Tokens per tile of the chunked FFN (methods with ``chunked_ffn``)."""
    seed: int = 0
    """Model and batch seed."""

    def __post_init__(self) -> None:
        for name in ("budget_mib", "granularity", "start", "max_tokens", "mlp_chunk_size"):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name} must be > 0, got {getattr(self, name)}")
        if self.start % self.granularity:
            raise ValueError(f"start={self.start} must be a multiple of granularity={self.granularity} (tokens per rank)")

    @property
    def budget_bytes(self) -> int:
        return int(self.budget_mib * 2**20)

    def step(self, world: int) -> int:
        """Global search resolution at degree ``world``."""
        return self.granularity * world


FULL = SearchConfig(budget_mib=10, granularity=32, start=64, max_tokens=1 << 15, d_model=64, n_layers=4, n_heads=8)
QUICK = SearchConfig(budget_mib=3, granularity=128, start=256, max_tokens=1 << 13, d_model=32, n_layers=2, n_heads=4,
                     mlp_chunk_size=64)
FULL_PLAN = {1: ["vanilla", "memory_efficient", "memory_efficient+chunked_ffn"],
             2: ["ring", "zigzag_ring", "ulysses", "tp", "tp_sp"],
             4: ["ring", "zigzag_ring", "ulysses", "tp", "tp_sp"],
             8: ["ring", "ulysses", "tp", "tp_sp"]}  # zigzag = ring in memory for a bidirectional encoder (P=2, 4 show it)
QUICK_PLAN = {1: ["memory_efficient+chunked_ffn"], 2: ["ring"]}


# ---------------------------------------------------------------------------------------------- one step


def build_model(method: Method, cfg: SearchConfig, group):
    """The protein encoder for ``method``, bound to ``group`` (SP or TP); returns ``(model, sharded names)``."""
    import torch

    from lightning_sp import SequenceParallelAttention
    from lightning_sp.context import SequenceParallelContext
    from lightning_sp.models import ProteinEncoder
    from lightning_sp.tensor_parallel import TensorParallelContext, bind_tensor_parallel

    torch.manual_seed(cfg.seed)
    model = ProteinEncoder(d_model=cfg.d_model, n_layers=cfg.n_layers, n_heads=cfg.n_heads, mlp_ratio=cfg.mlp_ratio,
                           mlp_chunk_size=cfg.mlp_chunk_size if method.chunked_ffn else None,
                           dense_attention=method.dense_attention)
    sharded: list[str] = []
    if method.parallel == "sp":
        context = SequenceParallelContext(group=group, backend=method.backend)
        for m in model.net.modules():
            if isinstance(m, SequenceParallelAttention):
                m.bind(context)
    elif method.parallel == "tp":
        tp = TensorParallelContext(group=group, sequence_parallel=method.tp_sequence_parallel)
        sharded = bind_tensor_parallel(model.net, tp)
        sharded = [f"net.{n}" for n in sharded]
    return model, sharded


def make_batch(n: int, method: Method, model, group, seed: int):
    """Masked-residue batch of one protein context of ``n`` residues, this rank's part (``[1, N_local]``)."""
    import torch

    from lightning_sp import SequenceParallelAttention, shard_sequence

    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(4, 24, (1, n), generator=g)  # [1, N] residue tokens
    labels = torch.where(torch.rand(1, n, generator=g) < 0.15, ids, torch.full_like(ids, -100))  # [1, N]
    pos = torch.arange(n).unsqueeze(0)  # [1, N]
    batch = {"input_ids": ids, "labels": labels, "position_ids": pos}
    if method.parallel == "sp":
        attn = next(m for m in model.net.modules() if isinstance(m, SequenceParallelAttention))
        attn.context.global_seq_len = n
        batch = {k: shard_sequence(v, group, layout=attn.layout).clone() for k, v in batch.items()}  # [1, N/P]
    return batch


def train_step(model, batch, method: Method, sharded: list[str], group) -> float:
    """Forward, backward, gradient reduction as the strategy does it, AdamW step. Returns the loss."""
    import torch.distributed as dist

    from lightning_sp.tensor_parallel.grads import reduce_replicated_gradients

    optimizer = model.configure_optimizers()["optimizer"]
    logits = model(batch["input_ids"], batch["position_ids"])  # [1, N_local, V]
    loss = model.net.cross_entropy(logits, batch["labels"])
    del logits
    loss.backward()
    if method.parallel == "sp":  # DDP over the sequence-parallel ranks (in place, one parameter at a time)
        for p in model.parameters():
            dist.all_reduce(p.grad, group=group)
    elif method.parallel == "tp" and method.tp_sequence_parallel:  # replicated params saw N/t rows each
        reduce_replicated_gradients(model, sharded, group)
    optimizer.step()
    return float(loss.detach())


def measure_step(method: Method, n: int, cfg: SearchConfig, group) -> int:
    """Peak bytes one training step at global length ``n`` adds on this rank (see ``MEASURED``)."""
    import torch.distributed as dist

    from experiments.common.memory import PeakRSS

    world = dist.get_world_size(group) if group is not None else 1
    if world > 1:
        dist.barrier(group)
    with PeakRSS() as peak:
        model, sharded = build_model(method, cfg, group if world > 1 else None)
        batch = make_batch(n, method, model, group, cfg.seed)
        peak.restart_peak()  # TP builds the full model, then keeps its slice: count what it keeps
        train_step(model, batch, method, sharded, group)
        del model, batch
    if world > 1:
        dist.barrier(group)
    return peak.increase_bytes


def max_over_ranks(value: int, group) -> int:
    import torch
    import torch.distributed as dist

    if group is None or dist.get_world_size(group) == 1:
        return value
    t = torch.tensor([value], dtype=torch.int64)
    dist.all_reduce(t, op=dist.ReduceOp.MAX, group=group)
    return int(t)


# ---------------------------------------------------------------------------------------------- search


def search(method: Method, cfg: SearchConfig, group, world: int) -> dict:
    """Grow N (doubling) until a step does not fit, then bisect to ``cfg.step(world)`` tokens."""
    step = cfg.step(world)
    probes: list[dict] = []

    def fits(n: int) -> bool:
        t0 = time.perf_counter()
        peak = max_over_ranks(measure_step(method, n, cfg, group), group)
        probes.append({"N": n, "peak_bytes": peak, "fits": peak <= cfg.budget_bytes, "seconds": round(time.perf_counter() - t0, 2)})
        return peak <= cfg.budget_bytes

    measure_step(method, step, cfg, group)  # warm-up: code pages, gloo pairs, ring sub-buffers
    lo, hi, n = 0, None, cfg.start * world
    while hi is None:
        if n > cfg.max_tokens:
            break
        if fits(n):
            lo, n = n, 2 * n
        else:
            hi = n
    while hi is not None and hi - lo > step:
        mid = lo + (hi - lo) // step // 2 * step
        if fits(mid):
            lo = mid
        else:
            hi = mid
    by_n = {p["N"]: p["peak_bytes"] for p in probes}
    return {"method": method.name, "P": world, "longest_N": lo, "granularity_tokens": step,
            "next_N_not_fitting": hi, "capped_at_max_tokens": hi is None,
            "peak_at_longest_bytes": by_n.get(lo), "peak_at_next_bytes": by_n.get(hi) if hi else None,
            "budget_bytes": cfg.budget_bytes, "probes": probes}


def _worker(rank: int, world: int, cfg: SearchConfig, names: list[str]) -> list[dict]:
    import torch.distributed as dist

    group = dist.group.WORLD
    rows = []
    for name in names:
        t0 = time.perf_counter()
        row = search(METHODS[name], cfg, group, world)
        row["search_seconds"] = round(time.perf_counter() - t0, 1)
        rows.append(row)
    return rows


def _measure_worker(rank: int, world: int, cfg: SearchConfig, points: list[tuple[str, int]]) -> list[int]:
    import torch.distributed as dist

    group = dist.group.WORLD
    out = []
    warmed = set()
    for name, n in points:
        if name not in warmed:
            measure_step(METHODS[name], cfg.step(world), cfg, group)
            warmed.add(name)
        out.append(max_over_ranks(measure_step(METHODS[name], n, cfg, group), group))
    return out


def measure_points(world: int, points: list[tuple[str, int]], cfg: SearchConfig, *, timeout_s: float = 600) -> list[int]:
    """Peak bytes (max over ranks) of one training step for each ``(method, N)`` at degree ``world``,
    measured in freshly spawned ranks (one warm-up step per method first)."""
    from experiments.common.launch import run_on_ranks

    with mmap_threshold(MMAP_THRESHOLD):
        return run_on_ranks(_measure_worker, world, (cfg, points), timeout_s=timeout_s, pg_timeout_s=timeout_s)[0]


def run_search(plan: dict[int, list[str]], cfg: SearchConfig, *, timeout_s: float = 900, concurrent: bool = False,
               log=print, on_degree_done=None) -> list[dict]:
    """One spawn of ``P`` ranks per degree (all degrees at once if ``concurrent``); every method of the plan
    searched there. Rows as in the file. ``on_degree_done(rows so far)`` after each degree (partial saves)."""
    from experiments.common.launch import run_on_ranks

    for p, names in plan.items():
        unknown = [n for n in names if n not in METHODS]
        if unknown:
            raise ValueError(f"unknown methods {unknown} for P={p}; choose from {sorted(METHODS)}")
        wrong = [n for n in names if (METHODS[n].parallel == "none") != (p == 1)]
        if wrong:
            raise ValueError(f"methods {wrong} do not run at P={p}: single-process methods need P=1, parallel ones P>1")
        if p > 1 and cfg.n_heads % p:
            raise ValueError(f"n_heads={cfg.n_heads} must be divisible by P={p} (Ulysses and TP split the heads)")
    import threading

    done: dict[int, list[dict]] = {}
    lock = threading.Lock()

    def one_degree(p: int) -> list[dict]:
        t0 = time.perf_counter()
        found = run_on_ranks(_worker, p, (cfg, plan[p]), timeout_s=timeout_s, pg_timeout_s=timeout_s)[0]
        log(f"[P={p}] " + ", ".join(f"{r['method']}: N={r['longest_N']}" for r in found) + f" ({time.perf_counter() - t0:.0f} s)")
        with lock:
            done[p] = found
            if on_degree_done is not None:
                on_degree_done([r for q in sorted(done) for r in done[q]])
        return found

    degrees = sorted(plan)
    with mmap_threshold(MMAP_THRESHOLD):
        if concurrent:  # peak RSS is per process: groups running side by side do not change each other's peaks
            from concurrent.futures import ThreadPoolExecutor

            with ThreadPoolExecutor(len(degrees)) as pool:
                per_degree = list(pool.map(one_degree, degrees))
        else:
            per_degree = [one_degree(p) for p in degrees]
    return [r for found in per_degree for r in found]


def add_ratios(rows: list[dict]) -> None:
    """The papers' ratios: longest N / longest N of the baseline (vanilla and memory-efficient at P=1;
    TP and TP+SP at the same P)."""
    best = {(r["method"], r["P"]): r["longest_N"] for r in rows}
    for r in rows:
        for base in ("vanilla", "memory_efficient", "memory_efficient+chunked_ffn"):
            b = best.get((base, 1))
            r[f"x_vs_{base}"] = round(r["longest_N"] / b, 3) if b else None
        for base in ("tp", "tp_sp"):
            b = best.get((base, r["P"])) if r["P"] > 1 else None
            r[f"x_vs_{base}_same_P"] = round(r["longest_N"] / b, 3) if b else None


def log_tensorboard(rows: list[dict], log_dir: Path) -> None:
    """One run per method and P (``ring-P4``): peak MiB of every probe against N, and the longest N."""
    from torch.utils.tensorboard import SummaryWriter

    from experiments.common.results import run_name

    for r in rows:
        with SummaryWriter(str(log_dir / run_name(r["method"], P=r["P"]))) as w:
            for pr in sorted(r["probes"], key=lambda pr: pr["N"]):
                w.add_scalar("memory/peak_MiB_per_rank_vs_N", pr["peak_bytes"] / 2**20, pr["N"])
            w.add_scalar("longest_sequence/longest_N", r["longest_N"], r["P"])


def main(argv: list[str] | None = None) -> int:
    from experiments.common.results import RUNS, add_output_arguments, output_dir, run_metadata, write_results

    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true", help="tiny model and budget, P = 1 and 2: a smoke run")
    p.add_argument("--budget-mib", type=float, default=None, help=f"per-rank budget (default {FULL.budget_mib}; quick {QUICK.budget_mib})")
    p.add_argument("--degrees", default=None, help="comma-separated P to run (default: all of the plan)")
    p.add_argument("--methods", default=None, help=f"comma-separated subset of {list(METHODS)} (default: the plan's)")
    add_output_arguments(p, NAME)  # longest_sequence.{json,csv}
    p.add_argument("--log-dir", default=None, help=f"TensorBoard dir (default {RUNS / NAME}; <out>/runs with --out)")
    p.add_argument("--sequential", action="store_true", help="one degree after another (default: all degrees' "
                   "rank groups at once; only the wall time differs, peaks are per process)")
    p.add_argument("--timeout", type=float, default=1800, help="seconds per group of rank processes")
    args = p.parse_args(argv)
    explicit_out = args.out is not None
    args.out = output_dir(args, NAME)
    cfg = dataclasses.replace(QUICK if args.quick else FULL)
    if args.budget_mib is not None:
        cfg = dataclasses.replace(cfg, budget_mib=args.budget_mib)
    plan = dict(QUICK_PLAN if args.quick else FULL_PLAN)
    if args.degrees:
        keep = {int(x) for x in args.degrees.split(",")}
        if keep - set(plan):
            raise SystemExit(f"--degrees {sorted(keep - set(plan))} not in the plan {sorted(plan)}")
        plan = {k: v for k, v in plan.items() if k in keep}
    if args.methods:
        keep = set(args.methods.split(","))
        if keep - set(METHODS):
            raise SystemExit(f"--methods {sorted(keep - set(METHODS))} unknown; choose from {list(METHODS)}")
        plan = {k: [m for m in v if m in keep] for k, v in plan.items()}
        plan = {k: v for k, v in plan.items() if v}
    t0 = time.perf_counter()

    def save(rows: list[dict], *, complete: bool) -> Path:
        rows = [dict(r) for r in rows]
        add_ratios(rows)
        for r in rows:
            r["label"] = METHODS[r["method"]].label
        meta = run_metadata(__file__, argv, config=dataclasses.asdict(cfg), plan=plan, memory_method=MEASURED,
                            runtime_s=round(time.perf_counter() - t0, 1), quick=args.quick, complete=complete,
                            degrees_done=sorted({r["P"] for r in rows}))
        return write_results(NAME, meta, rows, args.out)

    rows = run_search(plan, cfg, timeout_s=args.timeout, concurrent=not args.sequential,
                      on_degree_done=lambda rows: save(rows, complete=False))
    path = save(rows, complete=True)
    add_ratios(rows)
    runtime = time.perf_counter() - t0
    log_dir = Path(args.log_dir) if args.log_dir else (Path(args.out) / "runs" if explicit_out else RUNS / NAME)
    log_tensorboard(rows, log_dir)
    print(f"{'method':<30} {'P':>2} {'longest N':>10} {'peak MiB':>9} {'next N':>7} {'next MiB':>9}  x vanilla  x TP  x TP+SP")
    for r in rows:
        nxt = f"{r['peak_at_next_bytes'] / 2**20:9.2f}" if r["peak_at_next_bytes"] else "      n/a"
        cur = f"{r['peak_at_longest_bytes'] / 2**20:9.2f}" if r["peak_at_longest_bytes"] else "      n/a"
        print(f"{r['method']:<30} {r['P']:>2} {r['longest_N']:>10} {cur} {str(r['next_N_not_fitting']):>7} {nxt}"
              f"  {r['x_vs_vanilla']}  {r['x_vs_tp_same_P']}  {r['x_vs_tp_sp_same_P']}")
    print(f"wrote {path} (and .csv); TensorBoard: {log_dir}; {runtime:.0f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
