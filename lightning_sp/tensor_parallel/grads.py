"""Gradient bookkeeping that tensor parallelism needs after backward and before the optimizer step.

Parameters split by a tensor-parallel layer hold their full gradient on each rank; all others are
replicated, and under sequence parallelism each tp rank saw only ``S/t`` rows, so their gradients are
partial sums (Note [Megatron tensor + sequence parallelism]).
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
import torch.distributed as dist
from torch import nn

from lightning_sp.comm.device import group_device
from lightning_sp.comm.release import collective
from lightning_sp.comm.stats import CommStats


def _local(t: torch.Tensor) -> torch.Tensor:
    from torch.distributed.tensor import DTensor

    return t.to_local() if isinstance(t, DTensor) else t


def reduce_replicated_gradients(module: nn.Module, sharded: Iterable[str], group, stats: CommStats | None = None) -> None:
    """Sum the gradients of ``module``'s replicated parameters (names not in ``sharded``) over the
    tensor-parallel ``group``, in place; call once per optimizer step (not per micro-batch). Bytes are
    counted into ``stats`` as ``"grad_all_reduce"`` (``2 (t-1)/t`` of each gradient, as ``all_reduce_raw``)."""
    sharded = set(sharded)
    world = dist.get_world_size(group)
    for name, p in module.named_parameters():  # same order on every rank: one all-reduce each
        if name not in sharded and p.grad is not None:
            g = _local(p.grad)
            if stats is not None:
                stats.add("grad_all_reduce", 2 * (world - 1) * g.numel() * g.element_size() // world)
            collective(dist.all_reduce, g, op=dist.ReduceOp.SUM, group=group)


def clip_grad_norm_(module: nn.Module, parameters: Iterable[nn.Parameter], max_norm: float, *,
                    sharded: Iterable[str], tp_group, shard_group=None) -> torch.Tensor:
    """``torch.nn.utils.clip_grad_norm_`` for the *global* model: squared norms of tp-split parameters
    are summed over ``tp_group``, replicated ones counted once; with FSDP (``shard_group``: the ranks
    each parameter is sharded over) the local shards are summed over it first. Returns the norm."""
    sharded = set(sharded)
    names = {id(p): n for n, p in module.named_parameters()}
    grads = [(names.get(id(p)) in sharded, _local(p.grad)) for p in parameters if p.grad is not None]
    # a rank without gradients still joins both all-reduces (its peers wait in them): zeros on the group's device
    device = grads[0][1].device if grads else group_device(shard_group if shard_group is not None else tp_group)
    sq = torch.zeros(2, dtype=torch.float64, device=device)  # [split, replicated]
    for split, g in grads:
        sq[0 if split else 1] += g.double().pow(2).sum()
    if shard_group is not None:
        collective(dist.all_reduce, sq, group=shard_group)
    split_sq = sq[0:1].clone()
    collective(dist.all_reduce, split_sq, group=tp_group)
    total = (split_sq[0] + sq[1]).sqrt()
    coef = (max_norm / (total + 1e-6)).clamp(max=1.0)  # as torch.nn.utils.clip_grad_norm_
    for _, g in grads:
        g.mul_(coef.to(g.dtype))
    return total


class TensorParallelGradients:
    """The gradient work tensor parallelism adds to a training step of ``module``, whose tensor-parallel
    layers ``bind_tensor_parallel_layers`` bound to ``context`` (it returns ``sharded``, the names of the
    split parameters): sum the replicated parameters' partial gradients over ``tp`` once per optimizer
    step, and clip by the norm of the whole model. Nothing to do when ``context.world == 1``."""

    def __init__(self, module: nn.Module, sharded: Iterable[str], context) -> None:
        self.module = module
        self.sharded = set(sharded)
        self.context = context  # a TensorParallelContext

    @property
    def active(self) -> bool:
        """There is a tensor-parallel group of more than one rank (else ``reduce`` has nothing to do)."""
        return self.context.world > 1

    def reduce(self) -> None:
        """``reduce_replicated_gradients`` over the tensor-parallel group, bytes counted in ``context.comm``."""
        if self.active:
            reduce_replicated_gradients(self.module, self.sharded, self.context.group, self.context.comm)

    def reducing_after(self, closure):
        """``closure`` (forward + backward of the last micro-batch), then ``reduce``: what the optimizer runs."""

        def closure_then_reduce():
            result = closure()
            self.reduce()
            return result

        return closure_then_reduce

    def clip(self, optimizer: torch.optim.Optimizer, max_norm: float, *, shard_group=None) -> torch.Tensor:
        """``clip_grad_norm_`` of ``optimizer``'s parameters by the whole model's norm (``shard_group``: the
        group FSDP2 shards them over, if it does)."""
        params = [p for g in optimizer.param_groups for p in g["params"]]
        return clip_grad_norm_(self.module, params, max_norm, sharded=self.sharded, tp_group=self.context.group,
                               shard_group=shard_group)
