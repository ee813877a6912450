"""Local attention kernels: ``forward -> (out, lse)`` and a backward that takes the *global* output
and log-sum-exp, so a ring backend can differentiate each block against the merged result.

Shapes (all kernels): ``q [B, Sq, H, D]``, ``k, v [B, Sk, H_kv, D]`` with ``H % H_kv == 0``
(query head ``h`` uses KV head ``h // (H / H_kv)``), ``out [B, Sq, H, D]``, ``lse [B, H, Sq]`` in
the accumulation dtype (fp32, fp64 for fp64). Masks come from ``plan.MaskKind``: FULL, CAUSAL
(square, aligned) or a DENSE ``[Sq, Sk]`` bool tensor (True = visible). A row with no visible key
gets ``out = 0`` and ``lse = -inf``; every backward accepts ``-inf`` rows (their gradient is 0).

Kernels (``KERNELS``):

- ``torch``: blockwise pure PyTorch (tiles of ``128 x 512``; never materialises the whole score
  matrix); any float dtype incl. fp64, any device; the reference implementation and the last
  fallback of every other kernel.
- ``sdpa``: PyTorch's fused ops. CPU: ``aten._scaled_dot_product_flash_attention_for_cpu`` (+ its
  backward), every dtype and mask; K/V with ``H_kv`` heads natively where the op takes them
  (``cpu_sdpa_takes_gqa``), else repeated per query head. CUDA: the flash op where eligible, else
  the memory-efficient op, else ``torch``.
- ``efficient`` (CUDA): ``aten._scaled_dot_product_efficient_attention``, else ``torch``.
- ``cudnn`` (CUDA): ``aten._scaled_dot_product_cudnn_attention`` (what PyTorch's context parallel
  uses on Hopper), else the efficient op, else ``torch``.
- ``flash_attn`` (CUDA): the flash-attn package 2.6 / 2.7 / 2.8 (pinned by ``__version__``;
  imported lazily), else the efficient op, else ``torch``. Natively, per call (``kernel_for_call``): a
  sliding window's DENSE blocks whose mask is exactly a band (Note [flash-attn windows for DENSE blocks])
  and a soft-cap that is the only score modifier (Note [flash-attn soft-capping]).
- ``flex`` (``ops/flex.py``): FlexAttention (compiled) for every block on CUDA (fp16, bf16, fp32, head dims
  >= 16), else ``sdpa``; calls with score modifiers too (``score_mod_kernel``). Opt-in: not yet run on a GPU.
  Under every other kernel a call with score modifiers runs the pure-PyTorch ``ScoreModKernel``.
- ``auto``: CPU: ``sdpa``. CUDA: ``flash_attn`` when a supported flash-attn is installed, else
  ``sdpa``, with the cuDNN op tried first on Hopper (Note [cuDNN first on Hopper], measured on an H200).

Note [CUDA kernel eligibility] (checked per block call, ``why_not``):

=============  =================  ==========================  ========  ===========  ==========
op             dtypes             head dim D                  arch      masks        H_kv != H
=============  =================  ==========================  ========  ===========  ==========
flash (SDPA)   fp16, bf16         D % 8 == 0, D <= 256 (*)    sm80+     FULL/CAUSAL  native
flash-attn     fp16, bf16         D % 8 == 0, D <= 256        sm80+     FULL/CAUSAL  native
                                                                        (+ DENSE
                                                                        bands)
cuDNN          fp16, bf16         D % 8 == 0, D <= 128        sm80-121  FULL/CAUSAL  native
efficient      fp16, bf16, fp32   D % 8 (half) / 4 (fp32)     sm50+     all (DENSE   expanded
                                                                        as a bias)
torch          any float          any                         any       all          expanded
=============  =================  ==========================  ========  ===========  ==========

(*) PyTorch refuses flash backward for D > 192 on sm86/sm89/sm120; those blocks go to the next op.
bf16 needs sm80+ for every fused op. fp64 always runs ``torch``. "native": K/V go in with their
``H_kv`` heads (the op broadcasts them, and its dK/dV come back with ``H_kv`` heads); "expanded":
``expand_kv`` repeats them per query head (the efficient op's GQA support differs between PyTorch
builds, so it is not relied on).

Rules that depend on the block, not only on the model (the checks PyTorch's dispatcher makes in
``sdp_utils.cpp`` and that a direct op call skips):

- every fused op needs ``B >= 1``, ``S_q >= 1`` and ``S_k >= 1`` (``check_nonzero_sequence_lengths_dense``;
  flash-attn's ``mha_fwd``: "batch size must be positive");
- cuDNN needs ``S_k != 1`` ("cudnn SDPA does not support key/value sequence length 1",
  ``check_cudnn_tensor_shapes``, pytorch#138529) and ``B, H <= 65535``: a one-token document, or a
  causal piece with one key, goes to the efficient op;
- deterministic mode (``torch.use_deterministic_algorithms(True)``, not ``warn_only``) never runs
  cuDNN: PyTorch's dispatcher drops it (``check_cudnn_deterministic``) but the op called directly
  does not check and runs a non-deterministic backward. The flash op's and the efficient op's
  backward read the same flag themselves and run deterministically (one key split, ordered dQ
  accumulation), and flash-attn gets ``deterministic=True``, so those stay eligible; ``torch`` is
  deterministic, so some op is always eligible. With ``warn_only=True`` the ops run as PyTorch's own
  dispatcher would run them (cuDNN included), and warn themselves.

What every fused call gets, whatever the caller passed (a slice, a view with an odd storage offset,
a non-contiguous last dim, an fp32 merged ``out``): ``_fused_input`` tensors, contiguous ``[B, S, H, D]``
with a 16-byte aligned start (the efficient op's ``check_supported``, flash-attn's 128-bit loads,
cuDNN), ``out`` and ``dout`` in the query's dtype (flash-attn's ``mha_bwd`` checks it; the efficient
and cuDNN backward reinterpret the memory silently), a contiguous fp32 lse, and a float
``softmax_scale`` (flash-attn 2.7+ registers its functions as ``torch.library`` custom ops, whose
schema checks every argument's type).

Note [flash-attn windows for DENSE blocks]
    flash-attn's ``window_size=(left, right)`` lets query row ``i`` see key rows ``j`` with
    ``i + S_k - S_q - left <= j <= i + S_k - S_q + right`` (bottom-right aligned; negative: unbounded), after
    ``mha_fwd``/``mha_bwd`` normalise it: a bound ``>= S_k`` becomes unbounded, ``causal`` sets ``right = 0``,
    and ``set_params_fprop`` turns an unbounded side beside a bounded one into ``S_k``. A planned call under a
    mask (Note [Plans under a mask] in ``ops/plan.py``) covers global queries ``[q0, q0 + S_q)`` and keys
    ``[k0, k0 + S_k)``; when they lie in one document, the shared key padding does not cut the keys and no
    bidirectional span boundary cuts either side, its visibility is ``low <= (k0 + j) - (q0 + i) <= high``
    (``-window left``, ``min(window right, 0 if causal outside a common span)``), a band on local rows shifted by
    ``k0 - q0``. ``flash_attn_window`` maps it to ``(left, right)`` and refuses, with the reason, a band whose
    binding bound would have to be negative (a ring block far from the diagonal), a right bound ``> S_k`` (read
    as unbounded), or an unbounded right side beside a left bound when ``S_q > S_k + 1`` (capped at ``S_k``, it
    would hide keys from the first rows). Those blocks, and any DENSE block of another mask, keep the efficient
    op (its additive bias) or ``torch``; ``why_not``'s ``band`` carries the reason. Rows the band leaves empty get
    ``lse = +inf`` and ``out = 0`` from flash-attn, then our convention (``_empty_rows_to_convention``).
    Checked exhaustively against the stand-in's model of the real normalisation (``tests/unit/
    test_flash_window.py``): every window it returns reproduces ``StructuredMask.visible`` exactly, and for the
    bands it refuses no ``(left, right)`` does.

Note [flash-attn soft-capping]
    flash-attn's ``softcap`` computes ``softcap * tanh(scale * q.k / softcap)`` (``set_params_fprop``: the
    scores are multiplied by ``scale / softcap``, tanh-ed, then scaled by ``softcap`` in the softmax) and its
    backward multiplies ``dS`` by ``1 - tanh^2``: exactly ``masks.ScoreMods``' soft-cap, applied first, and the lse
    it returns (and reads back in the backward) is that of the capped scores, so the ring merges it as any
    other. A call whose only score modifier is a soft-cap (``flash_attn_softcap``; attention sinks join the
    merged result, not the scores) runs flash-attn with it on eligible blocks, FULL, CAUSAL or a band, and the
    call's exact ``ScoreModKernel`` on the others (the efficient op has no soft-cap). ``mha_fwd`` refuses a
    soft-cap with dropout; we never pass dropout. ALiBi is not passed: flash-attn's bias is
    ``-slope * |i + S_k - S_q - j|`` on the block's local rows (our ``-slope * |q - k|`` on global positions only
    when ``q0 + S_q == k0 + S_k``), and with ``causal`` it adds ``slope * j`` instead (softmax-invariant per
    row, but the lse it returns then differs from the exact one the ring merges).

Note [Calling the SDPA ops directly]: the backward ops are called with exactly what the forward
op would have returned for a dense (not varlen), dropout-free call, because forward residuals are
not kept: ``cum_seq_q = cum_seq_k = None`` (an *undefined* tensor; a 0-element tensor is
"defined" and selects the varlen path), ``max_q = Sq``, ``max_k = Sk``, placeholder philox
seed/offset of the forward's dtype and shape (unread when ``dropout_p = 0``), the efficient op's
lse padded to a multiple of 32 along the sequence and the cuDNN op's lse as ``[B, H, Sq, 1]``. A
``-inf`` lse row is passed as ``+inf``, so that ``p = exp(s - lse) = 0`` inside the fused kernel
(flash-attn itself stores ``+inf`` for a row that saw no key).
"""

