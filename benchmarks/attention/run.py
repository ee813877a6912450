#!/usr/bin/env python
"""Attention benchmarks for lightning-sp, measured side by side in one run.

    .venv/bin/python -m benchmarks.attention.run                  # full run (~5-10 min on 2 CPU cores)
    .venv/bin/python -m benchmarks.attention.run --quick          # ~1 min smoke run
    .venv/bin/python -m benchmarks.attention.run --sections volume,memory --quick --out /tmp/x

Sections (``--sections``, comma-separated; default all):

- ``deepspeed``: Ulysses (``SequenceParallelAttention(backend="ulysses", kernel="sdpa")``) vs
  DeepSpeed's ``DistributedAttention`` with ``F.scaled_dot_product_attention`` as its local attention,
  CPU/gloo, P = 2 and 4 ranks, causal fp32 fwd+bwd, same shapes. Outputs and gradients are checked
  to agree before timing; the timing alternates the two implementations rep by rep, with a barrier
  before and after each fwd+bwd; median over reps. If DeepSpeed cannot be imported, a clearly
  labelled in-script baseline "naive all_to_all + SDPA" is timed instead.
- ``volume``: per-rank forward bytes (``attn.comm_stats``) / analytic volume
  (``lightning_sp.comm.volume.forward_elements``) for every backend, MHA and GQA, P = 2 and 4.
- ``memory``: per-rank activation memory at a fixed global N for P = 1, 2, 4 (P = 1: local attention):
  (a) bytes saved for backward by one attention call (``torch.autograd.graph.saved_tensors_hooks``,
  unique storages by ``untyped_storage().data_ptr()``), (b) peak RSS increase during one fwd+bwd
  (``VmHWM`` reset through ``/proc/self/clear_refs``, glibc told to mmap every allocation >= 128 KiB
  so freed memory leaves the process), (c) the same peak plus the bytes of this rank's inputs
  ``q, k, v, dout`` (the whole per-rank footprint of the call while the harness holds the inputs),
  and (d) the peak as in a model: ``q, k, v`` are made inside the measurement by a node that saves
  nothing (``_Projected``, like a projection's output) and the harness drops them after the forward,
  so they live on only if the backend saved them (local attention and the rings save them; Ulysses
  saves its head-split copies instead), plus ``dout``. (b) charges a backend for copies of its
  inputs but not for the inputs themselves, (c) for both; (d) for what a model would hold. The
  backward is seeded through a function that does not keep the attention output alive
  (``experiments.common.memory.grad_seed``), as in a model, where the next layer's backward has
  released it before attention's backward runs; an output that the backend itself saves for
  backward still counts. ``allgather_kv`` is also shown without its gathered K/V (``2 N h_kv``),
  which it keeps by design.
- ``memtrace`` (not in the default run): where each backend's peak comes from. One fwd+bwd per
  backend under ``experiments.common.memory.AllocatorPeak`` (``torch.profiler``, ``profile_memory``);
  from the allocator events (address, bytes, running total) it reports the peak of tensor bytes
  allocated during the call and the tensors alive at that moment, grouped by the aten op that
  allocated them and its autograd node.
  Sees only the PyTorch allocator (not gloo's own buffers, which the RSS peak includes).
- ``gpu``: points at ``benchmarks/gpu/run.py``, which holds the GPU measurements.

Results go to ``<out>/attention_<date>_<host kind>.json`` and ``.csv`` (device, torch version,
date, exact command included).
"""

from __future__ import annotations

import argparse
import csv
import datetime
import json
import os
import platform
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]

from experiments.common.memory import (
    AllocatorPeak,
    grad_seed,
    mmap_large_allocations,
    proc_status_kib,
    reset_peak_rss,
)
from experiments.common.peers import SDPALocal, deepspeed_ulysses

# Large allocations through mmap, so the memory they free leaves the process and VmHWM deltas mean
# "peak bytes this call needed". Must be set before the rank processes start (inherited by spawn).
mmap_large_allocations()

