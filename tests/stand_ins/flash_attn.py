"""Stand-in ``flash_attn`` packages (2.6, 2.7, 2.8) for CPU tests of ``FlashAttnKernel``.

``make_flash_attn(version)`` returns a module object with ``__version__`` and a
``flash_attn_interface`` whose ``_flash_attn_forward/_backward`` take exactly the parameters of
that release's ``flash_attn/flash_attn_interface.py`` (read from the v2.6.3, v2.7.0, v2.7.4,
v2.8.0 and v2.8.3 tags): every parameter without a default must be passed, and none other exists.

- 2.6: plain Python functions (``__signature__`` as in 2.6.3; a missing argument is a
  ``TypeError``), with the types its pybind11 extension accepts checked by hand.
- 2.7, 2.8: real ``torch.library.custom_op`` objects registered with flash-attn's own annotations
  (``dropout_p: float``, ``window_size_left: int``, ``alibi_slopes: Optional[Tensor]``, ...; the
  backward declares ``mutates_args=("dq", "dk", "dv")``), so PyTorch's dispatcher checks every
  argument's type and count exactly as it does for the real package, and introspection sees only
  ``(*args, **kwargs)``. Each ``make_flash_attn`` call registers its own pair under a fresh name.

Both then apply flash-attn's Python wrapper (``maybe_contiguous`` on q, k, v; on dout, q, k, v, out
in the backward; never on dq, dk, dv) and refuse what ``csrc/flash_attn/flash_api.cpp``
``mha_fwd/mha_bwd`` refuse, or what they accept and then compute wrongly on:

- dtypes fp16/bf16, all of q, k, v, out, dout, dq, dk, dv the query's ("query and out must have
  the same dtype", "dq must have the same dtype as q");
- ``head_size % 8 == 0`` and ``<= 256`` (2.7+; 2.6 padded inside ``mha_fwd`` but its ``mha_bwd``
  checks ``% 8`` too), ``num_heads % num_heads_k == 0``, batch and sequences non-empty, shapes;
- last-dim stride 1 for dq, dk, dv ("dq must have contiguous last dimension");
- a contiguous fp32 ``[B, H, Sq]`` ``softmax_lse`` (read through ``data_ptr`` without strides or a
  dtype check), with no ``-inf`` (``exp(s - lse)`` overflows);
- 16-byte aligned starts and strides of every tensor (128-bit loads: a misaligned address faults);
- ``deterministic=True`` under ``torch.use_deterministic_algorithms(True)`` (``mha_bwd`` otherwise
  accumulates dQ with atomics, in no fixed order);
- ``softcap > 0`` with ``dropout_p > 0`` ("Softcapping does not support dropout for now"); window sizes
  that do not fit the C++ ``int`` the extension takes; and, stricter than the real op, any dropout or
  ``alibi_slopes`` at all (not modelled here).

Results are computed in float64 (layout ``[B, S, H, D]``) exactly as the real kernels compute them
(``flash_visible``, ``_flash_reference_forward/_backward``): the window is normalised as ``mha_fwd`` /
``mha_bwd`` and ``set_params_fprop`` normalise it (a bound ``>= S_k`` becomes unbounded, ``causal`` sets the
right bound to 0, and with one side bounded the other unbounded side becomes ``S_k``), both bounds and
``causal`` are aligned bottom-right (query ``i`` sees keys ``[i + S_k - S_q - left, i + S_k - S_q + right]``),
the soft-cap is ``softcap * tanh(scale * q.k / softcap)`` (its backward through ``1 - tanh^2``), and a row that
sees no key gets ``out = 0``, ``lse = +inf``. Results are returned in that version's tuple shape; ``calls``
records each call's bound arguments.
"""

import inspect
import math
import types
import uuid
from typing import Optional, Tuple

import torch

from tests.stand_ins.cuda_sdpa import ContractError, check_aligned

_T = inspect.Parameter.POSITIONAL_OR_KEYWORD


def _sig(names: str, defaults: dict | None = None) -> inspect.Signature:
    defaults = defaults or {}
    return inspect.Signature([
        inspect.Parameter(n, _T, default=defaults.get(n, inspect.Parameter.empty)) for n in names.split()
    ])


SIGNATURES = {
    "2.6": (
        _sig("q k v dropout_p softmax_scale causal window_size softcap alibi_slopes return_softmax"),
        _sig("dout q k v out softmax_lse dq dk dv dropout_p softmax_scale causal window_size softcap "
             "alibi_slopes deterministic rng_state", {"rng_state": None}),
    ),
    "2.7": (
        _sig("q k v dropout_p softmax_scale causal window_size_left window_size_right softcap alibi_slopes "
             "return_softmax"),
        _sig("dout q k v out softmax_lse dq dk dv dropout_p softmax_scale causal window_size_left "
             "window_size_right softcap alibi_slopes deterministic rng_state", {"rng_state": None}),
    ),
}
SIGNATURES["2.8"] = SIGNATURES["2.7"]


