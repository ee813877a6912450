"""lightning-sp: exact sequence (context) parallel attention and a Lightning strategy.

Public API (see DESIGN.md): ``SequenceParallelAttention``, ``shard_sequence``, ``gather_sequence``,
``sequence_parallel_cross_entropy``, ``SequenceParallelStrategy``.

Importing the package registers the strategy with Lightning's ``StrategyRegistry`` under
``"sequence_parallel"`` (Lightning's own plugin mechanism; the only import-time effect), so
``Trainer(strategy="sequence_parallel")`` works after ``import lightning_sp``.
"""

from lightning_sp.attention import SequenceParallelAttention, layout_for_backend
from lightning_sp.callbacks import SequenceParallelMonitor
from lightning_sp.context import SequenceParallelContext
from lightning_sp.layout import SequenceLayout, gather_sequence, sequence_positions, shard_sequence
from lightning_sp.loss import sequence_parallel_cross_entropy
from lightning_sp.metrics import TokenAccuracy, TokenCrossEntropy, TokenPerplexity
from lightning_sp.strategy import SequenceParallelStrategy

__all__ = [
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
    "sequence_parallel_cross_entropy",
    "sequence_positions",
    "shard_sequence",
]
