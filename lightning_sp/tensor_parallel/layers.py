"""Megatron tensor-parallel layers that are plain ``nn.Linear`` / ``nn.Embedding`` until bound.

A model is built full-size on every rank from the same seed (so it is the one-process model);
``bind_tensor_parallel(model, ctx)`` then keeps each rank's slice of every parallel weight. Unbound,
every layer here computes exactly what its ``torch.nn`` base class computes.

Note [Megatron tensor + sequence parallelism]
    One transformer layer on ``t`` ranks (Korthikanti et al. 2022, Fig. 5), ``S`` tokens, width ``h``::

        x [S/t, h] -> LayerNorm -> g -> qkv (column) -> attention on H/t heads -> proj (row) -> g' -> + x
                   -> LayerNorm -> g -> fc1 (column) -> GeLU -> fc2 (row)                  -> g' -> + x

    With sequence parallelism (``ctx.sequence_parallel``), ``g`` is an all-gather of the sequence
    (backward: reduce-scatter) and ``g'`` a reduce-scatter (backward: all-gather), so norms and
    residuals hold ``S/t`` rows. Without it, ``g`` is the identity (backward: all-reduce), ``g'`` an
    all-reduce, and everything outside the parallel linears is replicated on every rank.
    Forward traffic per layer with SP: 2 all-gathers + 2 reduce-scatters of ``[S, h]``, i.e.
    ``4 (t-1)/t * S h`` elements sent per rank (``lightning_sp.comm.volume.tensor_parallel_elements``).

    The column-parallel matmul keeps only its input *shard* ``[S/t, h]`` for backward and all-gathers
    it again there to form the weight gradient (Megatron's ``LinearWithGradAccumulationAndAsync
    Communication``): the saved activation is ``1/t`` of the gathered one (Korthikanti's ``34/t``).

    Weights: column-parallel layers split their output features (for a fused layer, each segment of
    ``output_sizes`` separately, so a fused ``qkv`` keeps this rank's q, k and v heads), row-parallel
    layers their input features, the vocabulary-parallel embedding its rows; the split is
    ``shard_range`` (``torch.chunk``-style). Parameters not split by one of these layers are
    replicated; under SP their gradients are partial (each rank saw ``S/t`` rows) and must be summed
    over the tensor-parallel group (``SequenceParallelStrategy`` does it before the optimizer step).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.nn.functional as F
from torch import nn

from lightning_sp.comm.tensor_parallel import (
    copy_to_tensor_parallel_region,
    reduce_from_tensor_parallel_region,
    reduce_scatter_to_sequence_parallel_region,
    sp_all_gather,
    sp_reduce_scatter,
)
from lightning_sp.tensor_parallel.context import TensorParallelContext, shard_range


class TensorParallelModule(nn.Module):
    """A module that changes when bound to a tensor-parallel group (``bind_tensor_parallel``)."""

    tp: TensorParallelContext | None = None

    def bind_tensor_parallel(self, ctx: TensorParallelContext) -> None:
        """Keep this rank's slice of the parallel weights (idempotent for the same context)."""
        raise NotImplementedError

    def tensor_parallel_parameter_names(self) -> tuple[str, ...]:
        """Names (relative to this module) of the parameters split across the tensor-parallel group."""
        return ()

    @property
    def tp_bound(self) -> bool:
        return self.tp is not None and self.tp.world > 1


def _keep_rows(param: nn.Parameter, ranges: Sequence[tuple[int, int]], dim: int) -> None:
    """Replace ``param``'s data by the concatenation of its ``ranges`` along ``dim`` (in place)."""
    parts = [param.data.narrow(dim, a, b - a) for a, b in ranges]
    param.data = torch.cat(parts, dim).contiguous()


def _check_rebind(module: TensorParallelModule, ctx: TensorParallelContext) -> bool:
    """True if the weights are already split as ``ctx`` wants (same group size and rank: a new Trainer
    stage rebuilds the groups), after switching to ``ctx``; raise if they are split another way."""
    done = getattr(module, "_tp_split", None)  # (world, rank) of the split already applied
    if done is None:
        return False
    if done == (ctx.world, ctx.rank):
        module.tp = ctx
        return True
    raise ValueError(
        f"{type(module).__name__} is already split as rank {done[1]} of {done[0]} tensor-parallel ranks; "
        f"it cannot be re-split as rank {ctx.rank} of {ctx.world}: build a fresh model for another "
        "tensor_parallel_size (and load a checkpoint into it)"
    )


