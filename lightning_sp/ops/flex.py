"""FlexAttention kernel: one block of a masked call (score modifiers, ``mask_mod``, DENSE masks) as one fused
``torch.nn.attention.flex_attention`` call on CUDA, with the project's kernel interface (``forward -> (out, lse)``,
``backward`` against the merged row's ``out``/``lse``; ``ops/kernels.py``).

Which kernel runs a call with score modifiers (``score_mod_kernel`` in ``ops/kernels.py``): ``FlexKernel`` under
``kernel="flex"`` (opt-in until its GPU test has run on a GPU), ``ScoreModKernel`` under every other; ``FlexKernel`` runs a block with FlexAttention when ``why_not_flex`` finds
nothing against it, else ``ScoreModKernel`` (the blockwise PyTorch loop, exact on any device):

- the block is on CUDA (FlexAttention's CPU path has no backward, and its forward materialises the scores);
- fp16, bf16 or fp32 (fp64 runs ``ScoreModKernel``, the exact reference), head dims >= 16 (Inductor's
  FlexAttention lowering: "NYI: embedding dimension ... must be at least 16"), ``B, S_q, S_k >= 1``;
- the modifiers are only those FlexAttention expresses here (``FLEX_SCORE_MODS``: soft-capping, ALiBi,
  ``score_mod``, ``mask_mod``); a field of ``ScoreMods`` outside that list that is set (a learned bias whose
  gradient ``ScoreModKernel`` computes) sends the block to ``ScoreModKernel``.

Attention sinks never reach a kernel: they are absorbed into the merged ``(out, lse)`` after the blocks
(Note [Attention sinks] in ``ops/ring_attention.py``), and the backward below uses that merged ``lse``, so
sinks and their gradient are exact with this kernel too.

``kernel="flex"`` (``make_kernel``) is a ``FlexKernel`` without modifiers: every block (FULL, CAUSAL, DENSE)
runs FlexAttention on CUDA where eligible, else the SDPA kernel (CPU, fp64).

Note [FlexAttention blocks on global indices]
    A block is ``q [B, S_q, H, D]`` at global query position ``q_global`` and head ``head_offset`` against
    ``k, v [B, S_k, H_kv, D]`` at global key position ``k_global``. FlexAttention calls ``score_mod(s, b, h,
    q_idx, kv_idx)`` and ``mask_mod(b, h, q_idx, kv_idx)`` with the block's *local* indices; the closures here
    add the offsets, held as 0-d int64 tensors on the device (a Python int in a closure is a constant to
    ``torch.compile``: every ring step would recompile), and apply ``ScoreMods``' parts in its order
    (soft-cap, ALiBi on global ``|q - k|``, ``score_mod``). Visibility is the call's ``MaskKind`` on local
    indices (CAUSAL: ``kv_idx <= q_idx``; DENSE: the call's ``[S_q, S_k]`` bool tensor, captured) AND the user's
    ``mask_mod`` on global indices. The ``BlockMask`` (FlexAttention's tile sparsity, built by evaluating the
    mask on the block's grid) is cached for FULL/CAUSAL calls, keyed by everything the mask reads
    (``_BlockMaskCache``, bounded); a DENSE call's mask tensor is built afresh by every plan, so its
    ``BlockMask`` is too. GQA: ``enable_gqa`` with ``H_kv`` K/V heads. FlexAttention's returned lse is in
    natural log (its kernels keep base 2 and the frontend multiplies by ln 2), as this project's.

Note [FlexAttention backward against the merged row]
    A ring backend differentiates block ``b`` of a row against the *merged* row: ``L`` = the row's lse over all
    blocks (and sinks), ``O`` = its output, ``P_j = exp(s_j - L)``. The exact block gradients are
    ``dV_j = P_j dO``, ``dS_j = P_j (dO . v_j - delta)``, ``delta = dO . O`` (flash-attention's backward).
    FlexAttention differentiates only its own block: ``o_b = sum_j p_j v_j`` with ``p_j = exp(s_j - l_b)``,
    ``l_b`` the block's lse. Since ``P_j = w p_j`` with ``w = exp(l_b - L)`` (per row), feeding its autograd

        grad_o_b = w dO            ->  dv_j = p_j w dO = P_j dO                                 (exact)
                                        ds_j = p_j (w dO . v_j - w dO . o_b) = P_j (dO . v_j - delta_b)

    leaves ``ds_j`` off by ``P_j (delta_b - delta)`` with ``delta_b = dO . o_b``. FlexAttention's lse is
    differentiable (``d l_b / d s_j = p_j``), so also feeding ``grad_l_b = w (delta_b - delta)`` adds
    ``p_j w (delta_b - delta) = P_j (delta_b - delta)``, and ``ds_j`` is exact; the modifiers' derivatives
    follow by FlexAttention's own joint graph, and dQ/dK from ``ds`` as usual. A row the block leaves empty
    has ``l_b = -inf``, so ``w = 0`` (``L = -inf`` too: ``exp(nan) -> 0``). No gradient other than through
    ``o_b`` can produce the correction: ``sum_j dS_j`` over a block is ``P_b (delta_b - delta)`` (P_b = the
    block's share of the row), while a gradient through ``o_b`` alone always sums to 0 over ``j``.
    The price: the backward re-runs the block's forward (FlexAttention's autograd needs its own ``o_b, l_b``;
    the ring keeps only the merged ones), about +40% of a block's backward FLOPs.
"""

