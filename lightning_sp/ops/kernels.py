"""Local attention kernels: ``forward -> (out, lse)`` and a backward that takes the *global* output
and log-sum-exp, so a ring backend can differentiate each block against the merged result.

Shapes (all kernels): ``q [B, Sq, H, D]``, ``k, v [B, Sk, H_kv, D]`` with ``H % H_kv == 0``
(query head ``h`` uses KV head ``h // (H / H_kv)``), ``out [B, Sq, H, D]``, ``lse [B, H, Sq]`` in
the accumulation dtype. Masks come from ``plan.MaskKind``: FULL, CAUSAL (square, aligned) or a
DENSE ``[Sq, Sk]`` bool tensor (True = visible). A row with no visible key gets ``out = 0`` and
``lse = -inf``.

Kernels:
- ``torch``: blockwise pure PyTorch (tiles of ``128 x 512``; never materialises the whole score
  matrix); any float dtype incl. fp64; the reference implementation.
- ``sdpa``: PyTorch's fused ops. CPU: ``aten._scaled_dot_product_flash_attention_for_cpu`` (+ its
  backward op). CUDA: ``aten._scaled_dot_product_flash_attention`` for fp16/bf16 FULL/CAUSAL blocks
  (other blocks fall back to ``torch``).
- ``flash_attn``: the flash-attn package (CUDA, fp16/bf16), imported lazily.
"""

from __future__ import annotations

import inspect
import math
from typing import Protocol

import torch

from lightning_sp.ops.merge import accumulation_dtype, merge_into
from lightning_sp.ops.plan import MaskKind

KERNELS = ("auto", "torch", "sdpa", "flash_attn")


def expand_kv(x: torch.Tensor, num_heads: int) -> torch.Tensor:
    """``[B, S, H_kv, D] -> [B, S, H, D]``: each KV head serves ``H / H_kv`` query heads."""
    groups = num_heads // x.size(2)
    return x if groups == 1 else x.repeat_interleave(groups, dim=2)


def reduce_kv_grad(grad: torch.Tensor, num_kv_heads: int) -> torch.Tensor:
    """``[B, S, H, D] -> [B, S, H_kv, D]``: sum the gradients of the query heads sharing a KV head."""
    b, s, h, d = grad.shape
    groups = h // num_kv_heads
    return grad if groups == 1 else grad.view(b, s, num_kv_heads, groups, d).sum(3)


class LocalKernel(Protocol):
    name: str

    def forward(self, q, k, v, *, scale: float, kind: MaskKind, mask) -> tuple[torch.Tensor, torch.Tensor]: ...

    def backward(self, dout, q, k, v, out, lse, *, scale: float, kind: MaskKind, mask) -> tuple[torch.Tensor, ...]: ...


# ----------------------------------------------------------------------------------------------
# torch: blockwise, pure PyTorch
# ----------------------------------------------------------------------------------------------