def _check(cond, msg):
    if not cond:
        raise ContractError(msg)


def _maybe_contiguous(x):  # flash_attn_interface.maybe_contiguous
    return x.contiguous() if x is not None and x.stride(-1) != 1 else x


_INT32 = (-(2**31), 2**31 - 1)


def _check_common(a, op, minor):
    if a["softcap"] > 0:  # mha_fwd / mha_bwd
        _check(a["dropout_p"] == 0.0, f"{op}: Softcapping does not support dropout for now")
    _check(a["dropout_p"] == 0.0, f"{op}: dropout is not modelled by the stand-in")
    _check(a["alibi_slopes"] is None, f"{op}: alibi_slopes are not modelled by the stand-in")
    for w in _window_args(a):  # the extension's C++ ``int``
        _check(isinstance(w, int) and not isinstance(w, bool) and _INT32[0] <= w <= _INT32[1],
               f"{op}: window size {w!r} is not a C++ int")
    q, k, v = a["q"], a["k"], a["v"]
    for n in ("q", "k", "v"):
        t = a[n]
        _check(t.dtype in (torch.float16, torch.bfloat16), f"{op}: {n} dtype {t.dtype}")
        _check(t.dtype == q.dtype, f"{op}: query and {n} must have the same dtype")
        _check(t.dim() == 4 and t.stride(-1) == 1, f"{op}: {n} must be [B, S, H, D] with contiguous last dimension")
    b, sq, h, d = q.shape
    _check(b > 0 and sq > 0 and k.size(1) > 0, f"{op}: batch size and sequence lengths must be positive")
    _check(d <= 256 and d % 8 == 0, f"{op}: head_size {d} must be a multiple of 8 and at most 256")
    _check(k.shape == v.shape and k.shape[0] == b and k.size(3) == d, f"{op}: key/value shapes")
    _check(h % k.size(2) == 0, f"{op}: number of heads in key/value must divide number of heads in query")
    check_aligned(op, q=q, k=k, v=v)


def _check_pybind_types_26(a, op):
    """flash-attn 2.6 calls its pybind11 extension: ints, floats, bools and tensors, nothing else."""
    for n in ("dropout_p", "softmax_scale", "softcap"):
        _check(isinstance(a[n], (int, float)) and not isinstance(a[n], bool), f"{op}: {n} must be a float, got {a[n]!r}")
    for n in ("causal", "return_softmax", "deterministic"):
        _check(isinstance(a.get(n, False), bool), f"{op}: {n} must be a bool, got {a.get(n)!r}")
    w = a["window_size"]
    _check(len(w) == 2 and all(isinstance(x, int) and not isinstance(x, bool) for x in w), f"{op}: window_size {w!r}")


def flash_visible(sq: int, sk: int, causal: bool, left: int, right: int, *, backward: bool,
                  has_alibi: bool = False) -> torch.Tensor:
    """``[S_q, S_k]`` bool: what the real kernel computes for this call. The window is normalised line by line
    as ``mha_fwd`` (clamp, then the one-query and causal rules) or ``mha_bwd`` (causal first, then clamp) and
    ``set_params_fprop`` do (flash_api.cpp, v2.6.3 to v2.8.3), then masked as ``Mask::apply_mask`` (mask.h) does:
    causal ``j < i + 1 + S_k - S_q``; local ``max(0, i + S_k - S_q - left) <= j < min(S_k, i + 1 + S_k - S_q +
    right)``."""
    if backward:
        if causal:
            right = 0
        left, right = (-1 if left >= sk else left), (-1 if right >= sk else right)
    else:
        left, right = (-1 if left >= sk else left), (-1 if right >= sk else right)
        if sq == 1 and not has_alibi:
            causal = False  # "causal=true is the same as causal=false in this case"
        if causal:
            right = 0
    is_causal = left < 0 and right == 0  # set_params_fprop
    if left < 0 and right >= 0:
        left = sk
    if left >= 0 and right < 0:
        right = sk
    is_local = (left >= 0 or right >= 0) and not is_causal
    i = torch.arange(sq)[:, None]
    j = torch.arange(sk)[None, :]
    if is_causal:
        return (j < i + 1 + sk - sq).expand(sq, sk)
    if is_local:
        return (j >= (i + sk - sq - left).clamp(min=0)) & (j < (i + 1 + sk - sq + right).clamp(max=sk))
    return torch.ones(sq, sk, dtype=torch.bool)


