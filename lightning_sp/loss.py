"""Loss over a sequence split across ranks: every token counted once, value identical on every rank.

The cross-entropy is computed in chunks of tokens (Note [Chunked cross-entropy]) so a long context's
``[B*S_local, V]`` logits are never copied whole into float32, neither in forward nor in backward; given the
hidden states and the output projection instead, the logits themselves are never held whole (Note [Tiled
logits and cross-entropy]).
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


# Note [Tiled logits and cross-entropy]
#     At long contexts and large vocabularies the logits are often the largest activation: a rank holds
#     [T, V] = [S/P, V] of them (64K tokens / 8 ranks x 128K vocabulary = 2 GiB in bf16), and the loss's
#     backward makes a second [T, V] tensor, its gradient. Given the hidden states h [T, C] and the output
#     projection W [V, C] (+ b [V]) instead, each tile of rows computes its logits z = h W^T + b, keeps only
#     lse [T], and drops z; the backward recomputes z per tile and turns the softmax gradient
#     g = softmax(z) - onehot(label) (0 for ignored tokens) into
#         dh = g W,    dW += g^T h,    db += sum_rows g
#     so no tensor of T x V elements ever exists, in forward or backward (the idea of DeepSpeed ALST's tiled
#     loss and of fused linear cross-entropy kernels). dW and db accumulate in the accumulation dtype.


class _TiledLinearCrossEntropySum(torch.autograd.Function):
    """Sum of token cross-entropies of ``h W^T + b`` over non-ignored tokens, one tile of rows at a time.
    ``hidden [T, C]``, ``weight [V, C]``, ``bias [V] | None``, ``labels [T]``."""

    @staticmethod
    def forward(ctx, hidden, weight, bias, labels, ignore_index: int, tile_rows: int):
        acc = accumulation_dtype(hidden.dtype)
        valid = labels != ignore_index  # [T]
        safe_labels = labels.masked_fill(~valid, 0)
        lse = torch.empty(hidden.size(0), dtype=acc, device=hidden.device)  # [T]
        total = torch.zeros((), dtype=acc, device=hidden.device)
        for start in range(0, hidden.size(0), tile_rows):
            rows = slice(start, start + tile_rows)
            logits = torch.nn.functional.linear(hidden[rows], weight, bias).to(acc)  # [t, V]: one tile only
            lse[rows] = torch.logsumexp(logits, dim=-1)
            target = logits.gather(1, safe_labels[rows, None]).squeeze(1)  # [t]
            total += ((lse[rows] - target) * valid[rows]).sum()
        ctx.save_for_backward(hidden, weight, bias, safe_labels, valid, lse)
        ctx.tile_rows = tile_rows
        return total

    @staticmethod
    def backward(ctx, grad_total):
        hidden, weight, bias, safe_labels, valid, lse = ctx.saved_tensors
        acc = lse.dtype
        scale = grad_total.to(acc)
        grad_hidden = torch.empty_like(hidden)  # [T, C]
        grad_weight = torch.zeros(weight.shape, dtype=acc, device=weight.device)  # [V, C]
        grad_bias = None if bias is None else torch.zeros(bias.shape, dtype=acc, device=bias.device)  # [V]
        for start in range(0, hidden.size(0), ctx.tile_rows):
            rows = slice(start, start + ctx.tile_rows)
            logits = torch.nn.functional.linear(hidden[rows], weight, bias).to(acc)  # [t, V], recomputed
            grad = torch.exp(logits - lse[rows, None])  # softmax
            grad.scatter_add_(1, safe_labels[rows, None], torch.full_like(grad[:, :1], -1.0))
            grad.mul_((valid[rows, None] * scale).to(acc))  # [t, V] d loss / d logits
            grad_low = grad.to(hidden.dtype)  # as F.linear's own backward multiplies, in the inputs' dtype
            grad_hidden[rows] = grad_low @ weight  # [t, V] @ [V, C]
            grad_weight += grad_low.T @ hidden[rows]  # [V, t] @ [t, C], summed over tiles in acc
            if grad_bias is not None:
                grad_bias += grad.sum(0)
        grad_bias = None if grad_bias is None else grad_bias.to(bias.dtype)
        return grad_hidden, grad_weight.to(weight.dtype), grad_bias, None, None, None


def linear_cross_entropy_sum(hidden: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor, *,
                             bias: torch.Tensor | None = None, ignore_index: int = -100,
                             chunk_elements: int = _CHUNK_ELEMENTS) -> torch.Tensor:
    """Summed token cross-entropy of the logits ``hidden [..., C] @ weight[V, C]^T (+ bias [V])`` against
    ``labels [...]``, in the accumulation dtype, without ever holding the logits whole (Note [Tiled logits
    and cross-entropy]): at most ``chunk_elements`` logits exist at a time."""
    if hidden.shape[:-1] != labels.shape:
        raise ValueError(f"hidden states {tuple(hidden.shape)} and labels {tuple(labels.shape)} disagree on the "
                         "leading dims: pass hidden [B, S_local, C] and labels [B, S_local]")
    if weight.dim() != 2 or weight.size(1) != hidden.size(-1):
        raise ValueError(f"weight {tuple(weight.shape)} must be the output projection [V, C] with C = "
                         f"{hidden.size(-1)} (the hidden size), as nn.Linear(C, V).weight is")
    if bias is not None and tuple(bias.shape) != (weight.size(0),):
        raise ValueError(f"bias {tuple(bias.shape)} must be [V] = [{weight.size(0)}]")
    hidden2d = hidden.reshape(-1, hidden.size(-1))
    tile_rows = max(1, chunk_elements // max(1, weight.size(0)))
    return _TiledLinearCrossEntropySum.apply(hidden2d, weight, bias, labels.reshape(-1), ignore_index, tile_rows)


def sequence_parallel_cross_entropy(
    logits: torch.Tensor, labels: torch.Tensor, *, ignore_index: int = -100, group=None,
    weight: torch.Tensor | None = None, bias: torch.Tensor | None = None,
) -> torch.Tensor:
    """Mean cross-entropy over all non-ignored tokens of the global (unsharded) sequence batch.

    ``logits [B, S_local, V]``, ``labels [B, S_local]``. The returned value is the same on every
    rank of ``group``; its backward sums over the group (the backward of an all-reduce), so that
    averaging gradients over all data x sequence ranks (DDP) gives the non-parallel gradient.
    Computed in chunks (Note [Chunked cross-entropy]); the result is float32 (float64 for float64
    logits). For causal LMs, shift the labels on the *global* sequence, before sharding.

    Tiled logits: pass the output projection as ``weight [V, C]`` (and ``bias [V]``, if any) and the
    hidden states ``[B, S_local, C]`` as the first argument: the logits are then computed and dropped
    one tile of tokens at a time in forward and backward, never held whole (Note [Tiled logits and
    cross-entropy]); same value and gradients as ``F.linear`` followed by this loss.
    """
    if weight is not None:
        token_loss = linear_cross_entropy_sum(logits, weight, labels, bias=bias, ignore_index=ignore_index)
    elif bias is not None:
        raise ValueError("bias without weight: pass the output projection as weight=[V, C] to tile the logits, "
                         "or add the bias to the logits yourself")
    elif logits.shape[:-1] != labels.shape:
        raise ValueError(f"logits {tuple(logits.shape)} and labels {tuple(labels.shape)} disagree on [B, S_local]")
    else:
        token_loss = cross_entropy_sum(logits, labels, ignore_index=ignore_index)
    count = (labels != ignore_index).sum().to(token_loss.dtype)
    world, _ = group_size_and_rank(group)
    if world > 1:
        # [loss_sum, count] summed over the group in one collective
        totals = all_reduce_sum(torch.stack([token_loss, count]), group)
        token_loss, count = totals[0], totals[1].detach()
    return token_loss / count.clamp_min(1)
