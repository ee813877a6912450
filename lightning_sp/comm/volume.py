"""Analytic communication volume per rank and layer, forward and backward, in elements.

``N`` global tokens, ``P`` ranks, ``H``/``H_kv`` query/KV heads of size ``D`` (``h = H*D``,
``h_kv = H_kv*D``). Same convention as ``CommStats`` (``lightning_sp.comm.stats``): what this rank hands
to a collective as its send buffer. Each backward term is read off what that backward sends:

    backend       forward                               backward
    ulysses       (2H + 2H_kv') D N / P                 same: the 4 all-to-alls run in reverse on the grads
    ring, zigzag  (P-1)/P * 2 N h_kv   (K/V blocks)     (P-1)/P * 2 N h_kv  (K/V again)
                                                        +       2 N h_kv    (dK/dV partial sums: P sends,
                                                                             a full circle back to the owner)
    allgather_kv  (P-1)/P * 2 N h_kv   (all-gather)     (P-1)/P * 2 N h_kv  (re-gather the saved shards)
                                                        + (P-1)/P * 2 N h_kv (ring reduce-scatter of dK/dV)
    colossal      (P-1)/P * 2 N h_kv   (RingQK: K,      as ring: V with dV partial sums (RingAV backward),
                                        RingAV: V)      then K with dK partial sums (RingQK backward)
    usp (U x R)   Ulysses over U on the full heads + ring over R on H_kv'/U heads, each term as above

K/V in pieces (``SequenceParallelAttention(kv_pieces=)``, Note [K/V in pieces] in
``lightning_sp/ops/ring_attention.py``; ring, zigzag_ring and usp's ring): when a block travels in
``m > 1`` pieces, each piece comes straight from its owner (the forward bytes are the ring's) and each
dK/dV contribution goes straight back to its owner: ``(P-1)/P * 2 N h_kv`` instead of the circle's
``2 N h_kv``. Pass the pieces actually used, ``kv_pieces=piece_count(module.kv_pieces, block_len)``
with ``block_len`` = the ring's K/V block (``N/P``; ``N/R`` for usp), to ``backward_elements``.

``H_kv' = lcm(H_kv, U)``: Ulysses replicates KV heads until its ``U`` ranks can split them
(``replicated_kv_heads``; ``U = P`` for plain Ulysses). Gradient partial sums travel in the
accumulation dtype (fp32 for bf16/fp16 inputs): in *bytes*, the dK/dV terms (ring, zigzag, colossal,
usp's ring, allgather_kv's reduce-scatter) are twice the element count times a 16-bit input's
element size. The formulas count elements and are exact in bytes for fp32/fp64.

Megatron tensor + sequence parallelism (``tensor_parallel_elements``), per transformer layer on ``t``
ranks: forward 2 all-gathers + 2 reduce-scatters of ``[N, h]``: ``4 (t-1)/t N h``; backward each
column-parallel linear (qkv, fc1) re-gathers its saved input shard and reduce-scatters its input grad,
each row-parallel linear (proj, fc2) all-gathers its output grad: ``6 (t-1)/t N h``. Without SP,
2 all-reduces each way (``2 (t-1)/t`` of the input each): ``4 (t-1)/t N h`` forward and backward.
"""

from __future__ import annotations

import math

RING_BACKENDS = ("ring", "zigzag_ring", "colossal")


