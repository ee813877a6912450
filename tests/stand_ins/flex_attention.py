"""``FlexAttentionStandIn``: PyTorch's compiled CUDA ``flex_attention`` on CPU, with autograd (the real op has no
CPU backward), for ``lightning_sp/ops/flex.py``'s tests.

Each call is

1. checked against what the real op requires (torch 2.13, ``torch/nn/attention/flex_attention.py`` and
   Inductor's lowering ``torch/_inductor/kernel/flex/flex_attention.py``), never less strictly; each rule names
   the real check it mirrors:

   - 4-D ``[B, H, S, D]`` q/k/v of one dtype and device (``_validate_sdpa_input``; "NYI: query, key, and value
     must be 4D tensors"), the dtype one the CUDA lowering compiles (fp16, bf16, fp32; ``dtypes=`` widens it
     for a float64 numerics test), q/k head dims equal (``_validate_embed_dim``), head dims >= 16 (the lowering's
     "NYI: embedding dimension ... must be at least 16"), equal batch sizes;
   - heads: equal unless ``enable_gqa``, then ``Hq % Hkv == 0`` (the frontend's two ``ValueError``\\s);
   - contiguous ``[B, H, S, D]`` memory (stricter than the real op, which takes any last-dim-contiguous
     strides; the kernel hands it contiguous tensors, so a change there shows up here);
   - ``block_mask``: a ``BlockMask`` for exactly ``(S_q, S_k)`` on the inputs' device (the frontend's shape and
     device checks), or ``None``; ``scale`` a Python float; ``return_lse`` and ``return_aux`` not both;
   - ``score_mod``/``mask_mod`` evaluated through ``torch.vmap`` over scalar indices, as the real op traces them
     (a callable that is not elementwise fails here as there);
2. recorded in ``calls`` as a dict of what was passed;
3. answered by a dense evaluation that honours the ``BlockMask``'s tiles as the fused kernel does: a *full*
   tile is visible without ``mask_mod``, a *partial* tile through ``mask_mod``, any other tile is skipped. Scores
   are computed in fp32 (in fp64 for fp64 inputs); the lse is returned in natural log (the frontend's
   ``lse * ln 2``), fp32 for half inputs; a row with no visible key gets ``out = 0``, ``lse = -inf``. Out and lse
   are differentiable (the real op differentiates through its lse too).
"""

from __future__ import annotations

import math

import torch
from torch.nn.attention.flex_attention import BlockMask

CUDA_DTYPES = (torch.float16, torch.bfloat16, torch.float32)


def _vmap_bhqk(fn, prefix_dims: int):
    """``fn(*prefix, b, h, q, k)`` vectorised over ``b [B], h [H], q [Sq], k [Sk]`` by nested ``torch.vmap``
    (as the real op's math path does), ``prefix_dims`` leading ``[B, H, Sq, Sk]`` tensor arguments."""
    for axis in (3, 2, 1, 0):  # innermost first: k, q, h, b; each level maps the prefix tensors' leading dim
        dims = [0] * prefix_dims + [None] * 4
        dims[prefix_dims + axis] = 0
        fn = torch.vmap(fn, in_dims=tuple(dims))
    return fn