import torch

BACKENDS = ["ulysses", "ring", "zigzag_ring", "allgather_kv", "usp", "colossal"]
SECTIONS = ["deepspeed", "volume", "memory", "memtrace", "gpu"]


# ----------------------------------------------------------------------------------------------
# helpers
# ----------------------------------------------------------------------------------------------


def _inputs(seed, b, n, h, h_kv, d, dtype=torch.float32):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(b, n, h, d, generator=g, dtype=dtype)
    k = torch.randn(b, n, h_kv, d, generator=g, dtype=dtype)
    v = torch.randn(b, n, h_kv, d, generator=g, dtype=dtype)
    dout = torch.randn(b, n, h, d, generator=g, dtype=dtype)
    return q, k, v, dout


class _SavedBytes:
    """Bytes of unique storages autograd saves for backward while active."""

    def __init__(self):
        self.storages: dict[int, int] = {}

    def pack(self, t):
        s = t.untyped_storage()
        self.storages[s.data_ptr()] = s.nbytes()
        return t

    @staticmethod
    def unpack(t):
        return t

    @property
    def total(self) -> int:
        return sum(self.storages.values())


class _Projected(torch.autograd.Function):
    """``q, k, v`` as a model has them: outputs of a graph node that saves nothing (like the
    projections, which save their input, not their output), so once the harness drops its references
    they stay alive only if the attention saved them, and the gradients they receive are consumed
    (freed) by this node's backward instead of accumulating in leaves."""

    @staticmethod
    def forward(ctx, anchor, q, k, v):
        return q.clone(), k.clone(), v.clone()

    @staticmethod
    def backward(ctx, dq, dk, dv):
        return torch.zeros((), dtype=dq.dtype), None, None, None


# ----------------------------------------------------------------------------------------------
# DeepSpeed side by side
# ----------------------------------------------------------------------------------------------


class _NaiveUlysses(torch.nn.Module):
    """Fallback baseline when DeepSpeed is missing: naive all_to_all + SDPA, [B, S/P, H, D] in/out."""

    def __init__(self, causal: bool, group):
        super().__init__()
        self.causal, self.group = causal, group

    def _a2a(self, x, scatter_dim, gather_dim):
        from torch.distributed.nn.functional import all_to_all

        p = torch.distributed.get_world_size(self.group)
        chunks = [c.contiguous() for c in x.chunk(p, dim=scatter_dim)]
        out = all_to_all([torch.empty_like(c) for c in chunks], chunks, group=self.group)
        return torch.cat(out, dim=gather_dim)

    def forward(self, q, k, v):
        qh, kh, vh = (self._a2a(t, 2, 1) for t in (q, k, v))  # [B, S, H/P, D]
        out = SDPALocal(self.causal)(qh, kh, vh)
        return self._a2a(out, 1, 2)


def _fwd_bwd(fn, q, k, v, dout):
    for t in (q, k, v):
        t.grad = None
    out = fn(q, k, v)
    out.backward(dout)
    return out


