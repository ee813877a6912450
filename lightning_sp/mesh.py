"""The ``dp x cp(ring x ulysses) x tp`` ``DeviceMesh`` of ``SequenceParallelStrategy``, and its groups.

``strategy_dims`` picks the strategy's degrees, ``build_strategy_groups`` creates the mesh and the
contexts the model is bound to; both run without a Trainer.

One named 4-D mesh (``MeshAxis`` names, TP innermost: Note [Mesh axis order] in ``topology``) built
with ``init_device_mesh``, plus two flattened 1-D views: ``sp`` (= ``cp``, ring x ulysses: the
attention's group, Ulysses-inner as the ``usp`` contract needs) and ``dp_sp`` (ranks holding the same
tensor-parallel shard: DDP's process group and FSDP2's mesh). Every group gets the strategy's
``process_group_timeout`` so a dead rank fails a collective quickly on every axis.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from datetime import timedelta

import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from lightning_sp.attention import default_ulysses_degree
from lightning_sp.comm.agree import gather_rows
from lightning_sp.context import SequenceParallelContext
from lightning_sp.ops.backends import BACKENDS
from lightning_sp.tensor_parallel import TensorParallelContext
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


_BUILT: dict[tuple, tuple[dist.ProcessGroup, ParallelMesh]] = {}
"""The meshes this process built, by ``(dims, device_type, timeout)``, with the world group they were built on
(Note [One mesh per world and layout])."""


def _reusable(key: tuple) -> ParallelMesh | None:
    """The mesh built earlier for ``key`` if every rank still has it alive in the same world (one all-gather
    every rank joins: whether to build is decided together, Note [Cross-rank checks are decided together])."""
    world = dist.distributed_c10d._get_default_group()
    world_of, mesh = _BUILT.get(key, (None, None))
    live = dist.distributed_c10d._world.pg_map
    ok = mesh is not None and world_of is world and all(
        mesh.group(axis) in live or mesh.group(axis) is world for axis in MeshAxis)
    rows = gather_rows([int(ok)], dist.group.WORLD)
    if all(row[0] == 1 for row in rows):
        return mesh
    _BUILT.pop(key, None)
    return None


def build_parallel_mesh(dims: ParallelDims, device_type: str, *, timeout: timedelta | None = None) -> ParallelMesh:
    """Create the mesh on every rank (collective: call it on all ranks, in the same order), or return the one
    this process built before for the same degrees, device type and timeout (Note [One mesh per world and
    layout]): its groups live as long as the world group.

    Note [One mesh per world and layout]
        A second ``Trainer`` in the same process (fit, then a new Trainer that resumes; fit, then test) used to
        build a second mesh after the first Trainer's teardown destroyed some of its groups. On NCCL with a bound
        device (Lightning binds one), ``init_device_mesh`` creates groups with ``split_group``, which names them
        ``sha1(ranks + number of live groups)``: once groups were destroyed while others (``dp_sp``, which FSDP2
        parameters keep) lived on, the count repeated and the new group's name was taken ("A process group is
        already registered under the name ..."; seen on one H200 with torch 2.11). gloo names groups with a
        counter and never collided, so CPU tests could not see it. Groups are now kept until the world is
        destroyed, and a later Trainer with the same layout reuses them (no new communicators either).
    """
    if dist.get_world_size() != dims.world_size:
        raise ValueError(f"the process group has {dist.get_world_size()} ranks but the mesh needs {dims.world_size}")
    key = (dims, device_type, timeout)
    reused = _reusable(key)
    if reused is not None:
        return reused
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
    _BUILT[key] = (dist.distributed_c10d._get_default_group(), pm)
    return pm


# ------------------------------------------------------------------------- the strategy's degrees and groups
def check_strategy_degrees(sequence_parallel_size: int | None, *, backend: str, ulysses_degree: int | None,
                           tensor_parallel_size: int) -> None:
    """``SequenceParallelStrategy``'s eager checks of its degrees and backend (before any device is known)."""
    if sequence_parallel_size is not None and (
        not isinstance(sequence_parallel_size, int) or isinstance(sequence_parallel_size, bool) or sequence_parallel_size < 1
    ):
        raise ValueError(f"sequence_parallel_size must be a positive integer or None (all ranks), got {sequence_parallel_size!r}")
    if backend not in BACKENDS:
        raise ValueError(f"backend={backend!r} is not one of {BACKENDS}")
    if ulysses_degree is not None and backend != "usp":
        raise ValueError(
            f"ulysses_degree={ulysses_degree} only applies to backend='usp' (got backend={backend!r}); "
            f"use backend='usp' for a ring x ulysses split, or drop ulysses_degree"
        )
    if ulysses_degree is not None and sequence_parallel_size is not None:
        ParallelDims(world_size=sequence_parallel_size, sequence_parallel_size=sequence_parallel_size,
                     ulysses_degree=ulysses_degree)  # eager check: ulysses_degree divides sp
    if not isinstance(tensor_parallel_size, int) or isinstance(tensor_parallel_size, bool) or tensor_parallel_size < 1:
        raise ValueError(f"tensor_parallel_size must be a positive integer, got {tensor_parallel_size!r}")