from __future__ import annotations

import dataclasses
import functools
import inspect
import math
from collections import OrderedDict
from typing import Callable, NamedTuple

import torch

from lightning_sp.masks import ScoreMods
from lightning_sp.ops.merge import accumulation_dtype
from lightning_sp.ops.plan import MaskKind

FLEX_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
FLEX_MIN_HEAD_DIM = 16
FLEX_SCORE_MODS = ("softcap", "alibi_slopes", "mask_mod", "score_mod")
"""The ``ScoreMods`` fields FlexAttention expresses here; any other field that is set sends the block to
``ScoreModKernel``."""
BLOCK_MASK_CACHE_SIZE = 32


class FlexOps(NamedTuple):
    """What ``FlexKernel`` calls: ``flex_attention`` (compiled on CUDA), ``create_block_mask``, and
    ``AuxRequest`` where the installed PyTorch takes ``return_aux=`` (else ``return_lse=True``)."""

    flex_attention: Callable
    create_block_mask: Callable
    aux_request: type | None


def _ops_from(module, flex_attention: Callable) -> FlexOps:
    takes_aux = "return_aux" in inspect.signature(module.flex_attention).parameters
    aux = getattr(module, "AuxRequest", None) if takes_aux else None
    return FlexOps(flex_attention, module.create_block_mask, aux)


@functools.cache
def compiled_flex_ops() -> FlexOps:
    """PyTorch's FlexAttention, compiled (uncompiled it materialises the whole score matrix), with Dynamo's
    automatic dynamic shapes: per closure structure (mask kind x modifiers x dtype x forward/backward) the first
    block length compiles a static graph and the second a dynamic one that serves every later length. Not
    ``dynamic=True``: it makes the float ``scale`` symbolic, and FlexAttention's lowering has had bugs with it
    (pytorch#147756). Dynamo keeps at most ``recompile_limit`` (8) graphs per function, past which it runs the
    uncompiled op (exact, slow): one mask configuration can need 12 (3 kinds x 2 directions x 2 lengths), so
    the guide (docs/guides/masks.md, Kernels on CUDA) says to raise it."""
    from torch.nn.attention import flex_attention as module

    return _ops_from(module, torch.compile(module.flex_attention))


def eager_flex_ops() -> FlexOps:
    """PyTorch's FlexAttention uncompiled (the CPU tests' forward; no backward on CPU)."""
    from torch.nn.attention import flex_attention as module

    return _ops_from(module, module.flex_attention)


@functools.cache
def flex_available() -> bool:
    try:
        from torch.nn.attention import flex_attention  # noqa: F401
    except ImportError:
        return False
    return True


