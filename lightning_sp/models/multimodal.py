"""Causal decoder over interleaved image-patch tokens and text tokens."""

from __future__ import annotations

import torch
from typing_extensions import override

from lightning_sp.models.base import TransformerLM


class MultimodalDecoder(TransformerLM):
    """Next-token decoder; labels come pre-shifted from the data (``labels[t]`` = target after token ``t``).

    Batch: ``input_ids, labels, position_ids [B, S]``; optional ``answer_mask [B, S]`` (bool) marks the
    long-range answer target, whose accuracy is logged as ``answer_acc/{train,val}``.
    """

    causal = True
    default_vocab_size = 279

    def _step(self, batch: dict[str, torch.Tensor], stage: str) -> torch.Tensor:
        logits = self(batch["input_ids"], batch.get("position_ids"), batch.get("cu_seqlens"))  # [B, S, V]
        group = self.net.sequence_parallel_group()
        loss = self.net.cross_entropy(logits, batch["labels"])
        bsz = batch["input_ids"].shape[0]
        self.log(f"Loss/{stage}", loss, prog_bar=True, on_step=stage == "train", on_epoch=stage != "train", sync_dist=stage != "train", batch_size=bsz)
        if "answer_mask" in batch:
            m = batch["answer_mask"].bool()  # [B, S]: exactly one position per sample, on one rank
            correct = (self.net.argmax(logits) == batch["labels"]) & m
            stats = torch.stack([correct.sum(), m.sum()]).float()
            if group is not None:
                torch.distributed.all_reduce(stats, group=group)
            if stats[1] > 0:
                self.log(f"answer_acc/{stage}", stats[0] / stats[1], prog_bar=stage == "val", on_step=stage == "train",
                         on_epoch=stage != "train", sync_dist=stage != "train", batch_size=bsz)
        return loss

    @override
    def training_step(self, batch: dict[str, torch.Tensor], batch_idx: int) -> torch.Tensor:
        return self._step(batch, "train")

    @override
    def validation_step(self, batch: dict[str, torch.Tensor], batch_idx: int) -> None:
        self._step(batch, "val")
