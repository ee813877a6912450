"""ESM-2-style protein encoder: bidirectional attention, rotary positions, masked-residue objective."""

from __future__ import annotations

import lightning as L
import torch
from typing_extensions import override

from lightning_sp.models._attention import sequence_parallel_cross_entropy
from lightning_sp.models.layers import Transformer, TransformerConfig


class ProteinEncoder(L.LightningModule):
    """Masked-residue language model over packed protein contexts.

    Batch: ``input_ids, labels, position_ids [B, S]`` (``S`` local under the strategy) and optional
    ``cu_seqlens [n_docs + 1]`` (global). ``labels`` is ``-100`` except at masked residues.
    """

    def __init__(
        self,
        *,
        vocab_size: int = 31,
        d_model: int = 128,
        n_layers: int = 4,
        n_heads: int = 4,
        n_kv_heads: int | None = None,
        mlp_ratio: float = 4.0,
        attention_backend: str | None = None,
        lr: float = 1e-3,
        weight_decay: float = 0.01,
        warmup_steps: int = 10,
    ) -> None:
        super().__init__()
        self.save_hyperparameters()
        if lr <= 0 or warmup_steps < 0 or weight_decay < 0:
            raise ValueError(f"need lr > 0, warmup_steps >= 0, weight_decay >= 0; got {lr}, {warmup_steps}, {weight_decay}")
        self.config = TransformerConfig(
            vocab_size=vocab_size, d_model=d_model, n_layers=n_layers, n_heads=n_heads, n_kv_heads=n_kv_heads,
            mlp_ratio=mlp_ratio, causal=False, attention_backend=attention_backend,
        )
        self.net = Transformer(self.config)

    @override
    def forward(self, input_ids, position_ids=None, cu_seqlens=None) -> torch.Tensor:
        return self.net(input_ids, position_ids, cu_seqlens)  # [B, S, V]

    def _loss(self, batch: dict[str, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
        logits = self(batch["input_ids"], batch.get("position_ids"), batch.get("cu_seqlens"))  # [B, S, V]
        loss = sequence_parallel_cross_entropy(logits, batch["labels"], group=self.net.sequence_parallel_group())
        return loss, logits

    @override
    def training_step(self, batch: dict[str, torch.Tensor], batch_idx: int) -> torch.Tensor:
        loss, _ = self._loss(batch)
        self.log("train/loss", loss, prog_bar=True, on_step=True, batch_size=1)
        self.log("train/perplexity", loss.detach().exp(), on_step=True, batch_size=1)
        return loss

    @override
    def validation_step(self, batch: dict[str, torch.Tensor], batch_idx: int) -> None:
        loss, _ = self._loss(batch)
        self.log("val/loss", loss, prog_bar=True, sync_dist=True, batch_size=1)

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
