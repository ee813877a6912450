"""Rank layout of the ``dp x sp x tp`` device mesh, ``sp`` split into ``ring x ulysses``: pure rank math.

Nothing here creates a process group; ``lightning_sp.mesh`` turns these degrees into a named
``DeviceMesh``. Errors are raised eagerly and name every degree.

Note [Mesh axis order]
----------------------
Tensor parallelism (Megatron TP+SP, four collectives per layer on the critical path) is the
innermost axis, Ulysses next (its all-to-alls need the most bandwidth after TP, so its ranks should
share a node), ring next, data parallel outermost::

    global rank = ((dp_idx * sp) + ring_idx * ulysses + ulysses_idx) * tp + tp_idx     sp = ring * ulysses

With ``tp = 1`` (the default) this is the ``(dp, sp)`` layout below, unchanged:

    world 8, sp 4, ulysses 2:      dp 0                 dp 1
                                ring 0    ring 1     ring 0    ring 1
                                [0, 1]    [2, 3]     [4, 5]    [6, 7]     <- ulysses groups

    sp groups: [0,1,2,3] [4,5,6,7]; ring groups: [0,2] [1,3] [4,6] [5,7]; dp groups: [0,4] [1,5] ...

    world 8, tp 2, sp 2, dp 2:    tp groups [0,1] [2,3] [4,5] [6,7]; sp groups [0,2] [1,3] [4,6] [5,7];
                                  dp groups [0,4] [1,5] [2,6] [3,7]; dp x sp groups [0,2,4,6] [1,3,5,7]

Within an sp group, group rank ``r = ring_idx * ulysses + ulysses_idx``, so ``r % ulysses`` is the
Ulysses index and ``r // ulysses`` the ring index (the ``usp`` contract of ``SequenceParallelAttention``).
"""

from __future__ import annotations

import enum
from dataclasses import dataclass


class MeshAxis(str, enum.Enum):
    """Names of the device-mesh axes, outermost first."""

    DP = "dp"
    SP = "sp"
    RING = "ring"
    ULYSSES = "ulysses"
    TP = "tp"
    DP_SP = "dp_sp"
    """The flattened ``dp x sp`` axis: ranks that hold the same tensor-parallel shard (gradients are
    averaged over it by DDP / FSDP)."""


