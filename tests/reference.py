"""Dense float64 attention on the full sequence: the reference every backend is checked against."""

from __future__ import annotations

import math

import torch


def dense_visibility(n: int, *, causal=False, cu_seqlens=None, mask=None) -> torch.Tensor:
    """``[N, N]`` bool (True = visible) from the definitions, pair by pair in tensor form, independent of
    ``lightning_sp.masks``: same document, causal unless both in one bidirectional span, the window, chunks."""
    pos = torch.arange(n)
    qp, kp = pos[:, None], pos[None, :]
    visible = torch.ones(n, n, dtype=torch.bool)
    in_span = torch.zeros(n, n, dtype=torch.bool)
    if mask is not None:
        for s, e in mask.bidirectional_spans:
            inside = (pos >= s) & (pos < e)
            in_span |= inside[:, None] & inside[None, :]
    if causal:
        visible &= (kp <= qp) | in_span
    if cu_seqlens is not None:
        doc = torch.bucketize(pos, cu_seqlens.long(), right=True)
        visible &= doc[:, None] == doc[None, :]
    if mask is not None:
        if mask.window is not None:
            left, right = mask.window
            if left != -1:
                visible &= qp - kp <= left
            if right != -1:
                visible &= kp - qp <= right
        if mask.chunk_size is not None:
            visible &= (qp // mask.chunk_size) == (kp // mask.chunk_size)
    return visible


def dense_attention(q, k, v, *, causal=False, cu_seqlens=None, seq_len=None, scale=None, mask=None, sinks=None):
    """``q [B, N, H, D]``, ``k, v [B, N, H_kv, D]`` -> ``[B, N, H, D]`` in float64, materialising the
    whole ``[N, N]`` score matrix. Keys at or beyond ``seq_len`` (padding) are never attended. ``mask``: an
    ``AttentionMask`` (windows, chunks, spans, softcap, ALiBi, ``mask_mod``, ``score_mod``, applied on the whole
    sequence's indices); ``sinks [H]``: one more logit per head in every row's softmax, with a zero value
    (differentiable, as ``q``, ``k``, ``v``)."""
    q, k, v = q.double(), k.double(), v.double()
    b, n, h, d = q.shape
    groups = h // k.size(2)
    k, v = k.repeat_interleave(groups, dim=2), v.repeat_interleave(groups, dim=2)
    scores = torch.einsum("bqhd,bkhd->bhqk", q, k) * (scale or 1.0 / math.sqrt(d))
    visible = dense_visibility(n, causal=causal, cu_seqlens=cu_seqlens, mask=mask)
    if seq_len is not None:  # padded keys are never seen by real queries (padding rows: whatever, trimmed)
        pos = torch.arange(n)
        visible &= (pos[None, :] < seq_len) | (pos[:, None] >= seq_len)
    visible = visible.expand(b, h, n, n)
    if mask is not None:
        bi = torch.arange(b).view(b, 1, 1, 1)
        hi = torch.arange(h).view(1, h, 1, 1)
        qi = torch.arange(n).view(1, 1, n, 1)
        ki = torch.arange(n).view(1, 1, 1, n)
        if mask.softcap is not None:
            scores = mask.softcap * torch.tanh(scores / mask.softcap)
        if mask.alibi_slopes is not None:
            slopes = torch.tensor(mask.alibi_slopes, dtype=torch.float64).view(1, h, 1, 1)
            scores = scores - slopes * (qi - ki).abs()
        if mask.score_mod is not None:
            scores = mask.score_mod(scores, bi, hi, qi, ki)
        if mask.mask_mod is not None:
            visible = visible & torch.as_tensor(mask.mask_mod(bi, hi, qi, ki), dtype=torch.bool)
    scores = scores.masked_fill(~visible, -math.inf)
    if sinks is not None:
        sink_col = sinks.double().view(1, h, 1, 1).expand(b, h, n, 1)
        probs = torch.softmax(torch.cat([scores, sink_col], dim=-1), dim=-1)[..., :n]
    else:
        probs = torch.softmax(scores, dim=-1)
    return torch.einsum("bhqk,bkhd->bqhd", probs, v)


def key_blocks(visible: torch.Tensor, q_start: int, key_ranges) -> list[tuple]:
    """``(k0, k1, kind, mask)`` of each key range for the queries ``[q_start, N)`` of the ``[N, N]`` boolean
    ``visible``, as the planner hands blocks to a kernel: FULL (every pair visible), CAUSAL (the square diagonal
    block, lower triangle), else DENSE with its mask; a range with no visible pair is skipped."""
    from lightning_sp.ops.plan import MaskKind

    n = visible.size(1)
    out = []
    for k0, k1 in key_ranges:
        block = visible[q_start:, k0:k1]
        if not block.any():
            continue
        if block.all():
            out.append((k0, k1, MaskKind.FULL, None))
        elif (k0, k1) == (q_start, n) and torch.equal(block, torch.ones_like(block).tril()):
            out.append((k0, k1, MaskKind.CAUSAL, None))
        else:
            out.append((k0, k1, MaskKind.DENSE, block))
    return out

