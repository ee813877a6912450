"""Loss over a sequence split across ranks: every token counted once, value identical on every rank."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from lightning_sp.comm.collectives import all_reduce_sum
from lightning_sp.layout import group_size_and_rank


def sequence_parallel_cross_entropy(
    logits: torch.Tensor, labels: torch.Tensor, *, ignore_index: int = -100, group=None
) -> torch.Tensor:
    """Mean cross-entropy over all non-ignored tokens of the global (unsharded) sequence batch.

    ``logits [B, S_local, V]``, ``labels [B, S_local]``. The returned value is the same on every
    rank of ``group``; its backward sums over the group (the backward of an all-reduce), so that
    averaging gradients over all data x sequence ranks (DDP) gives the non-parallel gradient.
    """
    if logits.shape[:-1] != labels.shape:
        raise ValueError(f"logits {tuple(logits.shape)} and labels {tuple(labels.shape)} disagree on [B, S_local]")
    token_loss = F.cross_entropy(
        logits.reshape(-1, logits.size(-1)).float() if logits.dtype in (torch.float16, torch.bfloat16) else logits.reshape(-1, logits.size(-1)),
        labels.reshape(-1), ignore_index=ignore_index, reduction="sum",
    )
    count = (labels != ignore_index).sum().to(token_loss.dtype)
    world, _ = group_size_and_rank(group)
    if world > 1:
        # [loss_sum, count] summed over the group in one collective
        totals = all_reduce_sum(torch.stack([token_loss, count]), group)
        token_loss, count = totals[0], totals[1].detach()
    return token_loss / count.clamp_min(1)
