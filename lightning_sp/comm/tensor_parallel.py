"""Megatron's tensor-parallel "region" collectives, differentiable, each counting the bytes it sends.

Built from the raw all-gather / reduce-scatter of ``lightning_sp.comm.collectives``. Every rank of the
tensor-parallel group computes the *same* loss, so (unlike the sequence-parallel ``all_gather_along``
whose ranks hold different losses) a replicated value's gradient is not summed again:

    name (Megatron)                            forward                       backward
    copy_to_tensor_parallel_region             identity                      all-reduce
    reduce_from_tensor_parallel_region         all-reduce                    identity
    gather_from_sequence_parallel_region       all-gather seq (+ trim)       reduce-scatter seq (+ pad)
    reduce_scatter_to_sequence_parallel_region reduce-scatter seq (+ pad)    all-gather seq (+ trim)

Note [Sequence-parallel padding]
    Sequence parallelism shards the sequence dim ``S`` over ``t`` ranks. When ``t`` does not divide
    ``S`` the sequence is padded at the end to ``S_pad = t * ceil(S / t)`` before the reduce-scatter,
    and every all-gather trims back to the true ``S`` (``seq_len``). Padding rows live only in the
    sequence-sharded region (norms, residuals): they are row-local there and dropped before anything
    that mixes tokens (attention, the loss), so they never change a real token, and their gradient
    is zero::

        S = 5, t = 2:   rank 0 rows [0, 1, 2]   rank 1 rows [3, 4, pad]       S_pad = 6

Byte convention (``lightning_sp.comm.stats``): all-gather ``(t-1) * shard``, reduce-scatter
``(t-1)/t * input``, all-reduce ``2 (t-1)/t * input`` (what a ring all-reduce sends). Every collective
here, forward and backward, counts into the ``stats`` it is given (the ``TensorParallelContext.comm``
of the layer), so measured traffic can be compared with ``lightning_sp.comm.volume``.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F

from lightning_sp.comm.collectives import all_gather_raw, reduce_scatter_raw
from lightning_sp.comm.release import collective
from lightning_sp.comm.stats import CommStats


def sp_shard_len(seq_len: int, world: int) -> int:
    """Rows per rank in the sequence-sharded region: ``ceil(S / t)``."""
    return -(-seq_len // world)


def _pad_seq(x: torch.Tensor, dim: int, length: int) -> torch.Tensor:
    extra = length - x.size(dim)
    if extra == 0:
        return x
    pad = [0, 0] * (x.dim() - 1 - dim) + [0, extra]  # F.pad counts dims from the last
    return F.pad(x, pad)


def all_reduce_raw(x: torch.Tensor, group, stats: CommStats | None = None, op_name: str = "all_reduce", *,
                   reduce_op=dist.ReduceOp.SUM) -> torch.Tensor:
    """Reduce over ranks (no autograd; ``reduce_op`` default sum); returns a new tensor."""
    world = dist.get_world_size(group)
    x = x.contiguous().clone()
    if stats is not None:
        stats.add(op_name, 2 * (world - 1) * x.numel() * x.element_size() // world)
    collective(dist.all_reduce, x, op=reduce_op, group=group)
    return x


def sp_all_gather(x: torch.Tensor, group, *, dim: int, seq_len: int, stats: CommStats | None = None) -> torch.Tensor:
    """``[.., S_pad/t, ..] -> [.., S, ..]`` (no autograd): all-gather along ``dim``, trim to ``seq_len``."""
    full = all_gather_raw(x, group, dim, stats)
    return full.narrow(dim, 0, seq_len) if full.size(dim) != seq_len else full


def sp_reduce_scatter(x: torch.Tensor, group, *, dim: int, stats: CommStats | None = None) -> torch.Tensor:
    """``[.., S, ..] -> [.., S_pad/t, ..]`` (no autograd): pad ``dim`` to a multiple of ``t``, sum over
    ranks, keep this rank's rows."""
    world = dist.get_world_size(group)
    x = _pad_seq(x, dim, world * sp_shard_len(x.size(dim), world))
    return reduce_scatter_raw(x, group, dim, stats)


