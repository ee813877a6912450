"""What a tensor-parallel layer is bound to: its group, the sequence-parallel switch and byte counters."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch.distributed as dist

from lightning_sp.comm.stats import CommStats

if TYPE_CHECKING:
    from torch.distributed import ProcessGroup


@dataclass(kw_only=True)
class TensorParallelContext:
    group: "ProcessGroup | None" = None
    """The tensor-parallel group (the innermost ``tp`` mesh axis); ``None``: no tensor parallelism."""
    sequence_parallel: bool = True
    """Megatron sequence parallelism: norms, dropout and residuals run on ``S/t`` sequence shards, with
    all-gather / reduce-scatter around the parallel linears instead of all-reduces."""
    ulysses_degree: int = 1
    """Ulysses degree of the context-parallel attention that runs on this rank's heads (heads divide
    across TP first, then Ulysses); only used to check head counts eagerly."""
    comm: CommStats = field(default_factory=CommStats)
    """Bytes moved by the tensor-parallel collectives."""

    def __post_init__(self) -> None:
        if self.ulysses_degree < 1:
            raise ValueError(f"ulysses_degree must be >= 1, got {self.ulysses_degree}")

    @property
    def world(self) -> int:
        return 1 if self.group is None else dist.get_world_size(self.group)

    @property
    def rank(self) -> int:
        return 0 if self.group is None else dist.get_rank(self.group)


def shard_range(n: int, world: int, rank: int) -> tuple[int, int]:
    """``[start, stop)`` of rank ``rank``'s part of ``n`` rows split ``torch.chunk``-style (``ceil(n/world)``
    rows per rank, the last ones shorter or empty) -- the split ``DTensor``'s ``Shard`` uses."""
    size = -(-n // world)
    start = min(rank * size, n)
    return start, min(start + size, n)
