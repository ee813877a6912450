#!/usr/bin/env python
"""Communication volume per rank and layer, forward and backward, measured next to each formula
(``experiments/comm_volume/README.md``).

    .venv/bin/python -m experiments.comm_volume.run            # P = 2, 4, 8; N = 256..2048 (gloo, CPU)
    .venv/bin/python -m experiments.comm_volume.run --quick    # P = 2, 4; N = 64 (the smoke test)
    .venv/bin/python -m experiments.comm_volume.plot                   # figure + table from the result file

For every sequence-parallel backend (ulysses, ring, zigzag_ring, allgather_kv, colossal, and usp at
every Ulysses x ring split ``1 < U < P``) one ``SequenceParallelAttention`` layer runs forward and
backward on ``P`` gloo ranks; for Megatron TP+SP one transformer layer (``lightning_sp.models.layers.
Block``, tensor-parallel degree ``t = P``) does. The bytes each rank hands to its collectives are read
from the layer's ``CommStats`` (the attention's ``comm_stats``; the block's ``TensorParallelContext.
comm``), reset between forward and backward, and written next to the formulas of
``lightning_sp.comm.volume`` (elements x 4 bytes, fp32). Every rank's count is checked to be equal.
MHA (H = H_kv = 8) and GQA (H = 8, H_kv = 2), head dim 16, batch 1, causal.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]

from experiments.common.results import add_output_arguments, output_dir, run_metadata, write_results
from experiments.common.launch import run_on_ranks

NAME = "comm_volume"
HEADS = {"mha": (8, 8), "gqa": (8, 2)}  # (H, H_kv)
HEAD_DIM = 16
KV_PIECES = 8  # K/V pieces of the ring backends, as in the committed results (the memory-saving setting)
SP_BACKENDS = ("ulysses", "ring", "zigzag_ring", "allgather_kv", "colossal")
FORMULAS = {  # the papers' forward formulas, as the README and figure name them (h = H*D, h_kv = H_kv*D)
    "ulysses": "4Nh/P (K/V: H_kv'/H of it)",
    "ring": "(P-1)/P * 2N h_kv",
    "zigzag_ring": "(P-1)/P * 2N h_kv",
    "allgather_kv": "(P-1)/P * 2N h_kv",
    "colossal": "RingQK + RingAV: (P-1)/P * 2N h_kv",
    "usp": "Ulysses over U + ring over P/U on h_kv'/U",
    "megatron_tp_sp": "4(t-1)/t * N h (Megatron-SP 4Nh)",
}


def _methods(world: int) -> list[tuple[str, int | None]]:
    """``(backend, ulysses_degree)`` for every attention variant at ``world`` ranks."""
    usp = [("usp", u) for u in range(2, world) if world % u == 0]
    return [(b, None) for b in SP_BACKENDS] + usp


def _split(stats) -> tuple[int, dict[str, int]]:
    snap = stats.snapshot()
    return sum(snap.values()), dict(snap)


def _subgroups(world: int, p: int, usp_degrees: list[int]):
    """This rank's ``P``-rank group (ranks ``[i*P, (i+1)*P)``) and, per Ulysses degree ``u``, its usp
    ``(ulysses_group, ring_group)`` inside it (Ulysses-inner: consecutive ranks). Every rank creates
    every group in the same order, as ``new_group`` requires."""
    import torch.distributed as dist

    me = dist.get_rank()
    mine, usp = None, {}
    for start in range(0, world, p):
        ranks = list(range(start, start + p))
        g = dist.new_group(ranks)
        if me in ranks:
            mine = g
        for u in usp_degrees:
            for i in range(p // u):  # Ulysses groups: consecutive ranks
                members = ranks[i * u:(i + 1) * u]
                ug = dist.new_group(members)
                if me in members:
                    usp.setdefault(u, [None, None])[0] = ug
            for j in range(u):  # ring groups: stride u
                members = ranks[j::u]
                rg = dist.new_group(members)
                if me in members:
                    usp.setdefault(u, [None, None])[1] = rg
    return mine, usp


def _attention_case(group, usp_groups, backend, u, n, h, h_kv, seed):
    """Bytes this rank sends in one attention layer's forward and backward."""
    import torch

    from lightning_sp import SequenceParallelAttention, shard_sequence
    from lightning_sp.context import SequenceParallelContext

    attn = SequenceParallelAttention(causal=True, backend=backend, ulysses_degree=u, kv_pieces=KV_PIECES)
    ug, rg = usp_groups.get(u, (None, None))
    attn.bind(SequenceParallelContext(group=group, backend=backend, ulysses_degree=u, ulysses_group=ug, ring_group=rg))
    g = torch.Generator().manual_seed(seed)
    q, k, v, dout = (torch.randn(1, n, hh, HEAD_DIM, generator=g) for hh in (h, h_kv, h_kv, h))
    q, k, v, dout = (shard_sequence(t, group, layout=attn.layout) for t in (q, k, v, dout))
    q, k, v = (t.requires_grad_() for t in (q, k, v))
    attn.comm_stats.reset()
    out = attn(q, k, v)
    fwd = _split(attn.comm_stats)
    attn.comm_stats.reset()
    out.backward(dout)
    bwd = _split(attn.comm_stats)
    return fwd, bwd, attn.layout.ulysses_degree


