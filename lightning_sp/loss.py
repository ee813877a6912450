"""Loss over a sequence split across ranks: every token counted once, value identical on every rank.

The cross-entropy is computed in chunks of tokens (Note [Chunked cross-entropy]) so a long context's
``[B*S_local, V]`` logits are never copied whole into float32, neither in forward nor in backward.
"""

from __future__ import annotations

import torch

from lightning_sp.comm.collectives import all_reduce_sum
from lightning_sp.layout import group_size_and_rank
from lightning_sp.ops.merge import accumulation_dtype

# Note [Chunked cross-entropy]
#     F.cross_entropy on bf16 logits [T, V] needs a float32 copy (T*V*4 bytes: 8 GiB for 64K tokens
#     and a 32K vocabulary) and saves the float32 log-softmax for backward. Instead, per chunk of
#     rows: upcast the chunk, take its logsumexp and the target logit, and keep only lse [T]. The
#     backward recomputes softmax per chunk from the saved (input) logits and lse:
#         d loss_t / d logits_t = softmax(logits_t) - onehot(label_t)        (0 for ignored tokens)
#     so the only [T, V] tensor it creates is the gradient itself, in the logits' dtype.
_CHUNK_ELEMENTS = 1 << 24  # upcast at most 16M logits at a time (64 MiB in float32)


class _ChunkedCrossEntropySum(torch.autograd.Function):
    """Sum of token cross-entropies over non-ignored tokens. ``logits [T, V]``, ``labels [T]``."""

    @staticmethod
    def forward(ctx, logits, labels, ignore_index: int, chunk_rows: int):
        acc = accumulation_dtype(logits.dtype)
        valid = labels != ignore_index  # [T]
        safe_labels = labels.masked_fill(~valid, 0)
        lse = torch.empty(logits.size(0), dtype=acc, device=logits.device)  # [T]
        total = torch.zeros((), dtype=acc, device=logits.device)
        for start in range(0, logits.size(0), chunk_rows):
            rows = slice(start, start + chunk_rows)
            chunk = logits[rows].to(acc)  # [c, V]: the only upcast copy, one chunk at a time
            lse[rows] = torch.logsumexp(chunk, dim=-1)
            target = chunk.gather(1, safe_labels[rows, None]).squeeze(1)  # [c]
            total += ((lse[rows] - target) * valid[rows]).sum()
        ctx.save_for_backward(logits, safe_labels, valid, lse)
        ctx.chunk_rows = chunk_rows
        return total

    @staticmethod
    def backward(ctx, grad_total):
        logits, safe_labels, valid, lse = ctx.saved_tensors
        grad = torch.empty_like(logits)  # [T, V] in the logits' dtype
        scale = grad_total.to(lse.dtype)
        for start in range(0, logits.size(0), ctx.chunk_rows):
            rows = slice(start, start + ctx.chunk_rows)
            probs = torch.exp(logits[rows].to(lse.dtype) - lse[rows, None])  # [c, V] softmax
            probs.scatter_add_(1, safe_labels[rows, None], torch.full_like(probs[:, :1], -1.0))
            probs.mul_((valid[rows, None] * scale).to(probs.dtype))
            grad[rows] = probs
        return grad, None, None, None


def cross_entropy_sum(logits: torch.Tensor, labels: torch.Tensor, *, ignore_index: int = -100,
                      chunk_elements: int = _CHUNK_ELEMENTS) -> torch.Tensor:
    """Summed token cross-entropy of ``logits [..., V]`` against ``labels [...]`` (ignored tokens add 0),
    in the accumulation dtype, computed in chunks of at most ``chunk_elements`` upcast logits."""
    logits2d = logits.reshape(-1, logits.size(-1))
    chunk_rows = max(1, chunk_elements // max(1, logits2d.size(1)))
    return _ChunkedCrossEntropySum.apply(logits2d, labels.reshape(-1), ignore_index, chunk_rows)


def sequence_parallel_cross_entropy(
    logits: torch.Tensor, labels: torch.Tensor, *, ignore_index: int = -100, group=None
) -> torch.Tensor:
    """Mean cross-entropy over all non-ignored tokens of the global (unsharded) sequence batch.

    ``logits [B, S_local, V]``, ``labels [B, S_local]``. The returned value is the same on every
    rank of ``group``; its backward sums over the group (the backward of an all-reduce), so that
    averaging gradients over all data x sequence ranks (DDP) gives the non-parallel gradient.
    Computed in chunks (Note [Chunked cross-entropy]); the result is float32 (float64 for float64
    logits). For causal LMs, shift the labels on the *global* sequence, before sharding.
    """
    if logits.shape[:-1] != labels.shape:
        raise ValueError(f"logits {tuple(logits.shape)} and labels {tuple(labels.shape)} disagree on [B, S_local]")
    token_loss = cross_entropy_sum(logits, labels, ignore_index=ignore_index)
    count = (labels != ignore_index).sum().to(token_loss.dtype)
    world, _ = group_size_and_rank(group)
    if world > 1:
        # [loss_sum, count] summed over the group in one collective
        totals = all_reduce_sum(torch.stack([token_loss, count]), group)
        token_loss, count = totals[0], totals[1].detach()
    return token_loss / count.clamp_min(1)
