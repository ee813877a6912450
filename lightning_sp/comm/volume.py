"""Analytic forward communication volume per rank and attention layer, in elements.

``N`` global tokens, ``P`` ranks, ``H``/``H_kv`` query/KV heads of size ``D`` (``h = H*D``).
Same byte convention as ``CommStats`` (send buffers handed to the collective).

    ulysses       (2*H + 2*H_kv') * D * N / P        H_kv' = max(H_kv, P) (KV heads replicated up to P)
    ring, zigzag  (P-1)/P * 2 * N * H_kv * D
    allgather_kv  (P-1)/P * 2 * N * H_kv * D
    colossal      (P-1)/P * 2 * N * H_kv * D         (RingQK passes K, RingAV passes V)
    usp (U x R)   (2*H + 2*H_kv') * D * N / P  +  (R-1)/R * 2 * N * H_kv' * D / U
"""

from __future__ import annotations

import math


def replicated_kv_heads(num_heads: int, num_kv_heads: int, degree: int) -> int:
    return num_kv_heads * (degree // math.gcd(num_kv_heads, degree))


def forward_elements(backend: str, *, seq_len: int, world: int, num_heads: int, num_kv_heads: int,
                     head_dim: int, ulysses_degree: int | None = None) -> float:
    n, p, d = seq_len, world, head_dim
    if backend == "local" or p == 1:
        return 0.0
    if backend == "ulysses":
        h_kv = replicated_kv_heads(num_heads, num_kv_heads, p)
        return (2 * num_heads + 2 * h_kv) * d * n / p
    if backend in ("ring", "zigzag_ring", "allgather_kv", "colossal"):
        return (p - 1) / p * 2 * n * num_kv_heads * d
    if backend == "usp":
        u = ulysses_degree
        r = p // u
        h_kv = replicated_kv_heads(num_heads, num_kv_heads, u)
        a2a = (2 * num_heads + 2 * h_kv) * d * n / p if u > 1 else 0.0
        return a2a + (r - 1) / r * 2 * n * h_kv * d / u
    raise ValueError(f"no analytic volume for backend {backend!r}")


def tensor_parallel_elements(*, tokens: int, hidden: int, world: int, sequence_parallel: bool = True) -> float:
    """Forward elements sent per rank and transformer layer by Megatron tensor parallelism on ``world``
    ranks (``tokens`` = ``B*S`` per tensor-parallel group, ``hidden`` = ``h``). With SP: 2 all-gathers
    + 2 reduce-scatters of ``[S, h]``; without: 2 all-reduces (each ``2 (t-1)/t`` of its input). Both
    ``4 (t-1)/t * N h``: the paper's ``4Nh`` for large ``t``. Ulysses moves ``4 N h / P``."""
    if world == 1:
        return 0.0
    return 4 * (world - 1) / world * tokens * hidden