class _SequenceParallelColumnLinear(torch.autograd.Function):
    """``y = all_gather(x) @ W^T + b`` saving only ``x``'s shard (Note [Megatron tensor + sequence parallelism])."""

    @staticmethod
    def forward(ctx, x, weight, bias, group, seq_len, stats):
        # x [B, S_pad/t, C_in] -> full [B, S, C_in] -> [B, S, C_out/t]
        full = sp_all_gather(x, group, dim=1, seq_len=seq_len, stats=stats)
        ctx.save_for_backward(x, weight)
        ctx.group, ctx.seq_len, ctx.stats, ctx.has_bias = group, seq_len, stats, bias is not None
        return F.linear(full, weight, bias)

    @staticmethod
    def backward(ctx, grad):  # grad [B, S, C_out/t]
        x, weight = ctx.saved_tensors
        dt = grad.dtype  # under autocast the matmul ran in a lower precision than x / weight
        full = sp_all_gather(x, ctx.group, dim=1, seq_len=ctx.seq_len, stats=ctx.stats)  # re-gather [B, S, C_in]
        grad_x = sp_reduce_scatter(grad @ weight.to(dt), ctx.group, dim=1, stats=ctx.stats)  # [B, S_pad/t, C_in]
        g2 = grad.reshape(-1, grad.size(-1))  # [B*S, C_out/t]
        grad_w = g2.t() @ full.reshape(-1, full.size(-1)).to(dt)  # [C_out/t, C_in]
        grad_b = g2.sum(0).to(weight.dtype) if ctx.has_bias else None
        return grad_x.to(x.dtype), grad_w.to(weight.dtype), grad_b, None, None, None


def column_parallel_linear(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, tp: TensorParallelContext | None,
    *, seq_len: int | None = None,
) -> torch.Tensor:
    """Column-parallel ``F.linear``. With SP: ``x [B, S_pad/t, C_in] -> [B, S, C_out_local]`` (``seq_len``
    = ``S``, default ``t * S_pad/t``); without SP: ``x [B, S, C_in]`` replicated. Unbound: ``F.linear``."""
    if tp is None or tp.world == 1:
        return F.linear(x, weight, bias)
    if tp.sequence_parallel:
        s = x.size(1) * tp.world if seq_len is None else seq_len
        return _SequenceParallelColumnLinear.apply(x, weight, bias, tp.group, s, tp.comm)
    return F.linear(copy_to_tensor_parallel_region(x, tp.group, tp.comm), weight, bias)


class ColumnParallelLinear(nn.Linear, TensorParallelModule):
    """``nn.Linear`` whose output features split over the tensor-parallel group.

    ``output_sizes``: for a fused layer (``qkv``), the sizes of its output segments; each is split
    separately, so rank ``r``'s output is ``[seg_0 part r, seg_1 part r, ...]``. Forward takes
    ``x [B, S_pad/t, C_in]`` (SP) and returns ``[B, S, C_out_local]`` (``seq_len=S``).
    """

    def __init__(self, in_features: int, out_features: int, bias: bool = True, *,
                 output_sizes: Sequence[int] | None = None, **kwargs) -> None:
        super().__init__(in_features, out_features, bias=bias, **kwargs)
        self.output_sizes = tuple(output_sizes) if output_sizes is not None else (out_features,)
        if sum(self.output_sizes) != out_features or min(self.output_sizes) < 1:
            raise ValueError(f"output_sizes {self.output_sizes} must be positive and sum to out_features={out_features}")
        self.tp = None

    def local_output_sizes(self) -> tuple[int, ...]:
        if not self.tp_bound:
            return self.output_sizes
        return tuple(b - a for a, b in (shard_range(n, self.tp.world, self.tp.rank) for n in self.output_sizes))

    def bind_tensor_parallel(self, ctx: TensorParallelContext) -> None:
        if _check_rebind(self, ctx):
            return
        self.tp, self._tp_split = ctx, (ctx.world, ctx.rank)
        if ctx.world == 1:
            return
        ranges, offset = [], 0
        for n in self.output_sizes:
            a, b = shard_range(n, ctx.world, ctx.rank)
            ranges.append((offset + a, offset + b))
            offset += n
        _keep_rows(self.weight, ranges, 0)
        if self.bias is not None:
            _keep_rows(self.bias, ranges, 0)

    def tensor_parallel_parameter_names(self) -> tuple[str, ...]:
        return ("weight", "bias") if self.bias is not None else ("weight",)

    def forward(self, x: torch.Tensor, *, seq_len: int | None = None) -> torch.Tensor:
        return column_parallel_linear(x, self.weight, self.bias, self.tp, seq_len=seq_len)


class RowParallelLinear(nn.Linear, TensorParallelModule):
    """``nn.Linear`` whose input features split over the group: ``[B, S, C_in_local] -> [B, S_pad/t, C_out]``
    (SP: reduce-scatter of the partial sums) or ``[B, S, C_out]`` (no SP: all-reduce). The bias is
    replicated and added after the reduction."""

    def __init__(self, in_features: int, out_features: int, bias: bool = True, **kwargs) -> None:
        super().__init__(in_features, out_features, bias=bias, **kwargs)
        self.tp = None

    def bind_tensor_parallel(self, ctx: TensorParallelContext) -> None:
        if _check_rebind(self, ctx):
            return
        self.tp, self._tp_split = ctx, (ctx.world, ctx.rank)
        if ctx.world > 1:
            _keep_rows(self.weight, [shard_range(self.in_features, ctx.world, ctx.rank)], 1)

    def tensor_parallel_parameter_names(self) -> tuple[str, ...]:
        return ("weight",)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not self.tp_bound:
            return F.linear(x, self.weight, self.bias)
        partial = F.linear(x, self.weight)  # [B, S, C_out], this rank's share of the sum
        tp = self.tp
        if tp.sequence_parallel:
            out = reduce_scatter_to_sequence_parallel_region(partial, tp.group, dim=1, stats=tp.comm)
        else:
            out = reduce_from_tensor_parallel_region(partial, tp.group, tp.comm)
        return out if self.bias is None else out + self.bias


