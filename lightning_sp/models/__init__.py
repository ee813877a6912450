"""Demo models built on ``SequenceParallelAttention``: they run unchanged with or without the strategy."""

from lightning_sp.models.layers import Transformer, TransformerConfig, rotary
from lightning_sp.models.multimodal import MultimodalDecoder
from lightning_sp.models.protein import ProteinEncoder

__all__ = ["MultimodalDecoder", "ProteinEncoder", "Transformer", "TransformerConfig", "rotary"]