def check_launch_matches_nodes(*, devices: int, num_nodes: int) -> None:
    """Under torchrun, ``devices`` must be the ranks it started per node (``LOCAL_WORLD_SIZE``): Lightning
    checks only ``num_nodes * devices == WORLD_SIZE``, and a wrong split would place Ulysses
    all-to-alls (``ulysses``, ``usp``'s inner axis, ``auto``'s pricing) across nodes without a word."""
    local_world = os.environ.get("LOCAL_WORLD_SIZE")
    if "TORCHELASTIC_RUN_ID" not in os.environ or not (local_world or "").isdigit():
        return
    if int(local_world) != devices:
        world = os.environ.get("WORLD_SIZE", "?")
        raise ValueError(
            f"torchrun started {local_world} ranks per node (LOCAL_WORLD_SIZE={local_world}, WORLD_SIZE={world}) "
            f"but the Trainer has devices={devices}, num_nodes={num_nodes}: pass "
            f"devices={local_world}, num_nodes=WORLD_SIZE // LOCAL_WORLD_SIZE (torchrun's --nnodes), so the "
            "strategy knows which ranks share a node"
        )


def check_world_matches(world_size: int, *, devices: int, num_nodes: int) -> None:
    """The process group has the ``num_nodes x devices`` ranks the Trainer was configured with."""
    if world_size != num_nodes * max(devices, 1):
        raise ValueError(
            f"the process group has {world_size} ranks but the Trainer was configured with "
            f"num_nodes={num_nodes} x devices={devices}"
        )


def strategy_dims(world_size: int, *, sequence_parallel_size: int | None, backend: str, ulysses_degree: int | None,
                  tensor_parallel_size: int, ranks_per_node: int | None, num_nodes: int, devices: int) -> ParallelDims:
    """``SequenceParallelStrategy``'s degrees on ``world_size`` ranks: ``sp`` defaults to every rank a
    ``tp`` group leaves, ``usp`` splits it with ``ulysses_degree`` (default ``default_ulysses_degree``),
    ``ulysses`` is all-Ulysses, the rest all-ring. Errors name every argument and the devices."""
    sp = max(world_size // tensor_parallel_size, 1) if sequence_parallel_size is None else sequence_parallel_size
    if backend == "usp":
        u = ulysses_degree or default_ulysses_degree(sp, ranks_per_node=ranks_per_node)
    elif backend == "ulysses":
        u = sp
    else:
        u = 1
    try:
        return ParallelDims(world_size=world_size, sequence_parallel_size=sp, ulysses_degree=u,
                            tensor_parallel_size=tensor_parallel_size)
    except ValueError as err:
        raise ValueError(
            f"SequenceParallelStrategy(sequence_parallel_size={sp}, backend={backend!r}, "
            f"ulysses_degree={ulysses_degree}, tensor_parallel_size={tensor_parallel_size}) on num_nodes={num_nodes} x "
            f"devices={devices}: {err}"
        ) from None


@dataclass(kw_only=True)
class StrategyGroups:
    """What ``build_strategy_groups`` creates on this rank."""

    mesh: ParallelMesh
    """The ``dp x ring x ulysses x tp`` mesh and its flattened views."""
    context: SequenceParallelContext
    """What the model's ``SequenceParallelAttention`` modules are bound to (sp / ring / ulysses groups)."""
    tensor_parallel: TensorParallelContext
    """What the model's tensor-parallel layers are bound to (group ``None`` when ``tp == 1``)."""
    dp_group: dist.ProcessGroup
    """One rank per sp group (same sp index): the data-parallel axis."""
    summary: list[str]
    """Lines for the log (rank zero): the degrees, the backend, the mesh."""


def build_strategy_groups(dims: ParallelDims, device_type: str, *, backend: str, kernel: str, data_parallel: str,
                          ranks_per_node: int | None, timeout: timedelta | None,
                          **context_options) -> StrategyGroups:
    """Create the mesh (a collective: every rank, same order) and the contexts bound to it.
    ``context_options``: further ``SequenceParallelContext`` fields (``hardware``, ``memory_budget``,
    ``auto_policy``)."""
    mesh = build_parallel_mesh(dims, device_type, timeout=timeout)
    usp = backend == "usp"
    context = SequenceParallelContext(
        group=mesh.group(MeshAxis.SP),
        backend=backend,
        ulysses_degree=dims.ulysses if usp else None,
        ulysses_group=mesh.group(MeshAxis.ULYSSES) if usp else None,
        ring_group=mesh.group(MeshAxis.RING) if usp else None,
        kernel=kernel,
        ranks_per_node=ranks_per_node,
        **context_options,
    )
    described = backend
    if backend == "auto":
        described = (f"auto (chosen at the first attention call from the shapes, sp={dims.sp} "
                     f"and {ranks_per_node} ranks per node, among ulysses, zigzag_ring, allgather_kv "
                     f"and usp on the zigzag layout)")
    summary = [f"SequenceParallelStrategy: world={dims.world_size} dp={dims.dp} sp={dims.sp} (ring={dims.ring} x "
               f"ulysses={dims.ulysses}) backend={described} data_parallel={data_parallel}"]
    tensor_parallel = TensorParallelContext(
        group=mesh.group(MeshAxis.TP) if dims.tp > 1 else None, sequence_parallel=True,
        ulysses_degree=dims.ulysses if backend in ("ulysses", "usp") else 1,
    )
    if dims.tp > 1:
        summary.append(f"SequenceParallelStrategy: tensor_parallel_size={dims.tp} (Megatron TP+SP, innermost axis); "
                       f"mesh dp x ring x ulysses x tp = {' x '.join(map(str, dims.mesh_shape))}")
    return StrategyGroups(mesh=mesh, context=context, tensor_parallel=tensor_parallel,
                          dp_group=mesh.group(MeshAxis.DP), summary=summary)
