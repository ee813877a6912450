"""Causal decoder over interleaved image-patch tokens and text tokens."""

from __future__ import annotations

import lightning as L
import torch
from typing_extensions import override

from lightning_sp.models._attention import sequence_parallel_cross_entropy
from lightning_sp.models.layers import Transformer, TransformerConfig
from lightning_sp.models.protein import make_optimizer


class MultimodalDecoder(L.LightningModule):
    """Next-token decoder; labels come pre-shifted from the data (``labels[t]`` = target after token ``t``).

    Batch: ``input_ids, labels, position_ids [B, S]``; optional ``answer_mask [B, S]`` (bool) marks the
    long-range answer target, whose accuracy is logged as ``*/answer_acc``.
    """

    def __init__(
        self,
        *,
        vocab_size: int = 279,
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
            mlp_ratio=mlp_ratio, causal=True, attention_backend=attention_backend,
        )
        self.net = Transformer(self.config)

    @override
    def forward(self, input_ids, position_ids=None, cu_seqlens=None) -> torch.Tensor:
        return self.net(input_ids, position_ids, cu_seqlens)  # [B, S, V]

    def _step(self, batch: dict[str, torch.Tensor], stage: str) -> torch.Tensor:
        logits = self(batch["input_ids"], batch.get("position_ids"), batch.get("cu_seqlens"))  # [B, S, V]
        group = self.net.sequence_parallel_group()
        loss = sequence_parallel_cross_entropy(logits, batch["labels"], group=group)
        bsz = batch["input_ids"].shape[0]
        self.log(f"{stage}/loss", loss, prog_bar=True, on_step=stage == "train", on_epoch=stage != "train", sync_dist=stage != "train", batch_size=bsz)
        if "answer_mask" in batch:
            m = batch["answer_mask"].bool()  # [B, S]: exactly one position per sample, on one rank
            correct = (logits.argmax(-1) == batch["labels"]) & m
            stats = torch.stack([correct.sum(), m.sum()]).float()
            if group is not None:
                torch.distributed.all_reduce(stats, group=group)
            if stats[1] > 0:
                self.log(f"{stage}/answer_acc", stats[0] / stats[1], prog_bar=stage == "val", on_step=stage == "train",
                         on_epoch=stage != "train", sync_dist=stage != "train", batch_size=bsz)
        return loss

    @override
    def training_step(self, batch: dict[str, torch.Tensor], batch_idx: int) -> torch.Tensor:
        return self._step(batch, "train")

    @override
    def validation_step(self, batch: dict[str, torch.Tensor], batch_idx: int) -> None:
        self._step(batch, "val")

    @override
    def configure_optimizers(self):
        return make_optimizer(self, self.hparams.lr, self.hparams.weight_decay, self.hparams.warmup_steps)
