"""The models' single point of contact with the core: attention module, loss, and group accessor."""

from __future__ import annotations

from torch import nn

from lightning_sp.attention import SequenceParallelAttention
from lightning_sp.loss import sequence_parallel_cross_entropy
from lightning_sp.masks import AttentionMask

__all__ = ["AttentionMask", "SequenceParallelAttention", "attention_group", "sequence_parallel_cross_entropy"]


def attention_group(module: nn.Module):
    """Sequence-parallel group of the first ``SequenceParallelAttention`` in ``module``: its own
    ``group=`` if given, else the bound context's; ``None`` when the model runs unsharded (the loss
    is then a plain token mean)."""
    for m in module.modules():
        if isinstance(m, SequenceParallelAttention):
            return m.process_group
    return None
