"""What a ``SequenceParallelAttention`` is bound to: its process groups, backend and kernel.

The strategy builds one context per sequence-parallel group and binds it to every attention module
of the model (``SequenceParallelAttention.bind``); standalone users pass ``group=`` directly and the
module builds its own. Nothing here is a module-level global.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from lightning_sp.comm.stats import CommStats

if TYPE_CHECKING:
    from torch.distributed import ProcessGroup


@dataclass(kw_only=True)
class SequenceParallelContext:
    group: "ProcessGroup | None" = None
    """The sequence-parallel group; ``None`` means no parallelism (world of one)."""
    backend: str = "auto"
    """Backend used by modules built with ``backend=None``."""
    ulysses_degree: int | None = None
    """Inner (Ulysses) degree for ``usp``; ``None`` lets the library choose."""
    ulysses_group: "ProcessGroup | None" = None
    """For ``usp``: this rank's Ulysses sub-group (group ranks ``r`` with equal ``r // ulysses_degree``)."""
    ring_group: "ProcessGroup | None" = None
    """For ``usp``: this rank's ring sub-group (group ranks ``r`` with equal ``r % ulysses_degree``)."""
    kernel: str = "auto"
    """Local kernel used by modules built with ``kernel="auto"``."""
    global_seq_len: int | None = None
    """Unpadded length of the current batch's global sequence, set by whoever shards the batch.
    Positions at or beyond it are padding: never attended to. ``None``: the shards hold no padding."""
    comm: CommStats = field(default_factory=CommStats)
    """Bytes moved by every collective issued on behalf of the bound modules."""
