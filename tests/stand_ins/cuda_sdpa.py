"""``CudaSdpaStandIn``: a dispatch mode that stands in for PyTorch's CUDA attention ops on CPU.

Under it, ``aten._scaled_dot_product_{flash,efficient,cudnn}_attention`` and their backward ops
(which have no CPU kernel) are intercepted after the real schema has parsed the call (so argument
types are the real schema's). Each call is

1. checked against what the CUDA implementation (torch 2.13, ``attention.cu`` /
   ``attention_backward.cu`` / ``sdp_utils.cpp``, the vendored ``flash_attn/flash_api.cpp``)
   requires, never less strictly than the real op: where the real op does not check and computes
   garbage (or a non-deterministic result) instead, the stand-in refuses too. Each rule names the
   real check it mirrors:

   - dense call: ``cum_seq_* is None`` (a 0-element tensor is *defined* and selects the varlen
     path), ``max_q/max_k`` equal to the sequence lengths, dropout 0;
   - dtypes, head dims (flash ``mha_fwd/mha_bwd``: ``head_size % 8 == 0``, ``<= 256``; cuDNN
     ``check_cudnn_tensor_shapes``: ``% 8``, ``<= 128``; efficient ``check_head_dim_size_mem_efficient``:
     ``% 8`` half, ``% 4`` fp32), head counts (native GQA only for flash and cuDNN);
   - non-empty (``check_nonzero_sequence_lengths_dense``; flash-attn: "batch size must be positive");
   - cuDNN: ``S_k != 1`` and ``B, H <= 65535`` (``check_cudnn_tensor_shapes``, pytorch#138529), a
     square causal block, strides exactly a transposed contiguous ``[B, S, H, D]``
     (``check_cudnn_layout``), and not in strict deterministic mode (``check_cudnn_deterministic``:
     the op itself does not check and runs a non-deterministic backward);
   - every tensor argument: last-dim stride 1 (``check_last_dim_stride_equals_1_dense``, flash
     ``mha_bwd``: "dq must have contiguous last dimension") and a 16-byte aligned start and strides
     (the efficient op's ``check_data_ptr_alignment_mem_efficient`` / ``check_supported``; flash's
     and cuDNN's 128-bit loads fault on a misaligned address);
   - backward: ``grad_out`` and ``out`` of the query's shape and dtype (flash ``mha_bwd``: "query and
     out must have the same dtype"; the efficient and cuDNN backward reinterpret the memory as the
     query's dtype without a check), the efficient backward's ``out`` a transposed contiguous
     ``[B, S, H, D]`` (its M stride is implied, not read); the lse each forward returns, fp32,
     contiguous (the kernels index it without strides), no ``-inf`` (``exp(s - lse)`` overflows);
2. recorded in ``calls`` as ``(op name, args, kwargs)``;
3. answered: on ``meta`` tensors by the real meta kernels, on CPU tensors by a float64 reference
   that also mimics the quirks a caller must handle (flash and cuDNN store ``+inf`` lse for a row
   with no key; the efficient op pads its lse to a multiple of 32 with garbage, and writes NaN
   output for a row with no key).

Every other op runs unchanged.
"""

from __future__ import annotations

import math

import torch
from torch.utils._python_dispatch import TorchDispatchMode

aten = torch.ops.aten
HALF = (torch.float16, torch.bfloat16)


class ContractError(AssertionError):
    """A call the real CUDA op would reject (or answer wrongly)."""


def _require(cond, msg):
    if not cond:
        raise ContractError(msg)


ALIGN_BYTES = 16
CUDNN_MAX_DIM = 65535


