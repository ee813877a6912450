#!/usr/bin/env python
"""Calibrate ``lightning_sp.choices._PEAK_MODEL`` (Note [kv_pieces from a memory budget]): the allocator peak of
one attention fwd+bwd per rank, inputs included, for every backend and kv_pieces 1, 2, 4, 8 at two shapes, then
per backend a non-negative least-squares fit of whole blocks (``w_u * u + w_kv * u_kv``) and of pieces
(``f_u * u + f_kv * u_kv + (m_u * u + m_kv * u_kv) / m``), printed as the table to paste.

    OMP_NUM_THREADS=1 .venv/bin/python -m benchmarks.kv_pieces.calibrate_peak_memory     # ~10 min on a quiet 2-core CPU

P = 4 gloo ranks, fp32, causal, ``kernel="sdpa"``, ``MIN_PIECE_TOKENS = 128``; the peak is PyTorch's CPU
allocator's (``experiments.common.memory.AllocatorPeak``), deterministic. The validation shapes live in
``tests/distributed/test_choices.py`` and are never fitted.
"""

from __future__ import annotations

import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]

from experiments.common.launch import run_on_ranks

WORLD = 4
SHAPES = [(4096, 16, 16, 32), (2048, 8, 2, 64)]  # (N, H, H_kv, D)
BACKENDS = ["ring", "zigzag_ring", "allgather_kv", "ulysses", "usp"]
PIECES = [1, 2, 4, 8]
MIN_PIECE_TOKENS = 128


def _worker(rank: int, world: int) -> list[dict]:
    import torch
    import torch.distributed as dist

    from experiments.common.memory import attention_peak_bytes
    from lightning_sp import SequenceParallelAttention, shard_sequence
    from lightning_sp.ops import ring_attention

    ring_attention.MIN_PIECE_TOKENS = MIN_PIECE_TOKENS
    rows = []
    for n, h, h_kv, d in SHAPES:
        g = torch.Generator().manual_seed(0)
        full = [torch.randn(1, n, x, d, generator=g) for x in (h, h_kv, h_kv, h)]  # q, k, v, dout
        for backend in BACKENDS:
            for pieces in PIECES:
                attn = SequenceParallelAttention(causal=True, backend=backend, group=dist.group.WORLD, kernel="sdpa",
                                                 kv_pieces=pieces, validate_inputs=False)
                q, k, v, dout = (shard_sequence(t, dist.group.WORLD, layout=attn.layout).clone() for t in full)
                q, k, v = (t.requires_grad_() for t in (q, k, v))
                peak, inputs = attention_peak_bytes(attn, q, k, v, dout, seq_len=n, group=dist.group.WORLD)
                rows.append({"shape": (n, h, h_kv, d), "backend": backend, "pieces": pieces, "peak": peak,
                             "inputs": inputs,
                             "u": q.numel() * q.element_size(), "u_kv": k.numel() * k.element_size()})
    return rows


def fit(rows: list[dict]) -> dict[str, tuple[float, ...]]:
    import numpy as np
    from scipy.optimize import nnls

    from lightning_sp.ops.backends import head_group_count
    from lightning_sp.ops.ring_attention import piece_count

    table = {}
    for backend in BACKENDS:
        whole, whole_y, split, split_y = [], [], [], []
        for r in (r for r in rows if r["backend"] == backend):
            n, h, h_kv, d = r["shape"]
            degree = WORLD if backend == "ulysses" else 2 if backend == "usp" else 1
            u, u_kv = r["u"], r["u_kv"] * (degree // h_kv if degree > h_kv else 1)  # after K/V head replication
            y = r["peak"] + r["inputs"] - (2 * WORLD * r["u_kv"] if backend == "allgather_kv" else 0)
            m = piece_count(r["pieces"], n // WORLD, MIN_PIECE_TOKENS)
            if backend == "ulysses":  # head groups: a divisor of the K/V heads per rank (after replication)
                m = head_group_count(r["pieces"], max(h_kv, WORLD) // WORLD, n // WORLD)
            if m == 1:
                whole.append([u, u_kv]), whole_y.append(y)
            else:
                split.append([u, u_kv, u / m, u_kv / m]), split_y.append(y)
        w, _ = nnls(np.array(whole, float), np.array(whole_y, float))
        c, _ = nnls(np.array(split, float), np.array(split_y, float))
        err = max(abs(np.array(split) @ c - split_y) / split_y)
        table[backend] = tuple(round(float(x), 3) for x in (*w, *c))
        print(f"{backend:12s} max error on the fitted rows with pieces: {err:.3f}")
    return table


def main() -> None:
    per_rank = run_on_ranks(_worker, WORLD, timeout_s=3600, pg_timeout_s=900)
    rows = [dict(r[0], peak=max(x["peak"] for x in r)) for r in zip(*per_rank)]  # the worst rank
    print("#                  (w_u,   w_kv,   f_u,   f_kv,  m_u,   m_kv)")
    for backend, coefs in fit(rows).items():
        print(f'    "{backend}": {coefs},')


if __name__ == "__main__":
    main()