def unsupported_mods(mods: ScoreMods | None) -> list[str]:
    """The set fields of ``mods`` outside ``FLEX_SCORE_MODS`` (they need ``ScoreModKernel``)."""
    if mods is None:
        return []
    def is_set(value) -> bool:
        return value is not None and not (isinstance(value, (tuple, list)) and not value)

    return [f.name for f in dataclasses.fields(mods)
            if f.name not in FLEX_SCORE_MODS and f.name != "table_grad"  # bookkeeping of the call, not a modifier
            and is_set(getattr(mods, f.name))]


def why_not_flex(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mods: ScoreMods | None, *,
                 device_type: str | None = None, dtypes: tuple[torch.dtype, ...] = FLEX_DTYPES) -> str | None:
    """``None`` if FlexAttention runs this block (module docstring), else why not. ``device_type``: the device
    type to assume, ``dtypes`` the ones to run (a CPU test forces ``"cuda"`` and fp64 with a stand-in op)."""
    if (device_type or q.device.type) != "cuda":
        return f"device {q.device.type} (FlexAttention runs CUDA blocks here)"
    if not flex_available():
        return "torch.nn.attention.flex_attention is not available in this PyTorch"
    if q.dtype not in dtypes:
        return f"dtype {q.dtype} (needs one of {', '.join(str(d).removeprefix('torch.') for d in dtypes)})"
    if min(q.size(-1), v.size(-1)) < FLEX_MIN_HEAD_DIM:
        return f"head dims {q.size(-1)}/{v.size(-1)} (FlexAttention needs >= {FLEX_MIN_HEAD_DIM})"
    if min(q.size(0), q.size(1), k.size(1)) < 1:
        return f"empty block (B={q.size(0)}, S_q={q.size(1)}, S_k={k.size(1)})"
    other = unsupported_mods(mods)
    if other:
        return f"score modifiers {other} (ScoreModKernel computes them)"
    return None


class _BlockMaskCache:
    """LRU of ``BlockMask`` objects for FULL/CAUSAL blocks, at most ``size`` entries. The key holds everything
    the mask reads (shape, offsets, device, the user's ``mask_mod``), and the entry keeps that callable alive
    so its ``id`` cannot be reused while the entry exists."""

    def __init__(self, size: int = BLOCK_MASK_CACHE_SIZE):
        self.size, self._entries = size, OrderedDict()

    def get(self, key, build):
        if key in self._entries:
            self._entries.move_to_end(key)
            return self._entries[key][0]
        value = build()
        self._entries[key] = (value, key)
        while len(self._entries) > self.size:
            self._entries.popitem(last=False)
        return value

    def __len__(self):
        return len(self._entries)

    def clear(self):
        self._entries.clear()


BLOCK_MASKS = _BlockMaskCache()


def _block_grads_against_row(o_b, lse_b, dout, out, lse):
    """Note [FlexAttention backward against the merged row]: the cotangents ``(grad_o_b [B, H, S_q, D],
    grad_lse_b [B, H, S_q])`` that make FlexAttention's autograd of one block return its exact share of the
    merged row's gradient. ``o_b``/``lse_b``: the block's own (detached); ``dout``/``out`` ``[B, H, S_q, D]``,
    ``lse [B, H, S_q]``: the merged row's, in the accumulation dtype."""
    w = torch.exp(lse_b.to(lse.dtype) - lse).nan_to_num(nan=0.0)  # [B, H, Sq]; an empty row: -inf - -inf -> 0
    delta = (dout * out).sum(-1)  # [B, H, Sq]
    delta_b = (dout * o_b.to(dout.dtype)).sum(-1)
    return (dout * w[..., None]).to(o_b.dtype), (w * (delta_b - delta)).to(lse_b.dtype)