def check_aligned(op, **tensors):
    """16-byte aligned start (CUDA allocations are 256-byte aligned, so the storage offset decides)
    and row strides, for every tensor the fused kernel loads with 128-bit accesses."""
    for name, t in tensors.items():
        size = t.element_size()
        _require((t.storage_offset() * size) % ALIGN_BYTES == 0,
                 f"{op}: {name} starts at byte offset {t.storage_offset() * size}, not {ALIGN_BYTES}-byte aligned")
        for dim in range(t.dim() - 1):
            _require(t.size(dim) == 1 or (t.stride(dim) * size) % ALIGN_BYTES == 0,
                     f"{op}: {name} stride {t.stride()} (dim {dim}) is not {ALIGN_BYTES}-byte aligned")


def _check_qkv(op, q, k, v, *, dtypes, native_gqa, max_d, head_dim_multiple):
    for name, t in (("query", q), ("key", k), ("value", v)):
        _require(t.dim() == 4, f"{op}: {name} must be [B, H, S, D], got {tuple(t.shape)}")
        _require(t.dtype in dtypes, f"{op}: {name} dtype {t.dtype} not in {dtypes}")
        _require(t.stride(-1) == 1, f"{op}: {name} last dim must have stride 1")
    _require(k.dtype == q.dtype and v.dtype == q.dtype, f"{op}: query, key and value dtypes differ")
    b, h, sq, d = q.shape
    _require(b > 0 and sq > 0 and k.size(2) > 0, f"{op}: empty batch or sequence {tuple(q.shape)}, {tuple(k.shape)}")
    _require(k.size(0) == b and v.size(0) == b, f"{op}: batch sizes differ")
    _require(k.shape == v.shape, f"{op}: key {tuple(k.shape)} and value {tuple(v.shape)} differ")
    _require(k.size(-1) == d, f"{op}: head dims differ")
    if native_gqa:
        _require(h % k.size(1) == 0, f"{op}: {h} query heads not a multiple of {k.size(1)} kv heads")
    else:
        _require(k.size(1) == h, f"{op}: needs as many kv heads as query heads ({k.size(1)} != {h})")
    _require(d <= max_d, f"{op}: head dim {d} > {max_d}")
    _require(d % head_dim_multiple == 0, f"{op}: head dim {d} is not a multiple of {head_dim_multiple}")
    check_aligned(op, query=q, key=k, value=v)


def _check_grad_out_and_out(op, dout, out, q, v):
    """Backward: ``grad_out`` and ``out`` ``[B, H, Sq, D_v]`` in the query's dtype, last stride 1, aligned."""
    shape = (*q.shape[:3], v.size(-1))
    for name, t in (("grad_out", dout), ("out", out)):
        _require(tuple(t.shape) == shape, f"{op}: {name} shape {tuple(t.shape)} != {shape}")
        _require(t.dtype == q.dtype, f"{op}: {name} dtype {t.dtype} must be the query's ({q.dtype})")
        _require(t.stride(-1) == 1, f"{op}: {name} last dim must have stride 1")
    check_aligned(op, grad_out=dout, out=out)


def _check_cudnn_block(op, q, k, is_causal):
    """``check_cudnn_tensor_shapes`` and ``check_cudnn_deterministic`` (which PyTorch's dispatcher
    applies and a direct call skips), and a square causal block."""
    b, h, sq, _ = q.shape
    _require(k.size(2) != 1, f"{op}: cuDNN attention does not support key/value sequence length 1")
    _require(b <= CUDNN_MAX_DIM and h <= CUDNN_MAX_DIM, f"{op}: batch {b} / heads {h} > {CUDNN_MAX_DIM}")
    _require(not is_causal or sq == k.size(2), f"{op}: causal needs Sq == Sk here")
    strict = torch.are_deterministic_algorithms_enabled() and not torch.is_deterministic_algorithms_warn_only_enabled()
    _require(not strict, f"{op}: cuDNN attention is not deterministic and torch.use_deterministic_algorithms(True) is on")


def _check_bhsd_layout(op, *tensors):
    """cuDNN's ``check_cudnn_layout``: a [B, H, S, D] view of a contiguous [B, S, H, D] tensor."""
    for t in tensors:
        b, h, s, d = t.shape
        _require(t.stride() == (s * h * d, d, h * d, 1), f"{op}: strides {t.stride()} are not [B, S, H, D] contiguous")


