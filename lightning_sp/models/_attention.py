"""The models' single point of contact with the core: attention module, loss, and group accessor.

TEMPORARY: until ``lightning_sp.attention`` / ``lightning_sp.loss`` land, a local stand-in with the
same signature is used (plain attention over the given sequence, which is what the core does with
``backend=None`` and nothing bound).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

try:
    from lightning_sp.attention import SequenceParallelAttention  # noqa: F401
except ImportError:  # pragma: no cover - removed once the core lands

    class SequenceParallelAttention(nn.Module):  # type: ignore[no-redef]
        def __init__(self, *, causal=False, softmax_scale=None, backend=None, group=None, ulysses_degree=None, kernel="auto"):
            super().__init__()
            self.causal, self.softmax_scale = causal, softmax_scale

        def forward(self, q, k, v, *, cu_seqlens=None):
            b, s, h, d = q.shape  # q [B, S, H, D], k/v [B, S, Hkv, D]
            rep = h // k.shape[2]
            k, v = k.repeat_interleave(rep, 2), v.repeat_interleave(rep, 2)
            mask = torch.ones(s, s, dtype=torch.bool, device=q.device)
            if self.causal:
                mask = mask.tril()
            if cu_seqlens is not None:
                doc = torch.bucketize(torch.arange(s, device=q.device), cu_seqlens[1:].to(q.device), right=True)
                mask = mask & (doc[:, None] == doc[None, :])
            out = F.scaled_dot_product_attention(
                q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), attn_mask=mask, scale=self.softmax_scale
            )  # [B, H, S, D]
            return out.transpose(1, 2)

try:
    from lightning_sp.loss import sequence_parallel_cross_entropy  # noqa: F401
except ImportError:  # pragma: no cover

    def sequence_parallel_cross_entropy(logits, labels, *, ignore_index=-100, group=None):
        if group is not None:
            raise RuntimeError("lightning_sp.loss is missing; cannot reduce over a sequence-parallel group")
        return F.cross_entropy(logits.flatten(0, -2).float(), labels.flatten(), ignore_index=ignore_index)


def attention_group(module: nn.Module):
    """Sequence-parallel group of the first bound ``SequenceParallelAttention`` in ``module``; ``None`` if unbound."""
    for m in module.modules():
        if isinstance(m, SequenceParallelAttention):
            ctx = getattr(m, "context", None)
            if ctx is not None:
                return getattr(ctx, "group", None)
            return getattr(m, "group", None)
    return None
