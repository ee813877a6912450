"""Stand-in ``flash_attn`` packages (2.6, 2.7, 2.8) for CPU tests of ``FlashAttnKernel``.

``make_flash_attn(version)`` returns a module object with ``__version__`` and a
``flash_attn_interface`` whose ``_flash_attn_forward/_backward`` take exactly the parameters of
that release's ``flash_attn/flash_attn_interface.py`` (read from the v2.6.3, v2.7.0, v2.7.4,
v2.8.0 and v2.8.3 tags): every parameter without a default must be passed, and none other
exists. From 2.7 the real functions are ``torch.library.custom_op`` objects, whose Python
signature is ``(*args, **kwargs)``; the stand-in mimics that too, so introspection learns nothing.
Results are computed in float64 (``cuda_sdpa._ref_*``; layout ``[B, S, H, D]``) and returned in
that version's tuple shape; ``calls`` records each call's bound arguments.
"""

from __future__ import annotations

import inspect
import math
import types

import torch

from tests.stand_ins.cuda_sdpa import ContractError, _ref_backward, _ref_forward

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


def make_flash_attn(version: str):
    minor = ".".join(version.split(".")[:2])
    fwd_sig, bwd_sig = SIGNATURES[minor]
    calls: list[tuple[str, dict]] = []

    def window(a) -> tuple[int, int]:
        return tuple(a["window_size"]) if minor == "2.6" else (a["window_size_left"], a["window_size_right"])

    def check_common(a, op):
        _check(a["dropout_p"] == 0.0 and a["softcap"] == 0.0 and a["alibi_slopes"] is None, f"{op}: extras")
        _check(window(a) == (-1, -1), f"{op}: window {window(a)}")
        for n in ("q", "k", "v"):
            t = a[n]
            _check(t.dtype in (torch.float16, torch.bfloat16), f"{op}: {n} dtype {t.dtype}")
            _check(t.stride(-1) == 1, f"{op}: {n} last stride")
        _check(a["q"].size(2) % a["k"].size(2) == 0, f"{op}: heads")

    def forward(*args, **kwargs):
        a = fwd_sig.bind(*args, **kwargs).arguments  # TypeError, like the real op, on a missing argument
        calls.append(("forward", a))
        check_common(a, "_flash_attn_forward")
        _check(a["return_softmax"] is False, "return_softmax")
        q, k, v = a["q"], a["k"], a["v"]  # [B, S, H, D]
        if q.device.type == "meta":  # shapes only
            out, lse = torch.empty_like(q), torch.empty(q.size(0), q.size(2), q.size(1), device="meta")
            rng, s_dmask = torch.empty(2, dtype=torch.int64, device="meta"), torch.empty(0, dtype=q.dtype, device="meta")
            return (out, q, k, v, out, lse, s_dmask, rng) if minor == "2.6" else (out, lse, s_dmask, rng)
        out, lse = _ref_forward(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), None, a["causal"], a["softmax_scale"])
        out = out.transpose(1, 2).to(q.dtype).contiguous()
        lse = lse.masked_fill(torch.isneginf(lse), math.inf).float()  # flash-attn: +inf for no key
        rng, s_dmask = torch.zeros(2, dtype=torch.int64), torch.empty(0, dtype=q.dtype)
        if minor == "2.6":
            return out, q, k, v, out, lse, s_dmask, rng
        return out, lse, s_dmask, rng

    def backward(*args, **kwargs):
        a = bwd_sig.bind(*args, **kwargs).arguments
        calls.append(("backward", a))
        check_common(a, "_flash_attn_backward")
        q, k, v, lse = a["q"], a["k"], a["v"], a["softmax_lse"]
        _check(lse.dtype == torch.float32 and tuple(lse.shape) == (q.size(0), q.size(2), q.size(1)), "lse [B, H, Sq] fp32")
        for n, like in (("dq", q), ("dk", k), ("dv", v)):
            _check(a[n].shape == like.shape and a[n].dtype == like.dtype, f"{n} buffer")
        if q.device.type == "meta":
            softmax_d = torch.empty(q.size(0), q.size(2), q.size(1), device="meta")
            return (a["dq"], a["dk"], a["dv"], softmax_d) if minor == "2.6" else softmax_d
        _check(not torch.isneginf(lse).any(), "-inf lse overflows exp(s - lse)")
        grads = _ref_backward(*(a[n].transpose(1, 2) for n in ("dout", "q", "k", "v", "out")), lse, None, a["causal"], a["softmax_scale"])
        for n, g in zip(("dq", "dk", "dv"), grads):
            a[n].copy_(g.transpose(1, 2))
        softmax_d = torch.zeros(q.size(0), q.size(2), q.size(1), dtype=torch.float32)
        if minor == "2.6":
            return a["dq"], a["dk"], a["dv"], softmax_d
        return softmax_d

    if minor != "2.6":  # torch.library.custom_op objects: introspection sees (*args, **kwargs)
        def opaque(fn):
            def op(*args, **kwargs):
                return fn(*args, **kwargs)
            return op

        forward, backward = opaque(forward), opaque(backward)
    else:
        forward.__signature__, backward.__signature__ = fwd_sig, bwd_sig
    interface = types.SimpleNamespace(_flash_attn_forward=forward, _flash_attn_backward=backward)
    module = types.ModuleType("flash_attn")
    module.__version__ = version
    module.flash_attn_interface = interface
    module.calls = calls
    return module