def _check_dense_varlen_args(op, cum_q, cum_k, max_q, max_k, q, k):
    _require(cum_q is None and cum_k is None,
             f"{op}: cum_seq_q/cum_seq_k must be None (undefined) for a dense call; a defined tensor "
             f"(even 0-element) selects the varlen path")
    _require((max_q, max_k) == (q.size(2), k.size(2)), f"{op}: max_q/max_k {(max_q, max_k)} != {(q.size(2), k.size(2))}")


def _check_lse(op, lse, shape):
    _require(lse.dtype == torch.float32, f"{op}: logsumexp must be fp32, got {lse.dtype}")
    _require(tuple(lse.shape) == tuple(shape), f"{op}: logsumexp shape {tuple(lse.shape)} != {tuple(shape)}")
    _require(lse.is_contiguous(), f"{op}: logsumexp must be contiguous")
    if lse.device.type != "meta":
        _require(not torch.isneginf(lse).any(), f"{op}: -inf in logsumexp makes exp(s - lse) overflow")


def _check_philox(op, seed, offset, dtype, seed_shape):
    for name, t, shape in (("philox_seed", seed, seed_shape), ("philox_offset", offset, ())):
        _require(isinstance(t, torch.Tensor), f"{op}: {name} must be a tensor, got {t!r}")
        _require(t.dtype == dtype and tuple(t.shape) == shape, f"{op}: {name} {t.dtype}{tuple(t.shape)} != {dtype}{shape}")


# -- float64 reference (q [B, H, Sq, D], k, v [B, H_kv, Sk, D]) -----------------------------------


def _scores(q, k, bias, causal, scale):
    g = q.size(1) // k.size(1)
    kk = k.double().repeat_interleave(g, dim=1)
    s = q.double() @ kk.transpose(-1, -2) * scale  # [B, H, Sq, Sk]
    if bias is not None:
        s = s + bias.double()
    if causal:
        sq, sk = s.shape[-2:]
        s = s.masked_fill(torch.ones(sq, sk, dtype=torch.bool).triu(1), -math.inf)
    return s


