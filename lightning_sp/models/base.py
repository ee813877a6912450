"""What the demo models share: a ``Transformer`` on ``SequenceParallelAttention``, its config and
the optimizer. Subclasses set ``causal`` and ``default_vocab_size`` and define their steps."""

from __future__ import annotations

from typing import ClassVar

import lightning as L
import torch
from typing_extensions import override

from lightning_sp.models.layers import Transformer, TransformerConfig


class TransformerLM(L.LightningModule):
    causal: ClassVar[bool]
    default_vocab_size: ClassVar[int]

    def __init__(
        self,
        *,
        vocab_size: int | None = None,
        d_model: int = 128,
        n_layers: int = 4,
        n_heads: int = 4,
        n_kv_heads: int | None = None,
        mlp_ratio: float = 4.0,
        attention_backend: str | None = None,
        lr: float = 1e-3,
        weight_decay: float = 0.01,
        warmup_steps: int = 10,
        mlp_chunk_size: int | None = None,
        dense_attention: bool = False,
        activation_checkpointing: bool = False,
    ) -> None:
        """``vocab_size=None``: the subclass's ``default_vocab_size`` (the CLI links it from the data)."""
        super().__init__()
        self.save_hyperparameters()
        if lr <= 0 or warmup_steps < 0 or weight_decay < 0:
            raise ValueError(f"need lr > 0, warmup_steps >= 0, weight_decay >= 0; got {lr}, {warmup_steps}, {weight_decay}")
        self.config = TransformerConfig(
            vocab_size=vocab_size or self.default_vocab_size, d_model=d_model, n_layers=n_layers, n_heads=n_heads,
            n_kv_heads=n_kv_heads, mlp_ratio=mlp_ratio, causal=self.causal, attention_backend=attention_backend,
            mlp_chunk_size=mlp_chunk_size, dense_attention=dense_attention,
            activation_checkpointing=activation_checkpointing,
        )
        self.net = Transformer(self.config)

    @override
    def forward(self, input_ids, position_ids=None, cu_seqlens=None) -> torch.Tensor:
        return self.net(input_ids, position_ids, cu_seqlens)  # [B, S, V]

    @override
    def configure_optimizers(self):
        return make_optimizer(self, self.hparams.lr, self.hparams.weight_decay, self.hparams.warmup_steps)


def make_optimizer(module: L.LightningModule, lr: float, weight_decay: float, warmup_steps: int):
    """AdamW (no decay on norms/biases) with linear warmup, then constant."""
    decay = [p for n, p in module.named_parameters() if p.dim() >= 2]
    no_decay = [p for n, p in module.named_parameters() if p.dim() < 2]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": weight_decay}, {"params": no_decay, "weight_decay": 0.0}], lr=lr)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda step: min(1.0, (step + 1) / max(1, warmup_steps)))
    return {"optimizer": opt, "lr_scheduler": {"scheduler": sched, "interval": "step"}}
