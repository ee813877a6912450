"""Data parallelism over ``dp x sp`` for ``SequenceParallelStrategy``: FSDP2 wrapping, DDP's process group
under tensor parallelism, and replica synchronisation outside fitting. Runs without a Trainer.

A plain MEAN over all ``dp x sp`` ranks is exactly the non-parallel gradient (Note [Gradient reduction
over dp x sp] in ``lightning_sp.strategy``), so DDP over those ranks or FSDP2's reduce-scatter over the
flattened ``dp_sp`` mesh need nothing sequence-specific.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from lightning_sp.mesh import ParallelMesh
from lightning_sp.topology import MeshAxis

DATA_PARALLEL = ("ddp", "fsdp")


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
            dist.broadcast(t.data, src=src, group=group)