def _scores(a, backward):
    """float64 ``(s [B, H, Sq, Sk], dtanh or None)``: scaled, soft-capped, masked scores of the call ``a``."""
    q, k = a["q"].double().transpose(1, 2), a["k"].double().transpose(1, 2)  # [B, H, S, D]
    k = k.repeat_interleave(q.size(1) // k.size(1), dim=1)
    s = q @ k.transpose(-1, -2) * a["softmax_scale"]
    dtanh = None
    if a["softcap"] > 0:  # set_params_fprop: tanh(q.k * scale / softcap), then scaled by softcap
        t = torch.tanh(s / a["softcap"])
        s, dtanh = a["softcap"] * t, 1 - t * t
    visible = flash_visible(q.size(2), k.size(2), a["causal"], *_window_args(a), backward=backward)
    return s.masked_fill(~visible, -math.inf), dtanh


def _window_args(a):
    return tuple(a["window_size"]) if "window_size" in a else (a["window_size_left"], a["window_size_right"])


def _flash_reference_forward(a):
    s, _ = _scores(a, backward=False)
    lse = torch.logsumexp(s, -1)  # [B, H, Sq]; -inf where no key
    p = torch.exp(s - lse[..., None]).nan_to_num(nan=0.0)
    v = a["v"].double().transpose(1, 2)
    out = p @ v.repeat_interleave(s.size(1) // v.size(1), dim=1)  # [B, H, Sq, D]; 0 where no key
    return out.transpose(1, 2), lse.masked_fill(torch.isneginf(lse), math.inf)  # flash-attn: +inf for no key


def _flash_reference_backward(a):
    s, dtanh = _scores(a, backward=True)
    q, k, v = (a[n].double().transpose(1, 2) for n in ("q", "k", "v"))
    g = q.size(1) // k.size(1)
    do, out = a["dout"].double().transpose(1, 2), a["out"].double().transpose(1, 2)
    p = torch.exp(s - a["softmax_lse"].double()[..., None])  # +inf lse -> 0
    vv, kk = v.repeat_interleave(g, dim=1), k.repeat_interleave(g, dim=1)
    dv = p.transpose(-1, -2) @ do
    ds = p * (do @ vv.transpose(-1, -2) - (do * out).sum(-1, keepdim=True))
    if dtanh is not None:
        ds = ds * dtanh  # d(softcap * tanh(x / softcap)) / dx
    scale = a["softmax_scale"]
    dq, dk = ds @ kk * scale, ds.transpose(-1, -2) @ q * scale

    def fold(x):  # [B, H, Sk, D] -> [B, Sk, H_kv, D]
        b, h, sk, d = x.shape
        return x.view(b, h // g, g, sk, d).sum(2).transpose(1, 2)

    return dq.transpose(1, 2), fold(dk), fold(dv)


def _forward_impl(a, minor, calls):
    op = "_flash_attn_forward"
    calls.append(("forward", a))
    a["q"], a["k"], a["v"] = (_maybe_contiguous(a[n]) for n in ("q", "k", "v"))
    _check_common(a, op, minor)
    _check(a["return_softmax"] is False, "return_softmax")
    q, k, v = a["q"], a["k"], a["v"]  # [B, S, H, D]
    b, sq, h, _ = q.shape
    if q.device.type == "meta":  # shapes only
        out, lse = torch.empty_like(q), torch.empty(b, h, sq, device="meta")
        rng, s_dmask = torch.empty(2, dtype=torch.int64, device="meta"), torch.empty(0, dtype=q.dtype, device="meta")
    else:
        out, lse = _flash_reference_forward(a)
        out, lse = out.to(q.dtype).contiguous(), lse.float()
        rng, s_dmask = torch.zeros(2, dtype=torch.int64), torch.empty(0, dtype=q.dtype)
    if minor == "2.6":
        return out, q, k, v, out, lse, s_dmask, rng
    return out, lse, s_dmask, rng


def _backward_impl(a, minor, calls):
    op = "_flash_attn_backward"
    calls.append(("backward", a))
    for n in ("dout", "q", "k", "v", "out"):
        a[n] = _maybe_contiguous(a[n])
    _check_common(a, op, minor)
    q, k, v, lse = a["q"], a["k"], a["v"], a["softmax_lse"]
    b, sq, h, _ = q.shape
    for n in ("dout", "out"):
        _check(a[n].dtype == q.dtype, f"{op}: query and {n} must have the same dtype")
        _check(a[n].shape == q.shape, f"{op}: {n} shape {tuple(a[n].shape)} != {tuple(q.shape)}")
    for n, like in (("dq", q), ("dk", k), ("dv", v)):
        t = a[n]
        _check(t is not None and t.shape == like.shape, f"{op}: {n} buffer shape")
        _check(t.dtype == q.dtype, f"{op}: {n} must have the same dtype as q")
        _check(t.stride(-1) == 1, f"{op}: {n} must have contiguous last dimension")
    check_aligned(op, dout=a["dout"], out=a["out"], dq=a["dq"], dk=a["dk"], dv=a["dv"])
    _check(lse.dtype == torch.float32 and tuple(lse.shape) == (b, h, sq), f"{op}: softmax_lse must be [B, H, Sq] fp32")
    _check(lse.is_contiguous(), f"{op}: softmax_lse must be contiguous (read without strides)")
    strict = torch.are_deterministic_algorithms_enabled() and not torch.is_deterministic_algorithms_warn_only_enabled()
    _check(a["deterministic"] or not strict,
           f"{op}: deterministic=False under torch.use_deterministic_algorithms(True) (dQ accumulated with atomics)")
    if q.device.type == "meta":
        softmax_d = torch.empty(b, h, sq, device="meta")
    else:
        _check(not torch.isneginf(lse).any(), f"{op}: -inf lse overflows exp(s - lse)")
        for n, g in zip(("dq", "dk", "dv"), _flash_reference_backward(a)):
            a[n].copy_(g)
        softmax_d = torch.zeros(b, h, sq, dtype=torch.float32)
    if minor == "2.6":
        return a["dq"], a["dk"], a["dv"], softmax_d
    return softmax_d


def _custom_ops(minor, calls):
    """flash-attn 2.7/2.8's ``_flash_attn_forward/_backward``: ``torch.library.custom_op`` with the
    release's annotations (flash_attn_interface.py), registered under a fresh name."""
    n = uuid.uuid4().hex  # unique even if this module is imported twice in one process
    fwd_sig, bwd_sig = SIGNATURES[minor]

    @torch.library.custom_op(f"lightning_sp_stand_ins::flash_attn_forward_{n}", mutates_args=())
    def _flash_attn_forward(
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        dropout_p: float,
        softmax_scale: float,
        causal: bool,
        window_size_left: int,
        window_size_right: int,
        softcap: float,
        alibi_slopes: Optional[torch.Tensor],
        return_softmax: bool,
    ) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        a = fwd_sig.bind(q, k, v, dropout_p, softmax_scale, causal, window_size_left, window_size_right, softcap,
                         alibi_slopes, return_softmax).arguments
        return _forward_impl(a, minor, calls)

    @torch.library.custom_op(f"lightning_sp_stand_ins::flash_attn_backward_{n}", mutates_args=("dq", "dk", "dv"))
    def _flash_attn_backward(
        dout: torch.Tensor,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        out: torch.Tensor,
        softmax_lse: torch.Tensor,
        dq: Optional[torch.Tensor],
        dk: Optional[torch.Tensor],
        dv: Optional[torch.Tensor],
        dropout_p: float,
        softmax_scale: float,
        causal: bool,
        window_size_left: int,
        window_size_right: int,
        softcap: float,
        alibi_slopes: Optional[torch.Tensor],
        deterministic: bool,
        rng_state: Optional[torch.Tensor] = None,
    ) -> torch.Tensor:
        a = bwd_sig.bind(dout, q, k, v, out, softmax_lse, dq, dk, dv, dropout_p, softmax_scale, causal,
                         window_size_left, window_size_right, softcap, alibi_slopes, deterministic, rng_state).arguments
        return _backward_impl(a, minor, calls)

    # meta tensors dispatch to the fake impl: the same checks, shapes only
    _flash_attn_forward.register_fake(lambda *args: _forward_impl(fwd_sig.bind(*args).arguments, minor, calls))
    _flash_attn_backward.register_fake(lambda *args: _backward_impl(bwd_sig.bind(*args).arguments, minor, calls))
    return _flash_attn_forward, _flash_attn_backward


def make_flash_attn(version: str):
    minor = ".".join(version.split(".")[:2])
    fwd_sig, bwd_sig = SIGNATURES[minor]
    calls: list[tuple[str, dict]] = []

    if minor == "2.6":
        def forward(*args, **kwargs):
            a = fwd_sig.bind(*args, **kwargs).arguments  # TypeError, like the real function, on a missing argument
            _check_pybind_types_26(a, "_flash_attn_forward")
            return _forward_impl(a, minor, calls)

        def backward(*args, **kwargs):
            a = bwd_sig.bind(*args, **kwargs).arguments
            _check_pybind_types_26(a, "_flash_attn_backward")
            return _backward_impl(a, minor, calls)

        forward.__signature__, backward.__signature__ = fwd_sig, bwd_sig
    else:
        forward, backward = _custom_ops(minor, calls)
    interface = types.SimpleNamespace(_flash_attn_forward=forward, _flash_attn_backward=backward)
    module = types.ModuleType("flash_attn")
    module.__version__ = version
    module.flash_attn_interface = interface
    module.calls = calls
    return module
