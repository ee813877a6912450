"""Differentiable collectives along the sequence and head dims, each counting the bytes it sends.

Byte convention: see ``lightning_sp.comm.stats``. Backward rules (each rank's loss differs, so
gradients of replicated results are *summed* over ranks):

    all-to-all (seq -> heads)   backward: all-to-all (heads -> seq)
    all-gather along a dim      backward: reduce-scatter along that dim
    all-reduce (sum)            backward: all-reduce (sum)
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import torch.distributed as dist

from lightning_sp.comm.release import collective
from lightning_sp.comm.stats import CommStats

# torch >= 2.10 renamed the tensor variants; keep working on older releases.
_all_gather_single = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
_reduce_scatter_single = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


def _count(stats: CommStats | None, op: str, nbytes: int) -> None:
    if stats is not None:
        stats.add(op, nbytes)


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


def _release_now(temp: torch.Tensor, *keep: torch.Tensor) -> None:
    """Free the memory of ``temp``, a buffer of a finished collective that nothing will read again, now,
    unless it shares storage with one of ``keep`` (the caller's input, the returned result).

    gloo's ``Work`` keeps references to the send and receive buffers and drops them from its worker thread
    some time after ``wait()`` has returned, so a buffer the caller no longer holds used to stay allocated for a
    timing-dependent while: one extra ``[B, S/P, H, D]`` shard at Ulysses' backward peak in some calls and not
    in others (benchmarks/README.md, section 8, "Ulysses memory"). Resizing the storage to 0 frees it at once;
    the late reference then holds an empty storage. (Since ``collective`` waits for gloo to let go, Note [gloo
    drops a collective's tensors on its worker thread], no late reference is left; this still frees the buffer
    before the caller's own reference goes.) CPU only: on CUDA the caching allocator orders reuse
    after the collective's stream, and ProcessGroupNCCL manages its buffers' lifetimes itself."""
    if temp.device.type != "cpu":
        return
    storage = temp.untyped_storage()
    if any(t.untyped_storage().data_ptr() == storage.data_ptr() for t in keep):
        return
    storage.resize_(0)


# ----------------------------------------------------------------------------------------------
# all-to-all: sequence split <-> head split (DeepSpeed-Ulysses)
# ----------------------------------------------------------------------------------------------


class TokenOrder(NamedTuple):
    """A permutation of the ``S`` tokens an all-to-all gathers (Note [Sorting while gathering]).

    ``sort [S]`` int64: ``gathered.index_select(seq_dim, sort)`` puts the tokens, gathered in source-rank
    order, in global order; ``unsort [S]``: its inverse, back to source-rank order."""

    sort: torch.Tensor
    unsort: torch.Tensor


# Note [Head-major gather]
# ~~~~~~~~~~~~~~~~~~~~~~~~
# The CPU flash op (aten._scaled_dot_product_flash_attention_for_cpu) takes [B, H, S, D] tensors of any
# strides, and runs faster when q, k, v are contiguous (head-major memory) than when they are transposed
# views of [B, S, H, D] memory (benchmarks/README.md, section 8, "Ulysses memory", "Head-major gathers";
# benchmarks/headmajor_sdpa/run.py). So seq_to_head_all_to_all(head_major=True) hands out its [B, S, H/P, D]
# result as the transpose of a contiguous [B, H/P, S, D] tensor: with a token order the gather writes it
# (no extra copy), without one a copy of the receive buffer does (recv is freed after it: a transient).
# Ulysses asks for it for q, k, v where the kernel prefers_heads_major (SDPAKernel on CPU; each head group is
# copied out on its own, Note [Heads in groups]), not for dout (head_to_seq's backward): given a head-major dout, the CPU flash backward
# allocates a dout-sized buffer of its own (AllocatorPeak, torch 2.13: one tensor more at the backward's
# peak, +u/2 per rank in bench_peers' ulysses pair). Not on CUDA, nor in USP: the CUDA ops (_fused_input in
# ops/kernels.py) and the ring's sends copy anything but contiguous [B, S, H, D]. The SDPA kernel's CPU path
# only transposes (no copy of its own).


def _heads_slice(c: int, heads_per_group: int) -> slice:
    return slice(c * heads_per_group, (c + 1) * heads_per_group)


def seq_to_head_groups_all_to_all(x: torch.Tensor, group, stats: CommStats | None = None,
                                  order: TokenOrder | None = None, *, head_major: bool = False,
                                  groups: int = 1) -> list[torch.Tensor]:
    """``[B, S/P, H, D] -> groups x [B, S, H/(P G), D]``: gather the sequence, scatter the heads in one all-to-all
    (no autograd), then hand out this rank's ``H/P`` heads (global heads ``rank H/P ...``, in order) in ``groups``
    groups of consecutive heads (Note [Heads in groups] in ``ops/backends.py``). With ``order``, the gathered
    tokens come out sorted by ``order.sort`` (one gather copy, no extra pass).

    With ``groups > 1`` each group is in memory of its own, so that what a group's kernel saves is freed when that
    group's backward is done: without a token order or head-major memory that is one copy (with them, the copy
    made anyway writes each group apart).

    ``head_major`` (Note [Head-major gather]): each result's memory is ``[B, H/(P G), S, D]`` contiguous (returned
    as its ``.transpose(1, 2)``); without ``order`` that costs one copy of the receive buffer (none when
    ``B = H/P = 1``: the layouts coincide). Else (``groups = 1``) a view of the receive buffer (``[B, S, H/P, D]``
    memory where ``B = 1``) or the sorted gather's contiguous ``[B, S, H/P, D]``: what the CUDA ops and the
    ring's sends take without a copy."""
    world = dist.get_world_size(group)
    b, s_local, h, d = x.shape
    h_local, s = h // world, world * s_local
    if h_local % groups:
        raise ValueError(f"{h_local} heads per rank do not split into {groups} groups")
    # [B, S/P, H, D] -> [B, S/P, P, H/P, D] -> [P, S/P, B, H/P, D]: chunk p goes to rank p
    send = x.reshape(b, s_local, world, h_local, d).permute(2, 1, 0, 3, 4).contiguous()
    recv = torch.empty_like(send)  # [P(source rank), S/P, B, H/P, D]
    _count(stats, "all_to_all", _nbytes(send))
    collective(dist.all_to_all_single, recv, send, group=group)
    _release_now(send, x)
    hg = h_local // groups
    outs = []
    for c in range(groups):
        part = recv[:, :, :, _heads_slice(c, hg)]  # [P, S/P, B, hg, D]
        if head_major:
            # -> [B, hg, P, S/P, D] -> [B, hg, S(source-rank order), D] (a view)
            gathered = part.permute(2, 3, 0, 1, 4).reshape(b, hg, s, d)
            # -> contiguous [B, hg, S(sorted), D] (the gather or one copy) -> [B, S, hg, D] view
            out = (gathered.index_select(2, order.sort) if order is not None else gathered.contiguous()).transpose(1, 2)
        else:
            # -> [B, S(source-rank order), hg, D] (a view where B = 1 and the group is all heads)
            out = part.permute(2, 0, 1, 3, 4).reshape(b, s, hg, d)
            if order is not None:
                out = out.index_select(1, order.sort)  # [B, S(sorted), hg, D]
            elif groups > 1:
                out = out.contiguous()
        outs.append(out)
    _release_now(recv, *outs)
    return outs


def seq_to_head_all_to_all(x: torch.Tensor, group, stats: CommStats | None = None,
                           order: TokenOrder | None = None, *, head_major: bool = False) -> torch.Tensor:
    """``[B, S/P, H, D] -> [B, S, H/P, D]``: ``seq_to_head_groups_all_to_all`` in one group."""
    return seq_to_head_groups_all_to_all(x, group, stats, order, head_major=head_major)[0]


def head_groups_to_seq_all_to_all(parts: list[torch.Tensor], group, stats: CommStats | None = None,
                                  order: TokenOrder | None = None) -> torch.Tensor:
    """``groups x [B, S, H/(P G), D] -> [B, S/P, H, D]``: scatter the sequence, gather the heads (no autograd); the
    inverse of ``seq_to_head_groups_all_to_all`` (any strides). With ``order``, the tokens are in ``order.sort``
    order and go back to their source ranks, folded into the send buffer's copy."""
    world = dist.get_world_size(group)
    b, s, hg, d = parts[0].shape
    s_local, h_local = s // world, hg * len(parts)
    if len(parts) == 1 and order is not None:
        # [B, S(sorted), H/P, D] -> [S, B, H/P, D] (a view) -> gather by unsort -> [S(source-rank order), B, H/P, D]
        # = [P, S/P, B, H/P, D] contiguous: sequence chunk p goes to rank p
        send = parts[0].transpose(0, 1).index_select(0, order.unsort).view(world, s_local, b, h_local, d)
    elif len(parts) == 1:
        # [B, S, H/P, D] -> [B, P, S/P, H/P, D] -> [P, S/P, B, H/P, D] (no copy where it is that memory already)
        send = parts[0].reshape(b, world, s_local, h_local, d).permute(1, 2, 0, 3, 4).contiguous()
    else:  # each group written into its heads of one send buffer
        send = torch.empty(world, s_local, b, h_local, d, dtype=parts[0].dtype, device=parts[0].device)
        for c, x in enumerate(parts):
            dst = send[:, :, :, _heads_slice(c, hg)]  # [P, S/P, B, hg, D]
            if order is not None:  # dst[unsort-th token] = x[token]: dst[sort[i]] = x[i]
                dst.view(s, b, hg, d).index_copy_(0, order.sort, x.transpose(0, 1))
            else:
                dst.copy_(x.reshape(b, world, s_local, hg, d).permute(1, 2, 0, 3, 4))
    recv = torch.empty_like(send)  # [P(source rank = head group), S/P, B, H/P, D]
    _count(stats, "all_to_all", _nbytes(send))
    collective(dist.all_to_all_single, recv, send, group=group)
    _release_now(send, *parts)
    # [P, S/P, B, H/P, D] -> [B, S/P, P, H/P, D] -> [B, S/P, H, D]
    out = recv.permute(2, 1, 0, 3, 4).reshape(b, s_local, world * h_local, d)
    _release_now(recv, out)
    return out


def head_to_seq_all_to_all(x: torch.Tensor, group, stats: CommStats | None = None,
                           order: TokenOrder | None = None) -> torch.Tensor:
    """``[B, S, H/P, D] -> [B, S/P, H, D]``: ``head_groups_to_seq_all_to_all`` of one group."""
    return head_groups_to_seq_all_to_all([x], group, stats, order)


class _SeqToHeadGroups(torch.autograd.Function):
    """``seq_to_head_groups_all_to_all``; the backward sends the groups' gradients back in one all-to-all."""

    @staticmethod
    def forward(ctx, x, group, stats, order, head_major: bool, groups: int):
        ctx.group, ctx.stats, ctx.order = group, stats, order
        return tuple(seq_to_head_groups_all_to_all(x, group, stats, order, head_major=head_major, groups=groups))

    @staticmethod
    def backward(ctx, *grads):
        # any strides: the send buffer is built with one copy (a .contiguous() here would copy twice)
        return head_groups_to_seq_all_to_all(list(grads), ctx.group, ctx.stats, ctx.order), *(None,) * 5


class _HeadGroupsToSeq(torch.autograd.Function):
    """``head_groups_to_seq_all_to_all``; the backward gathers the gradient to heads and hands each group its
    own contiguous ``[B, S, H/(P G), D]`` (the CPU flash backward copies a strided head slice of ``dout`` inside
    the call, at its peak; so each group's is freed when that group's backward is done)."""

    @staticmethod
    def forward(ctx, group, stats, order, head_major: bool, *parts):
        ctx.group, ctx.stats, ctx.order, ctx.head_major, ctx.groups = group, stats, order, head_major, len(parts)
        return head_groups_to_seq_all_to_all(list(parts), group, stats, order)

    @staticmethod
    def backward(ctx, grad):
        parts = seq_to_head_groups_all_to_all(grad, ctx.group, ctx.stats, ctx.order, head_major=ctx.head_major,
                                              groups=ctx.groups)
        return None, None, None, None, *parts


def seq_to_head_groups(x: torch.Tensor, group, stats: CommStats | None = None, order: TokenOrder | None = None, *,
                       head_major: bool = False, groups: int = 1) -> list[torch.Tensor]:
    """Differentiable ``[B, S/P, H, D] -> groups x [B, S, H/(P G), D]``, each group in memory of its own
    (``seq_to_head_groups_all_to_all``); ``order``: sort the gathered tokens (``TokenOrder``); ``head_major``:
    each result's memory is ``[B, H/(P G), S, D]`` (Note [Head-major gather])."""
    return list(_SeqToHeadGroups.apply(x, group, stats, order, head_major, groups))


def head_groups_to_seq(parts: list[torch.Tensor], group, stats: CommStats | None = None,
                       order: TokenOrder | None = None, *, head_major: bool = False) -> torch.Tensor:
    """Differentiable ``groups x [B, S, H/(P G), D] -> [B, S/P, H, D]``; ``order``: the parts' tokens are sorted
    by it; ``head_major``: the memory of the gradients it hands back, as in ``seq_to_head``."""
    return _HeadGroupsToSeq.apply(group, stats, order, head_major, *parts)


def seq_to_head(x: torch.Tensor, group, stats: CommStats | None = None,
                order: TokenOrder | None = None, *, head_major: bool = False) -> torch.Tensor:
    """Differentiable ``[B, S/P, H, D] -> [B, S, H/P, D]``; ``order``: sort the gathered tokens (``TokenOrder``);
    ``head_major``: the result's memory is ``[B, H/P, S, D]`` (Note [Head-major gather])."""
    return seq_to_head_groups(x, group, stats, order, head_major=head_major)[0]


def head_to_seq(x: torch.Tensor, group, stats: CommStats | None = None,
                order: TokenOrder | None = None, *, head_major: bool = False) -> torch.Tensor:
    """Differentiable ``[B, S, H/P, D] -> [B, S/P, H, D]``; ``order``: ``x``'s tokens are sorted by it;
    ``head_major``: the memory of the gradient it hands back (``[B, S, H/P, D]``), as in ``seq_to_head``."""
    return head_groups_to_seq([x], group, stats, order, head_major=head_major)


# ----------------------------------------------------------------------------------------------
# all-gather / reduce-scatter along a dim
# ----------------------------------------------------------------------------------------------


def all_gather_raw(x: torch.Tensor, group, dim: int, stats: CommStats | None = None) -> torch.Tensor:
    """Concatenate every rank's ``x`` along ``dim`` in rank order (no autograd)."""
    world = dist.get_world_size(group)
    x = x.movedim(dim, 0).contiguous()  # [S_local, ...]
    out = torch.empty((world * x.size(0), *x.shape[1:]), dtype=x.dtype, device=x.device)
    _count(stats, "all_gather", (world - 1) * _nbytes(x))
    collective(_all_gather_single, out, x, group=group)
    return out.movedim(0, dim)


def reduce_scatter_raw(x: torch.Tensor, group, dim: int, stats: CommStats | None = None) -> torch.Tensor:
    """Sum ``x`` over ranks and keep this rank's slice of ``dim`` (no autograd)."""
    world = dist.get_world_size(group)
    x = x.movedim(dim, 0).contiguous()  # [S, ...]
    out = torch.empty((x.size(0) // world, *x.shape[1:]), dtype=x.dtype, device=x.device)
    _count(stats, "reduce_scatter", (world - 1) * _nbytes(out))
    collective(_reduce_scatter_single, out, x, op=dist.ReduceOp.SUM, group=group)
    return out.movedim(0, dim)


class _AllGather(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group, dim, stats):
        ctx.group, ctx.dim, ctx.stats = group, dim, stats
        return all_gather_raw(x, group, dim, stats)

    @staticmethod
    def backward(ctx, grad):
        return reduce_scatter_raw(grad, ctx.group, ctx.dim, ctx.stats), None, None, None


def all_gather_along(x: torch.Tensor, group, *, dim: int, stats: CommStats | None = None) -> torch.Tensor:
    """Differentiable all-gather along ``dim``; backward is a reduce-scatter of the gradients."""
    return _AllGather.apply(x, group, dim % x.dim(), stats)


class _AllReduceSum(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        x = x.clone()
        collective(dist.all_reduce, x, op=dist.ReduceOp.SUM, group=group)
        return x

    @staticmethod
    def backward(ctx, grad):
        grad = grad.clone()
        collective(dist.all_reduce, grad, op=dist.ReduceOp.SUM, group=ctx.group)
        return grad, None


def all_reduce_sum(x: torch.Tensor, group) -> torch.Tensor:
    """Differentiable sum over ranks; backward sums the gradients over ranks too."""
    return _AllReduceSum.apply(x, group)


class _AllGatherOwnGrad(torch.autograd.Function):
    """All-gather whose backward keeps this rank's slice of its own gradient (no communication): the
    gradient of a loss that every rank computes identically from the gathered result."""

    @staticmethod
    def forward(ctx, x, group, dim, stats):
        ctx.group, ctx.dim, ctx.local = group, dim, x.size(dim)
        return all_gather_raw(x, group, dim, stats)

    @staticmethod
    def backward(ctx, grad):
        rank = dist.get_rank(ctx.group)
        return grad.narrow(ctx.dim, rank * ctx.local, ctx.local).contiguous(), None, None, None


def all_gather_replicated_loss(x: torch.Tensor, group, *, dim: int, stats: CommStats | None = None) -> torch.Tensor:
    """Differentiable all-gather along ``dim`` for a loss replicated on every rank: the backward takes
    this rank's slice of its own gradient instead of summing all ranks' (which would count the loss
    once per rank)."""
    return _AllGatherOwnGrad.apply(x, group, dim % x.dim(), stats)