class VocabParallelEmbedding(nn.Embedding, TensorParallelModule):
    """``nn.Embedding`` whose rows (the vocabulary) split over the group. ``ids [B, S] -> [B, S_pad/t, C]``
    (SP) or ``[B, S, C]``: each rank looks up the ids in its range, zeros the others, and the partial
    results are reduce-scattered (SP) or all-reduced. Vocabulary sizes no degree divides work
    (``shard_range``: no padding rows, so the model is the one-process model)."""

    def __init__(self, num_embeddings: int, embedding_dim: int, **kwargs) -> None:
        for name in ("padding_idx", "max_norm"):
            if kwargs.get(name) is not None:
                raise NotImplementedError(f"VocabParallelEmbedding does not support {name}; use nn.Embedding")
        if kwargs.get("sparse"):
            raise NotImplementedError("VocabParallelEmbedding does not support sparse gradients")
        super().__init__(num_embeddings, embedding_dim, **kwargs)
        self.tp = None
        self.vocab_start, self.vocab_stop = 0, num_embeddings

    def bind_tensor_parallel(self, ctx: TensorParallelContext) -> None:
        if _check_rebind(self, ctx):
            return
        self.tp, self._tp_split = ctx, (ctx.world, ctx.rank)
        if ctx.world > 1:
            self.vocab_start, self.vocab_stop = shard_range(self.num_embeddings, ctx.world, ctx.rank)
            _keep_rows(self.weight, [(self.vocab_start, self.vocab_stop)], 0)

    def tensor_parallel_parameter_names(self) -> tuple[str, ...]:
        return ("weight",)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        if not self.tp_bound:
            return F.embedding(ids, self.weight)
        outside = (ids < self.vocab_start) | (ids >= self.vocab_stop)  # [B, S]
        local = (ids - self.vocab_start).masked_fill(outside, 0)
        partial = F.embedding(local, self.weight) * (~outside).unsqueeze(-1).to(self.weight.dtype)  # [B, S, C]
        tp = self.tp
        if tp.sequence_parallel:
            return reduce_scatter_to_sequence_parallel_region(partial, tp.group, dim=1, stats=tp.comm)
        return reduce_from_tensor_parallel_region(partial, tp.group, tp.comm)


def gather_sequence_parallel_output(x: torch.Tensor, tp: TensorParallelContext | None, *, seq_len: int) -> torch.Tensor:
    """``[B, S_pad/t, C] -> [B, S, C]`` outside a parallel linear (e.g. a final hidden state), differentiable."""
    from lightning_sp.comm.tensor_parallel import gather_from_sequence_parallel_region

    if tp is None or tp.world == 1 or not tp.sequence_parallel:
        return x
    return gather_from_sequence_parallel_region(x, tp.group, seq_len=seq_len, dim=1, stats=tp.comm)


def bind_tensor_parallel(model: nn.Module, ctx: TensorParallelContext) -> list[str]:
    """Bind every ``TensorParallelModule`` of ``model`` (in ``named_modules`` order); return the names of
    the parameters split over the group (all others are replicated)."""
    sharded: list[str] = []
    for name, m in model.named_modules():
        if isinstance(m, TensorParallelModule):
            m.bind_tensor_parallel(ctx)
            sharded += [f"{name}.{p}" if name else p for p in m.tensor_parallel_parameter_names()]
    return sharded


def bind_tensor_parallel_layers(model: nn.Module, ctx: TensorParallelContext, *, tensor_parallel_size: int) -> set[str]:
    """``bind_tensor_parallel`` for ``SequenceParallelStrategy(tensor_parallel_size=t)``: split the model's
    ``TensorParallelModule`` weights over the ``tp`` axis (Note [Megatron tensor + sequence parallelism]);
    return the names of the split parameters (the others are replicated). Raises if there are none."""
    sharded = set(bind_tensor_parallel(model, ctx))
    if not sharded:
        raise ValueError(
            f"tensor_parallel_size={tensor_parallel_size} but the model has no tensor-parallel layers "
            "(lightning_sp.tensor_parallel.ColumnParallelLinear / RowParallelLinear / VocabParallelEmbedding): "
            "build it from them (as lightning_sp.models does), or use tensor_parallel_size=1"
        )
    return sharded
