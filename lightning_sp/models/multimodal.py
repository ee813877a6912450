"""Causal decoder over interleaved image-patch tokens and text tokens.

Note [Images inside a causal stream]
    A vision-language decoder reads text left to right, but an image is not a sentence: PaliGemma and Gemma 3
    let every token of an image see the whole image (the image tokens form one bidirectional block) while text
    stays causal. ``image_attention="bidirectional"`` does that here with ``AttentionMask(bidirectional_spans=)``:
    each image's patch tokens ``[start, end)`` see each other, every other pair keeps the causal rule. The spans
    are *global* positions taken from the sample's structure before sharding (the data's ``image_spans``, passed
    whole by the strategy), so they are the same on every rank and the mask means the same whatever the layout;
    the attention then computes only the blocks the mask leaves visible. A position inside a span must not be
    supervised with a token of the same span (it would see its own target): every step checks this, agreed across
    the sequence-parallel group, and raises on every rank if a label leaks.
"""

from __future__ import annotations

import torch
from typing_extensions import override

from lightning_sp.masks import span_index
from lightning_sp.models._attention import AttentionMask
from lightning_sp.models.base import TransformerLM

IMAGE_ATTENTION = ("bidirectional", "causal")
IGNORE_INDEX = -100


class MultimodalDecoder(TransformerLM):
    """Next-token decoder; labels come pre-shifted from the data (``labels[t]`` = target after token ``t``).

    Batch: ``input_ids, labels, position_ids [B, S]``; optional ``answer_mask [B, S]`` (bool) marks the
    long-range answer target, whose accuracy is logged as ``answer_acc/{train,val}``; ``image_spans [B, n, 2]``
    (global ``[start, end)`` of each image's patch tokens, the same for every row) when ``image_attention`` is
    ``"bidirectional"``.

    ``image_attention``: ``"bidirectional"`` (as PaliGemma and Gemma 3; the multimodal demo's config) makes each
    image's patches one bidirectional span inside the causal stream (Note [Images inside a causal stream]);
    ``"causal"`` (default, so a batch without ``image_spans`` still trains) reads them left to right like text.
    Every other argument is ``TransformerLM``'s.
    """

    causal = True
    default_vocab_size = 279

    def __init__(self, *, image_attention: str = "causal", **kwargs) -> None:
        if image_attention not in IMAGE_ATTENTION:
            raise ValueError(f"image_attention must be one of {IMAGE_ATTENTION}, got {image_attention!r}")
        super().__init__(**kwargs)
        self.image_attention = image_attention

    def image_mask(self, image_spans: torch.Tensor | None) -> AttentionMask | None:
        """The batch's ``AttentionMask`` (``None``: plain causal): ``image_spans [B, n, 2]`` or ``[n, 2]`` ->
        one bidirectional span per image, on global positions."""
        if self.image_attention == "causal" or image_spans is None:
            return None
        spans = torch.as_tensor(image_spans)
        if spans.dim() == 3:  # [B, n, 2]: one mask serves every row, so the rows must agree
            if spans.size(0) > 1 and not bool((spans == spans[:1]).all()):
                raise ValueError(
                    "image_spans differ between the samples of this batch, but one AttentionMask serves every row: "
                    "put the images at the same positions in every sample of a batch, use batch_size=1, or "
                    "image_attention='causal'"
                )
            spans = spans[0]
        if spans.dim() != 2 or spans.size(-1) != 2:
            raise ValueError(f"image_spans must be [B, n, 2] or [n, 2] ([start, end) per image), got shape {tuple(spans.shape)}")
        if spans.numel() == 0:
            return None
        return AttentionMask(bidirectional_spans=tuple(map(tuple, spans.tolist())))

    @override
    def forward(self, input_ids, position_ids=None, cu_seqlens=None, image_spans=None) -> torch.Tensor:
        """``[B, S]`` ids -> ``[B, S, V]`` logits; without ``image_spans`` every token is causal."""
        return self.net(input_ids, position_ids, cu_seqlens, mask=self.image_mask(image_spans))

    def _step(self, batch: dict[str, torch.Tensor], stage: str) -> torch.Tensor:
        if self.image_attention == "bidirectional" and "image_spans" not in batch:
            raise ValueError(
                "image_attention='bidirectional' needs the batch's image_spans ([B, n, 2] global [start, end) of each "
                "image's patch tokens, as DigitSequenceDataset yields them); pass them or set image_attention='causal'"
            )
        mask = self.image_mask(batch.get("image_spans"))
        logits = self.net(batch["input_ids"], batch.get("position_ids"), batch.get("cu_seqlens"), mask=mask)  # [B, S, V]
        group = self.net.sequence_parallel_group()
        loss = self.net.cross_entropy(logits, batch["labels"])
        bsz = batch["input_ids"].shape[0]
        self.log(f"Loss/{stage}", loss, prog_bar=True, on_step=stage == "train", on_epoch=stage != "train", sync_dist=stage != "train", batch_size=bsz)
        answers = "answer_mask" in batch
        if not answers and mask is None:
            return loss
        stats = torch.zeros(3, device=logits.device)  # correct answers, answers, labels that see their own token
        if answers:
            m = batch["answer_mask"].bool()  # [B, S]: exactly one position per sample, on one rank
            correct = (self.net.argmax(logits) == batch["labels"]) & m
            stats[0], stats[1] = correct.sum(), m.sum()
        if mask is not None:
            stats[2] = _labels_inside_spans(batch, mask.bidirectional_spans)
        if group is not None:  # every rank raises or none does
            torch.distributed.all_reduce(stats, group=group)
        if stats[2] > 0:
            raise ValueError(
                f"{int(stats[2])} supervised positions lie inside a bidirectional image span with their target "
                "token: they would see the token they are asked to predict. Supervise only positions whose next "
                "token is outside the span (as DigitSequenceDataset does), or set image_attention='causal'"
            )
        if answers and stats[1] > 0:
            self.log(f"answer_acc/{stage}", stats[0] / stats[1], prog_bar=stage == "val", on_step=stage == "train",
                     on_epoch=stage != "train", sync_dist=stage != "train", batch_size=bsz)
        return loss

    @override
    def training_step(self, batch: dict[str, torch.Tensor], batch_idx: int) -> torch.Tensor:
        return self._step(batch, "train")

    @override
    def validation_step(self, batch: dict[str, torch.Tensor], batch_idx: int) -> None:
        self._step(batch, "val")


def _labels_inside_spans(batch: dict[str, torch.Tensor], spans: tuple[tuple[int, int], ...]) -> torch.Tensor:
    """How many of this shard's supervised positions ``t`` have ``t`` and their target ``t + 1`` in one span
    (``start <= t < end - 1``). Global positions: the batch's ``position_ids`` (this model packs no documents,
    so they are the positions in the sequence), else ``arange(S)`` unsharded."""
    labels = batch["labels"]  # [B, S]
    pos = batch.get("position_ids")
    if pos is None:
        pos = torch.arange(labels.size(1), device=labels.device).expand_as(labels)
    here = span_index(pos, spans)  # [B, S]
    inside = (here >= 0) & (here == span_index(pos + 1, spans))  # t and t + 1 in one span
    return (inside & (labels != IGNORE_INDEX)).sum()