@dataclass(kw_only=True, frozen=True)
class ParallelDims:
    """Degrees of the ``dp x sp(ring x ulysses) x tp`` mesh over ``world_size`` ranks."""

    world_size: int
    """Total number of ranks (``num_nodes * devices``)."""
    sequence_parallel_size: int
    """Ranks that share one sequence (the ``sp`` axis); must divide ``world_size``."""
    ulysses_degree: int = 1
    """Inner (Ulysses, all-to-all) part of ``sp``; must divide ``sequence_parallel_size``. The ring
    degree is ``sequence_parallel_size // ulysses_degree``."""
    tensor_parallel_size: int = 1
    """Ranks that share one layer's weights (Megatron tensor + sequence parallelism; the innermost
    ``tp`` axis). ``sequence_parallel_size * tensor_parallel_size`` must divide ``world_size``."""

    def __post_init__(self) -> None:
        ws, sp, u, tp = self.world_size, self.sequence_parallel_size, self.ulysses_degree, self.tensor_parallel_size
        degrees = f"(world_size={ws}, sequence_parallel_size={sp}, ulysses_degree={u}, tensor_parallel_size={tp})"
        for name, value in (("world_size", ws), ("sequence_parallel_size", sp), ("ulysses_degree", u),
                            ("tensor_parallel_size", tp)):
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"{name} must be a positive integer, got {value!r} {degrees}.")
        if ws % tp != 0:
            fits = [d for d in range(1, ws + 1) if ws % d == 0]
            raise ValueError(
                f"tensor_parallel_size={tp} does not divide world_size={ws} {degrees}. Use a tensor_parallel_size "
                f"in {fits}, or change the number of devices/nodes to a multiple of {tp}."
            )
        if ws % (sp * tp) != 0:
            fits = [d for d in range(1, ws // tp + 1) if (ws // tp) % d == 0]
            what = f"world_size={ws}" if tp == 1 else f"world_size / tensor_parallel_size = {ws // tp}"
            raise ValueError(
                f"sequence_parallel_size={sp} does not divide {what} {degrees}: the data-parallel "
                f"degree world_size / (sequence_parallel_size * tensor_parallel_size) must be an integer. Use a "
                f"sequence_parallel_size in {fits}, or change the number of devices/nodes to a multiple of {sp * tp}."
            )
        if sp % u != 0:
            fits = [d for d in range(1, sp + 1) if sp % d == 0]
            raise ValueError(
                f"ulysses_degree={u} does not divide sequence_parallel_size={sp} {degrees}: the ring degree "
                f"sequence_parallel_size / ulysses_degree must be an integer. Use a ulysses_degree in {fits}."
            )

    # degrees --------------------------------------------------------------------------------------
    @property
    def dp(self) -> int:
        """Data-parallel degree (model replicas)."""
        return self.world_size // (self.sequence_parallel_size * self.tensor_parallel_size)

    @property
    def tp(self) -> int:
        return self.tensor_parallel_size

    @property
    def dp_sp(self) -> int:
        """Ranks holding the same tensor-parallel shard: gradients are averaged over them."""
        return self.dp * self.sp

    @property
    def sp(self) -> int:
        return self.sequence_parallel_size

    @property
    def ulysses(self) -> int:
        return self.ulysses_degree

    @property
    def ring(self) -> int:
        return self.sequence_parallel_size // self.ulysses_degree

    def degree(self, axis: MeshAxis | str) -> int:
        return {MeshAxis.DP: self.dp, MeshAxis.SP: self.sp, MeshAxis.RING: self.ring,
                MeshAxis.ULYSSES: self.ulysses, MeshAxis.TP: self.tp, MeshAxis.DP_SP: self.dp_sp}[MeshAxis(axis)]

    @property
    def mesh_shape(self) -> tuple[int, int, int, int]:
        """``(dp, ring, ulysses, tp)``: the ``DeviceMesh`` shape, outermost first, in global rank order."""
        return (self.dp, self.ring, self.ulysses, self.tp)

    # coordinates ----------------------------------------------------------------------------------
    def _check_rank(self, rank: int) -> None:
        if not 0 <= rank < self.world_size:
            raise ValueError(f"rank {rank} is outside [0, {self.world_size}) for world_size={self.world_size}.")

    def coordinates(self, rank: int) -> dict[MeshAxis, int]:
        """This global rank's index along the ``dp``, ``sp``, ``ring`` and ``ulysses`` axes (``sp`` index =
        rank within its sp group); ``tp_rank`` gives the ``tp`` index."""
        self._check_rank(rank)
        dp_idx, sp_idx = divmod(rank // self.tp, self.sp)
        ring_idx, ulysses_idx = divmod(sp_idx, self.ulysses)
        return {MeshAxis.DP: dp_idx, MeshAxis.SP: sp_idx, MeshAxis.RING: ring_idx, MeshAxis.ULYSSES: ulysses_idx}

    def tp_rank(self, rank: int) -> int:
        """Index along the innermost ``tp`` axis."""
        self._check_rank(rank)
        return rank % self.tp

    def dp_rank(self, rank: int) -> int:
        return self.coordinates(rank)[MeshAxis.DP]

    def sp_rank(self, rank: int) -> int:
        return self.coordinates(rank)[MeshAxis.SP]

    # rank lists -----------------------------------------------------------------------------------
    def groups(self, axis: MeshAxis | str) -> list[list[int]]:
        """Every group along ``axis`` (each a sorted list of global ranks), in a fixed order that every
        rank can iterate to call ``dist.new_group`` identically. Each rank is in exactly one group."""
        axis = MeshAxis(axis)
        sp, u, r, tp = self.sp, self.ulysses, self.ring, self.tp

        def g(d: int, ri: int, ui: int, ti: int) -> int:  # Note [Mesh axis order]
            return ((d * sp) + ri * u + ui) * tp + ti

        dps, rs, us, ts = range(self.dp), range(r), range(u), range(tp)
        if axis is MeshAxis.TP:
            return [[g(d, ri, ui, ti) for ti in ts] for d in dps for ri in rs for ui in us]
        if axis is MeshAxis.SP:
            return [[g(d, ri, ui, ti) for ri in rs for ui in us] for d in dps for ti in ts]
        if axis is MeshAxis.DP:
            return [[g(d, ri, ui, ti) for d in dps] for ri in rs for ui in us for ti in ts]
        if axis is MeshAxis.DP_SP:
            return [[g(d, ri, ui, ti) for d in dps for ri in rs for ui in us] for ti in ts]
        if axis is MeshAxis.ULYSSES:
            return [[g(d, ri, ui, ti) for ui in us] for d in dps for ri in rs for ti in ts]
        # ring: fixed dp, ulysses and tp index, varying ring index
        return [[g(d, ri, ui, ti) for ri in rs] for d in dps for ui in us for ti in ts]

    def group_of(self, axis: MeshAxis | str, rank: int) -> list[int]:
        """The ranks of ``rank``'s group along ``axis``."""
        self._check_rank(rank)
        for ranks in self.groups(axis):
            if rank in ranks:
                return ranks
        raise AssertionError("unreachable: every rank is in one group per axis")