class FlexAttentionStandIn:
    def __init__(self, dtypes=CUDA_DTYPES, device_type: str = "cpu"):
        self.dtypes, self.device_type, self.calls = tuple(dtypes), device_type, []

    def __call__(self, query, key, value, score_mod=None, block_mask=None, scale=None, enable_gqa=False,
                 return_lse=False, kernel_options=None, *, return_aux=None):
        q, k, v = query, key, value
        if not all(isinstance(t, torch.Tensor) for t in (q, k, v)):
            raise TypeError("query, key and value must be tensors")
        if q.dim() != 4 or k.dim() != 4 or v.dim() != 4:
            raise NotImplementedError("NYI: query, key, and value must be 4D tensors")
        if not (q.dtype == k.dtype == v.dtype):
            raise ValueError(f"Expected query, key, and value to have the same dtype, got {q.dtype}, {k.dtype}, "
                             f"{v.dtype}")
        if not (q.device == k.device == v.device) or q.device.type != self.device_type:
            raise ValueError(f"inputs must all be on {self.device_type}, got {q.device}, {k.device}, {v.device}")
        if q.dtype not in self.dtypes:
            raise ValueError(f"dtype {q.dtype} is not compiled by the FlexAttention lowering ({self.dtypes})")
        if q.size(-1) != k.size(-1):
            raise ValueError(f"Expect query and key/value to have the same embedding dimension but got "
                             f"E={q.size(-1)} and E={k.size(-1)}.")
        if q.size(-1) < 16 or v.size(-1) < 16:
            raise NotImplementedError(f"NYI: embedding dimension of the query, key, and value must be at least 16 "
                                      f"but got E={q.size(-1)} and Ev={v.size(-1)}")
        if q.size(0) != k.size(0) or k.size(0) != v.size(0) or k.shape[:3] != v.shape[:3]:
            raise ValueError(f"batch sizes / key-value shapes differ: {tuple(q.shape)}, {tuple(k.shape)}, "
                             f"{tuple(v.shape)}")
        hq, hkv = q.size(1), k.size(1)
        if not enable_gqa and hq != hkv:
            raise ValueError(f"Expect query and key/value to have the same number of heads but got Hq={hq} and "
                             f"Hkv={hkv}. Try setting enable_gqa=True for GQA.")
        if enable_gqa and hq % hkv:
            raise ValueError(f"Expect number of query heads to be a multiple of kv heads for GQA but got Hq={hq} "
                             f"and Hkv={hkv}.")
        for name, t in (("query", q), ("key", k), ("value", v)):
            if not t.is_contiguous():
                raise ValueError(f"{name} must be contiguous [B, H, S, D] memory (stride {t.stride()})")
        sq, sk = q.size(2), k.size(2)
        if block_mask is not None:
            if not isinstance(block_mask, BlockMask):
                raise TypeError(f"block_mask must be a BlockMask, got {type(block_mask)}")
            if tuple(block_mask.shape[-2:]) != (sq, sk):
                raise ValueError(f"block_mask was created for block_mask.shape={block_mask.shape} but got "
                                 f"q_len={sq} and kv_len={sk}")
            if block_mask.kv_num_blocks.device != q.device:
                raise RuntimeError("Expect q/k/v and block_mask to be on the same device")
        if scale is not None and type(scale) is not float:
            raise TypeError(f"scale must be a Python float, got {type(scale)}")
        if return_lse and return_aux is not None:
            raise ValueError("Cannot specify both return_lse and return_aux.")
        if kernel_options is not None:
            raise ValueError("the stand-in takes no kernel_options (the kernel passes none)")
        self.calls.append(dict(q=q, k=k, v=v, score_mod=score_mod, block_mask=block_mask, scale=scale,
                               enable_gqa=enable_gqa, return_lse=return_lse, return_aux=return_aux))
        out, lse = self._attend(q, k, v, score_mod, block_mask, 1.0 / math.sqrt(q.size(-1)) if scale is None else scale)
        if return_aux is not None:
            return out, type("AuxOutput", (), {"lse": lse if return_aux.lse else None, "max_scores": None})()
        return (out, lse) if return_lse else out

    @staticmethod
    def _attend(q, k, v, score_mod, block_mask, scale):
        b, hq, sq, _ = q.shape
        hkv, sk = k.size(1), k.size(2)
        acc = torch.float64 if q.dtype == torch.float64 else torch.float32
        kx = k.repeat_interleave(hq // hkv, dim=1).to(acc)  # [B, Hq, Sk, D]
        vx = v.repeat_interleave(hq // hkv, dim=1).to(acc)
        s = q.to(acc) @ kx.transpose(-1, -2) * scale  # [B, Hq, Sq, Sk]
        dev = q.device
        bi, hi = torch.arange(b, device=dev), torch.arange(hq, device=dev)
        qi, ki = torch.arange(sq, device=dev), torch.arange(sk, device=dev)
        if score_mod is not None:
            s = _vmap_bhqk(score_mod, 1)(s, bi, hi, qi, ki)
        if block_mask is not None:
            s = s.masked_fill(~_visible(block_mask, b, hq, sq, sk, bi, hi, qi, ki), -math.inf)
        lse = torch.logsumexp(s, dim=-1)  # [B, Hq, Sq]; -inf for a row with no visible key
        p = torch.exp(s - lse[..., None].masked_fill(torch.isneginf(lse)[..., None], 0.0))
        out = (p @ vx).to(q.dtype)  # an empty row: p = 0 -> out = 0
        return out, lse


def _tiles(num_blocks, indices, n_q_tiles, n_k_tiles):
    """``[B', H', Q tiles]`` counts and ``[B', H', Q tiles, K max]`` indices -> ``[B', H', Q tiles, K tiles]`` bool."""
    cols = torch.arange(indices.size(-1), device=indices.device)
    valid = cols < num_blocks[..., None]  # only the first num_blocks entries of a row are meaningful
    out = torch.zeros(*indices.shape[:3], n_k_tiles + 1, dtype=torch.bool, device=indices.device)
    out.scatter_(-1, torch.where(valid, indices.long(), n_k_tiles), True)  # invalid entries: a column dropped below
    return out[:, :, :n_q_tiles, :n_k_tiles]


def _visible(bm: BlockMask, b, hq, sq, sk, bi, hi, qi, ki):
    """The fused kernel's visibility: full tiles, and ``mask_mod`` inside partial tiles."""
    bq, bk = bm.BLOCK_SIZE
    nq, nk = -(-sq // bq), -(-sk // bk)
    partial = _tiles(bm.kv_num_blocks, bm.kv_indices, nq, nk)
    full = (_tiles(bm.full_kv_num_blocks, bm.full_kv_indices, nq, nk) if bm.full_kv_num_blocks is not None
            else torch.zeros_like(partial))
    expand = lambda t: t.repeat_interleave(bq, 2)[:, :, :sq].repeat_interleave(bk, 3)[..., :sk]  # noqa: E731
    partial, full = expand(partial).expand(b, hq, sq, sk), expand(full).expand(b, hq, sq, sk)
    by_mod = _vmap_bhqk(bm.mask_mod, 0)(bi, hi, qi, ki)
    return full | (partial & by_mod)