class FlexKernel:
    """One block with FlexAttention on CUDA (module docstring, Note [FlexAttention blocks on global indices]),
    else ``fallback``: ``ScoreModKernel`` with ``mods``, the SDPA kernel without (``ops/kernels.py`` builds both
    kernels; this module does not import it, so that ``kernels`` can import this one). ``ops``: the FlexAttention
    functions (default: ``compiled_flex_ops()``, resolved at the first CUDA block); ``device_type="cuda"`` forces
    the flex path for tensors of another device and ``dtypes`` widens the dtypes (the CPU tests, with a stand-in
    ``ops``: fp64 for exactness)."""

    name = "flex"

    def __init__(self, mods: ScoreMods | None = None, *, fallback, q_global: int = 0, k_global: int = 0,
                 head_offset: int = 0, ops: FlexOps | None = None, device_type: str | None = None,
                 dtypes: tuple[torch.dtype, ...] = FLEX_DTYPES, block_masks: _BlockMaskCache | None = None):
        self.mods, self.q_global, self.k_global, self.head_offset = mods, q_global, k_global, head_offset
        self._ops, self.device_type, self.dtypes = ops, device_type, dtypes
        self._block_masks = BLOCK_MASKS if block_masks is None else block_masks
        self.fallback = fallback

    def prefers_heads_major(self, device: torch.device) -> bool:
        """CUDA: FlexAttention reads ``[B, H, S, D]``, so head-major memory saves the copy in ``_heads_first``;
        elsewhere the fallback's preference."""
        if (self.device_type or torch.device(device).type) == "cuda":
            return True
        prefers = getattr(self.fallback, "prefers_heads_major", None)
        return prefers is not None and bool(prefers(device))

    def why_not(self, q, k, v) -> str | None:
        return why_not_flex(q, k, v, self.mods, device_type=self.device_type, dtypes=self.dtypes)

    def ops(self) -> FlexOps:
        if self._ops is None:
            self._ops = compiled_flex_ops()
        return self._ops

    # -- closures (Note [FlexAttention blocks on global indices]) --------------------------------------------

    def _offsets(self, device):
        return tuple(torch.tensor(x, dtype=torch.int64, device=device)
                     for x in (self.q_global, self.k_global, self.head_offset))

    def _score_mod(self, acc: torch.dtype, offsets):
        mods = self.mods
        if mods is None or (mods.softcap is None and mods.alibi_slopes is None and mods.score_mod is None):
            return None
        q_off, k_off, h_off = offsets
        softcap, user = mods.softcap, mods.score_mod
        slopes = None
        if mods.alibi_slopes is not None:
            slopes = torch.tensor(mods.alibi_slopes, dtype=acc, device=q_off.device)  # [H_total], global heads

        def score_mod(score, b, h_idx, q_idx, kv_idx):
            hg, qg, kg = h_idx + h_off, q_idx + q_off, kv_idx + k_off
            if softcap is not None:
                score = torch.tanh(score / softcap) * softcap
            if slopes is not None:
                score = score - slopes[hg] * (qg - kg).abs().to(score.dtype)
            if user is not None:
                score = user(score, b, hg, qg, kg)
            return score

        return score_mod

    def _mask_mod(self, kind: MaskKind, mask, offsets):
        user = None if self.mods is None else self.mods.mask_mod
        if kind is MaskKind.FULL and user is None:
            return None
        q_off, k_off, h_off = offsets

        def mask_mod(b, h_idx, q_idx, kv_idx):
            if kind is MaskKind.CAUSAL:
                visible = kv_idx <= q_idx
            elif kind is MaskKind.DENSE:
                visible = mask[q_idx, kv_idx]
            else:
                visible = None
            if user is not None:
                extra = user(b, h_idx + h_off, q_idx + q_off, kv_idx + k_off)
                visible = extra if visible is None else visible & extra
            return visible

        return mask_mod

    def _block_mask(self, kind, mask, b, h, sq, sk, device, offsets):
        mask_mod = self._mask_mod(kind, mask, offsets)
        if mask_mod is None:
            return None
        user = None if self.mods is None else self.mods.mask_mod
        # the user's mask_mod may read b and h: evaluate it per batch and head; ours never do
        bb, hh = (b, h) if user is not None else (None, None)

        def build():
            return self.ops().create_block_mask(mask_mod, bb, hh, sq, sk, device=device)

        if kind is MaskKind.DENSE:
            return build()
        offsets_read = (self.q_global, self.k_global, self.head_offset) if user is not None else None
        key = (kind, bb, hh, sq, sk, str(device), offsets_read, id(user), user)
        return self._block_masks.get(key, build)

    # -- the kernel interface ------------------------------------------------------------------------------

    def _flex(self, qh, kh, vh, *, scale, kind, mask):
        """``qh [B, H, Sq, D]``, ``kh, vh [B, H_kv, Sk, D]`` (contiguous) -> ``(out [B, H, Sq, D], lse [B, H, Sq])``,
        the lse in natural log, as FlexAttention returns it."""
        b, h, sq, _ = qh.shape
        acc = accumulation_dtype(qh.dtype)
        offsets = self._offsets(qh.device)
        ops = self.ops()
        kwargs = dict(score_mod=self._score_mod(acc, offsets),
                      block_mask=self._block_mask(kind, mask, b, h, sq, kh.size(2), qh.device, offsets),
                      scale=float(scale), enable_gqa=kh.size(1) != h)
        if ops.aux_request is not None:
            out, aux = ops.flex_attention(qh, kh, vh, return_aux=ops.aux_request(lse=True), **kwargs)
            return out, aux.lse
        return ops.flex_attention(qh, kh, vh, return_lse=True, **kwargs)

    def forward(self, q, k, v, *, scale, kind, mask):
        _check_heads(q, k)
        if self.why_not(q, k, v) is not None:
            return self.fallback.forward(q, k, v, scale=scale, kind=kind, mask=mask)
        out, lse = self._flex(*(_heads_first(x) for x in (q, k, v)), scale=scale, kind=kind, mask=mask)
        lse = lse.to(accumulation_dtype(q.dtype))  # [B, H, Sq]
        lse = lse.masked_fill(torch.isposinf(lse), -math.inf)  # a row that saw no key: lse = -inf, out = 0
        out = out.masked_fill(torch.isneginf(lse)[..., None], 0.0)
        return out.transpose(1, 2), lse  # [B, Sq, H, D]

    def backward(self, dout, q, k, v, out, lse, *, scale, kind, mask):
        """Note [FlexAttention backward against the merged row]."""
        _check_heads(q, k)
        if self.why_not(q, k, v) is not None:
            return self.fallback.backward(dout, q, k, v, out, lse, scale=scale, kind=kind, mask=mask)
        acc = accumulation_dtype(q.dtype)
        with torch.enable_grad():
            qh, kh, vh = (_heads_first(x.detach()).requires_grad_() for x in (q, k, v))
            o_b, lse_b = self._flex(qh, kh, vh, scale=scale, kind=kind, mask=mask)
            grad_o, grad_lse = _block_grads_against_row(
                o_b.detach(), lse_b.detach(), dout.transpose(1, 2).to(acc), out.transpose(1, 2).to(acc), lse.to(acc))
            dq, dk, dv = torch.autograd.grad((o_b, lse_b), (qh, kh, vh), (grad_o, grad_lse))
        return dq.transpose(1, 2), dk.transpose(1, 2), dv.transpose(1, 2)  # [B, S, H(_kv), D]


def _check_heads(q: torch.Tensor, k: torch.Tensor) -> None:
    """``kernels.check_heads`` (this module cannot import ``kernels``): ``H`` a positive multiple of ``H_kv``."""
    h, h_kv = q.size(2), k.size(2)
    if h_kv < 1 or h % h_kv:
        raise ValueError(f"q has {h} heads and k/v have {h_kv}: the query heads must be a positive multiple of the "
                         f"K/V heads (each K/V head serves H / H_kv query heads); pass [B, S, H, D] tensors")


def _heads_first(x: torch.Tensor) -> torch.Tensor:
    """``[B, S, H, D] -> [B, H, S, D]`` contiguous (no copy for head-major memory)."""
    return x.transpose(1, 2).contiguous()