class _CopyToTP(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group, stats):
        ctx.group, ctx.stats = group, stats
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        return all_reduce_raw(grad, ctx.group, ctx.stats), None, None


class _ReduceFromTP(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group, stats):
        return all_reduce_raw(x, group, stats)

    @staticmethod
    def backward(ctx, grad):
        return grad, None, None


class _GatherFromSP(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group, dim, seq_len, stats):
        ctx.group, ctx.dim, ctx.stats = group, dim, stats
        return sp_all_gather(x, group, dim=dim, seq_len=seq_len, stats=stats)

    @staticmethod
    def backward(ctx, grad):
        return sp_reduce_scatter(grad, ctx.group, dim=ctx.dim, stats=ctx.stats), None, None, None, None


class _ReduceScatterToSP(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group, dim, stats):
        ctx.group, ctx.dim, ctx.stats, ctx.seq_len = group, dim, stats, x.size(dim)
        return sp_reduce_scatter(x, group, dim=dim, stats=stats)

    @staticmethod
    def backward(ctx, grad):
        return sp_all_gather(grad.contiguous(), ctx.group, dim=ctx.dim, seq_len=ctx.seq_len, stats=ctx.stats), None, None, None


def copy_to_tensor_parallel_region(x: torch.Tensor, group, stats: CommStats | None = None) -> torch.Tensor:
    """Forward identity, backward all-reduce (the input of a column-parallel layer without SP)."""
    return _CopyToTP.apply(x, group, stats)


def reduce_from_tensor_parallel_region(x: torch.Tensor, group, stats: CommStats | None = None) -> torch.Tensor:
    """Forward all-reduce, backward identity (the output of a row-parallel layer without SP)."""
    return _ReduceFromTP.apply(x, group, stats)


def gather_from_sequence_parallel_region(
    x: torch.Tensor, group, *, seq_len: int, dim: int = 1, stats: CommStats | None = None
) -> torch.Tensor:
    """``[B, S_pad/t, C] -> [B, S, C]``; backward reduce-scatters the gradient (Note [Sequence-parallel padding])."""
    return _GatherFromSP.apply(x, group, dim % x.dim(), seq_len, stats)


def reduce_scatter_to_sequence_parallel_region(
    x: torch.Tensor, group, *, dim: int = 1, stats: CommStats | None = None
) -> torch.Tensor:
    """``[B, S, C]`` (partial sums) ``-> [B, S_pad/t, C]``; backward all-gathers the gradient."""
    return _ReduceScatterToSP.apply(x, group, dim % x.dim(), stats)


def scatter_to_sequence_parallel_region(x: torch.Tensor, group, *, dim: int = 1, stats: CommStats | None = None) -> torch.Tensor:
    """``[B, S, C]`` (replicated) ``-> [B, S_pad/t, C]``: this rank's rows, no communication forward.
    Backward all-gathers (each rank's loss sees only its rows of a replicated input)."""
    world, rank = dist.get_world_size(group), dist.get_rank(group)
    dim = dim % x.dim()
    n = sp_shard_len(x.size(dim), world)
    # gather_from(scatter(x)) == x, and the backward of a slice followed by all ranks' gradients is an all-gather
    return _ScatterToSP.apply(x, group, dim, n, rank, stats)


class _ScatterToSP(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group, dim, n, rank, stats):
        ctx.group, ctx.dim, ctx.seq_len, ctx.stats = group, dim, x.size(dim), stats
        return _pad_seq(x, dim, n * dist.get_world_size(group)).narrow(dim, rank * n, n).contiguous()

    @staticmethod
    def backward(ctx, grad):
        grad = sp_all_gather(grad.contiguous(), ctx.group, dim=ctx.dim, seq_len=ctx.seq_len, stats=ctx.stats)
        return grad, None, None, None, None, None