from __future__ import annotations

import bisect
import copy
import functools
import math
from typing import Protocol

import torch

from lightning_sp.masks import StructuredMask
from lightning_sp.ops.flex import FlexKernel
from lightning_sp.ops.merge import accumulation_dtype, merge_into
from lightning_sp.ops.plan import MaskKind

KERNELS = ("auto", "torch", "sdpa", "flash_attn", "efficient", "cudnn", "flex")

_HALF = (torch.float16, torch.bfloat16)
FLASH_ATTN_VERSIONS = ("2.6", "2.7", "2.8")
"""flash-attn minor versions whose private ``_flash_attn_forward/_backward`` signatures we call."""


def check_heads(q: torch.Tensor, k: torch.Tensor) -> None:
    """Every kernel's first check: ``q``'s heads a positive multiple of ``k``'s (GQA groups). Without it, fewer
    query heads than K/V heads kill the process inside PyTorch's CPU flash op (SIGFPE, torch 2.13), and a
    non-multiple pairs the wrong heads."""
    h, h_kv = q.size(2), k.size(2)
    if h_kv < 1 or h % h_kv:
        raise ValueError(f"q has {h} heads and k/v have {h_kv}: the query heads must be a positive multiple of the "
                         f"K/V heads (each K/V head serves H / H_kv query heads); pass [B, S, H, D] tensors")


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

    def prefers_heads_major(self, device: torch.device) -> bool:
        """Whether the op reads ``[B, S, H, D]`` q/K/V faster when their memory is head-major (``[B, H, S, D]``
        contiguous, seen through a transpose): the ring then lays them out so once per call
        (``ops/ring_attention.py``, Note [Head-major blocks]) and Ulysses gathers them so (Note [Head-major
        gather] in ``comm/collectives.py``). Optional: a kernel without it gets ``[B, S, H, D]`` memory."""
        ...

    def forward(self, q, k, v, *, scale: float, kind: MaskKind, mask) -> tuple[torch.Tensor, torch.Tensor]: ...

    def backward(self, dout, q, k, v, out, lse, *, scale: float, kind: MaskKind, mask) -> tuple[torch.Tensor, ...]: ...


def prefers_heads_major(kernel: LocalKernel, device: torch.device) -> bool:
    """``kernel.prefers_heads_major(device)``, ``False`` for a kernel without the method (it is optional)."""
    prefers = getattr(kernel, "prefers_heads_major", None)
    return prefers is not None and bool(prefers(device))


# ----------------------------------------------------------------------------------------------
# eligibility (Note [CUDA kernel eligibility])
# ----------------------------------------------------------------------------------------------

CUDA_OPS = ("flash", "flash_attn", "cudnn", "efficient")