def _ref_forward(q, k, v, bias, causal, scale):
    s = _scores(q, k, bias, causal, scale)
    lse = torch.logsumexp(s, -1)  # [B, H, Sq]; -inf where no key
    p = torch.exp(s - lse[..., None]).nan_to_num(nan=0.0)
    out = p @ v.double().repeat_interleave(q.size(1) // k.size(1), dim=1)
    return out, lse


def _ref_backward(dout, q, k, v, out, lse, bias, causal, scale):
    g = q.size(1) // k.size(1)
    s = _scores(q, k, bias, causal, scale)
    p = torch.exp(s - lse.double()[..., None])  # +inf lse -> 0
    do, vv = dout.double(), v.double().repeat_interleave(g, dim=1)
    dv = p.transpose(-1, -2) @ do
    delta = (do * out.double()).sum(-1, keepdim=True)
    ds = p * (do @ vv.transpose(-1, -2) - delta)
    dq = ds @ k.double().repeat_interleave(g, dim=1) * scale
    dk = ds.transpose(-1, -2) @ q.double() * scale

    def fold(x):  # [B, H, Sk, D] -> [B, H_kv, Sk, D]
        b, h, sk, d = x.shape
        return x.view(b, h // g, g, sk, d).sum(2)

    return dq, fold(dk), fold(dv)


class CudaSdpaStandIn(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.calls: list[tuple[str, tuple, dict]] = []

    def names(self) -> list[str]:
        return [c[0] for c in self.calls]

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        handler = _HANDLERS.get(func)
        if handler is None:
            return func(*args, **kwargs)
        name = func.__name__.split(".")[0]
        self.calls.append((name, args, kwargs))
        result = handler(*args, **kwargs)
        if args[0].device.type == "meta":  # shapes from the real meta kernel
            return func(*args, **kwargs)
        return result


def _like(x, ref):
    return x.to(ref.dtype)


def _flash_fwd(q, k, v, dropout_p=0.0, is_causal=False, return_debug_mask=False, *, scale=None):
    op = "_scaled_dot_product_flash_attention"
    _check_qkv(op, q, k, v, dtypes=HALF, native_gqa=True, max_d=256, head_dim_multiple=8)
    _require(dropout_p == 0.0 and not return_debug_mask, f"{op}: dropout / debug mask")
    _require(not is_causal or q.size(2) == k.size(2), f"{op}: causal needs Sq == Sk here")
    if q.device.type == "meta":
        return None
    out, lse = _ref_forward(q, k, v, None, is_causal, scale)
    lse = lse.masked_fill(torch.isneginf(lse), math.inf)  # flash: +inf for a row with no key
    b, h, sq, _ = q.shape
    return (_like(out, q), lse.float(), None, None, sq, k.size(2), torch.zeros(2, dtype=torch.uint64),
            torch.zeros((), dtype=torch.uint64), torch.empty(0, dtype=q.dtype))


def _flash_bwd(dout, q, k, v, out, lse, cum_q, cum_k, max_q, max_k, dropout_p, is_causal, seed, offset, *, scale=None):
    op = "_scaled_dot_product_flash_attention_backward"
    _check_qkv(op, q, k, v, dtypes=HALF, native_gqa=True, max_d=256, head_dim_multiple=8)
    _check_dense_varlen_args(op, cum_q, cum_k, max_q, max_k, q, k)
    _require(dropout_p == 0.0, f"{op}: dropout")
    _require(not is_causal or q.size(2) == k.size(2), f"{op}: causal needs Sq == Sk here")
    _check_grad_out_and_out(op, dout, out, q, v)
    _check_lse(op, lse, q.shape[:3])
    _check_philox(op, seed, offset, torch.uint64, (2,))
    if q.device.type == "meta":
        return None
    return tuple(_like(g, t) for g, t in zip(_ref_backward(dout, q, k, v, out, lse, None, is_causal, scale), (q, k, v)))


def _cudnn_fwd(q, k, v, attn_bias, compute_log_sumexp, dropout_p=0.0, is_causal=False, return_debug_mask=False, *, scale=None):
    op = "_scaled_dot_product_cudnn_attention"
    _check_qkv(op, q, k, v, dtypes=HALF, native_gqa=True, max_d=128, head_dim_multiple=8)
    _check_bhsd_layout(op, q, k, v)
    _check_cudnn_block(op, q, k, is_causal)
    _require(compute_log_sumexp and dropout_p == 0.0, f"{op}: needs compute_log_sumexp=True, dropout 0")
    if q.device.type == "meta":
        return None
    out, lse = _ref_forward(q, k, v, attn_bias, is_causal, scale)
    lse = lse.masked_fill(torch.isneginf(lse), math.inf)
    b, h, sq, _ = q.shape
    seed = torch.zeros((), dtype=torch.int64)
    return (_like(out, q), lse.float().unsqueeze(-1), None, None, sq, k.size(2), seed, seed.clone(), None)


def _cudnn_bwd(dout, q, k, v, out, lse, seed, offset, attn_bias, cum_q, cum_k, max_q, max_k, dropout_p, is_causal, *, scale=None):
    op = "_scaled_dot_product_cudnn_attention_backward"
    _check_qkv(op, q, k, v, dtypes=HALF, native_gqa=True, max_d=128, head_dim_multiple=8)
    _check_cudnn_block(op, q, k, is_causal)
    _check_grad_out_and_out(op, dout, out, q, v)
    _check_bhsd_layout(op, q, k, v, out, dout)
    _check_dense_varlen_args(op, cum_q, cum_k, max_q, max_k, q, k)
    _require(dropout_p == 0.0, f"{op}: dropout")
    _check_lse(op, lse, (*q.shape[:3], 1))
    _check_philox(op, seed, offset, torch.int64, ())
    if q.device.type == "meta":
        return None
    return tuple(_like(g, t) for g, t in zip(_ref_backward(dout, q, k, v, out, lse[..., 0], attn_bias, is_causal, scale), (q, k, v)))


def _check_bias(op, bias, q, k):
    if bias is None:
        return
    b, h, sq, _ = q.shape
    _require(tuple(bias.shape) == (b, h, sq, k.size(2)), f"{op}: attn_bias shape {tuple(bias.shape)}")
    _require(bias.dtype == q.dtype, f"{op}: attn_bias dtype {bias.dtype} != query dtype {q.dtype}")
    _require(bias.stride(-1) == 1 and bias.stride(-2) % 16 == 0, f"{op}: attn_bias is not correctly aligned (stride {bias.stride()})")


def _eff_fwd(q, k, v, attn_bias, compute_log_sumexp, dropout_p=0.0, is_causal=False, *, scale=None):
    op = "_scaled_dot_product_efficient_attention"
    _check_qkv(op, q, k, v, dtypes=(*HALF, torch.float32), native_gqa=False, max_d=10**9,
               head_dim_multiple=8 if q.dtype in HALF else 4)
    _require(compute_log_sumexp and dropout_p == 0.0, f"{op}: needs compute_log_sumexp=True, dropout 0")
    _check_bias(op, attn_bias, q, k)
    if q.device.type == "meta":
        return None
    out, lse = _ref_forward(q, k, v, attn_bias, is_causal, scale)
    out = out.masked_fill(torch.isneginf(lse)[..., None], math.nan)  # no key: garbage the caller must clear
    b, h, sq, _ = q.shape
    padded = torch.full((b, h, -(-sq // 32) * 32), math.nan, dtype=torch.float32)
    padded[:, :, :sq] = lse.masked_fill(torch.isneginf(lse), math.inf)
    seed = torch.zeros((), dtype=torch.int64)
    return _like(out, q), padded, seed, seed.clone()


def _eff_bwd(dout, q, k, v, attn_bias, out, lse, seed, offset, dropout_p, grad_input_mask, is_causal=False, *, scale=None):
    op = "_scaled_dot_product_efficient_attention_backward"
    _check_qkv(op, q, k, v, dtypes=(*HALF, torch.float32), native_gqa=False, max_d=10**9,
               head_dim_multiple=8 if q.dtype in HALF else 4)
    _check_grad_out_and_out(op, dout, out, q, v)
    # the kernel reads out's batch and head strides but implies its sequence stride (H * D_v)
    _require(out.stride(2) == out.size(1) * out.size(3) and out.stride(1) == out.size(3),
             f"{op}: out strides {out.stride()} are not a [B, H, S, D] view of [B, S, H, D] rows")
    _check_bias(op, attn_bias, q, k)
    _require(dropout_p == 0.0, f"{op}: dropout")
    _require(list(grad_input_mask) == [True, True, True, False], f"{op}: grad_input_mask {grad_input_mask}")
    b, h, sq, _ = q.shape
    _check_lse(op, lse, (b, h, -(-sq // 32) * 32))
    _check_philox(op, seed, offset, torch.int64, ())
    if q.device.type == "meta":
        return None
    grads = _ref_backward(dout, q, k, v, out, lse[:, :, :sq], attn_bias, is_causal, scale)
    return (*(_like(g, t) for g, t in zip(grads, (q, k, v))), None)


_HANDLERS = {
    aten._scaled_dot_product_flash_attention.default: _flash_fwd,
    aten._scaled_dot_product_flash_attention_backward.default: _flash_bwd,
    aten._scaled_dot_product_cudnn_attention.default: _cudnn_fwd,
    aten._scaled_dot_product_cudnn_attention_backward.default: _cudnn_bwd,
    aten._scaled_dot_product_efficient_attention.default: _eff_fwd,
    aten._scaled_dot_product_efficient_attention_backward.default: _eff_bwd,
}
