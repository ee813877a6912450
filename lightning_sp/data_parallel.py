"""Data parallelism over ``dp x sp`` for ``SequenceParallelStrategy``: FSDP2 wrapping, DDP's process group
under tensor parallelism, and replica synchronisation outside fitting. Runs without a Trainer.

Note [Gradient reduction over dp x sp]
~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
Replica ``d`` (an sp group of ``P`` ranks) has loss ``L_d = sum_s l_{d,s} / n_d``, the token mean of
its sequence, where ``l_{d,s}`` sums the token losses of shard ``s``. ``sequence_parallel_cross_entropy``
returns ``L_d`` on every sp rank and its backward is that of an all-reduce: each of the ``P`` copies
of ``L_d`` sends gradient 1 back, so rank ``(d, s)`` holds ``P * dL_d/dtheta`` *through its shard*
(attention communication routes the cross-shard terms)::

    rank (d, s) grad  = P * g_{d,s}              sum_s g_{d,s} = dL_d/dtheta
    mean over s       = sum_s g_{d,s}            = replica d's gradient
    mean over d       = global-batch gradient    (equal token counts per replica)

So a plain MEAN over all ``dp * sp`` ranks is exactly the non-parallel gradient: DDP over the
world (``data_parallel="ddp"``) or FSDP2's reduce-scatter over the flattened world mesh
(``"fsdp"``); with ``tp > 1`` the same over ``dp x sp`` (tp ranks hold different shards). The
distributed tests check it to 1e-10 in float64.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from lightning_sp.comm.release import collective
from lightning_sp.mesh import ParallelMesh
from lightning_sp.topology import MeshAxis

DATA_PARALLEL = ("ddp", "fsdp")


def check_data_parallel(data_parallel: str) -> None:
    if data_parallel not in DATA_PARALLEL:
        raise ValueError(f"data_parallel={data_parallel!r} is not one of {DATA_PARALLEL}")


def ddp_process_group(ddp_kwargs: dict[str, Any], mesh: ParallelMesh) -> None:
    """Under tensor parallelism, point DDP at ``dp x sp`` (tp ranks hold different shards: never average
    across them); raises if the user passed a ``process_group`` of their own."""
    if ddp_kwargs.get("process_group") is not None:  # LightningCLI passes None explicitly
        raise ValueError("SequenceParallelStrategy builds DDP's process group (dp x sp) itself; "
                         "do not pass process_group=")
    ddp_kwargs["process_group"] = mesh.group(MeshAxis.DP_SP)


def fully_shard_model(model: nn.Module, mesh: ParallelMesh, shard_modules: Iterable[type[nn.Module]] = ()) -> nn.Module:
    """FSDP2 ``fully_shard`` over the flattened ``dp x sp`` mesh: each module of a class in ``shard_modules``
    (e.g. the transformer block) becomes its own unit, then the root."""
    from torch.distributed.fsdp import fully_shard

    shard_modules = tuple(shard_modules)
    dp_sp = mesh.dp_sp  # flattened dp x sp mesh, in global rank order
    for m in model.modules():
        if m is not model and isinstance(m, shard_modules):
            fully_shard(m, mesh=dp_sp)
    fully_shard(model, mesh=dp_sp)
    return model


def is_fsdp_root(model: Any) -> bool:
    """``model`` is wrapped by FSDP2 (``fully_shard``)."""
    from torch.distributed.fsdp import FSDPModule

    return isinstance(model, FSDPModule)


@contextmanager
def fsdp_gradient_sync_off(model: Any) -> Iterator[None]:
    """Inside, an FSDP2 root accumulates unsharded gradients locally (gradient accumulation's early
    micro-batches); the backward after it reduce-scatters them once."""
    model.set_requires_gradient_sync(False)
    try:
        yield None
    finally:
        model.set_requires_gradient_sync(True)


def broadcast_replicas(module: nn.Module, mesh: ParallelMesh) -> None:
    """Copy every parameter and buffer from the first rank of this rank's ``dp x sp`` group (the ranks that
    hold the same tensor-parallel shard); FSDP-sharded ``DTensor``s are skipped (consistent by construction)."""
    from torch.distributed.tensor import DTensor

    group = mesh.group(MeshAxis.DP_SP)
    if dist.get_world_size(group) == 1:
        return
    src = dist.get_process_group_ranks(group)[0]
    with torch.no_grad():
        for t in [*module.parameters(), *module.buffers()]:
            if isinstance(t, DTensor):
                continue  # sharded by FSDP: consistent by construction
            collective(dist.broadcast, t.data, src=src, group=group)
