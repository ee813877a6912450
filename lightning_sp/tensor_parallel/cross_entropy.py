"""Cross-entropy and argmax over logits whose vocabulary is split across the tensor-parallel group.

Note [Vocabulary-parallel cross-entropy]
    Rank ``r`` holds ``logits[..., V_r]`` for its vocabulary range ``[start_r, stop_r)``. The loss of a
    token is ``log sum_v exp(z_v) - z_label``; three all-reduces of ``[B, S]`` scalars give it without
    gathering ``[B, S, V]`` (Megatron's ``_VocabParallelCrossEntropy``)::

        m      = max_r max_v z_v               (all-reduce MAX; a constant shift, no gradient)
        sumexp = sum_r sum_v exp(z_v - m)      (all-reduce SUM)
        target = sum_r [label in r] z_label-m  (all-reduce SUM; one rank holds the label)
        loss   = log(sumexp) - target

    Every rank of the group holds the same loss, so the backward is local:
    ``dz = (softmax_r - onehot_r) * dloss`` on each rank's slice (no collective).
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from lightning_sp.comm.collectives import all_gather_raw, all_reduce_sum
from lightning_sp.comm.tensor_parallel import all_reduce_raw
from lightning_sp.layout import group_size_and_rank
from lightning_sp.tensor_parallel.context import TensorParallelContext


class _VocabParallelCE(torch.autograd.Function):
    @staticmethod
    def forward(ctx, logits, labels, vocab_start, ignore_index, group, stats):
        # logits [B, S, V_r], labels [B, S] -> per-token loss [B, S] (0 where ignored)
        m = logits.detach().amax(-1) if logits.size(-1) else logits.new_full(labels.shape, -torch.inf)
        m = all_reduce_raw(m, group, stats, "all_reduce", reduce_op=dist.ReduceOp.MAX)  # [B, S]
        shifted = logits - m.unsqueeze(-1)  # [B, S, V_r]
        exp = shifted.exp()
        sumexp = all_reduce_raw(exp.sum(-1), group, stats, "all_reduce")  # [B, S]
        local = labels - vocab_start
        mine = (labels != ignore_index) & (local >= 0) & (local < logits.size(-1))  # [B, S]
        idx = local.masked_fill(~mine, 0).unsqueeze(-1)
        picked = shifted.gather(-1, idx).squeeze(-1) if logits.size(-1) else torch.zeros_like(m)
        target = all_reduce_raw(picked * mine, group, stats, "all_reduce")  # [B, S]
        valid = labels != ignore_index
        loss = (sumexp.log() - target) * valid
        ctx.save_for_backward(exp / sumexp.unsqueeze(-1), idx, mine, valid)
        return loss

    @staticmethod
    def backward(ctx, grad):  # grad [B, S]
        softmax, idx, mine, valid = ctx.saved_tensors
        g = softmax.clone()  # [B, S, V_r]
        if g.size(-1):
            g.scatter_add_(-1, idx, -mine.to(g.dtype).unsqueeze(-1))
        return g * (grad * valid).unsqueeze(-1), None, None, None, None, None


def vocab_parallel_token_losses(
    logits: torch.Tensor, labels: torch.Tensor, tp: TensorParallelContext, *, vocab_start: int, ignore_index: int = -100
) -> torch.Tensor:
    """Per-token cross-entropy ``[B, S]`` (0 at ignored tokens) from vocabulary-split ``logits [B, S, V_r]``."""
    if logits.shape[:-1] != labels.shape:
        raise ValueError(f"logits {tuple(logits.shape)} and labels {tuple(labels.shape)} disagree on [B, S]")
    if logits.dtype in (torch.float16, torch.bfloat16):
        logits = logits.float()
    return _VocabParallelCE.apply(logits, labels, vocab_start, ignore_index, tp.group, tp.comm)


def tensor_parallel_cross_entropy(
    logits: torch.Tensor, labels: torch.Tensor, *, tp: TensorParallelContext, vocab_start: int,
    ignore_index: int = -100, group=None,
) -> torch.Tensor:
    """Mean cross-entropy over the non-ignored tokens of the global batch, from logits split along the
    vocabulary (tensor-parallel group ``tp``) and the sequence (context-parallel ``group``, as in
    ``sequence_parallel_cross_entropy``: its backward sums over ``group``). Same value on every rank."""
    token = vocab_parallel_token_losses(logits, labels, tp, vocab_start=vocab_start, ignore_index=ignore_index)
    loss_sum = token.sum()
    count = (labels != ignore_index).sum().to(loss_sum.dtype)
    world, _ = group_size_and_rank(group)
    if world > 1:
        totals = all_reduce_sum(torch.stack([loss_sum, count]), group)  # [2], summed over the cp group
        loss_sum, count = totals[0], totals[1].detach()
    return loss_sum / count.clamp_min(1)


def vocab_parallel_argmax(logits: torch.Tensor, tp: TensorParallelContext, *, vocab_start: int) -> torch.Tensor:
    """Global argmax ``[B, S]`` over the vocabulary from split ``logits [B, S, V_r]`` (first index on ties,
    as ``torch.argmax``)."""
    if tp.world == 1:
        return logits.argmax(-1)
    if logits.size(-1):
        val, idx = logits.detach().max(-1)
    else:
        val, idx = logits.new_full(logits.shape[:-1], -torch.inf), torch.zeros(logits.shape[:-1], dtype=torch.long)
    both = torch.stack([val.double(), (idx + vocab_start).double()])  # [2, B, S]
    g = all_gather_raw(both.unsqueeze(0), tp.group, 0, tp.comm)  # [t, 2, B, S]; rank order = vocabulary order
    best = g[:, 0].argmax(0, keepdim=True)  # [1, B, S]: first rank holding the max
    return g[:, 1].gather(0, best).squeeze(0).long()