def _tensor_parallel_case(group, n, h, h_kv, seed):
    """Bytes this rank sends in one Megatron TP+SP transformer layer's forward and backward."""
    import torch
    import torch.distributed as dist

    from lightning_sp.models.layers import Block, TransformerConfig
    from lightning_sp.tensor_parallel import TensorParallelContext, bind_tensor_parallel

    t = dist.get_world_size(group)
    torch.manual_seed(seed)
    blk = Block(TransformerConfig(vocab_size=8, d_model=h * HEAD_DIM, n_layers=1, n_heads=h, n_kv_heads=h_kv))
    ctx = TensorParallelContext(group=group, sequence_parallel=True)
    bind_tensor_parallel(blk, ctx)
    x = torch.randn(1, n // t, h * HEAD_DIM, requires_grad=True)  # [B, S/t, h]: this rank's sequence shard
    y = blk(x, torch.arange(n).expand(1, n), None)  # [B, S/t, h]
    fwd = _split(ctx.comm)
    ctx.comm.reset()
    y.backward(torch.randn_like(y))
    bwd = _split(ctx.comm)
    return fwd, bwd


def ring_kv_pieces(backend: str, n: int, p: int, u: int | None) -> int:
    """Pieces each ring K/V block travels in with ``kv_pieces=KV_PIECES`` (Note [K/V in pieces]): the ring
    block is ``N/P`` tokens (``N/R`` for usp's ring of ``R = P/U``); 1 off the ring."""
    from lightning_sp.ops.ring_attention import piece_count

    if backend in ("ring", "zigzag_ring"):
        return piece_count(KV_PIECES, n // p)
    if backend == "usp" and p // u > 1:
        return piece_count(KV_PIECES, n // (p // u))
    return 1


def _row(method, backend, u, heads, n, p, fwd, bwd) -> dict:
    h, h_kv = HEADS[heads]
    row = {"method": method, "backend": backend, "ulysses_degree": u, "heads": heads, "num_heads": h,
           "num_kv_heads": h_kv, "N": n, "P": p, "kv_pieces": ring_kv_pieces(backend, n, p, u),
           "measured_fwd_bytes": fwd[0], "measured_bwd_bytes": bwd[0]}
    fwd_el, bwd_el = formula_elements(row)
    return {**row, "formula_fwd_bytes": fwd_el * 4, "formula_bwd_bytes": bwd_el * 4,
            "formula": FORMULAS[backend], "fwd_ops": fwd[1], "bwd_ops": bwd[1]}


def _worker(rank: int, world: int, cfg: dict) -> list[dict]:
    """Every ``P`` in ``cfg["worlds"]`` (dividing ``world``) as ``world / P`` concurrent ``P``-rank groups:
    one spawn for all degrees (each spawned rank pays the library's import once)."""
    rows = []
    seed = 0
    for p in cfg["worlds"]:
        methods = _methods(p)
        group, usp = _subgroups(world, p, [u for b, u in methods if b == "usp"])
        for heads, (h, h_kv) in HEADS.items():
            for n in cfg["seq_lens"]:
                for backend, u in methods:
                    seed += 1
                    fwd, bwd, layout_u = _attention_case(group, usp, backend, u, n, h, h_kv, seed)
                    u = layout_u if backend == "usp" else None
                    method = backend if backend != "usp" else f"usp(U={u})"
                    rows.append(_row(method, backend, u, heads, n, p, fwd, bwd))
                if h % p == 0 and h_kv % p == 0:  # TP splits the heads: t must divide H and H_kv
                    seed += 1
                    fwd, bwd = _tensor_parallel_case(group, n, h, h_kv, seed)
                    rows.append(_row("megatron_tp_sp", "megatron_tp_sp", None, heads, n, p, fwd, bwd))
    return rows


def formula_elements(row: dict) -> tuple[float, float]:
    """(forward, backward) elements per rank of ``row``'s method from ``lightning_sp.comm.volume``."""
    from lightning_sp.comm import volume

    n, p, h, h_kv = row["N"], row["P"], row["num_heads"], row["num_kv_heads"]
    if row["backend"] == "megatron_tp_sp":
        kw = dict(tokens=n, hidden=h * HEAD_DIM, world=p, sequence_parallel=True)  # B = 1
        return volume.tensor_parallel_elements(**kw), volume.tensor_parallel_backward_elements(**kw)
    kw = dict(seq_len=n, world=p, num_heads=h, num_kv_heads=h_kv, head_dim=HEAD_DIM,
              ulysses_degree=row["ulysses_degree"])
    return volume.forward_elements(row["backend"], **kw), volume.backward_elements(row["backend"], kv_pieces=row["kv_pieces"], **kw)


def measure(worlds, seq_lens, timeout_s: float) -> list[dict]:
    """One spawn of ``max(worlds)`` gloo ranks; rank 0's rows, each checked equal on every rank."""
    world = max(worlds)
    if any(world % p for p in worlds):
        raise ValueError(f"every P must divide the largest, {world} (one spawn runs them all); got {worlds}")
    bad = [n for n in seq_lens if n % (2 * world)]
    if bad:
        raise ValueError(f"every N must be a multiple of 2 * max(P) = {2 * world} (zigzag chunks); got {bad}")
    cfg = dict(worlds=sorted(worlds), seq_lens=list(seq_lens))
    per_rank = run_on_ranks(_worker, world, (cfg,), timeout_s=timeout_s, pg_timeout_s=60)
    rows = []
    for i, row in enumerate(per_rank[0]):
        counts = {(r[i]["measured_fwd_bytes"], r[i]["measured_bwd_bytes"]) for r in per_rank}
        rows.append({**row, "same_on_all_ranks": len(counts) == 1})
    return rows


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true", help="P = 2, 4 and N = 64 only (smoke test)")
    p.add_argument("--worlds", type=int, nargs="+", default=None, help="ranks P (default 2 4 8; quick 2 4)")
    p.add_argument("--seq-lens", type=int, nargs="+", default=None,
                   help="global N, multiples of 2P (default 256 512 1024 2048; quick 64)")
    add_output_arguments(p, NAME)  # comm_volume.{json,csv}: runs/comm_volume/, --publish: paper_figures/
    p.add_argument("--timeout-s", type=float, default=900, help="for the one spawn of max(P) ranks")
    args = p.parse_args(argv)
    args.out = output_dir(args, NAME)
    worlds = args.worlds or ([2, 4] if args.quick else [2, 4, 8])
    seq_lens = args.seq_lens or ([64] if args.quick else [256, 512, 1024, 2048])
    if min(worlds) < 2:
        raise ValueError(f"--worlds must be >= 2 ranks, got {worlds}")
    t0 = time.perf_counter()
    rows = measure(worlds, seq_lens, args.timeout_s)
    meta = run_metadata(__file__, argv, kind="measured", experiment=NAME, backend="gloo", dtype="float32",
                        head_dim=HEAD_DIM, heads={k: list(v) for k, v in HEADS.items()}, batch=1, causal=True,
                        units="bytes sent per rank per layer (CommStats convention); formula_* = "
                              "lightning_sp.comm.volume elements x 4 bytes",
                        wall_s=round(time.perf_counter() - t0, 1))
    path = write_results(NAME, meta, rows, args.out)
    mismatched = [r for r in rows if (r["measured_fwd_bytes"], r["measured_bwd_bytes"])
                  != (r["formula_fwd_bytes"], r["formula_bwd_bytes"])]
    print(f"wrote {path} ({len(rows)} rows, {len(mismatched)} differ from the formula) in {meta['wall_s']} s")
    for r in mismatched:
        print(f"  {r['method']} {r['heads']} P={r['P']} N={r['N']}: fwd {r['measured_fwd_bytes']} vs "
              f"{r['formula_fwd_bytes']}, bwd {r['measured_bwd_bytes']} vs {r['formula_bwd_bytes']}")
    return 1 if mismatched or not all(r["same_on_all_ranks"] for r in rows) else 0


if __name__ == "__main__":
    sys.exit(main())
