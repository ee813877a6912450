"""What a ``SequenceParallelAttention`` is bound to: its process groups, backend and kernel.

The strategy builds one context per sequence-parallel group and binds it to every attention module
of the model (``SequenceParallelAttention.bind``); standalone users pass ``group=`` directly and the
module builds its own. Nothing here is a module-level global.
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch

from lightning_sp.comm.stats import CommStats

if TYPE_CHECKING:
    from torch.distributed import ProcessGroup

    from lightning_sp.cost_model import AutoChoice, HardwareProfile


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
    ranks_per_node: int | None = None
    """Ranks that share a node (fast interconnect). ``auto`` and ``usp``'s default degree keep every
    all-to-all inside a node when they can. ``None``: unknown (no cap)."""
    comm: CommStats = field(default_factory=CommStats)
    """Bytes moved by every collective issued on behalf of the bound modules."""
    hardware: "HardwareProfile | str | None" = None
    """Cost-model profile ``backend="auto"`` chooses with (``lightning_sp.cost_model``; a preset name or a
    calibrated ``HardwareProfile``). ``None``: ``cost_model.default_profile`` for the device."""
    resolved_backend: str | None = field(default=None, compare=False)
    """What ``backend="auto"`` resolved to at the last attention call (``None`` before); ``usp`` as
    ``"usp(ulysses=U)"``."""
    auto_policy: str | None = None
    """How ``backend="auto"`` picks among its candidates: ``"measure"`` (time them once per shape bucket on
    this machine, cached; Note [auto measures its candidates] in ``lightning_sp/choices.py``) or ``"model"``
    (the cost model's prediction). ``None``: ``$LIGHTNING_SP_AUTO``, else ``"model"`` when ``hardware`` is set,
    else ``"measure"``."""
    memory_budget: int | None = None
    """Bytes one attention fwd+bwd may peak at per rank, for modules with ``kv_pieces="auto"`` and no
    ``memory_budget`` of their own. ``None``: whole K/V blocks on CPU; a share of the free memory on CUDA."""
    auto_choice: "AutoChoice | None" = field(default=None, compare=False)
    """The cost model's decision behind ``resolved_backend``: candidates, predicted times, exclusions."""
    auto_choices: dict = field(default_factory=dict, repr=False, compare=False)
    """Per-shape cache of ``auto``'s decisions (not configuration)."""
    kv_pieces_choices: dict = field(default_factory=dict, repr=False, compare=False)
    """Per-shape cache of ``kv_pieces="auto"``'s decisions (not configuration)."""

    # Per-batch cache shared by every module bound to this context (not configuration).
    _cu_cache: tuple | None = field(default=None, repr=False, compare=False)

    def cu_bounds(self, cu_seqlens: "torch.Tensor") -> tuple[int, ...]:
        """``cu_seqlens`` as host ints, read from the device once per tensor (not once per layer).

        Keyed on the tensor object itself (a weak reference) and its version counter, so a new
        batch's tensor, or one modified in place, is read again even if it reuses the old storage."""
        cached = self._cu_cache
        if cached is not None and cached[0]() is cu_seqlens and cached[1] == cu_seqlens._version:
            return cached[2]
        bounds = tuple(int(b) for b in cu_seqlens.tolist())
        self._cu_cache = (weakref.ref(cu_seqlens), cu_seqlens._version, bounds)
        return bounds
