"""Dense float64 attention on the full sequence: the reference every backend is checked against."""

from __future__ import annotations

import math

import torch


def dense_attention(q, k, v, *, causal=False, cu_seqlens=None, seq_len=None, scale=None):
    """``q [B, N, H, D]``, ``k, v [B, N, H_kv, D]`` -> ``[B, N, H, D]`` in float64, materialising the
    whole ``[N, N]`` score matrix. Keys at or beyond ``seq_len`` (padding) are never attended."""
    q, k, v = q.double(), k.double(), v.double()
    n, h, d = q.size(1), q.size(2), q.size(3)
    groups = h // k.size(2)
    k, v = k.repeat_interleave(groups, dim=2), v.repeat_interleave(groups, dim=2)
    scores = torch.einsum("bqhd,bkhd->bhqk", q, k) * (scale or 1.0 / math.sqrt(d))
    pos = torch.arange(n)
    visible = torch.ones(n, n, dtype=torch.bool)
    if causal:
        visible &= pos[None, :] <= pos[:, None]
    if cu_seqlens is not None:
        doc = torch.bucketize(pos, cu_seqlens.long(), right=True)
        visible &= doc[:, None] == doc[None, :]
    if seq_len is not None:
        visible &= (pos[None, :] < seq_len) | (pos[:, None] >= seq_len)
    scores = scores.masked_fill(~visible, -math.inf)
    return torch.einsum("bhqk,bkhd->bqhd", torch.softmax(scores, dim=-1), v)
