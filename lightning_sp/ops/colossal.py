"""ColossalAI sequence parallelism (Li et al. 2021): RingQK, then RingAV.

The 2021 baseline the papers compare against, kept as it was: keys travel around the ring to build
this rank's full ``[S/P, N]`` score rows, the softmax is taken over the whole row, then values
travel around the ring to form the output. The score/probability matrix is materialised and saved
for backward: memory O(N^2 / P), which is exactly what later methods remove.

Backward: ring-pass V to get ``dP`` (dV partial sums travel back to their owners), softmax
backward, ring-pass K to get ``dQ`` (dK partial sums travel back).
"""

from __future__ import annotations

import torch

from lightning_sp.comm.ring import RingComm, ring_pass, ring_pass_with_grads
from lightning_sp.comm.stats import CommStats
from lightning_sp.ops.precision import autocast_off
from lightning_sp.ops.kernels import expand_kv, reduce_kv_grad
from lightning_sp.ops.merge import accumulation_dtype
from lightning_sp.ops.plan import visibility


class ColossalFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, group, positions_by_rank, causal, doc_bounds, scale, stats):
        # q [B, S/P, H, D]; k, v [B, S/P, H_kv, D]; positions_by_rank[r]: global positions [S/P]
        comm = RingComm(group, stats)
        acc = accumulation_dtype(q.dtype)
        b, s_local, h, _ = q.shape
        qh = q.transpose(1, 2).to(acc)  # [B, H, S/P, D]
        qpos = positions_by_rank[comm.rank].to(q.device)
        scores = torch.empty(b, h, s_local, comm.world * s_local, dtype=acc, device=q.device)  # [B, H, S/P, N]

        def ring_qk(_step, src, blocks):
            (k_blk,) = blocks
            cols = slice(src * s_local, (src + 1) * s_local)
            kh = expand_kv(k_blk, h).transpose(1, 2).to(acc)  # [B, H, S/P, D]
            visible = visibility(qpos, positions_by_rank[src].to(q.device), causal=causal, doc_bounds=doc_bounds)
            scores[..., cols] = (qh @ kh.transpose(-1, -2) * scale).masked_fill(~visible, float("-inf"))

        ring_pass(comm, (k,), ring_qk)
        probs = torch.softmax(scores, dim=-1)  # [B, H, S/P, N]: the O(N^2/P) buffer
        del scores
        out = torch.zeros(b, h, s_local, v.size(-1), dtype=acc, device=q.device)

        def ring_av(_step, src, blocks):
            (v_blk,) = blocks
            cols = slice(src * s_local, (src + 1) * s_local)
            out.add_(probs[..., cols] @ expand_kv(v_blk, h).transpose(1, 2).to(acc))

        ring_pass(comm, (v,), ring_av)
        ctx.save_for_backward(q, k, v, probs)
        ctx.group, ctx.scale, ctx.stats = group, scale, stats
        return out.transpose(1, 2).to(q.dtype)  # [B, S/P, H, D]

    @staticmethod
    @autocast_off
    def backward(ctx, dout):
        q, k, v, probs = ctx.saved_tensors
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
        dscores = probs * (dprobs - (dprobs * probs).sum(-1, keepdim=True))  # softmax backward
        del dprobs
        dq = torch.zeros_like(qh)

        def ring_k(_step, src, blocks):
            (k_blk,) = blocks
            cols = slice(src * s_local, (src + 1) * s_local)
            kh = expand_kv(k_blk, h).transpose(1, 2).to(acc)
            dq.add_(dscores[..., cols] @ kh * ctx.scale)
            dk_blk = dscores[..., cols].transpose(-1, -2) @ qh * ctx.scale
            return (reduce_kv_grad(dk_blk.transpose(1, 2), h_kv),)

        (dk,) = ring_pass_with_grads(comm, (k,), ring_k)
        return dq.transpose(1, 2).to(q.dtype), dk.to(k.dtype), dv.to(v.dtype), *([None] * 6)


def colossal_attention(q, k, v, *, group, positions_by_rank, causal, doc_bounds, scale, stats: CommStats | None):
    return ColossalFunction.apply(q, k, v, group, positions_by_rank, causal, doc_bounds, scale, stats)
