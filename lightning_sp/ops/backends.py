"""Each sequence-parallel backend as a composition of differentiable collectives and block attention.

All take this rank's ``q [B, S/P, H, D]``, ``k, v [B, S/P, H_kv, D]`` laid out with the backend's
``SequenceLayout`` and return ``out [B, S/P, H, D]`` exactly equal to dense attention over the
whole global sequence (masks from global positions, ``doc_bounds`` and ``causal``).

    backend        layout        communication (forward, per rank)
    local          contiguous    none
    ulysses        contiguous    4 all-to-alls: 4*N*h/P (K/V: H_kv/H of that)
    ring           contiguous    P-1 K/V ring sends: (P-1)/P * 2*N*h_kv
    zigzag_ring    zigzag        as ring; balanced causal work
    allgather_kv   zigzag        all-gather K and V: (P-1)/P * 2*N*h_kv
    usp            zigzag(U)     Ulysses over U ranks, zigzag ring over P/U
    colossal       contiguous    ring K then ring V; O(N^2/P) score memory

Note [Sorting while gathering]
    After Ulysses' all-to-all a rank holds every position of its heads, concatenated in source-rank
    order. Under the zigzag layout (``auto``'s) that is not global order, and the causal plan of the
    permuted sequence needs many small kernel calls::

        P = 2, zigzag:   rank 0 holds chunks 0 3, rank 1 holds chunks 1 2
        gathered:        0 3 1 2      (3 runs: a causal plan of 5 kernel calls; 13 at P = 4)
        sorted:          0 1 2 3      (1 run: one causal call, as under the contiguous layout)

    Sorting with separate ``index_select`` calls costs a copy of ``q, k, v, out`` forward and a
    zero-fill plus scatter-add per gradient backward. Instead the all-to-all assembles the gathered
    tokens sorted (``TokenOrder``: one ``index_select`` in place of the reshape), the attention runs
    the one-run plan, and the reverse all-to-all gathers by the inverse permutation while it builds
    its send buffer (in place of the ``.contiguous()`` copy); each all-to-all's backward is the other
    with the same order, so no pass over the data is added beyond the one gather copy per gathered
    tensor. ``usp`` does the same inside each Ulysses group:
    under ``auto``'s plain zigzag layout a group of ``U`` ranks gathers ``2U`` interleaved chunks,
    sorted 2 runs, so its ring steps run ``zigzag_ring``'s plan. Permutations are cached per layout,
    length, ranks and device (``_token_order``); a gather that is already sorted gets none.

Note [Heads in groups]
    Ulysses attends over the whole sequence for ``H/P`` heads, so its backward holds the head-split
    ``q, k, v, out`` it saved (``4u``, ``u`` = one local ``[B, S/P, H, D]`` shard; the all-to-all
    outputs are copies, not the caller's tensors), ``dout`` and the kernel's ``dq, dk, dv`` (``4u``)
    at once: with the caller's ``q, k, v, dout`` that is ``12u``, 0.375 of what one process
    doing the whole sequence needs (``8P u``) at P = 4. Attention is independent per head, so
    ``ulysses`` gathers q, k, v whole (one all-to-all each, as with one group) and hands this rank's
    ``H/P`` heads out in ``G`` groups of consecutive heads, each in memory of its own
    (``seq_to_head_groups``; ``head_group_count``: the largest divisor of the K/V heads per rank that
    is at most ``kv_pieces``, fewer on short shards), then runs one kernel call, its own autograd node,
    per group; the output's all-to-all takes the groups' outputs in one send buffer. The backward
    then finishes one group (and autograd frees what that group saved) before it starts the next, so
    the kernel's transients are ``3u / G`` and the saved tensors shrink by ``4u / G`` per group done
    (``benchmarks/attention/run.py --sections memory``). Same all-to-alls and bytes as whole heads; ``G`` kernel calls of
    ``H/(PG)`` heads; one copy of each group's ``dq, dk, dv`` into the send buffers and of its ``dout``
    out of the receive buffer (whole heads use both as they are where ``B = 1``; the CPU flash backward
    would copy a strided head slice of ``dout`` itself, inside the call); query head ``h`` stays
    with K/V head ``h // (H / H_kv)``. ``usp`` runs a round of all-to-alls per group instead (its
    ring takes ``[B, S, H, D]`` blocks, so there is no gather copy to split the groups in).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from functools import lru_cache

import torch

from lightning_sp.comm.collectives import (
    TokenOrder,
    all_gather_raw,
    head_groups_to_seq,
    head_to_seq,
    seq_to_head,
    seq_to_head_groups,
)
from lightning_sp.comm.ring import RingComm, ring_reduce_scatter
from lightning_sp.comm.stats import CommStats
from lightning_sp.layout import Run, SequenceLayout, runs_for_ranks, runs_of, token_indices
from lightning_sp.masks import ScoreMods, StructuredMask
from lightning_sp.ops.precision import autocast_off
from lightning_sp.ops.colossal import colossal_attention
from lightning_sp.ops.kernels import LocalKernel, prefers_heads_major
from lightning_sp.ops.merge import accumulation_dtype
from lightning_sp.ops.ring_attention import (
    BlockAttentionSpec,
    absorb_sinks,
    accumulate_tile_grads,
    block_attention,
    block_attention_forward,
    piece_bounds,
    piece_count,
    query_chunks,
    sink_grad,
    slice_runs,
    zeros_if_unwritten,
)

BACKENDS = ("ulysses", "ring", "zigzag_ring", "allgather_kv", "usp", "colossal", "local", "auto")


@dataclass(frozen=True, eq=False)
class AttentionCall:
    """What is common to every backend for one forward call."""

    kernel: LocalKernel
    scale: float
    causal: bool
    layout: SequenceLayout
    padded_len: int
    doc_bounds: list[int] | None
    stats: CommStats | None
    kv_pieces: int = 1
    """Ring-style backends: pieces each K/V block travels in (``BlockAttentionSpec.kv_pieces``)."""
    heads_major: bool = True
    """Ring-style backends may copy blocks to head-major memory (``BlockAttentionSpec.heads_major``)."""
    mask: StructuredMask | None = None
    """The call's mask resolved on global positions (``AttentionMask.structured``); ``None``: ``causal`` and
    ``doc_bounds`` alone."""
    score_mods: ScoreMods | None = None
    follow_mask: bool = False
    """Rings and ``allgather_kv`` exchange only the K/V rows the mask lets each rank see (Note [Traffic follows
    the mask] in ``ops/ring_attention.py``)."""
    sinks: torch.Tensor | None = None
    """``[H]`` learned per-head sink logits (Note [Attention sinks] in ``ops/ring_attention.py``)."""

    def positions(self, world: int, rank: int, device=None) -> torch.Tensor:
        """Global positions of rank ``rank``'s tokens ``[padded_len / world]``; cached per layout,
        length and device (do not modify the returned tensor)."""
        return _positions(self.layout, world, self.padded_len, rank, torch.device(device or "cpu"))

    def runs(self, world: int, ranks) -> list[Run]:
        """Runs of the tokens of ``ranks`` (concatenated in that order); cached per layout."""
        return list(runs_for_ranks(self.layout, world, self.padded_len, tuple(ranks)))

    def spec(self, q_runs, k_runs_by_rank, group=None, head_offset: int = 0) -> BlockAttentionSpec:
        return BlockAttentionSpec(
            kernel=self.kernel, scale=self.scale, causal=self.causal, q_runs=q_runs,
            k_runs_by_rank=k_runs_by_rank, doc_bounds=self.doc_bounds, group=group, stats=self.stats,
            kv_pieces=self.kv_pieces, heads_major=self.heads_major, mask=self.mask, score_mods=self.score_mods,
            head_offset=head_offset, follow_mask=self.follow_mask and group is not None,
        )


@lru_cache(maxsize=64)
def _positions(layout: SequenceLayout, world: int, padded_len: int, rank: int, device: torch.device) -> torch.Tensor:
    return token_indices(layout, world, padded_len, rank).to(device)


@lru_cache(maxsize=1024)
def _sorted_runs(layout: SequenceLayout, world: int, padded_len: int, ranks: tuple[int, ...]) -> tuple[Run, ...]:
    """Runs of the tokens of ``ranks`` (gathered by an all-to-all) once sorted by global position (Note
    [Sorting while gathering]): local offsets count in sorted order."""
    positions = sorted(int(i) for r in ranks for i in token_indices(layout, world, padded_len, r).tolist())
    return tuple(runs_of(positions))


@lru_cache(maxsize=8)  # two [S] int64 tensors per entry, possibly on the GPU: keep few
def _token_order(layout: SequenceLayout, world: int, padded_len: int, ranks: tuple[int, ...],
                 device: torch.device) -> TokenOrder | None:
    """The ``TokenOrder`` that sorts the tokens of ``ranks`` (gathered in that order) by global position, on
    ``device``; ``None`` when they already are sorted. Built once per layout, length, ranks and device."""
    positions = torch.cat([token_indices(layout, world, padded_len, r) for r in ranks])
    sort = torch.argsort(positions)
    if torch.equal(sort, torch.arange(sort.numel())):
        return None
    return TokenOrder(sort.to(device), torch.argsort(sort).to(device))


def kv_head_replication(num_heads: int, num_kv_heads: int, degree: int) -> int:
    """How many times to replicate each KV head so ``degree`` ranks can split them (GQA/MQA with
    ``H_kv < degree``). Keeps query head ``h`` on the same rank as its KV head."""
    if num_heads % degree:
        raise ValueError(
            f"Ulysses splits heads across ranks: num_heads={num_heads} is not divisible by the Ulysses "
            f"degree {degree}. Use backend='usp' with a ulysses_degree dividing {num_heads}, or "
            f"backend='ring'/'zigzag_ring'/'allgather_kv', which have no head limit."
        )
    return degree // math.gcd(num_kv_heads, degree)


def local_attention(q, k, v, call: AttentionCall) -> torch.Tensor:
    whole = [Run(0, 0, q.size(1))]
    return block_attention(q, k, v, call.spec(whole, [whole]), call.sinks)


def head_group_count(kv_pieces: int, kv_heads_per_rank: int, shard_len: int) -> int:
    """How many head groups ``ulysses``/``usp`` run in (Note [Heads in groups]): the largest divisor of
    ``kv_heads_per_rank`` (K/V heads each rank holds after the all-to-all) that is at most
    ``piece_count(kv_pieces, shard_len)``, so short shards (and ``kv_pieces=1``) use one group."""
    most = piece_count(kv_pieces, shard_len)
    return max(d for d in range(1, kv_heads_per_rank + 1) if kv_heads_per_rank % d == 0 and d <= most)


def _in_head_groups(q, k, v, groups: int, attend) -> torch.Tensor:
    """``attend`` on each of ``groups`` head groups of ``q [B, S/P, H, D]``, ``k, v [B, S/P, H_kv, D]``,
    outputs concatenated along the heads (group ``c``: query heads ``c*H/groups ...``, K/V heads
    ``c*H_kv/groups ...``, so every query head keeps its K/V head)."""
    if groups == 1:
        return attend(q, k, v)
    parts = zip(q.chunk(groups, dim=2), k.chunk(groups, dim=2), v.chunk(groups, dim=2))
    return torch.cat([attend(qg, kg, vg) for qg, kg, vg in parts], dim=2)


def ulysses_attention(q, k, v, call: AttentionCall, *, group) -> torch.Tensor:
    world = torch.distributed.get_world_size(group)
    rep = kv_head_replication(q.size(2), k.size(2), world)
    if rep > 1:  # [B, S/P, H_kv, D] -> [B, S/P, H_kv*rep, D]
        k, v = k.repeat_interleave(rep, dim=2), v.repeat_interleave(rep, dim=2)

    everyone = tuple(range(world))
    whole = list(_sorted_runs(call.layout, world, call.padded_len, everyone))  # [Run(0, 0, S)]
    order = _token_order(call.layout, world, call.padded_len, everyone, q.device)  # Note [Sorting while gathering]

    head_major = prefers_heads_major(call.kernel, q.device)  # the CPU flash op (Note [Head-major gather])
    groups = head_group_count(call.kv_pieces, k.size(2) // world, q.size(1))
    # [B, S/P, H, D] -> groups x [B, S, H/(P G), D] (global order), each group its own memory (Note [Heads in groups])
    qs, ks, vs = (seq_to_head_groups(t, group, call.stats, order, head_major=head_major, groups=groups)
                  for t in (q, k, v))
    # this rank holds global query heads rank H/P ..., group c the c-th H/(P G) of them (score modifiers, sinks)
    heads = q.size(2) // world // groups
    first = torch.distributed.get_rank(group) * q.size(2) // world
    outs = [block_attention(qg, kg, vg, call.spec(whole, [whole], head_offset=first + c * heads), call.sinks)
            for c, (qg, kg, vg) in enumerate(zip(qs, ks, vs))]  # one autograd node per group
    # dout stays [B, S, H/P, D] memory: the CPU flash backward copies a head-major dout (one more tensor at the
    # backward's peak), Note [Head-major gather]
    return head_groups_to_seq(outs, group, call.stats, order)  # [B, S/P, H, D]


def ring_attention(q, k, v, call: AttentionCall, *, group) -> torch.Tensor:
    """``ring`` and ``zigzag_ring``: the layout decides which blocks are skipped."""
    world, rank = torch.distributed.get_world_size(group), torch.distributed.get_rank(group)
    runs = [call.runs(world, [r]) for r in range(world)]
    return block_attention(q, k, v, call.spec(runs[rank], runs, group=group), call.sinks)


class _AllGatherKVFunction(torch.autograd.Function):
    """All-gather K/V, attend locally; save only the local K/V shards (O(N/P) activations) and
    gather them again in backward. dK/dV go back to their owners through ring reduce-scatters
    (``ring_reduce_scatter``), one per K/V piece (``kv_pieces`` row ranges of a shard): the gradient
    of piece ``j`` of one rank's K/V shard is computed, added to the partial sum received from the
    previous rank and passed on, so the partial sums in flight are piece-sized, no ``[B, S, H_kv, D]``
    gradient is ever materialised, and the sum runs in the accumulation dtype (fp32 for bf16/fp16
    inputs), cast to the input dtype only at the end. The kernel runs on tiles of (query chunk x
    K/V piece) (``accumulate_tile_grads``), so its per-call results are tile-sized too."""

    @staticmethod
    def forward(ctx, q, k, v, sinks, spec, grad_spec, group, stats, kv_pieces):
        # [B, S/P, H_kv, D] -> [B, S, H_kv, D] in rank order
        k_all, v_all = all_gather_raw(k, group, 1, stats), all_gather_raw(v, group, 1, stats)
        res = absorb_sinks(block_attention_forward(spec, q, k_all, v_all), sinks, spec.head_offset)
        del k_all, v_all
        out = res.out.to(q.dtype)
        ctx.save_for_backward(q, k, v, out, res.lse, sinks)
        ctx.grad_spec, ctx.group, ctx.stats, ctx.kv_pieces = grad_spec, group, stats, kv_pieces
        return out

    @staticmethod
    @autocast_off
    def backward(ctx, dout):
        q, k, v, out, lse, sinks = ctx.saved_tensors
        dout = dout.contiguous()
        acc = accumulation_dtype(q.dtype)
        k_all, v_all = all_gather_raw(k, ctx.group, 1, ctx.stats), all_gather_raw(v, ctx.group, 1, ctx.stats)
        shard = k.size(1)
        dq = None  # first write assigns (Note [First write assigns] in ops/ring_attention.py)

        spec = ctx.grad_spec
        pieces = piece_count(ctx.kv_pieces, shard)
        q_chunks = query_chunks(spec.q_runs, q.size(1), pieces)
        kb = piece_bounds(shard, pieces)
        comm = RingComm(ctx.group, ctx.stats)
        dk = dv = None  # one piece (the default): its ring sum *is* the gradient, no copy
        if pieces > 1:
            dk, dv = (torch.empty(t.shape, dtype=acc, device=q.device) for t in (k, v))
        for j in range(pieces):
            def contribute(chunk, partial, j=j):  # this rank's share of piece j of rank `chunk`'s dK/dV
                # [B, piece, H_kv, D], added into the partial sum received (None: the first covering result)
                nonlocal dq
                rows = slice(chunk * shard + kb[j], chunk * shard + kb[j + 1])
                k_p, v_p = k_all[:, rows], v_all[:, rows]
                dq, partial = accumulate_tile_grads(
                    spec, q_chunks, slice_runs(spec.k_runs_by_rank[chunk], kb[j], kb[j + 1]), dout, q,
                    k_p, v_p, out, lse, dq, (None, None) if partial is None else partial,
                )
                return zeros_if_unwritten(partial, (k_p, v_p), acc)

            dk_j, dv_j = ring_reduce_scatter(comm, contribute)
            if pieces == 1:
                dk, dv = dk_j, dv_j
            else:
                dk[:, kb[j]:kb[j + 1]], dv[:, kb[j]:kb[j + 1]] = dk_j, dv_j
            del dk_j, dv_j
        dq = zeros_if_unwritten((dq,), (q,), acc)[0]
        dsinks = sink_grad(dout, out, lse, sinks, ctx.grad_spec.head_offset)
        return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype), dsinks, None, None, None, None, None


def allgather_kv_attention(q, k, v, call: AttentionCall, *, group) -> torch.Tensor:
    world, rank = torch.distributed.get_world_size(group), torch.distributed.get_rank(group)
    if call.follow_mask:  # gather only the rows the mask lets this rank see, from their owners (Note [Traffic follows
        # the mask] in ops/ring_attention.py): the rings' pairwise exchange, on the same layout, in pieces too
        runs = [call.runs(world, [r]) for r in range(world)]
        return block_attention(q, k, v, call.spec(runs[rank], runs, group=group), call.sinks)
    q_runs = call.runs(world, [rank])
    spec = call.spec(q_runs, [call.runs(world, range(world))])  # forward: all gathered keys at once
    grad_spec = call.spec(q_runs, [call.runs(world, [r]) for r in range(world)])  # backward: per owner
    return _AllGatherKVFunction.apply(q, k, v, call.sinks, spec, grad_spec, group, call.stats, call.kv_pieces)


def usp_attention(q, k, v, call: AttentionCall, *, ulysses_group, ring_group) -> torch.Tensor:
    u = torch.distributed.get_world_size(ulysses_group)
    r = torch.distributed.get_world_size(ring_group)
    ring_rank = torch.distributed.get_rank(ring_group)
    world = u * r
    if u == 1:
        ring_runs = [call.runs(world, [i]) for i in range(r)]
        return block_attention(q, k, v, call.spec(ring_runs[ring_rank], ring_runs, group=ring_group), call.sinks)
    # every ring rank sorts the tokens its Ulysses group gathers (Note [Sorting while gathering])
    members = [tuple(range(i * u, (i + 1) * u)) for i in range(r)]
    ring_runs = [list(_sorted_runs(call.layout, world, call.padded_len, m)) for m in members]
    order = _token_order(call.layout, world, call.padded_len, members[ring_rank], q.device)
    rep = kv_head_replication(q.size(2), k.size(2), u)
    if rep > 1:
        k, v = k.repeat_interleave(rep, dim=2), v.repeat_interleave(rep, dim=2)

    groups = head_group_count(call.kv_pieces, k.size(2) // u, q.size(1))
    group_heads = q.size(2) // groups
    u_rank = torch.distributed.get_rank(ulysses_group)
    done = []

    def attend(qg, kg, vg):  # one head group: [B, S/P, H', D] -> [B, S/R, H'/U, D] (this ring rank's
        # tokens, sorted) -> ring attention -> back to [B, S/P, H', D]
        # global query heads: group c's H/G heads, this Ulysses rank's H/(G U) of them
        offset = len(done) * group_heads + u_rank * (qg.size(2) // u)
        done.append(offset)
        spec = call.spec(ring_runs[ring_rank], ring_runs, group=ring_group, head_offset=offset)
        qh, kh, vh = (seq_to_head(t, ulysses_group, call.stats, order) for t in (qg, kg, vg))
        return head_to_seq(block_attention(qh, kh, vh, spec, call.sinks), ulysses_group, call.stats, order)

    return _in_head_groups(q, k, v, groups, attend)  # [B, S/P, H, D]


def colossal(q, k, v, call: AttentionCall, *, group) -> torch.Tensor:
    world = torch.distributed.get_world_size(group)
    positions = [call.positions(world, r, q.device) for r in range(world)]
    return colossal_attention(
        q, k, v, group=group, positions_by_rank=positions, causal=call.causal,
        doc_bounds=call.doc_bounds, scale=call.scale, stats=call.stats, mask=call.mask, score_mods=call.score_mods,
        sinks=call.sinks,
    )
