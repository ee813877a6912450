"""Token-level torchmetrics that count every token once across the sequence- and data-parallel axes.

Each rank updates with its *local* shard (``logits [B, S_local, V]``, ``labels [B, S_local]``) and
keeps sums, not means. The ranks of an sp group hold disjoint token shards and the dp replicas
disjoint samples, so summing the states over the whole world (torchmetrics' default
``process_group``) counts every token of the global batch exactly once, whatever the degrees.
Padding added by the strategy carries ``ignore_index`` and is never counted.

Do not feed these metrics the already-reduced output of ``sequence_parallel_cross_entropy``: that
value is the same on all sp ranks and would be counted ``sp`` times.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torchmetrics import Metric

__all__ = ["TokenCrossEntropy", "TokenPerplexity", "TokenAccuracy"]


class _TokenMetric(Metric):
    is_differentiable = False
    full_state_update = False

    def __init__(self, *, ignore_index: int = -100, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.ignore_index = ignore_index
        self.add_state("total", default=torch.tensor(0.0, dtype=torch.float64), dist_reduce_fx="sum")
        self.add_state("count", default=torch.tensor(0, dtype=torch.long), dist_reduce_fx="sum")

    def _valid(self, logits: torch.Tensor, labels: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        # [B, S_local, V], [B, S_local] -> [T, V], [T] (non-ignored tokens only)
        if logits.shape[:-1] != labels.shape:
            raise ValueError(f"logits {tuple(logits.shape)} must be labels {tuple(labels.shape)} + [vocab]")
        logits, labels = logits.reshape(-1, logits.size(-1)), labels.reshape(-1)
        keep = labels != self.ignore_index
        return logits[keep], labels[keep]


class TokenCrossEntropy(_TokenMetric):
    """Mean cross-entropy (nats) over all non-ignored tokens of everything seen, on every rank."""

    higher_is_better = False

    def update(self, logits: torch.Tensor, labels: torch.Tensor) -> None:
        logits, labels = self._valid(logits.detach(), labels)
        nll = F.cross_entropy(logits.float() if logits.dtype in (torch.float16, torch.bfloat16) else logits,
                              labels, reduction="sum")
        self.total += nll.to(torch.float64)
        self.count += labels.numel()

    def compute(self) -> torch.Tensor:
        return self.total / self.count.clamp(min=1)


class TokenPerplexity(TokenCrossEntropy):
    """``exp`` of the token-mean cross-entropy over all non-ignored tokens."""

    def compute(self) -> torch.Tensor:
        return torch.exp(super().compute())


class TokenAccuracy(_TokenMetric):
    """Fraction of non-ignored tokens whose arg-max logit is the label."""

    higher_is_better = True

    def update(self, logits: torch.Tensor, labels: torch.Tensor) -> None:
        logits, labels = self._valid(logits.detach(), labels)
        self.total += (logits.argmax(-1) == labels).sum().to(torch.float64)
        self.count += labels.numel()

    def compute(self) -> torch.Tensor:
        return self.total / self.count.clamp(min=1)