def why_not(
    op: str,
    *,
    dtype: torch.dtype,
    head_dim: int,
    kind: MaskKind,
    capability: tuple[int, int],
    batch: int,
    heads: int,
    seq_len_q: int,
    seq_len_k: int,
    deterministic: bool,
    band: "tuple[int, int] | str | None" = None,
) -> str | None:
    """``None`` if the CUDA ``op`` can run this block (``q [batch, seq_len_q, heads, head_dim]``
    against ``seq_len_k`` keys), else the reason it cannot. ``deterministic``: strict deterministic
    mode is on (``deterministic_required()``). ``band``: for a DENSE block, the flash-attn window
    ``(left, right)`` that is exactly its mask, or why there is none (``flash_attn_window``); only
    ``flash_attn`` reads it. Note [CUDA kernel eligibility]."""
    if op not in CUDA_OPS:
        raise ValueError(f"op must be one of {CUDA_OPS}, got {op!r}")
    if min(batch, seq_len_q, seq_len_k) < 1:
        return f"empty block (B={batch}, S_q={seq_len_q}, S_k={seq_len_k})"
    major, minor = capability
    if op == "efficient":
        if dtype not in (*_HALF, torch.float32):
            return f"dtype {dtype} (needs fp16, bf16 or fp32)"
        if major < 5:
            return f"sm{major}{minor} (needs sm50+)"
        if dtype is torch.bfloat16 and major < 8:
            return f"bf16 on sm{major}{minor} (needs sm80+)"
        align = 8 if dtype in _HALF else 4
        if head_dim % align:
            return f"head dim {head_dim} (needs a multiple of {align})"
        return None
    if dtype not in _HALF:
        return f"dtype {dtype} (needs fp16 or bf16)"
    if kind is MaskKind.DENSE and not (op == "flash_attn" and isinstance(band, tuple)):
        if op != "flash_attn":
            return "DENSE mask (needs FULL or CAUSAL)"
        why = f": {band}" if isinstance(band, str) else ""
        return f"DENSE mask that no flash-attn window expresses exactly (needs FULL, CAUSAL or a band{why})"
    if head_dim % 8:
        return f"head dim {head_dim} (needs a multiple of 8)"
    if major < 8:
        return f"sm{major}{minor} (needs sm80+)"
    if op == "cudnn":
        if (major, minor) > (12, 1):
            return f"sm{major}{minor} (cuDNN attention covers sm80-sm121)"
        if head_dim > 128:
            return f"head dim {head_dim} (needs <= 128)"
        if seq_len_k == 1:
            return "one key (cuDNN attention does not support S_k == 1)"
        if max(batch, heads) > _CUDNN_MAX_DIM:
            return f"B={batch}, H={heads} (cuDNN attention needs both <= {_CUDNN_MAX_DIM})"
        if deterministic:
            return "torch.use_deterministic_algorithms(True) is on and cuDNN attention is not deterministic"
        return None
    if head_dim > 256:
        return f"head dim {head_dim} (needs <= 256)"
    if op == "flash" and head_dim > 192 and (major, minor) in ((8, 6), (8, 9), (12, 0)):
        return f"head dim {head_dim} > 192 on sm{major}{minor} (PyTorch has no flash backward for it)"
    return None


_CUDNN_MAX_DIM = 65535
"""cuDNN attention's largest batch size and head count (``check_cudnn_tensor_shapes``)."""


def deterministic_required() -> bool:
    """``torch.use_deterministic_algorithms(True)`` without ``warn_only``: only deterministic ops run."""
    return torch.are_deterministic_algorithms_enabled() and not torch.is_deterministic_algorithms_warn_only_enabled()


_ALIGN_BYTES = 16


def _fused_input(x: torch.Tensor) -> torch.Tensor:
    """``x`` contiguous, starting at a 16-byte aligned address (CUDA allocations are 256-byte
    aligned, so the storage offset decides). A contiguous slice or view keeps its storage offset,
    which can be odd (a view into a flat buffer); the fused ops then read misaligned (the efficient
    op refuses, flash-attn faults with a misaligned address), so such a tensor is copied."""
    x = x.contiguous()
    if (x.storage_offset() * x.element_size()) % _ALIGN_BYTES:
        x = x.clone(memory_format=torch.contiguous_format)
    return x


def _bhsd(x: torch.Tensor, *, exact: bool = False) -> torch.Tensor:
    """``[B, S, H, D]`` -> a ``[B, H, S, D]`` view of a contiguous, 16-byte aligned ``[B, S, H, D]``
    tensor (the SDPA ops' layout; ``_fused_input``). ``exact``: also the canonical batch stride
    ``S*H*D``, which cuDNN checks even for ``B = 1`` (a sequence slice of a longer tensor is
    contiguous but has a larger one)."""
    x = _fused_input(x)
    if exact and x.stride(0) != x[0].numel():
        x = x.clone(memory_format=torch.contiguous_format)
    return x.transpose(1, 2)