def _deepspeed_section(rank, world, cfg, group):
    import torch.distributed as dist

    from lightning_sp import SequenceParallelAttention, shard_sequence

    baseline_name = "deepspeed.DistributedAttention"
    try:
        peer_call, baseline_version = deepspeed_ulysses(group, causal=True)
    except Exception as e:  # noqa: BLE001 - any import/init failure falls back to the labelled baseline
        baseline_name = f"naive all_to_all + SDPA (in-script; DeepSpeed unavailable: {type(e).__name__}: {e})"
        peer_call = _NaiveUlysses(True, group)
        baseline_version = None

    ours = SequenceParallelAttention(backend="ulysses", causal=True, group=group, kernel="sdpa", validate_inputs=False)
    rows = []
    b, h, d = cfg["batch"], cfg["heads"], cfg["head_dim"]
    for n in cfg["ds_seq_lens"]:
        q, k, v, dout = (shard_sequence(t, group) for t in _inputs(n, b, n, h, h, d))
        q, k, v = (t.clone().requires_grad_() for t in (q, k, v))
        ours.context.global_seq_len = n  # clones carry no length: say it (N divides, so no padding)
        # correctness first: same outputs and gradients
        o1 = _fwd_bwd(ours, q, k, v, dout).detach()
        g1 = [t.grad.clone() for t in (q, k, v)]
        o2 = _fwd_bwd(peer_call, q, k, v, dout).detach()
        g2 = [t.grad.clone() for t in (q, k, v)]
        max_diff = max(float((a - c).abs().max()) for a, c in zip([o1, *g1], [o2, *g2]))
        diffs = torch.tensor([max_diff])
        dist.all_reduce(diffs, op=dist.ReduceOp.MAX, group=group)
        max_diff = float(diffs)
        if max_diff > cfg["ds_tol"]:
            raise AssertionError(f"ours and {baseline_name} disagree at N={n}, P={world}: max |diff| {max_diff}")
        times = {"ours": [], "peer": []}
        impls = {"ours": ours, "peer": peer_call}
        for rep in range(cfg["warmup"] + cfg["reps"]):
            order = ("ours", "peer") if rep % 2 == 0 else ("peer", "ours")
            for name in order:
                dist.barrier(group)
                t0 = time.perf_counter()
                _fwd_bwd(impls[name], q, k, v, dout)
                dist.barrier(group)
                if rep >= cfg["warmup"]:
                    times[name].append(time.perf_counter() - t0)
        med = {name: statistics.median(ts) for name, ts in times.items()}
        rows.append({
            "world": world, "seq_len": n, "batch": b, "heads": h, "head_dim": d, "dtype": "float32", "causal": True,
            "baseline": baseline_name, "baseline_version": baseline_version,
            "ours_s": med["ours"], "baseline_s": med["peer"], "ratio_ours_over_baseline": med["ours"] / med["peer"],
            "ours_min_s": min(times["ours"]), "baseline_min_s": min(times["peer"]),
            "ratio_min_ours_over_min_baseline": min(times["ours"]) / min(times["peer"]),
            "load_average_1m": os.getloadavg()[0],
            "ours_all_s": times["ours"], "baseline_all_s": times["peer"], "max_abs_diff_out_and_grads": max_diff,
            "reps": cfg["reps"], "warmup": cfg["warmup"],
        })
    return rows


# ----------------------------------------------------------------------------------------------
# volume and memory
# ----------------------------------------------------------------------------------------------


def _volume_section(rank, world, cfg, group):
    from lightning_sp import SequenceParallelAttention, shard_sequence
    from lightning_sp.comm.volume import forward_elements

    rows = []
    n, d = cfg["vol_seq_len"], cfg["head_dim"]
    for heads_name, (h, h_kv) in cfg["vol_heads"].items():
        q, k, v, _ = _inputs(0, 1, n, h, h_kv, d)
        for backend in BACKENDS:
            attn = SequenceParallelAttention(causal=True, backend=backend, group=group, kernel="sdpa")
            local = [shard_sequence(t, group, layout=attn.layout) for t in (q, k, v)]
            with torch.no_grad():
                attn(*local)  # warm-up (creates usp sub-groups, validation collective)
                attn.comm_stats.reset()
                attn(*local)
            measured = attn.comm_stats.total_bytes / q.element_size()
            analytic = forward_elements(backend, seq_len=n, world=world, num_heads=h, num_kv_heads=h_kv, head_dim=d,
                                        ulysses_degree=attn.layout.ulysses_degree)
            rows.append({
                "world": world, "rank": rank, "backend": backend, "heads": heads_name, "num_heads": h, "num_kv_heads": h_kv,
                "seq_len": n, "head_dim": d, "ulysses_degree": attn.layout.ulysses_degree,
                "measured_elements": measured, "analytic_elements": analytic,
                "ratio": measured / analytic if analytic else float("nan"),
                "bytes_by_op": dict(attn.comm_stats.snapshot()),
            })
    return rows


