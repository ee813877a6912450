"""ColossalAI sequence parallelism (Li et al. 2021): RingQK, then RingAV.

The 2021 baseline the papers compare against, kept as it was: keys travel around the ring to build
this rank's full ``[S/P, N]`` score rows, the softmax is taken over the whole row, then values
travel around the ring to form the output. The score/probability matrix is materialised and saved
for backward: memory O(N^2 / P), which is exactly what later methods remove.

Backward: ring-pass V to get ``dP`` (dV partial sums travel back to their owners), softmax
backward, ring-pass K to get ``dQ`` (dK partial sums travel back).

Masks (``lightning_sp/masks.py``): the visibility of each score block comes from the mask on global positions;
score modifiers are applied to each block as it is built (the raw scores are kept beside the probabilities, one
more ``[B, H, S/P, N]`` buffer, and the backward differentiates the modifiers block by block); sinks are one more
column of the softmax with a zero value. Colossal keeps every score, so it skips no block and no traffic.
"""

from __future__ import annotations

import torch

from lightning_sp.comm.ring import RingComm, ring_pass, ring_pass_with_grads
from lightning_sp.comm.stats import CommStats
from lightning_sp.ops.precision import autocast_off
from lightning_sp.ops.kernels import expand_kv, reduce_kv_grad
from lightning_sp.ops.merge import accumulation_dtype
from lightning_sp.ops.plan import visibility


def _block_visible(qpos, kpos, causal, doc_bounds, mask):
    if mask is not None:
        return mask.visible(qpos, kpos)
    return visibility(qpos, kpos, causal=causal, doc_bounds=doc_bounds)


def _indices(b, h, qpos, kpos, device):
    return (torch.arange(b, device=device).view(b, 1, 1, 1), torch.arange(h, device=device).view(1, h, 1, 1),
            qpos.view(1, 1, -1, 1), kpos.view(1, 1, 1, -1))


class ColossalFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, sinks, group, positions_by_rank, causal, doc_bounds, scale, stats, mask, score_mods):
        # q [B, S/P, H, D]; k, v [B, S/P, H_kv, D]; positions_by_rank[r]: global positions [S/P]
        comm = RingComm(group, stats)
        acc = accumulation_dtype(q.dtype)
        b, s_local, h, _ = q.shape
        qh = q.transpose(1, 2).to(acc)  # [B, H, S/P, D]
        qpos = positions_by_rank[comm.rank].to(q.device)
        extra = 0 if sinks is None else 1  # the sink column
        scores = torch.empty(b, h, s_local, comm.world * s_local + extra, dtype=acc, device=q.device)  # [B, H, S/P, N]
        raw = torch.empty_like(scores[..., :comm.world * s_local]) if score_mods is not None else None

        def ring_qk(_step, src, blocks):
            (k_blk,) = blocks
            cols = slice(src * s_local, (src + 1) * s_local)
            kh = expand_kv(k_blk, h).transpose(1, 2).to(acc)  # [B, H, S/P, D]
            kpos = positions_by_rank[src].to(q.device)
            visible = _block_visible(qpos, kpos, causal, doc_bounds, mask)
            block = qh @ kh.transpose(-1, -2) * scale
            if score_mods is not None:
                raw[..., cols] = block
                idx = _indices(b, h, qpos, kpos, q.device)
                block = score_mods.apply(block, *idx)
                extra_visible = score_mods.visible(*idx)
                if extra_visible is not None:
                    visible = visible & extra_visible.to(q.device)
            scores[..., cols] = block.masked_fill(~visible, float("-inf"))

        ring_pass(comm, (k,), ring_qk)
        if sinks is not None:
            scores[..., -1] = sinks.detach().to(acc).view(1, h, 1)
        # [B, H, S/P, N]: the O(N^2/P) buffer; a row that sees no key (padding) is all -inf: zeros, not NaN
        probs = torch.softmax(scores, dim=-1).nan_to_num_(nan=0.0)
        del scores
        p_sink = None
        if sinks is not None:
            p_sink, probs = probs[..., -1], probs[..., :-1]
        out = torch.zeros(b, h, s_local, v.size(-1), dtype=acc, device=q.device)

        def ring_av(_step, src, blocks):
            (v_blk,) = blocks
            cols = slice(src * s_local, (src + 1) * s_local)
            out.add_(probs[..., cols] @ expand_kv(v_blk, h).transpose(1, 2).to(acc))

        ring_pass(comm, (v,), ring_av)
        ctx.save_for_backward(q, k, v, probs, raw, p_sink, sinks)
        ctx.group, ctx.scale, ctx.stats, ctx.score_mods = group, scale, stats, score_mods
        ctx.positions = positions_by_rank
        return out.transpose(1, 2).to(q.dtype)  # [B, S/P, H, D]

    @staticmethod
    @autocast_off
    def backward(ctx, dout):
        q, k, v, probs, raw, p_sink, sinks = ctx.saved_tensors
        comm = RingComm(ctx.group, ctx.stats)
        acc = probs.dtype
        h, h_kv, s_local = q.size(2), k.size(2), q.size(1)
        doh = dout.transpose(1, 2).to(acc)  # [B, H, S/P, D]
        qh = q.transpose(1, 2).to(acc)
        dprobs = torch.empty_like(probs)

        def ring_v(_step, src, blocks):
            (v_blk,) = blocks
            cols = slice(src * s_local, (src + 1) * s_local)
            vh = expand_kv(v_blk, h).transpose(1, 2).to(acc)
            dprobs[..., cols] = doh @ vh.transpose(-1, -2)
            dv_blk = probs[..., cols].transpose(-1, -2) @ doh  # [B, H, S/P, D]
            return (reduce_kv_grad(dv_blk.transpose(1, 2), h_kv),)

        (dv,) = ring_pass_with_grads(comm, (v,), ring_v)
        row_mean = (dprobs * probs).sum(-1, keepdim=True)  # [B, H, S/P, 1]; the sink's dP is 0
        dscores = probs * (dprobs - row_mean)  # softmax backward
        dsinks = None
        if sinks is not None:  # d loss / d sink = p_sink * (0 - row_mean), summed over this rank's rows
            dsinks = (-(p_sink * row_mean.squeeze(-1)).sum((0, 2))).to(sinks.dtype)
        del dprobs
        dq = torch.zeros_like(qh)
        b = q.size(0)
        qpos = ctx.positions[comm.rank].to(q.device)

        def ring_k(_step, src, blocks):
            (k_blk,) = blocks
            cols = slice(src * s_local, (src + 1) * s_local)
            kh = expand_kv(k_blk, h).transpose(1, 2).to(acc)
            ds = dscores[..., cols]
            if ctx.score_mods is not None:  # through the modifiers, on this block's raw scores (and a bias table's)
                idx = _indices(b, h, qpos, ctx.positions[src].to(q.device), q.device)
                ds = ctx.score_mods.backward_through(raw[..., cols], ds, *idx)
            dq.add_(ds @ kh * ctx.scale)
            dk_blk = ds.transpose(-1, -2) @ qh * ctx.scale
            return (reduce_kv_grad(dk_blk.transpose(1, 2), h_kv),)

        (dk,) = ring_pass_with_grads(comm, (k,), ring_k)
        return dq.transpose(1, 2).to(q.dtype), dk.to(k.dtype), dv.to(v.dtype), dsinks, *([None] * 8)


def colossal_attention(q, k, v, *, group, positions_by_rank, causal, doc_bounds, scale, stats: CommStats | None,
                       mask=None, score_mods=None, sinks=None):
    return ColossalFunction.apply(q, k, v, sinks, group, positions_by_rank, causal, doc_bounds, scale, stats, mask,
                                  score_mods)