class TorchBlockwiseKernel:
    name = "torch"

    def __init__(self, block_q: int = 128, block_k: int = 512):
        self.block_q, self.block_k = block_q, block_k

    def _tiles(self, sq: int, sk: int, kind: MaskKind):
        for q0 in range(0, sq, self.block_q):
            q1 = min(q0 + self.block_q, sq)
            for k0 in range(0, sk, self.block_k):
                if kind is MaskKind.CAUSAL and k0 > q1 - 1:
                    break  # tile entirely above the diagonal
                yield q0, q1, k0, min(k0 + self.block_k, sk)

    @staticmethod
    def _tile_visible(kind, mask, q0, q1, k0, k1, device):
        if kind is MaskKind.FULL:
            return None
        if kind is MaskKind.CAUSAL:
            qi = torch.arange(q0, q1, device=device)[:, None]
            ki = torch.arange(k0, k1, device=device)[None, :]
            return ki <= qi
        return mask[q0:q1, k0:k1]

    def forward(self, q, k, v, *, scale, kind, mask):
        acc = accumulation_dtype(q.dtype)
        b, sq, h, _ = q.shape
        qh = q.transpose(1, 2).to(acc)  # [B, H, Sq, D]
        kh = expand_kv(k, h).transpose(1, 2).to(acc)  # [B, H, Sk, D]
        vh = expand_kv(v, h).transpose(1, 2).to(acc)
        out = torch.zeros(b, sq, h, v.size(-1), dtype=acc, device=q.device)  # [B, Sq, H, D]
        lse = torch.full((b, h, sq), -math.inf, dtype=acc, device=q.device)  # [B, H, Sq]
        for q0, q1, k0, k1 in self._tiles(sq, k.size(1), kind):
            s = qh[:, :, q0:q1] @ kh[:, :, k0:k1].transpose(-1, -2) * scale  # [B, H, bq, bk]
            visible = self._tile_visible(kind, mask, q0, q1, k0, k1, q.device)
            if visible is not None:
                s = s.masked_fill(~visible, -math.inf)
            tile_lse = torch.logsumexp(s, dim=-1)  # [B, H, bq]
            p = torch.exp(s - tile_lse.unsqueeze(-1)).nan_to_num(nan=0.0)  # rows with no key: 0
            tile_out = (p @ vh[:, :, k0:k1]).transpose(1, 2)  # [B, bq, H, D]
            merge_into(out[:, q0:q1], lse[:, :, q0:q1], tile_out, tile_lse)
        return out, lse

    def backward(self, dout, q, k, v, out, lse, *, scale, kind, mask):
        acc = accumulation_dtype(q.dtype)
        h, h_kv = q.size(2), k.size(2)
        qh = q.transpose(1, 2).to(acc)  # [B, H, Sq, D]
        kh = expand_kv(k, h).transpose(1, 2).to(acc)  # [B, H, Sk, D]
        vh = expand_kv(v, h).transpose(1, 2).to(acc)
        doh = dout.transpose(1, 2).to(acc)  # [B, H, Sq, D]
        delta = (doh * out.transpose(1, 2).to(acc)).sum(-1)  # [B, H, Sq]
        lse = lse.to(acc)
        dq, dk, dv = torch.zeros_like(qh), torch.zeros_like(kh), torch.zeros_like(vh)
        for q0, q1, k0, k1 in self._tiles(q.size(1), k.size(1), kind):
            s = qh[:, :, q0:q1] @ kh[:, :, k0:k1].transpose(-1, -2) * scale  # [B, H, bq, bk]
            visible = self._tile_visible(kind, mask, q0, q1, k0, k1, q.device)
            if visible is not None:
                s = s.masked_fill(~visible, -math.inf)
            p = torch.exp(s - lse[:, :, q0:q1, None]).nan_to_num(nan=0.0)  # [B, H, bq, bk]
            dv[:, :, k0:k1] += p.transpose(-1, -2) @ doh[:, :, q0:q1]
            dp = doh[:, :, q0:q1] @ vh[:, :, k0:k1].transpose(-1, -2)  # [B, H, bq, bk]
            ds = p * (dp - delta[:, :, q0:q1, None])
            dq[:, :, q0:q1] += ds @ kh[:, :, k0:k1] * scale
            dk[:, :, k0:k1] += ds.transpose(-1, -2) @ qh[:, :, q0:q1] * scale
        return (
            dq.transpose(1, 2),
            reduce_kv_grad(dk.transpose(1, 2), h_kv),
            reduce_kv_grad(dv.transpose(1, 2), h_kv),
        )


# ----------------------------------------------------------------------------------------------
# sdpa: PyTorch's fused attention ops
# ----------------------------------------------------------------------------------------------


class SDPAKernel:
    name = "sdpa"

    def __init__(self):
        self._fallback = TorchBlockwiseKernel()

    @staticmethod
    def _cuda_ok(q, kind) -> bool:
        return q.dtype in (torch.float16, torch.bfloat16) and kind is not MaskKind.DENSE

    def forward(self, q, k, v, *, scale, kind, mask):
        h = q.size(2)
        qh, kh, vh = q.transpose(1, 2), expand_kv(k, h).transpose(1, 2), expand_kv(v, h).transpose(1, 2)
        if q.is_cuda:
            if not self._cuda_ok(q, kind):
                return self._fallback.forward(q, k, v, scale=scale, kind=kind, mask=mask)
            res = torch.ops.aten._scaled_dot_product_flash_attention(
                qh, kh, vh, 0.0, kind is MaskKind.CAUSAL, False, scale=scale
            )
            return res[0].transpose(1, 2), res[1]
        additive = None
        if kind is MaskKind.DENSE:
            additive = torch.zeros(mask.shape, dtype=q.dtype, device=q.device).masked_fill(~mask, -math.inf)
        out, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
            qh, kh, vh, 0.0, kind is MaskKind.CAUSAL, attn_mask=additive, scale=scale
        )
        if kind is MaskKind.DENSE:  # the op reports lse = 0 for a row that saw no key
            lse = lse.masked_fill(~mask.any(-1), -math.inf)
        return out.transpose(1, 2), lse

    def backward(self, dout, q, k, v, out, lse, *, scale, kind, mask):
        h, h_kv = q.size(2), k.size(2)
        out = out.to(q.dtype)
        lse = lse.masked_fill(torch.isneginf(lse), 0.0)  # a row that saw no key: p = exp(-inf) = 0, not nan
        qh, kh, vh = q.transpose(1, 2), expand_kv(k, h).transpose(1, 2), expand_kv(v, h).transpose(1, 2)
        doh, oh = dout.to(q.dtype).transpose(1, 2), out.transpose(1, 2)
        if q.is_cuda:
            if not self._cuda_ok(q, kind):
                return self._fallback.backward(dout, q, k, v, out, lse, scale=scale, kind=kind, mask=mask)
            empty = torch.empty(0, device=q.device)
            dq, dk, dv = torch.ops.aten._scaled_dot_product_flash_attention_backward(
                doh, qh, kh, vh, oh, lse.float().contiguous(), empty, empty, q.size(1), k.size(1), 0.0,
                kind is MaskKind.CAUSAL, empty, empty, scale=scale,
            )
        else:
            additive = None
            if kind is MaskKind.DENSE:
                additive = torch.zeros(mask.shape, dtype=q.dtype, device=q.device).masked_fill(~mask, -math.inf)
            dq, dk, dv = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward(
                doh, qh, kh, vh, oh, lse.to(accumulation_dtype(q.dtype)), 0.0, kind is MaskKind.CAUSAL,
                attn_mask=additive, scale=scale,
            )
        return dq.transpose(1, 2), reduce_kv_grad(dk.transpose(1, 2), h_kv), reduce_kv_grad(dv.transpose(1, 2), h_kv)