def _memory_section(rank, world, cfg, group):
    import gc

    from lightning_sp import SequenceParallelAttention, shard_sequence

    rows = []
    n, h, d = cfg["mem_seq_len"], cfg["heads"], cfg["head_dim"]
    full = _inputs(1, 1, n, h, h, d)
    backends = ["local"] if world == 1 else cfg["backends"]
    for backend in backends:
        attn = SequenceParallelAttention(causal=True, backend=backend, group=group if world > 1 else None,
                                         kernel="sdpa", validate_inputs=False, **_pieces_kw(cfg))
        layout = attn.layout
        q, k, v, dout = (shard_sequence(t, group if world > 1 else None, layout=layout).clone() for t in full)
        q, k, v = (t.requires_grad_() for t in (q, k, v))
        # Warm-up fwd+bwd on a quarter of the sequence, outside the measurement: builds usp sub-groups
        # and faults in the code pages of the kernels this backend runs (they count in RSS).
        warm = [t.narrow(1, 0, max(1, t.size(1) // 4)).clone() for t in (q, k, v, dout)]
        for t in warm[:3]:
            t.requires_grad_()
        attn(*warm[:3], seq_len=warm[0].size(1) * world).backward(warm[3])
        del warm
        attn.context.global_seq_len = n  # the clones carry no length
        gc.collect()
        if world > 1:
            torch.distributed.barrier(group)
        saved = _SavedBytes()
        rss0 = proc_status_kib("VmRSS")
        hwm_ok = reset_peak_rss()
        with torch.autograd.graph.saved_tensors_hooks(saved.pack, saved.unpack):
            out = attn(q, k, v)
        hwm_fwd = proc_status_kib("VmHWM")
        seed = grad_seed(out, dout)
        del out  # the backend's saved tensors keep what it needs
        seed.backward()
        hwm_fwd_bwd = proc_status_kib("VmHWM")
        input_bytes = sum(t.numel() * t.element_size() for t in (q, k, v))
        inputs_and_dout = input_bytes + dout.numel() * dout.element_size()
        # (d) as in a model: q, k, v made inside the measurement by a node that saves nothing, and
        # dropped by the harness after the forward; dout held throughout (counted)
        data = [t.detach() for t in (q, k, v)]
        anchor = torch.zeros((), requires_grad=True)
        gc.collect()
        if world > 1:
            torch.distributed.barrier(group)
        rss0_model = proc_status_kib("VmRSS")
        reset_peak_rss()
        mq, mk, mv = _Projected.apply(anchor, *data)
        out = attn(mq, mk, mv)
        del mq, mk, mv
        seed = grad_seed(out, dout)
        del out
        seed.backward()
        model_bytes = (proc_status_kib("VmHWM") - rss0_model) * 1024 + dout.numel() * dout.element_size()
        del data, anchor
        rows.append({
            "world": world, "rank": rank, "backend": backend, "seq_len": n, "heads": h, "head_dim": d, "dtype": "float32",
            "causal": True, "saved_for_backward_bytes": saved.total, "local_qkv_bytes": input_bytes,
            "peak_rss_increase_fwd_bytes": (hwm_fwd - rss0) * 1024 if hwm_ok else None,
            "peak_rss_increase_fwd_bwd_bytes": (hwm_fwd_bwd - rss0) * 1024 if hwm_ok else None,
            "peak_fwd_bwd_with_inputs_bytes": (hwm_fwd_bwd - rss0) * 1024 + inputs_and_dout if hwm_ok else None,
            "peak_as_in_a_model_bytes": model_bytes if hwm_ok else None,
            # allgather_kv holds every rank's K and V ([B, N, H_kv, D] each) by design
            "gathered_kv_bytes": 2 * world * k.numel() * k.element_size() if backend == "allgather_kv" else 0,
        })
        del seed, q, k, v, dout, saved
        gc.collect()
        if world > 1:
            torch.distributed.barrier(group)
    return rows


def _pieces_kw(cfg) -> dict:
    """``kv_pieces`` for the memory sections: the module default unless ``--kv-pieces`` is given."""
    return {} if cfg.get("kv_pieces") is None else {"kv_pieces": cfg["kv_pieces"]}


def _memtrace_section(rank, world, cfg, group):
    from lightning_sp import SequenceParallelAttention, shard_sequence

    rows = []
    n, h, d = cfg["mem_seq_len"], cfg["heads"], cfg["head_dim"]
    full = _inputs(1, 1, n, h, h, d)
    backends = ["local"] if world == 1 else [b for b in cfg["backends"] if b != "colossal"]
    for backend in backends:
        attn = SequenceParallelAttention(causal=True, backend=backend, group=group if world > 1 else None,
                                         kernel="sdpa", validate_inputs=False, **_pieces_kw(cfg))
        q, k, v, dout = (shard_sequence(t, group if world > 1 else None, layout=attn.layout).clone() for t in full)
        q, k, v = (t.requires_grad_() for t in (q, k, v))
        attn.context.global_seq_len = n  # the clones carry no length
        attn(q, k, v).backward(dout)  # warm-up (usp sub-groups)
        for t in (q, k, v):
            t.grad = None
        if world > 1:
            torch.distributed.barrier(group)
        with AllocatorPeak() as peak:
            out = attn(q, k, v)
            seed = grad_seed(out, dout)
            del out
            seed.backward()
        rows.append({"world": world, "rank": rank, "backend": backend, "seq_len": n, "heads": h,
                     "local_shard_bytes": q.numel() * q.element_size(), "peak_alloc_bytes": peak.peak_bytes,
                     "live_at_peak": peak.live_at_peak()})
        del q, k, v, dout, seed
        if world > 1:
            torch.distributed.barrier(group)
    return rows


def _worker(rank, world, cfg):
    import torch.distributed as dist

    group = dist.group.WORLD
    torch.set_num_threads(cfg["threads_per_rank"])
    result = {}
    if world > 1 and "deepspeed" in cfg["sections"] and world in cfg["worlds"]:
        result["deepspeed"] = _deepspeed_section(rank, world, cfg, group)
    if world > 1 and "volume" in cfg["sections"] and world in cfg["worlds"]:
        result["volume"] = _volume_section(rank, world, cfg, group)
    if "memory" in cfg["sections"]:
        result["memory"] = _memory_section(rank, world, cfg, group)
    if "memtrace" in cfg["sections"]:
        result["memtrace"] = _memtrace_section(rank, world, cfg, group)
    return result


def _gpu_section(cfg):
    """The GPU measurements live in ``benchmarks/gpu/run.py`` (per-rank schedule vs one kernel call with
    simulated ranks, kernels, longest context, MFU); this section only says so."""
    if not torch.cuda.is_available():
        return {"skipped": "no CUDA device in this session (torch.cuda.is_available() is False)"}
    return {"skipped": "run benchmarks/gpu/run.py for the GPU measurements"}


# ----------------------------------------------------------------------------------------------
# driver
# ----------------------------------------------------------------------------------------------


def _device_info() -> dict:
    model = platform.processor() or "unknown"
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    model = line.split(":", 1)[1].strip()
                    break
    except OSError:
        pass
    info = {"cpu_model": model, "cpu_cores": os.cpu_count(), "platform": platform.platform(),
            "python": platform.python_version(), "torch": torch.__version__,
            "cuda": torch.cuda.get_device_name(0) if torch.cuda.is_available() else None}
    try:
        import deepspeed

        info["deepspeed"] = deepspeed.__version__
    except Exception:  # noqa: BLE001
        info["deepspeed"] = None
    return info


def _host_kind(info) -> str:
    if info["cuda"]:
        return "gpu-" + "".join(c if c.isalnum() else "-" for c in info["cuda"].lower()).strip("-")
    model = "".join(c if c.isalnum() else "-" for c in info["cpu_model"].lower()).strip("-")
    return f"cpu-{model}-{info['cpu_cores']}c"


def _fmt_bytes(x):
    return "n/a" if x is None else f"{x / 2**20:9.1f} MiB"


def _summaries(results, worlds):
    lines = []
    if "deepspeed" in results:
        lines.append("\n== Ulysses vs peer (fwd+bwd, causal fp32, median s; ratio = ours / peer, goal <= 1.0; min ratio = best-of-reps) ==")
        lines.append(f"baseline: {results['deepspeed'][0]['baseline'] if results['deepspeed'] else 'n/a'}")
        lines.append(f"{'P':>2} {'N':>6} {'ours s':>9} {'peer s':>9} {'ratio':>6} {'min ratio':>9} {'max|diff|':>10} {'load1m':>6}")
        for r in results["deepspeed"]:
            lines.append(f"{r['world']:>2} {r['seq_len']:>6} {r['ours_s']:9.3f} {r['baseline_s']:9.3f} "
                         f"{r['ratio_ours_over_baseline']:6.3f} {r['ratio_min_ours_over_min_baseline']:9.3f} "
                         f"{r['max_abs_diff_out_and_grads']:10.2e} {r['load_average_1m']:6.2f}")
    if "volume" in results:
        lines.append("\n== Forward elements per rank: measured / analytic (max over ranks of |ratio-1|) ==")
        heads = sorted({r["heads"] for r in results["volume"]})
        lines.append(f"{'backend':<13}" + "".join(f" {f'P={p} {hd}':>12}" for p in worlds for hd in heads))
        for backend in BACKENDS:
            cells = []
            for p in worlds:
                for hd in heads:
                    rs = [r["ratio"] for r in results["volume"] if r["backend"] == backend and r["world"] == p and r["heads"] == hd]
                    worst = max(rs, key=lambda x: abs(x - 1)) if rs else float("nan")
                    cells.append(f" {worst:12.4f}")
            lines.append(f"{backend:<13}" + "".join(cells))
    if "memory" in results:
        lines.extend(_memory_report(results["memory"]))
    if "memtrace" in results:
        lines.append("\n== Tensors alive at the allocator peak of one fwd+bwd (rank 0; u = one local shard) ==")
        for r in results["memtrace"]:
            if r["rank"] != 0:
                continue
            u = r["local_shard_bytes"]
            lines.append(f"P={r['world']} {r['backend']}: peak {r['peak_alloc_bytes'] / 2**20:.1f} MiB = {r['peak_alloc_bytes'] / u:.2f} u")
            for aten, node, mib, count in r["live_at_peak"]:
                lines.append(f"    {mib:8.2f} MiB ({mib * 2**20 / u:4.2f} u) x{count:<3} {aten:<40} in {node}")
    if "gpu" in results:
        lines.append(f"\n== GPU ==\n{results['gpu']}")
    return "\n".join(lines)


MEMORY_MEASURES = [  # (row key, column label, P=1 line)
    ("saved_for_backward_bytes", "saved", "saved for backward"),
    ("peak_rss_increase_fwd_bwd_bytes", "increase", "(b) peak RSS increase over the inputs"),
    ("peak_fwd_bwd_with_inputs_bytes", "+inputs", "(c) peak incl. the inputs q, k, v, dout"),
    ("peak_as_in_a_model_bytes", "model", "(d) peak as in a model (q, k, v alive only if saved; dout held)"),
]


def _memory_report(mem) -> list[str]:
    """One table per measure: the max over ranks at each P, as a ratio to P=1 (local attention on
    the whole sequence); allgather_kv also without its gathered K/V for the peak measures."""
    base = [r for r in mem if r["world"] == 1]
    if not base:
        return []
    b = base[0]
    ps = [p for p in sorted({r["world"] for r in mem}) if p > 1]
    lines = [f"\n== Per-rank activation memory, global N={b['seq_len']}, H={b['heads']}, D={b['head_dim']}, fp32 causal "
             "(max over ranks; ratio = mem(P)/mem(1)) =="]
    for key, label, title in MEMORY_MEASURES:
        if not b.get(key):
            continue
        lines.append(f"P=1 local, {title}: {_fmt_bytes(b[key])}")
        lines.append(f"{'backend':<13}" + "".join(f" {f'{label} P={p}':>16} {'ratio':>6} {'1/P':>5}" for p in ps))
        for backend in BACKENDS:
            cells = []
            for p in ps:
                vals = [r[key] for r in mem if r["backend"] == backend and r["world"] == p and r.get(key) is not None]
                if not vals:
                    cells.append(" " * 30)
                    continue
                m = max(vals)
                cells.append(f" {_fmt_bytes(m):>16} {m / b[key]:6.3f} {1 / p:5.3f}")
            lines.append(f"{backend:<13}" + "".join(cells))
        if key == "saved_for_backward_bytes":
            continue
        for p in ps:  # allgather_kv may keep its gathered K/V (nothing else of size N): that share apart
            rs = [r for r in mem if r["backend"] == "allgather_kv" and r["world"] == p and r.get(key) is not None]
            if rs:
                r = max(rs, key=lambda r: r[key])
                rest = r[key] - r["gathered_kv_bytes"]
                lines.append(f"  allgather_kv P={p} without its gathered K/V ({_fmt_bytes(r['gathered_kv_bytes'])}): "
                             f"{_fmt_bytes(rest)}, ratio {rest / b[key]:.3f}")
    return lines


def _csv_rows(results):
    for section in ("deepspeed", "volume", "memory", "memtrace"):
        for r in results.get(section, []):
            base = {"section": section, "world": r.get("world"), "rank": r.get("rank", 0), "backend": r.get("backend", "ulysses"),
                    "seq_len": r.get("seq_len"), "heads": r.get("heads")}
            for key, val in r.items():
                if isinstance(val, (int, float)) and not isinstance(val, bool) and key not in base:
                    yield {**base, "metric": key, "value": val}


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--sections", default="deepspeed,volume,memory,gpu", help=f"comma-separated subset of {SECTIONS}")
    p.add_argument("--quick", action="store_true", help="small sizes, 1-2 reps: a ~1 minute smoke run")
    p.add_argument("--worlds", default="2,4", help="sequence-parallel degrees (P=1 is added for memory)")
    p.add_argument("--ds-seq-lens", default=None, help="global N for the DeepSpeed comparison (default 4096,8192; quick 1024)")
    p.add_argument("--vol-seq-len", type=int, default=None, help="global N for the volume section (default 2048; quick 512)")
    p.add_argument("--mem-seq-len", type=int, default=None, help="global N for the memory section (default 8192; quick 2048)")
    p.add_argument("--backends", default=",".join(BACKENDS), help=f"comma-separated subset of {BACKENDS} (memory, memtrace)")
    p.add_argument("--kv-pieces", type=int, default=None,
                   help="SequenceParallelAttention(kv_pieces=) in the memory sections (default: the module default)")
    p.add_argument("--heads", type=int, default=8)
    p.add_argument("--head-dim", type=int, default=64)
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--reps", type=int, default=None, help="timed repetitions (default 5; quick 2)")
    p.add_argument("--warmup", type=int, default=None, help="warm-up repetitions (default 1; quick 1)")
    p.add_argument("--threads-per-rank", type=int, default=1)
    p.add_argument("--out", default=str(Path(__file__).resolve().parent / "results"), help="directory for the JSON/CSV results")
    p.add_argument("--name", default=None, help="file stem (default attention_<date>_<host kind>[_quick])")
    p.add_argument("--timeout", type=float, default=900.0, help="seconds per group of rank processes")
    args = p.parse_args(argv)
    unknown = set(args.sections.split(",")) - set(SECTIONS)
    if unknown:
        p.error(f"unknown sections {sorted(unknown)}; choose from {SECTIONS}")
    unknown = set(args.backends.split(",")) - set(BACKENDS)
    if unknown:
        p.error(f"unknown backends {sorted(unknown)}; choose from {BACKENDS}")
    if args.kv_pieces is not None and args.kv_pieces < 1:
        p.error(f"--kv-pieces must be >= 1, got {args.kv_pieces}")
    return args


def main(argv=None) -> int:
    from tests.distributed.harness import run_on_ranks

    args = parse_args(argv)
    t_start = time.perf_counter()
    q = args.quick
    cfg = {
        "sections": args.sections.split(","),
        "worlds": [int(x) for x in args.worlds.split(",")],
        "ds_seq_lens": [int(x) for x in args.ds_seq_lens.split(",")] if args.ds_seq_lens else ([1024] if q else [4096, 8192]),
        "vol_seq_len": args.vol_seq_len or (512 if q else 2048),
        "mem_seq_len": args.mem_seq_len or (2048 if q else 8192),
        "vol_heads": {"mha": (args.heads, args.heads), "gqa": (args.heads, max(1, args.heads // 4))},
        "heads": args.heads, "head_dim": args.head_dim, "batch": args.batch,
        "reps": args.reps or (2 if q else 5), "warmup": args.warmup if args.warmup is not None else 1,
        "threads_per_rank": args.threads_per_rank, "ds_tol": 1e-3,
        "backends": args.backends.split(","), "kv_pieces": args.kv_pieces,
    }
    info = _device_info()
    now = datetime.datetime.now(datetime.timezone.utc)
    meta = {"device": info, "date": now.isoformat(timespec="seconds"),
            "command": " ".join([os.path.relpath(sys.executable, os.getcwd()) if sys.executable.startswith(os.getcwd()) else sys.executable, *sys.argv]),
            "cwd": os.getcwd(), "config": cfg,
            "memory_method": "saved_for_backward: saved_tensors_hooks, unique untyped storages; peak: /proc/self/status "
                             "VmHWM after clear_refs=5, minus VmRSS before the call (MALLOC_MMAP_THRESHOLD_=131072); backward seeded "
                             "through grad_seed (the harness does not hold the output); +inputs: plus the bytes of local q, k, v, dout"}
    print(f"device: {info['cpu_model']} x{info['cpu_cores']} cores, torch {info['torch']}, deepspeed {info['deepspeed']}")
    print(f"command: {meta['command']}")
    results: dict = {}
    worlds = sorted(set(cfg["worlds"]) | ({1} if {"memory", "memtrace"} & set(cfg["sections"]) else set()))
    for world in worlds:
        if world == 1 and not {"memory", "memtrace"} & set(cfg["sections"]):
            continue
        t0 = time.perf_counter()
        per_rank = run_on_ranks(_worker, world, (cfg,), timeout_s=args.timeout, pg_timeout_s=args.timeout)
        print(f"[P={world}] done in {time.perf_counter() - t0:.1f}s", flush=True)
        results.setdefault("deepspeed", []).extend(per_rank[0].get("deepspeed", []))
        for section in ("volume", "memory", "memtrace"):
            for r in per_rank:
                results.setdefault(section, []).extend(r.get(section, []))
    results = {k: v for k, v in results.items() if k in cfg["sections"]}
    if "gpu" in cfg["sections"]:
        results["gpu"] = _gpu_section(cfg)
    meta["runtime_s"] = time.perf_counter() - t_start
    print(_summaries(results, [p for p in cfg["worlds"] if p > 1]))
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    stem = args.name or f"attention_{now.date().isoformat()}_{_host_kind(info)}{'_quick' if q else ''}"
    (out / f"{stem}.json").write_text(json.dumps({"meta": meta, "results": results}, indent=1, default=str))
    with open(out / f"{stem}.csv", "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=["section", "world", "rank", "backend", "seq_len", "heads", "metric", "value"])
        w.writeheader()
        for row in _csv_rows(results):
            w.writerow(row)
    print(f"\nwrote {out / stem}.json and .csv; total runtime {meta['runtime_s']:.1f}s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
