"""The ``dp x cp(ring x ulysses) x tp`` ``DeviceMesh`` of ``SequenceParallelStrategy``, and its groups.

One named 4-D mesh (``MeshAxis`` names, TP innermost: Note [Mesh axis order] in ``topology``) built
with ``init_device_mesh``, plus two flattened 1-D views: ``sp`` (= ``cp``, ring x ulysses: the
attention's group, Ulysses-inner as the ``usp`` contract needs) and ``dp_sp`` (ranks holding the same
tensor-parallel shard: DDP's process group and FSDP2's mesh). Every group gets the strategy's
``process_group_timeout`` so a dead rank fails a collective quickly on every axis.
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import timedelta

import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from lightning_sp.topology import MeshAxis, ParallelDims

MESH_AXES = (MeshAxis.DP, MeshAxis.RING, MeshAxis.ULYSSES, MeshAxis.TP)
"""Axes of the 4-D mesh, outermost first (``ParallelDims.mesh_shape`` order)."""


def _backend_options(timeout: timedelta | None):
    """``(backend, options)`` for ``init_device_mesh``'s ``backend_override`` carrying ``timeout``
    (``(None, None)``: the default backend and timeout)."""
    if timeout is None:
        return (None, None)
    backend = dist.get_backend()
    if backend == "gloo":
        opts = dist.ProcessGroupGloo._Options()
    elif backend == "nccl" and hasattr(dist, "ProcessGroupNCCL"):
        opts = dist.ProcessGroupNCCL.Options()
    else:
        return (None, None)
    opts._timeout = timeout
    return (backend, opts)


@dataclass(kw_only=True)
class ParallelMesh:
    """This rank's view of the mesh: the 4-D ``mesh`` and the flattened ``sp`` and ``dp_sp`` meshes."""

    dims: ParallelDims
    mesh: DeviceMesh
    """4-D, axes ``("dp", "ring", "ulysses", "tp")``: ``mesh["tp"]``, ``mesh["ring", "ulysses"]``, ..."""
    sp: DeviceMesh
    """1-D: the context-parallel (sequence-parallel) group, ``ring x ulysses`` flattened, Ulysses inner."""
    dp_sp: DeviceMesh
    """1-D: ``dp x ring x ulysses`` flattened; ranks that hold the same tensor-parallel shard."""

    def group(self, axis: MeshAxis | str) -> dist.ProcessGroup:
        """This rank's process group along ``axis``."""
        axis = MeshAxis(axis)
        if axis is MeshAxis.SP:
            return self.sp.get_group()
        if axis is MeshAxis.DP_SP:
            return self.dp_sp.get_group()
        return self.mesh.get_group(axis.value)

    def transient_groups(self) -> list[dist.ProcessGroup]:
        """The groups a Trainer stage may destroy at teardown: all of this rank's groups except the world
        and ``dp_sp``, which FSDP2 parameters (DTensors on that mesh) keep using after ``fit``."""
        seen: dict[int, dist.ProcessGroup] = {}
        keep = self.dp_sp.get_group()
        for g in [*self.mesh.get_all_groups(), self.sp.get_group()]:
            if g is keep:
                continue
            if g is not dist.group.WORLD and g is not dist.distributed_c10d._get_default_group():
                seen.setdefault(id(g), g)
        return list(seen.values())


def build_parallel_mesh(dims: ParallelDims, device_type: str, *, timeout: timedelta | None = None) -> ParallelMesh:
    """Create the mesh on every rank (collective: call it on all ranks, in the same order)."""
    if dist.get_world_size() != dims.world_size:
        raise ValueError(f"the process group has {dist.get_world_size()} ranks but the mesh needs {dims.world_size}")
    override = _backend_options(timeout)
    names = tuple(a.value for a in MESH_AXES)
    kwargs = {} if override == (None, None) else {"backend_override": {n: override for n in names}}
    mesh = init_device_mesh(device_type, dims.mesh_shape, mesh_dim_names=names, **kwargs)
    fkw = {} if override == (None, None) else {"backend_override": override}
    sp = mesh[MeshAxis.RING.value, MeshAxis.ULYSSES.value]._flatten(MeshAxis.SP.value, **fkw)
    dp_sp = mesh[MeshAxis.DP.value, MeshAxis.RING.value, MeshAxis.ULYSSES.value]._flatten(MeshAxis.DP_SP.value, **fkw)
    pm = ParallelMesh(dims=dims, mesh=mesh, sp=sp, dp_sp=dp_sp)
    rank = dist.get_rank()
    for axis in (MeshAxis.SP, MeshAxis.DP, MeshAxis.TP, MeshAxis.DP_SP, MeshAxis.RING, MeshAxis.ULYSSES):
        got = dist.get_process_group_ranks(pm.group(axis))
        want = dims.group_of(axis, rank)
        if got != want:  # the mesh and the pure rank math must agree (Note [Mesh axis order])
            raise AssertionError(f"rank {rank}: DeviceMesh {axis.value} group {got} != topology {want}")
    return pm