# ----------------------------------------------------------------------------------------------
# flash_attn: the flash-attn package (imported lazily, CUDA only)
# ----------------------------------------------------------------------------------------------


class FlashAttnKernel:
    """flash-attn 2.x private forward/backward, called with keyword arguments matched to the
    installed version's signature (it changed between 2.5 and 2.7). DENSE blocks and fp32 fall
    back to the ``torch`` kernel. Not exercised in CI (no GPU): see tests/gpu."""

    name = "flash_attn"

    def __init__(self):
        from flash_attn import flash_attn_interface as fai  # lazy: optional dependency

        self._fwd, self._bwd = fai._flash_attn_forward, fai._flash_attn_backward
        self._fwd_params = set(inspect.signature(self._fwd).parameters)
        self._bwd_params = set(inspect.signature(self._bwd).parameters)
        self._fallback = TorchBlockwiseKernel()

    def _window(self, params) -> dict:
        if "window_size_left" in params:
            return {"window_size_left": -1, "window_size_right": -1}
        return {"window_size": (-1, -1)} if "window_size" in params else {}

    def _extra(self, params) -> dict:
        extra = {"softcap": 0.0, "alibi_slopes": None, "deterministic": False, "return_softmax": False}
        return {k: val for k, val in extra.items() if k in params}

    def forward(self, q, k, v, *, scale, kind, mask):
        if kind is MaskKind.DENSE or q.dtype not in (torch.float16, torch.bfloat16):
            return self._fallback.forward(q, k, v, scale=scale, kind=kind, mask=mask)
        res = self._fwd(
            q.contiguous(), k.contiguous(), v.contiguous(), dropout_p=0.0, softmax_scale=scale,
            causal=kind is MaskKind.CAUSAL, **self._window(self._fwd_params), **self._extra(self._fwd_params),
        )
        out, lse = (res[0], res[1]) if len(res) <= 4 else (res[0], res[5])  # 2.7+: (out, lse, ...); 2.5: (out, q, k, v, out_pad, lse, ...)
        return out, lse

    def backward(self, dout, q, k, v, out, lse, *, scale, kind, mask):
        if kind is MaskKind.DENSE or q.dtype not in (torch.float16, torch.bfloat16):
            return self._fallback.backward(dout, q, k, v, out, lse, scale=scale, kind=kind, mask=mask)
        dq, dk, dv = torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)
        self._bwd(
            dout.to(q.dtype).contiguous(), q.contiguous(), k.contiguous(), v.contiguous(), out.to(q.dtype).contiguous(),
            lse.float().contiguous(), dq, dk, dv, dropout_p=0.0, softmax_scale=scale, causal=kind is MaskKind.CAUSAL,
            **self._window(self._bwd_params), **{kk: vv for kk, vv in self._extra(self._bwd_params).items() if kk != "return_softmax"},
            **({"rng_state": None} if "rng_state" in self._bwd_params else {}),
        )
        return dq, dk, dv


def flash_attn_available() -> bool:
    try:
        import flash_attn  # noqa: F401
    except ImportError:
        return False
    return torch.cuda.is_available()


def make_kernel(name: str) -> LocalKernel:
    """``"auto"``: flash-attn on CUDA when installed, else PyTorch SDPA (CPU or CUDA)."""
    if name not in KERNELS:
        raise ValueError(f"kernel must be one of {KERNELS}, got {name!r}")
    if name == "auto":
        name = "flash_attn" if flash_attn_available() else "sdpa"
    if name == "torch":
        return TorchBlockwiseKernel()
    if name == "sdpa":
        return SDPAKernel()
    if not flash_attn_available():
        raise ValueError("kernel='flash_attn' needs the flash-attn package and a CUDA device; use kernel='sdpa'")
    return FlashAttnKernel()
