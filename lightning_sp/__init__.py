"""lightning-sp: exact sequence (context) parallel attention and a Lightning strategy.

Public API (see DESIGN.md): ``SequenceParallelAttention``, ``shard_sequence``, ``gather_sequence``,
``sequence_parallel_cross_entropy``, ``SequenceParallelStrategy``.
"""

from lightning_sp.attention import SequenceParallelAttention, layout_for_backend
from lightning_sp.context import SequenceParallelContext
from lightning_sp.layout import SequenceLayout, gather_sequence, sequence_positions, shard_sequence
from lightning_sp.loss import sequence_parallel_cross_entropy

__all__ = [
    "SequenceParallelAttention",
    "SequenceParallelContext",
    "SequenceLayout",
    "SequenceParallelStrategy",
    "gather_sequence",
    "layout_for_backend",
    "sequence_parallel_cross_entropy",
    "sequence_positions",
    "shard_sequence",
]


def __getattr__(name):
    # The strategy imports Lightning; keep `import lightning_sp` light for kernel-only users.
    if name == "SequenceParallelStrategy":
        from lightning_sp.strategy import SequenceParallelStrategy

        return SequenceParallelStrategy
    raise AttributeError(f"module 'lightning_sp' has no attribute {name!r}")