def replicated_kv_heads(num_heads: int, num_kv_heads: int, degree: int) -> int:
    return num_kv_heads * (degree // math.gcd(num_kv_heads, degree))


def _check(backend: str, world: int, ulysses_degree: int | None) -> None:
    if world < 1:
        raise ValueError(f"world must be >= 1, got {world}")
    if backend == "usp" and (ulysses_degree is None or ulysses_degree < 1 or world % ulysses_degree):
        raise ValueError(f"backend='usp' needs a ulysses_degree dividing world={world}, got {ulysses_degree}")


def forward_elements(backend: str, *, seq_len: int, world: int, num_heads: int, num_kv_heads: int,
                     head_dim: int, ulysses_degree: int | None = None) -> float:
    """Elements this rank sends in one attention layer's forward (table in the module docstring)."""
    return _attention_elements(backend, seq_len=seq_len, world=world, num_heads=num_heads,
                               num_kv_heads=num_kv_heads, head_dim=head_dim, ulysses_degree=ulysses_degree,
                               backward=False)


def backward_elements(backend: str, *, seq_len: int, world: int, num_heads: int, num_kv_heads: int,
                      head_dim: int, ulysses_degree: int | None = None, kv_pieces: int = 1) -> float:
    """Elements this rank sends in one attention layer's backward (table in the module docstring);
    ``kv_pieces``: the pieces each ring K/V block actually travels in (1: whole blocks)."""
    if kv_pieces < 1:
        raise ValueError(f"kv_pieces must be >= 1, got {kv_pieces}")
    return _attention_elements(backend, seq_len=seq_len, world=world, num_heads=num_heads,
                               num_kv_heads=num_kv_heads, head_dim=head_dim, ulysses_degree=ulysses_degree,
                               backward=True, grads_to_owner=kv_pieces > 1 and backend != "colossal")


def _ring_elements(n: int, p: int, kv_width: float, backward: bool, grads_to_owner: bool = False) -> float:
    """A ring over ``p`` ranks passing K and V (``kv_width`` = heads * head dim each): forward the
    blocks (``p - 1`` sends), backward the blocks again plus the dK/dV partial sums (``p`` sends round
    the circle, or ``p - 1`` contributions straight to their owners with ``grads_to_owner``)."""
    if p == 1:
        return 0.0
    blocks = (p - 1) / p * 2 * n * kv_width
    if not backward:
        return blocks
    return blocks + (blocks if grads_to_owner else 2 * n * kv_width)


def _attention_elements(backend: str, *, seq_len: int, world: int, num_heads: int, num_kv_heads: int,
                        head_dim: int, ulysses_degree: int | None, backward: bool, grads_to_owner: bool = False) -> float:
    n, p, d = seq_len, world, head_dim
    _check(backend, p, ulysses_degree)
    if backend == "local" or p == 1:
        return 0.0
    if backend == "ulysses":  # the backward's all-to-alls move the grads of the same tensors
        h_kv = replicated_kv_heads(num_heads, num_kv_heads, p)
        return (2 * num_heads + 2 * h_kv) * d * n / p
    if backend in RING_BACKENDS:
        return _ring_elements(n, p, num_kv_heads * d, backward, grads_to_owner)
    if backend == "allgather_kv":
        gather = (p - 1) / p * 2 * n * num_kv_heads * d
        return 2 * gather if backward else gather  # backward: re-gather + reduce-scatter of dK/dV
    if backend == "usp":
        u = ulysses_degree
        r = p // u
        h_kv = replicated_kv_heads(num_heads, num_kv_heads, u)
        a2a = (2 * num_heads + 2 * h_kv) * d * n / p if u > 1 else 0.0
        return a2a + _ring_elements(n, r, h_kv * d / u, backward, grads_to_owner)
    raise ValueError(f"no analytic volume for backend {backend!r}")


def tensor_parallel_elements(*, tokens: int, hidden: int, world: int, sequence_parallel: bool = True) -> float:
    """Forward elements sent per rank and transformer layer by Megatron tensor parallelism on ``world``
    ranks (``tokens`` = ``B*S`` per tensor-parallel group, padded to a multiple of ``world`` with SP;
    ``hidden`` = ``h``). With SP: 2 all-gathers + 2 reduce-scatters of ``[S, h]``; without: 2 all-reduces
    (each ``2 (t-1)/t`` of its input). Both ``4 (t-1)/t * N h``: the paper's ``4Nh`` for large ``t``.
    Ulysses moves ``4 N h / P``."""
    if world == 1:
        return 0.0
    return 4 * (world - 1) / world * tokens * hidden


def tensor_parallel_backward_elements(*, tokens: int, hidden: int, world: int, sequence_parallel: bool = True) -> float:
    """Backward elements sent per rank and transformer layer by Megatron tensor parallelism: with SP
    ``6 (t-1)/t * N h`` (2 reduce-scatters + 2 all-gathers of the grads, and the 2 column-parallel
    linears re-gather their saved input shard); without SP ``4 (t-1)/t * N h`` (2 all-reduces)."""
    if world == 1:
        return 0.0
    return (6 if sequence_parallel else 4) * (world - 1) / world * tokens * hidden
