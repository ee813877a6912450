"""lightning-sp: exact sequence (context) parallel attention and a Lightning strategy.

Public API (see DESIGN.md): ``SequenceParallelAttention``, ``shard_sequence``, ``gather_sequence``,
``sequence_parallel_cross_entropy``, ``SequenceParallelStrategy``.

``import lightning_sp`` imports neither Lightning nor transformers (Note [A light import] in
``lightning_sp._registry``): the Lightning-facing names (``SequenceParallelStrategy``,
``SequenceParallelMonitor``) load on first access, and the strategy is registered with Lightning's
``StrategyRegistry`` under ``"sequence_parallel"`` as soon as Lightning is imported (before or after this
package; the only import-time effect), so ``Trainer(strategy="sequence_parallel")`` works after
``import lightning_sp``.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from lightning_sp._registry import register_when_lightning_loads
from lightning_sp.attention import SequenceParallelAttention, layout_for_backend
from lightning_sp.context import SequenceParallelContext
from lightning_sp.layout import SequenceLayout, gather_sequence, sequence_positions, shard_sequence
from lightning_sp.loss import sequence_parallel_cross_entropy
from lightning_sp.masks import AttentionMask, RelativePositionBias

if TYPE_CHECKING:
    from lightning_sp.callbacks import SequenceParallelMonitor
    from lightning_sp.metrics import TokenAccuracy, TokenCrossEntropy, TokenPerplexity
    from lightning_sp.planner import plan
    from lightning_sp.strategy import SequenceParallelStrategy

# name -> module, imported on first access (PEP 562): these pull in Lightning / torchmetrics
_LAZY = {
    "SequenceParallelMonitor": "lightning_sp.callbacks",
    "SequenceParallelStrategy": "lightning_sp.strategy",
    "TokenAccuracy": "lightning_sp.metrics",
    "TokenCrossEntropy": "lightning_sp.metrics",
    "TokenPerplexity": "lightning_sp.metrics",
    "plan": "lightning_sp.planner",
}


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'lightning_sp' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value  # later lookups skip __getattr__
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_LAZY))


register_when_lightning_loads()

__all__ = [
    "AttentionMask",
    "RelativePositionBias",
    "SequenceLayout",
    "SequenceParallelAttention",
    "SequenceParallelContext",
    "SequenceParallelMonitor",
    "SequenceParallelStrategy",
    "TokenAccuracy",
    "TokenCrossEntropy",
    "TokenPerplexity",
    "gather_sequence",
    "layout_for_backend",
    "plan",
    "sequence_parallel_cross_entropy",
    "sequence_positions",
    "shard_sequence",
]