def _bias(mask: torch.Tensor, b: int, h: int, dtype) -> torch.Tensor:
    """DENSE ``[Sq, Sk]`` bool -> additive ``[B, H, Sq, Sk]`` bias for the efficient op: 0 where
    visible, ``-inf`` elsewhere; rows padded to a multiple of 16 elements (the op's alignment rule;
    PyTorch's own ``pad_bias`` does the same) and broadcast over B and H."""
    sq, sk = mask.shape
    padded = torch.zeros(sq, -(-sk // 16) * 16, dtype=dtype, device=mask.device)
    padded[:, :sk].masked_fill_(~mask, -math.inf)
    return padded[:, :sk].expand(b, h, sq, sk)


def _lse_for_backward(lse: torch.Tensor) -> torch.Tensor:
    """``[B, H, Sq]`` merged lse -> fp32 contiguous, ``-inf`` (no key) as ``+inf`` so p = 0."""
    lse = lse.float()
    return lse.masked_fill(torch.isneginf(lse), math.inf).contiguous()


def _empty_rows_to_convention(out, lse, kind, mask):
    """Rows that saw no key: ``out = 0``, ``lse = -inf`` (fused ops write ``+inf`` or garbage)."""
    lse = lse.masked_fill(torch.isposinf(lse), -math.inf)
    if kind is MaskKind.DENSE:
        empty = ~mask.any(-1)  # [Sq]
        lse = lse.masked_fill(empty, -math.inf)
        out = out.masked_fill(empty[None, :, None, None], 0.0)
    return out, lse


# ----------------------------------------------------------------------------------------------
# the fused CUDA ops (argument lists: Note [Calling the SDPA ops directly])
# ----------------------------------------------------------------------------------------------


def _flash_sdpa_forward(q, k, v, *, scale, kind, mask):
    res = torch.ops.aten._scaled_dot_product_flash_attention(
        _bhsd(q), _bhsd(k), _bhsd(v), 0.0, kind is MaskKind.CAUSAL, False, scale=scale
    )  # (out [B, H, Sq, D], lse [B, H, Sq] fp32, cum_q, cum_k, max_q, max_k, rng_state, unused, debug)
    return res[0].transpose(1, 2), res[1]


def _flash_sdpa_backward(dout, q, k, v, out, lse, *, scale, kind, mask):
    dev = q.device
    dq, dk, dv = torch.ops.aten._scaled_dot_product_flash_attention_backward(
        _bhsd(dout), _bhsd(q), _bhsd(k), _bhsd(v), _bhsd(out), _lse_for_backward(lse),
        None, None, q.size(1), k.size(1), 0.0, kind is MaskKind.CAUSAL,
        torch.empty(2, dtype=torch.uint64, device=dev), torch.empty((), dtype=torch.uint64, device=dev),
        scale=scale,
    )  # [B, H, S, D] each; dk, dv with H_kv heads
    return dq.transpose(1, 2), dk.transpose(1, 2), dv.transpose(1, 2)


def _cudnn_forward(q, k, v, *, scale, kind, mask):
    res = torch.ops.aten._scaled_dot_product_cudnn_attention(
        _bhsd(q, exact=True), _bhsd(k, exact=True), _bhsd(v, exact=True), None, True, 0.0, kind is MaskKind.CAUSAL,
        False, scale=scale,
    )  # (out [B, H, Sq, D], lse [B, H, Sq, 1] fp32, cum_q, cum_k, max_q, max_k, seed, offset, debug)
    return res[0].transpose(1, 2), res[1].reshape(res[1].shape[:3])


def _cudnn_backward(dout, q, k, v, out, lse, *, scale, kind, mask):
    dev = q.device
    seed = torch.zeros((), dtype=torch.int64, device=dev)
    dq, dk, dv = torch.ops.aten._scaled_dot_product_cudnn_attention_backward(
        *(_bhsd(t, exact=True) for t in (dout, q, k, v, out)), _lse_for_backward(lse).unsqueeze(-1),
        seed, seed.clone(), None, None, None, q.size(1), k.size(1), 0.0, kind is MaskKind.CAUSAL, scale=scale,
    )
    return dq.transpose(1, 2), dk.transpose(1, 2), dv.transpose(1, 2)


def _efficient_forward(q, k, v, *, scale, kind, mask):
    b, sq, h, _ = q.shape
    bias = _bias(mask, b, h, q.dtype) if kind is MaskKind.DENSE else None
    res = torch.ops.aten._scaled_dot_product_efficient_attention(
        _bhsd(q), _bhsd(expand_kv(k, h)), _bhsd(expand_kv(v, h)), bias, True, 0.0, kind is MaskKind.CAUSAL, scale=scale
    )  # (out [B, H, Sq, D], lse [B, H, ceil(Sq/32)*32] fp32, seed, offset)
    return res[0].transpose(1, 2), res[1][:, :, :sq]


def _efficient_backward(dout, q, k, v, out, lse, *, scale, kind, mask):
    b, sq, h, _ = q.shape
    h_kv = k.size(2)
    bias = _bias(mask, b, h, q.dtype) if kind is MaskKind.DENSE else None
    lse_padded = torch.full((b, h, -(-sq // 32) * 32), math.inf, dtype=torch.float32, device=q.device)
    lse_padded[:, :, :sq] = _lse_for_backward(lse)
    seed = torch.zeros((), dtype=torch.int64, device=q.device)
    dq, dk, dv, _ = torch.ops.aten._scaled_dot_product_efficient_attention_backward(
        _bhsd(dout), _bhsd(q), _bhsd(expand_kv(k, h)), _bhsd(expand_kv(v, h)), bias, _bhsd(out), lse_padded,
        seed, seed.clone(), 0.0, [True, True, True, False], kind is MaskKind.CAUSAL, scale=scale,
    )
    return dq.transpose(1, 2), reduce_kv_grad(dk.transpose(1, 2), h_kv), reduce_kv_grad(dv.transpose(1, 2), h_kv)


_CUDA_FORWARD = {"flash": _flash_sdpa_forward, "cudnn": _cudnn_forward, "efficient": _efficient_forward}
_CUDA_BACKWARD = {"flash": _flash_sdpa_backward, "cudnn": _cudnn_backward, "efficient": _efficient_backward}


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

    def _tile_scores(self, qh, kh, q0, q1, k0, k1, *, scale, kind, mask):
        """One tile's ``(scores [B, H, bq, bk], visible [bq, bk] or None)`` from ``qh [B, H, Sq, D]``, ``kh [B, H, Sk, D]``
        (``ScoreModKernel`` modifies the scores and narrows what is visible here)."""
        s = qh[:, :, q0:q1] @ kh[:, :, k0:k1].transpose(-1, -2) * scale  # [B, H, bq, bk]
        return s, self._tile_visible(kind, mask, q0, q1, k0, k1, qh.device)

    def forward(self, q, k, v, *, scale, kind, mask):
        check_heads(q, k)
        acc = accumulation_dtype(q.dtype)
        b, sq, h, _ = q.shape
        qh = q.transpose(1, 2).to(acc)  # [B, H, Sq, D]
        kh = expand_kv(k, h).transpose(1, 2).to(acc)  # [B, H, Sk, D]
        vh = expand_kv(v, h).transpose(1, 2).to(acc)
        out = torch.zeros(b, sq, h, v.size(-1), dtype=acc, device=q.device)  # [B, Sq, H, D]
        lse = torch.full((b, h, sq), -math.inf, dtype=acc, device=q.device)  # [B, H, Sq]
        for q0, q1, k0, k1 in self._tiles(sq, k.size(1), kind):
            s, visible = self._tile_scores(qh, kh, q0, q1, k0, k1, scale=scale, kind=kind, mask=mask)
            if visible is not None:
                s = s.masked_fill(~visible, -math.inf)
            tile_lse = torch.logsumexp(s, dim=-1)  # [B, H, bq]
            p = torch.exp(s - tile_lse.unsqueeze(-1)).nan_to_num(nan=0.0)  # rows with no key: 0
            tile_out = (p @ vh[:, :, k0:k1]).transpose(1, 2)  # [B, bq, H, D]
            merge_into(out[:, q0:q1], lse[:, :, q0:q1], tile_out, tile_lse)
        return out, lse

    def backward(self, dout, q, k, v, out, lse, *, scale, kind, mask):
        check_heads(q, k)
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
# CUDA kernels: a preference list of fused ops, then ``torch``
# ----------------------------------------------------------------------------------------------


class _CudaChainKernel:
    """Runs each block with the first op of ``self.ops`` that is eligible for it (``why_not``), else
    the ``torch`` kernel. ``device_type="cuda"`` and ``capability`` force the CUDA path for tensors
    of another device (``meta`` in the unit tests, which check the exact op argument lists)."""

    name = ""
    ops: tuple[str, ...] = ()
    band: "tuple[int, int] | str | None" = None
    """A DENSE call's flash-attn window, or why it has none (``why_not``'s ``band``; set on ``FlashAttnKernel``'s
    per-call views only)."""

    def __init__(self, *, device_type: str | None = None, capability: tuple[int, int] | None = None):
        self.device_type, self.capability = device_type, capability
        self._fallback = TorchBlockwiseKernel()

    def _device_type(self, q) -> str:
        return self.device_type or q.device.type

    def _capability(self, q) -> tuple[int, int]:
        return self.capability or torch.cuda.get_device_capability(q.device)

    def _block(self, q, k, kind: MaskKind) -> dict:
        b, sq, h, d = q.shape
        return dict(dtype=q.dtype, head_dim=d, kind=kind, capability=self._capability(q), batch=b, heads=h,
                    seq_len_q=sq, seq_len_k=k.size(1), deterministic=deterministic_required(), band=self.band)

    def choose(self, q, k, kind: MaskKind) -> str:
        """The op this kernel runs a block ``q [B, Sq, H, D]``, ``k [B, Sk, H_kv, D]`` of mask ``kind``
        with (CUDA). Reads the deterministic mode at each call (the forward and the backward of a block
        may differ if it is switched in between; both are exact)."""
        block = self._block(q, k, kind)
        for op in self._ops(q):
            if self._op_available(op) and why_not(op, **block) is None:
                return op
        return "torch"

    def reasons(self, q, k, kind: MaskKind) -> dict[str, str | None]:
        """Each op this kernel tries for the block, in order -> why it does not run it (``None``: it can; ``choose``
        picks the first such op, else ``torch``)."""
        block = self._block(q, k, kind)
        return {op: why_not(op, **block) if self._op_available(op) else f"{op} is not available in this build"
                for op in self._ops(q)}

    def _ops(self, q) -> tuple[str, ...]:
        """The ops tried for a block of ``q``, first eligible wins."""
        return self.ops

    def _op_available(self, op: str) -> bool:
        return True

    def _cuda_only(self, device) -> ValueError:
        return ValueError(f"kernel={self.name!r} runs on CUDA tensors only (got {device.type}); use kernel='sdpa' or 'torch'")

    def _cpu_forward(self, q, k, v, *, scale, kind, mask):
        raise self._cuda_only(q.device)

    def _cpu_backward(self, dout, q, k, v, out, lse, *, scale, kind, mask):
        raise self._cuda_only(q.device)

    def _run_forward(self, op, q, k, v, *, scale, kind, mask):
        return _CUDA_FORWARD[op](q, k, v, scale=scale, kind=kind, mask=mask)

    def _run_backward(self, op, dout, q, k, v, out, lse, *, scale, kind, mask):
        return _CUDA_BACKWARD[op](dout, q, k, v, out, lse, scale=scale, kind=kind, mask=mask)

    def forward(self, q, k, v, *, scale, kind, mask):
        check_heads(q, k)
        if self._device_type(q) != "cuda":
            return self._cpu_forward(q, k, v, scale=scale, kind=kind, mask=mask)
        op = self.choose(q, k, kind)
        if op == "torch":
            return self._fallback.forward(q, k, v, scale=scale, kind=kind, mask=mask)
        out, lse = self._run_forward(op, q, k, v, scale=float(scale), kind=kind, mask=mask)
        return _empty_rows_to_convention(out, lse, kind, mask)

    def backward(self, dout, q, k, v, out, lse, *, scale, kind, mask):
        check_heads(q, k)
        if self._device_type(q) != "cuda":
            return self._cpu_backward(dout, q, k, v, out, lse, scale=scale, kind=kind, mask=mask)
        op = self.choose(q, k, kind)
        if op == "torch":
            return self._fallback.backward(dout, q, k, v, out, lse, scale=scale, kind=kind, mask=mask)
        dout, out = dout.to(q.dtype), out.to(q.dtype)  # the fused ops read them as the query's dtype
        return self._run_backward(op, dout, q, k, v, out, lse, scale=float(scale), kind=kind, mask=mask)


class SDPAKernel(_CudaChainKernel):
    """PyTorch's fused ops: the CPU flash op on CPU (every dtype and mask); on CUDA the flash op,
    then the memory-efficient op, then ``torch``."""

    name = "sdpa"
    ops = ("flash", "efficient")

    def prefers_heads_major(self, device: torch.device) -> bool:
        """CPU: the flash op reads head-major q/K/V 3-4% faster (benchmarks/README.md, section 8, "Ring pairs");
        CUDA: the fused ops take contiguous ``[B, S, H, D]`` (``_fused_input``)."""
        return torch.device(device).type == "cpu"

    def _cpu_forward(self, q, k, v, *, scale, kind, mask):
        h = q.size(2)
        if not cpu_sdpa_takes_gqa():  # older torch: repeat K/V per query head
            k, v = expand_kv(k, h), expand_kv(v, h)
        qh, kh, vh = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)
        additive = None
        if kind is MaskKind.DENSE:
            additive = torch.zeros(mask.shape, dtype=q.dtype, device=q.device).masked_fill(~mask, -math.inf)
        out, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
            qh, kh, vh, 0.0, kind is MaskKind.CAUSAL, attn_mask=additive, scale=scale
        )
        if kind is MaskKind.DENSE:  # the op reports lse = 0 for a row that saw no key
            lse = lse.masked_fill(~mask.any(-1), -math.inf)
        return out.transpose(1, 2), lse

    def _cpu_backward(self, dout, q, k, v, out, lse, *, scale, kind, mask):
        h, h_kv = q.size(2), k.size(2)
        lse = lse.to(accumulation_dtype(q.dtype))
        if lse.numel() and bool(lse.amin() == -math.inf):  # a copy only where needed: not at the backward's peak
            lse = lse.masked_fill(torch.isneginf(lse), math.inf)  # a row that saw no key: p = exp(s - inf) = 0
        native_gqa = cpu_sdpa_takes_gqa()
        if not native_gqa:
            k, v = expand_kv(k, h), expand_kv(v, h)
        qh, kh, vh = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)
        doh, oh = dout.to(q.dtype).transpose(1, 2), out.to(q.dtype).transpose(1, 2)
        additive = None
        if kind is MaskKind.DENSE:
            additive = torch.zeros(mask.shape, dtype=q.dtype, device=q.device).masked_fill(~mask, -math.inf)
        dq, dk, dv = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward(
            doh, qh, kh, vh, oh, lse, 0.0, kind is MaskKind.CAUSAL, attn_mask=additive, scale=scale,
        )
        dk, dv = dk.transpose(1, 2), dv.transpose(1, 2)  # [B, Sk, H_kv, D] natively, else [B, Sk, H, D]
        if not native_gqa:
            dk, dv = reduce_kv_grad(dk, h_kv), reduce_kv_grad(dv, h_kv)
        return dq.transpose(1, 2), dk, dv


@functools.cache
def cpu_sdpa_takes_gqa() -> bool:
    """Whether ``aten._scaled_dot_product_flash_attention_for_cpu`` and its backward take K/V with
    fewer heads than Q (``H % H_kv == 0``) and return dK/dV with ``H_kv`` heads (torch 2.13 does).
    A one-time probe on a tiny tensor, so an older build falls back to ``expand_kv``; saves the
    ``H / H_kv``-fold K/V copies and the dK/dV reduction of every CPU block call."""
    try:
        q, kv = torch.zeros(1, 2, 2, 4), torch.zeros(1, 1, 2, 4)
        out, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(q, kv, kv, 0.0, False, scale=0.5)
        grads = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward(
            out, q, kv, kv, out, lse, 0.0, False, scale=0.5
        )
    except (RuntimeError, TypeError, AttributeError):
        return False
    return out.shape == q.shape and all(g.shape == t.shape for g, t in zip(grads, (q, kv, kv)))


class EfficientKernel(_CudaChainKernel):
    """CUDA: ``aten._scaled_dot_product_efficient_attention`` (fp32 too; DENSE masks as a bias)."""

    name = "efficient"
    ops = ("efficient",)


class CudnnKernel(_CudaChainKernel):
    """CUDA: ``aten._scaled_dot_product_cudnn_attention``, then the efficient op, then ``torch``."""

    name = "cudnn"
    ops = ("cudnn", "efficient")

    def _op_available(self, op: str) -> bool:
        return op != "cudnn" or _cudnn_attention_built(self.capability)


def _cudnn_attention_built(stand_in_capability) -> bool:
    """PyTorch builds its cuDNN attention only against cuDNN 9+; a given ``capability`` describes a stand-in
    device (unit tests), on which cuDNN is assumed."""
    if stand_in_capability is not None:
        return True
    return torch.backends.cudnn.is_available() and (torch.backends.cudnn.version() or 0) >= 90000


class AutoKernel(SDPAKernel):
    """``kernel="auto"`` without flash-attn: ``sdpa`` (CPU: the CPU flash op; CUDA: the flash op, then the
    efficient op), except that on Hopper (sm90) a block tries the cuDNN op first (Note [cuDNN first on Hopper]).

    Note [cuDNN first on Hopper]
        Measured side by side in one run on one H200 (torch 2.11 + cuDNN 9.19, ``benchmarks/gpu/results/
        2026-11-28_h200/perf.json``), local causal fwd+bwd, bf16, 32 query / 8 K/V heads of 128: cuDNN 420 / 585 /
        556 TFLOP/s at N = 4K / 16K / 64K against SDPA's flash op 243 / 319 / 328, and every cuDNN block of the
        same run's exactness check (bf16, fp16, GQA, packed documents, odd lengths) within tolerance of float64.
        Only sm90 was measured, so only sm90 gets this order; elsewhere ``auto`` stays ``sdpa``. Blocks cuDNN
        cannot take (one key, D > 128, fp32, deterministic mode: Note [CUDA kernel eligibility]) go to the flash
        op as before, then to the efficient op."""

    name = "auto"

    def _ops(self, q) -> tuple[str, ...]:
        if self._capability(q)[0] == 9 and _cudnn_attention_built(self.capability):
            return ("cudnn", *self.ops)
        return self.ops


# ----------------------------------------------------------------------------------------------
# flash_attn: the flash-attn package (imported lazily, CUDA only)
# ----------------------------------------------------------------------------------------------


def _flash_attn_minor(version: str) -> str:
    """``"2.7.4.post1" -> "2.7"``; ``ValueError`` unless it is one of ``FLASH_ATTN_VERSIONS``."""
    minor = ".".join(version.split(".")[:2])
    if minor not in FLASH_ATTN_VERSIONS:
        raise ValueError(
            f"flash-attn {version} is not supported (its private _flash_attn_forward/_backward signatures "
            f"are known for {', '.join(FLASH_ATTN_VERSIONS)}); install flash-attn>=2.6,<2.9 or use kernel='sdpa'"
        )
    return minor


class FlashAttnKernel(_CudaChainKernel):
    """flash-attn's private ``_flash_attn_forward/_backward``, called positionally with the argument
    list of the installed version (pinned by ``flash_attn.__version__``: since 2.7 they are
    ``torch.library`` custom ops, so ``inspect.signature`` only sees ``(*args, **kwargs)``).

    ===========  =======================================================  ============================
    version      forward(q, k, v, dropout_p, softmax_scale, causal, ...)  returns
    ===========  =======================================================  ============================
    2.6          window_size, softcap, alibi_slopes, return_softmax        out, q, k, v, out_padded,
                                                                           lse, S_dmask, rng_state
    2.7, 2.8     window_size_left, window_size_right, softcap,             out, lse, S_dmask, rng_state
                 alibi_slopes, return_softmax
    ===========  =======================================================  ============================

    backward(dout, q, k, v, out, lse, dq, dk, dv, dropout_p, softmax_scale, causal, <window>,
    softcap, alibi_slopes, deterministic, rng_state) fills ``dq, dk, dv`` (``k``'s ``H_kv`` heads)
    and returns ``(dq, dk, dv, softmax_d)`` in 2.6, ``softmax_d`` in 2.7/2.8. ``deterministic`` is
    ``torch.are_deterministic_algorithms_enabled()`` (flash-attn does not read PyTorch's flag).

    The window is ``(-1, -1)`` and the soft-cap ``0.0`` except on the per-call views ``for_call`` makes
    (``kernel_for_call``): a DENSE call whose mask is exactly a band gets its window (Note [flash-attn windows
    for DENSE blocks]), a call whose only score modifier is a soft-cap gets ``softcap`` (Note [flash-attn
    soft-capping])."""

    name = "flash_attn"
    ops = ("flash_attn", "efficient")
    softcap = 0.0
    """``softcap * tanh(s / softcap)`` on every score inside flash-attn (0: none)."""

    def __init__(self, *, device_type=None, capability=None, module=None):
        super().__init__(device_type=device_type, capability=capability)
        if module is None:
            import flash_attn  # lazy: optional dependency

            module = flash_attn
        self.version = _flash_attn_minor(module.__version__)
        fai = module.flash_attn_interface
        self._fwd, self._bwd = fai._flash_attn_forward, fai._flash_attn_backward

    def for_call(self, *, band: "tuple[int, int] | str | None" = None, softcap: float = 0.0,
                 fallback: LocalKernel | None = None) -> "FlashAttnKernel":
        """A view of this kernel for one call: ``band`` (``flash_attn_window``) for a DENSE call, ``softcap`` with
        ``fallback`` (the exact ``ScoreModKernel`` of the call) for the blocks flash-attn cannot take. Under a
        soft-cap the efficient op is skipped (it has no soft-cap) and a non-CUDA tensor runs ``fallback``."""
        view = copy.copy(self)
        view.band, view.softcap = band, float(softcap)
        if softcap:
            if fallback is None:
                raise ValueError("a soft-capped flash-attn call needs the exact fallback kernel of the call")
            view.ops, view._fallback = ("flash_attn",), fallback
        elif self.softcap:  # a view of a soft-capped view: the plain chain again
            view.ops, view._fallback = type(self).ops, TorchBlockwiseKernel()
        return view

    def _window(self, kind: MaskKind) -> tuple:
        left, right = self.band if kind is MaskKind.DENSE else (-1, -1)
        return ((left, right),) if self.version == "2.6" else (left, right)

    def _cpu_forward(self, q, k, v, *, scale, kind, mask):
        if self.softcap:  # the call's exact kernel runs anywhere, as without flash-attn
            return self._fallback.forward(q, k, v, scale=scale, kind=kind, mask=mask)
        return super()._cpu_forward(q, k, v, scale=scale, kind=kind, mask=mask)

    def _cpu_backward(self, dout, q, k, v, out, lse, *, scale, kind, mask):
        if self.softcap:
            return self._fallback.backward(dout, q, k, v, out, lse, scale=scale, kind=kind, mask=mask)
        return super()._cpu_backward(dout, q, k, v, out, lse, scale=scale, kind=kind, mask=mask)

    def _run_forward(self, op, q, k, v, *, scale, kind, mask):
        if op != "flash_attn":
            return super()._run_forward(op, q, k, v, scale=scale, kind=kind, mask=mask)
        res = self._fwd(
            _fused_input(q), _fused_input(k), _fused_input(v), 0.0, scale, kind is MaskKind.CAUSAL,
            *self._window(kind), self.softcap, None, False,
        )
        lse = res[5] if self.version == "2.6" else res[1]  # [B, H, Sq] fp32
        return res[0], lse

    def _run_backward(self, op, dout, q, k, v, out, lse, *, scale, kind, mask):
        if op != "flash_attn":
            return super()._run_backward(op, dout, q, k, v, out, lse, scale=scale, kind=kind, mask=mask)
        q, k, v = _fused_input(q), _fused_input(k), _fused_input(v)
        dq, dk, dv = (torch.empty_like(t, memory_format=torch.contiguous_format) for t in (q, k, v))  # filled in place
        # ordered dQ accumulation (mha_bwd's ``deterministic``) in either deterministic mode
        deterministic = torch.are_deterministic_algorithms_enabled()
        self._bwd(
            _fused_input(dout), q, k, v, _fused_input(out), _lse_for_backward(lse), dq, dk, dv,
            0.0, scale, kind is MaskKind.CAUSAL, *self._window(kind), self.softcap, None, deterministic, None,
        )
        return dq, dk, dv


@functools.lru_cache(maxsize=1 << 16)
def flash_attn_window(mask: StructuredMask, q_global: int, q_len: int, k_global: int, k_len: int) -> tuple[int, int] | str:
    """flash-attn's ``(window_size_left, window_size_right)`` whose visibility, after ``mha_fwd``/``mha_bwd``
    normalise it, is exactly ``mask.visible`` on the queries ``[q_global, q_global + q_len)`` and keys ``[k_global,
    k_global + k_len)`` (a call planned under ``mask``: both globally contiguous); else why there is none.
    Note [flash-attn windows for DENSE blocks]. Pure and cached: the same blocks recur at every layer."""
    sq, sk = q_len, k_len
    if min(sq, sk) < 1:
        return "empty block"
    q1, k1 = q_global + sq, k_global + sk
    bounds = mask.doc_bounds or ()
    docs = {bisect.bisect_right(bounds, p) for p in (q_global, q1 - 1, k_global, k1 - 1)}
    if len(docs) > 1:
        return "its queries and keys are not all in one document"
    if mask.keys is not None and not (mask.keys[0] <= k_global and k1 <= mask.keys[1]):
        return "padding that every batch row has cuts its keys"
    causal = mask.causal
    if causal and mask.spans:
        starts = [s for s, _ in mask.spans]
        cuts = sorted({p for span in mask.spans for p in span})
        for lo, hi in ((q_global, q1), (k_global, k1)):
            i = bisect.bisect_right(cuts, lo)
            if i < len(cuts) and cuts[i] < hi:
                return "a bidirectional span's boundary cuts it"

        def span_of(pos):
            i = bisect.bisect_right(starts, pos) - 1
            return i if i >= 0 and pos < mask.spans[i][1] else -1

        span = span_of(q_global)
        if span >= 0 and span == span_of(k_global):
            causal = False  # queries and keys in one span see each other fully
    # the band on global positions, key - query in [low, high] (None: unbounded), then on local rows j - i
    low = None if mask.left is None else -mask.left
    high = mask.right
    if causal:
        high = 0 if high is None else min(high, 0)
    shift = k_global - q_global
    low = None if low is None else low - shift
    high = None if high is None else high - shift
    if (low is not None and (low > sk - 1 or (high is not None and low > high))) or (high is not None and high < 1 - sq):
        return "the mask leaves it empty"
    low_binds = low is not None and low > 1 - sq  # some row i has i + low > 0
    high_binds = high is not None and high < sk - 1  # row 0 has high < S_k - 1
    offset = sk - sq  # flash-attn's bottom-right alignment: j - i in [offset - left, offset + right]
    left = offset - low if low_binds else -1
    right = high - offset if high_binds else -1
    if low_binds and left < 0:
        return f"its band needs a left bound of {left} < 0 (flash-attn reads a negative bound as unbounded)"
    if high_binds and right < 0:
        return f"its band needs a right bound of {right} < 0 (flash-attn reads a negative bound as unbounded)"
    if high_binds and right == sk:  # an unbounded right side beside a left bound is capped at exactly S_k
        return (left if low_binds else sk - 1), -1  # left = S_k - 1: a bound that cuts no row
    if high_binds and right > sk:
        return f"its band needs a right bound of {right} > S_k = {sk}, which mha_fwd turns into unbounded"
    if low_binds and not high_binds and sq > sk + 1:
        return (f"an unbounded right side with a left bound is capped at S_k by flash-attn, which hides keys from "
                f"the first rows when S_q = {sq} > S_k + 1 = {sk + 1}")
    return int(left), int(right)


def flash_attn_softcap(mods) -> float | None:
    """The soft-cap flash-attn applies for score modifiers ``mods`` (``masks.ScoreMods``): ``mods.softcap`` when it
    is the only modifier (attention sinks are not one: they join the merged result, Note [Attention sinks]),
    else ``None``. ALiBi stays with ``ScoreModKernel``: flash-attn anchors its bias at the block's bottom-right
    corner (``-slope * |i + S_k - S_q - j|``) and, when causal, drops each row's constant (``+slope * j``), which
    changes the log-sum-exp a ring merges (Note [flash-attn soft-capping])."""
    if mods is None or mods.softcap is None:
        return None
    if (mods.alibi_slopes, mods.mask_mod, mods.score_mod, mods.relative_bias) != (None, None, None, None):
        return None
    return float(mods.softcap)


def kernel_for_call(kernel: LocalKernel, mods, *, mask: StructuredMask | None, call, head_offset: int) -> LocalKernel:
    """The kernel of one planned call (``plan.BlockCall``) under the local kernel ``kernel``, the call's structured
    ``mask`` and score modifiers ``mods``: under ``FlashAttnKernel``, a view that passes flash-attn the call's
    window (a DENSE call whose mask is exactly a band) and soft-cap (when it is the only modifier); else
    ``score_mod_kernel`` with modifiers, ``kernel`` without."""
    if isinstance(kernel, FlashAttnKernel):
        softcap = flash_attn_softcap(mods)
        if mods is None or softcap is not None:
            band = None
            if call.kind is MaskKind.DENSE:
                band = ("no structured mask to read the band from" if mask is None else
                        flash_attn_window(mask, call.q_global, call.q_len, call.k_global, call.k_len))
            if softcap is None and band is None:
                return kernel
            fallback = None if mods is None else ScoreModKernel(
                mods, q_global=call.q_global, k_global=call.k_global, head_offset=head_offset)
            return kernel.for_call(band=band, softcap=softcap or 0.0, fallback=fallback)
    if mods is None:
        return kernel
    return score_mod_kernel(kernel, mods, q_global=call.q_global, k_global=call.k_global, head_offset=head_offset)


def flash_attn_available() -> bool:
    """flash-attn is importable, a supported version (``FLASH_ATTN_VERSIONS``) and CUDA is present."""
    try:
        import flash_attn
    except ImportError:
        return False
    try:
        _flash_attn_minor(getattr(flash_attn, "__version__", "unknown"))
    except ValueError:
        return False
    return torch.cuda.is_available()


def make_kernel(name: str) -> LocalKernel:
    """``"auto"``: flash-attn on CUDA when a supported version is installed, else ``AutoKernel`` (PyTorch SDPA;
    on CUDA the flash op, then the efficient op, per block, with cuDNN first on Hopper)."""
    if name not in KERNELS:
        raise ValueError(f"kernel must be one of {KERNELS}, got {name!r}")
    if name == "auto":
        if not flash_attn_available():
            return AutoKernel()
        name = "flash_attn"
    if name == "torch":
        return TorchBlockwiseKernel()
    if name == "sdpa":
        return SDPAKernel()
    if name == "efficient":
        return EfficientKernel()
    if name == "cudnn":
        return CudnnKernel()
    if name == "flex":
        return FlexKernel(fallback=SDPAKernel())
    if not flash_attn_available():
        try:
            import flash_attn
        except ImportError:
            raise ValueError(
                "kernel='flash_attn' needs the flash-attn package (pip install 'flash-attn>=2.6,<2.9') "
                "and a CUDA device; use kernel='sdpa'"
            ) from None
        _flash_attn_minor(getattr(flash_attn, "__version__", "unknown"))  # raises for an unsupported version
        raise ValueError("kernel='flash_attn' needs a CUDA device; use kernel='sdpa'")
    return FlashAttnKernel()


# ----------------------------------------------------------------------------------------------
# score modifiers: the blockwise kernel with FlexAttention-style score_mod / mask_mod
# ----------------------------------------------------------------------------------------------


class ScoreModKernel(TorchBlockwiseKernel):
    """The ``torch`` kernel with a mask's per-score parts (``masks.ScoreMods``: soft-capping, ALiBi,
    ``score_mod``, ``mask_mod``) applied to every tile, on global indices: ``q_global``/``k_global`` are the
    global positions of the call's first query/key (calls under a mask are globally contiguous, Note [Plans
    under a mask] in ``ops/plan.py``), ``head_offset`` the global index of the first query head. No fused op
    takes these (flash-attn's softcap/ALiBi arguments have no equivalent for the others, and the SDPA ops none),
    so a call with score modifiers runs here under every ``kernel=`` but ``"flex"`` (``score_mod_kernel``): exact in
    every dtype, any device.
    The backward differentiates the modifiers by autograd on each tile (``ds = d mod(s) / ds . dS``) and adds the
    tile's share of a relative bias's table gradient to ``mods.table_grad`` (``ScoreMods.differentiable``)."""

    name = "torch+score_mods"

    def __init__(self, mods, *, q_global: int, k_global: int, head_offset: int, block_q: int = 128, block_k: int = 512):
        super().__init__(block_q, block_k)
        self.mods, self.q_global, self.k_global, self.head_offset = mods, q_global, k_global, head_offset

    def _indices(self, b, h, q0, q1, k0, k1, device):
        """Broadcastable global ``(b, h, q_idx, kv_idx)`` int64 tensors of a tile."""
        return (torch.arange(b, device=device).view(b, 1, 1, 1),
                torch.arange(self.head_offset, self.head_offset + h, device=device).view(1, h, 1, 1),
                torch.arange(self.q_global + q0, self.q_global + q1, device=device).view(1, 1, -1, 1),
                torch.arange(self.k_global + k0, self.k_global + k1, device=device).view(1, 1, 1, -1))

    def _visible(self, kind, mask, idx, q0, q1, k0, k1, device):
        visible = self._tile_visible(kind, mask, q0, q1, k0, k1, device)
        extra = self.mods.visible(*idx)
        if extra is None:
            return visible
        extra = extra.to(device)
        return extra if visible is None else visible & extra

    def _tile_scores(self, qh, kh, q0, q1, k0, k1, *, scale, kind, mask):
        b, h = qh.shape[:2]
        idx = self._indices(b, h, q0, q1, k0, k1, qh.device)
        s = self.mods.apply(qh[:, :, q0:q1] @ kh[:, :, k0:k1].transpose(-1, -2) * scale, *idx)  # [B, H, bq, bk]
        return s, self._visible(kind, mask, idx, q0, q1, k0, k1, qh.device)

    def backward(self, dout, q, k, v, out, lse, *, scale, kind, mask):
        check_heads(q, k)
        acc = accumulation_dtype(q.dtype)
        b, _, h, _ = q.shape
        h_kv = k.size(2)
        qh = q.transpose(1, 2).to(acc)
        kh = expand_kv(k, h).transpose(1, 2).to(acc)
        vh = expand_kv(v, h).transpose(1, 2).to(acc)
        doh = dout.transpose(1, 2).to(acc)
        delta = (doh * out.transpose(1, 2).to(acc)).sum(-1)  # [B, H, Sq]
        lse = lse.to(acc)
        dq, dk, dv = torch.zeros_like(qh), torch.zeros_like(kh), torch.zeros_like(vh)
        for q0, q1, k0, k1 in self._tiles(q.size(1), k.size(1), kind):
            idx = self._indices(b, h, q0, q1, k0, k1, q.device)
            raw = qh[:, :, q0:q1] @ kh[:, :, k0:k1].transpose(-1, -2) * scale  # [B, H, bq, bk]
            s, through_mods = self.mods.differentiable(raw, *idx)
            visible = self._visible(kind, mask, idx, q0, q1, k0, k1, q.device)
            s_masked = s if visible is None else s.masked_fill(~visible, -math.inf)
            p = torch.exp(s_masked - lse[:, :, q0:q1, None]).nan_to_num(nan=0.0)  # [B, H, bq, bk]
            dv[:, :, k0:k1] += p.transpose(-1, -2) @ doh[:, :, q0:q1]
            dp = doh[:, :, q0:q1] @ vh[:, :, k0:k1].transpose(-1, -2)
            ds = p * (dp - delta[:, :, q0:q1, None])  # d loss / d modified score
            ds = through_mods(ds)  # through the modifiers; adds the bias table's share to mods.table_grad
            dq[:, :, q0:q1] += ds @ kh[:, :, k0:k1] * scale
            dk[:, :, k0:k1] += ds.transpose(-1, -2) @ qh[:, :, q0:q1] * scale
        return dq.transpose(1, 2), reduce_kv_grad(dk.transpose(1, 2), h_kv), reduce_kv_grad(dv.transpose(1, 2), h_kv)


def score_mod_kernel(kernel: LocalKernel, mods, *, q_global: int, k_global: int, head_offset: int) -> LocalKernel:
    """The kernel of one call with score modifiers ``mods`` under the local kernel ``kernel``: ``ops/flex.py``'s
    ``FlexKernel`` under ``kernel="flex"`` (FlexAttention on eligible CUDA blocks, ``ScoreModKernel`` for the
    others), else ``ScoreModKernel`` (always under a relative bias: its backward accumulates the table's
    gradient). FlexAttention is opt-in until its GPU test (``tests/gpu/test_flex_kernels.py``)
    has passed on a GPU: it is checked on CPU against a stand-in only (docs/gpu-status.md)."""
    exact = ScoreModKernel(mods, q_global=q_global, k_global=k_global, head_offset=head_offset)
    if getattr(kernel, "name", None) != "flex" or getattr(mods, "relative_bias", None) is not None:
        return exact  # a relative bias's table gradient is accumulated by ScoreModKernel's backward only
    return FlexKernel(mods, fallback=exact, q_global=q_global, k_global=k_global, head_offset=head_offset)
