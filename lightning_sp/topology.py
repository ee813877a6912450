"""Rank layout of the ``(dp, sp)`` device mesh, with ``sp`` split into ``ring x ulysses``: pure rank math.

Nothing here creates a process group; the strategy turns these rank lists into groups with
``dist.new_group`` (on every rank, in the same order). Errors are raised eagerly and name every degree.

Note [Mesh axis order]
----------------------
Ulysses is the innermost axis (its all-to-alls need the most bandwidth, so its ranks should share a
node), ring next, data parallel outermost::

    global rank = dp_idx * sp + ring_idx * ulysses + ulysses_idx        sp = ring * ulysses

    world 8, sp 4, ulysses 2:      dp 0                 dp 1
                                ring 0    ring 1     ring 0    ring 1
                                [0, 1]    [2, 3]     [4, 5]    [6, 7]     <- ulysses groups

    sp groups: [0,1,2,3] [4,5,6,7]; ring groups: [0,2] [1,3] [4,6] [5,7]; dp groups: [0,4] [1,5] ...

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


@dataclass(kw_only=True, frozen=True)
class ParallelDims:
    """Degrees of the ``(dp, sp = ring x ulysses)`` mesh over ``world_size`` ranks."""

    world_size: int
    """Total number of ranks (``num_nodes * devices``)."""
    sequence_parallel_size: int
    """Ranks that share one sequence (the ``sp`` axis); must divide ``world_size``."""
    ulysses_degree: int = 1
    """Inner (Ulysses, all-to-all) part of ``sp``; must divide ``sequence_parallel_size``. The ring
    degree is ``sequence_parallel_size // ulysses_degree``."""

    def __post_init__(self) -> None:
        ws, sp, u = self.world_size, self.sequence_parallel_size, self.ulysses_degree
        degrees = f"(world_size={ws}, sequence_parallel_size={sp}, ulysses_degree={u})"
        for name, value in (("world_size", ws), ("sequence_parallel_size", sp), ("ulysses_degree", u)):
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"{name} must be a positive integer, got {value!r} {degrees}.")
        if ws % sp != 0:
            fits = [d for d in range(1, ws + 1) if ws % d == 0]
            raise ValueError(
                f"sequence_parallel_size={sp} does not divide world_size={ws} {degrees}: the data-parallel "
                f"degree world_size / sequence_parallel_size must be an integer. Use a sequence_parallel_size "
                f"in {fits}, or change the number of devices/nodes to a multiple of {sp}."
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
        """Data-parallel degree (number of sequence-parallel groups)."""
        return self.world_size // self.sequence_parallel_size

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
                MeshAxis.ULYSSES: self.ulysses}[MeshAxis(axis)]

    # coordinates ----------------------------------------------------------------------------------
    def _check_rank(self, rank: int) -> None:
        if not 0 <= rank < self.world_size:
            raise ValueError(f"rank {rank} is outside [0, {self.world_size}) for world_size={self.world_size}.")

    def coordinates(self, rank: int) -> dict[MeshAxis, int]:
        """This global rank's index along every axis (``sp`` index = rank within its sp group)."""
        self._check_rank(rank)
        dp_idx, sp_idx = divmod(rank, self.sp)
        ring_idx, ulysses_idx = divmod(sp_idx, self.ulysses)
        return {MeshAxis.DP: dp_idx, MeshAxis.SP: sp_idx, MeshAxis.RING: ring_idx, MeshAxis.ULYSSES: ulysses_idx}

    def dp_rank(self, rank: int) -> int:
        return self.coordinates(rank)[MeshAxis.DP]

    def sp_rank(self, rank: int) -> int:
        return self.coordinates(rank)[MeshAxis.SP]

    # rank lists -----------------------------------------------------------------------------------
    def groups(self, axis: MeshAxis | str) -> list[list[int]]:
        """Every group along ``axis`` (each a sorted list of global ranks), in a fixed order that every
        rank can iterate to call ``dist.new_group`` identically. Each rank is in exactly one group."""
        axis = MeshAxis(axis)
        sp, u, r = self.sp, self.ulysses, self.ring
        if axis is MeshAxis.SP:
            return [list(range(d * sp, (d + 1) * sp)) for d in range(self.dp)]
        if axis is MeshAxis.DP:
            return [list(range(s, self.world_size, sp)) for s in range(sp)]
        if axis is MeshAxis.ULYSSES:
            return [[d * sp + ri * u + ui for ui in range(u)] for d in range(self.dp) for ri in range(r)]
        # ring: fixed dp and ulysses index, varying ring index
        return [[d * sp + ri * u + ui for ri in range(r)] for d in range(self.dp) for ui in range(u)]

    def group_of(self, axis: MeshAxis | str, rank: int) -> list[int]:
        """The ranks of ``rank``'s group along ``axis``."""
        self._check_rank(rank)
        for ranks in self.groups(axis):
            if rank in ranks:
                return ranks
        raise AssertionError("unreachable: every rank is in one group per axis")
