"""ESM-2-style protein encoder: bidirectional attention, rotary positions, masked-residue objective."""

from __future__ import annotations

import torch
from typing_extensions import override

from lightning_sp.models.base import TransformerLM


class ProteinEncoder(TransformerLM):
    """Masked-residue language model over packed protein contexts.

    Batch: ``input_ids, labels, position_ids [B, S]`` (``S`` local under the strategy) and optional
    ``cu_seqlens [n_docs + 1]`` (global). ``labels`` is ``-100`` except at masked residues.
    """

    causal = False
    default_vocab_size = 31

    def _loss(self, batch: dict[str, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
        logits = self(batch["input_ids"], batch.get("position_ids"), batch.get("cu_seqlens"))  # [B, S, V]
        loss = self.net.cross_entropy(logits, batch["labels"])
        return loss, logits

    @override
    def training_step(self, batch: dict[str, torch.Tensor], batch_idx: int) -> torch.Tensor:
        loss, _ = self._loss(batch)
        self.log("Loss/train", loss, prog_bar=True, on_step=True, batch_size=1)
        self.log("perplexity/train", loss.detach().exp(), on_step=True, batch_size=1)
        return loss

    @override
    def validation_step(self, batch: dict[str, torch.Tensor], batch_idx: int) -> None:
        loss, _ = self._loss(batch)
        self.log("Loss/val", loss, prog_bar=True, sync_dist=True, batch_size=1)
