"""The CUDA kernel paths, checked on CPU: exact op argument lists on ``meta`` tensors, numerics
through stand-ins of PyTorch's CUDA attention ops (``tests/stand_ins/cuda_sdpa.py``) and of
flash-attn 2.6 / 2.7 / 2.8 (``tests/stand_ins/flash_attn.py``), eligibility rules, and the
``(out, lse)`` conventions of every kernel x dtype path. ``tests/gpu`` runs the same paths for real."""

import contextlib
import math
import sys

import pytest
import torch

from lightning_sp.layout import Run
from lightning_sp.ops import kernels as K
from lightning_sp.ops.plan import MaskKind
from lightning_sp.ops.ring_attention import BlockAttentionSpec, block_attention
from tests.reference import dense_attention
from tests.stand_ins.cuda_sdpa import ContractError, CudaSdpaStandIn
from tests.stand_ins.flash_attn import make_flash_attn

H100 = (9, 0)
FWD = {"flash": "_scaled_dot_product_flash_attention", "cudnn": "_scaled_dot_product_cudnn_attention",
       "efficient": "_scaled_dot_product_efficient_attention"}


def _cuda(cls, **kw):
    return cls(device_type="cuda", capability=H100, **kw)


# -- eligibility (Note [CUDA kernel eligibility]) -------------------------------------------------


@pytest.mark.parametrize(
    "op, dtype, d, kind, cap, reason",
    [
        ("flash", torch.bfloat16, 128, MaskKind.CAUSAL, H100, None),
        ("flash", torch.float16, 80, MaskKind.FULL, (8, 0), None),
        ("flash", torch.float16, 256, MaskKind.FULL, (8, 0), None),
        ("flash", torch.float16, 256, MaskKind.FULL, (8, 6), "> 192"),
        ("flash_attn", torch.float16, 256, MaskKind.FULL, (8, 6), None),
        ("flash", torch.float16, 100, MaskKind.FULL, H100, "multiple of 8"),
        ("flash_attn", torch.float16, 264, MaskKind.FULL, H100, "<= 256"),
        ("flash", torch.float32, 64, MaskKind.FULL, H100, "fp16 or bf16"),
        ("flash", torch.float16, 64, MaskKind.DENSE, H100, "DENSE"),
        ("flash", torch.float16, 64, MaskKind.FULL, (7, 5), "sm80"),
        ("cudnn", torch.bfloat16, 128, MaskKind.CAUSAL, H100, None),
        ("cudnn", torch.bfloat16, 256, MaskKind.CAUSAL, H100, "<= 128"),
        ("efficient", torch.float32, 4, MaskKind.DENSE, H100, None),
        ("efficient", torch.float32, 6, MaskKind.FULL, H100, "multiple of 4"),
        ("efficient", torch.float16, 12, MaskKind.FULL, H100, "multiple of 8"),
        ("efficient", torch.bfloat16, 64, MaskKind.FULL, (7, 5), "sm80"),
        ("efficient", torch.float64, 64, MaskKind.FULL, H100, "fp32"),
    ],
)
def test_eligibility_rules(op, dtype, d, kind, cap, reason):
    got = K.why_not(op, dtype=dtype, head_dim=d, kind=kind, capability=cap, **_BLOCK)
    assert got is None if reason is None else reason in got


_BLOCK = dict(batch=2, heads=8, seq_len_q=64, seq_len_k=64, deterministic=False)


@pytest.mark.parametrize(
    "op, block, reason",
    [
        ("cudnn", {}, None),
        ("cudnn", {"seq_len_k": 1}, "S_k == 1"),  # a one-token document, a causal piece with one key
        ("cudnn", {"seq_len_q": 1, "seq_len_k": 2}, None),
        ("cudnn", {"batch": 65536}, "<= 65535"),
        ("cudnn", {"heads": 65536}, "<= 65535"),
        ("cudnn", {"deterministic": True}, "use_deterministic_algorithms"),
        ("flash", {"seq_len_k": 1}, None),  # flash, efficient and flash-attn take a single key
        ("efficient", {"seq_len_k": 1}, None),
        ("flash_attn", {"seq_len_k": 1}, None),
        ("flash", {"deterministic": True}, None),  # deterministic backward under the flag
        ("efficient", {"deterministic": True}, None),
        ("flash_attn", {"deterministic": True}, None),
        ("flash", {"seq_len_k": 0}, "empty block"),
        ("efficient", {"seq_len_q": 0}, "empty block"),
        ("flash_attn", {"batch": 0}, "empty block"),
    ],
)
def test_eligibility_depends_on_the_block(op, block, reason):
    got = K.why_not(op, dtype=torch.bfloat16, head_dim=64, kind=MaskKind.CAUSAL, capability=H100, **{**_BLOCK, **block})
    assert got is None if reason is None else reason in got


def test_auto_tries_cudnn_first_on_hopper_only(monkeypatch):
    """Note [cuDNN first on Hopper]: ``auto`` (no flash-attn) is ``sdpa`` except that on sm90 cuDNN comes first;
    blocks cuDNN cannot take fall back to the flash op (not to the efficient op, as ``kernel="cudnn"`` does).
    Control: on sm80 and on CPU ``auto`` chooses exactly as ``sdpa``."""
    meta = lambda dtype, d=64, s=4: torch.empty(1, s, 2, d, dtype=dtype, device="meta")  # noqa: E731
    monkeypatch.setattr(K, "flash_attn_available", lambda: False)
    assert type(K.make_kernel("auto")) is K.AutoKernel
    hopper, ampere = K.AutoKernel(device_type="cuda", capability=H100), K.AutoKernel(device_type="cuda", capability=(8, 0))
    sdpa = K.SDPAKernel(device_type="cuda", capability=(8, 0))
    blocks = [(meta(torch.bfloat16), meta(torch.bfloat16), MaskKind.CAUSAL),
              (meta(torch.float16), meta(torch.float16), MaskKind.FULL),
              (meta(torch.bfloat16, 256), meta(torch.bfloat16, 256), MaskKind.FULL),   # D > 128: not cuDNN
              (meta(torch.bfloat16), meta(torch.bfloat16, s=1), MaskKind.FULL),        # one key: not cuDNN
              (meta(torch.float32), meta(torch.float32), MaskKind.FULL),
              (meta(torch.float16), meta(torch.float16), MaskKind.DENSE)]
    assert [hopper.choose(*b) for b in blocks] == ["cudnn", "cudnn", "flash", "flash", "efficient", "efficient"]
    assert [ampere.choose(*b) for b in blocks] == [sdpa.choose(*b) for b in blocks]
    monkeypatch.setattr(torch, "are_deterministic_algorithms_enabled", lambda: True)
    assert hopper.choose(*blocks[0]) == "flash"  # cuDNN's backward is not deterministic


def test_each_kernel_chooses_its_ops_in_order(monkeypatch):
    meta = lambda dtype, d=64, s=4: torch.empty(1, s, 2, d, dtype=dtype, device="meta")  # noqa: E731
    sdpa, cudnn, eff = _cuda(K.SDPAKernel), _cuda(K.CudnnKernel), _cuda(K.EfficientKernel)
    q = meta(torch.bfloat16)
    assert sdpa.choose(q, q, MaskKind.CAUSAL) == "flash"
    assert sdpa.choose(meta(torch.float16), meta(torch.float16), MaskKind.DENSE) == "efficient"
    assert sdpa.choose(meta(torch.float32), meta(torch.float32), MaskKind.FULL) == "efficient"
    assert sdpa.choose(meta(torch.float64), meta(torch.float64), MaskKind.FULL) == "torch"
    assert cudnn.choose(meta(torch.float16), meta(torch.float16), MaskKind.FULL) == "cudnn"
    assert cudnn.choose(meta(torch.float16, 256), meta(torch.float16, 256), MaskKind.FULL) == "efficient"
    assert cudnn.choose(meta(torch.float16), meta(torch.float16, s=1), MaskKind.FULL) == "efficient"  # one key
    assert cudnn.choose(meta(torch.float16, s=1), meta(torch.float16, s=1), MaskKind.CAUSAL) == "efficient"
    assert cudnn.choose(meta(torch.float16, s=1), meta(torch.float16, s=2), MaskKind.FULL) == "cudnn"  # one query
    assert eff.choose(q, q, MaskKind.CAUSAL) == "efficient"
    assert eff.choose(meta(torch.float32, 12), meta(torch.float32, 12), MaskKind.FULL) == "efficient"
    assert eff.choose(meta(torch.float16, 12), meta(torch.float16, 12), MaskKind.FULL) == "torch"
    assert eff.choose(q, meta(torch.bfloat16, s=0), MaskKind.FULL) == "torch"  # empty block
    monkeypatch.setattr(torch, "are_deterministic_algorithms_enabled", lambda: True)
    monkeypatch.setattr(torch, "is_deterministic_algorithms_warn_only_enabled", lambda: False)
    assert cudnn.choose(q, q, MaskKind.CAUSAL) == "efficient" and sdpa.choose(q, q, MaskKind.CAUSAL) == "flash"
    monkeypatch.setattr(torch, "is_deterministic_algorithms_warn_only_enabled", lambda: True)
    assert cudnn.choose(q, q, MaskKind.CAUSAL) == "cudnn"  # warn_only: PyTorch's own dispatcher's choice


# -- exact argument lists, meta tensors ------------------------------------------------------------


def _meta_block(b, s, h, h_kv, d, dtype):
    """A block sliced out of longer [B, S, H, D] tensors, as the ring loop passes it (not contiguous)."""
    full = lambda heads: torch.empty(b, s + 3, heads, d, dtype=dtype, device="meta")[:, 3:]  # noqa: E731
    return full(h), full(h_kv), full(h_kv)


@pytest.mark.parametrize("name", ["sdpa", "cudnn", "efficient", "flash_attn"])
def test_cuda_argument_lists_on_meta_tensors(name):
    """Every kernel x dtype x mask x head dim x GQA the GPU test runs: the op the rules pick gets an
    argument list the real CUDA op accepts (checked by the stand-in), and the results come back as
    ``out [B, Sq, H, D]`` (q dtype), ``lse [B, H, Sq]`` fp32, dK/dV with H_kv heads."""
    fa = make_flash_attn("2.8.3")
    kernel = {"sdpa": _cuda(K.SDPAKernel), "cudnn": _cuda(K.CudnnKernel), "efficient": _cuda(K.EfficientKernel),
              "flash_attn": _cuda(K.FlashAttnKernel, module=fa)}[name]
    b, s, h = 2, 40, 8
    dtypes = (torch.bfloat16, torch.float16, torch.float32)
    for dtype in dtypes:
        for kind in MaskKind:
            for d in (64, 80, 128, 256):
                for h_kv in (8, 1):
                    q, k, v = _meta_block(b, s, h, h_kv, d, dtype)
                    mask = torch.empty(s, s, dtype=torch.bool, device="meta") if kind is MaskKind.DENSE else None
                    op = kernel.choose(q, k, kind)
                    with CudaSdpaStandIn() as mode:
                        out, lse = kernel.forward(q, k, v, scale=0.1, kind=kind, mask=mask)
                        dq, dk, dv = kernel.backward(
                            torch.empty_like(out, dtype=dtype), q, k, v, out.to(dtype), lse.float(),
                            scale=0.1, kind=kind, mask=mask,
                        )
                    case = (name, dtype, kind, d, h_kv)
                    assert op != "torch", case  # every case of this grid has a fused op
                    if op == "flash_attn":
                        assert mode.names() == [] and [c[0] for c in fa.calls[-2:]] == ["forward", "backward"], case
                        assert fa.calls[-1][1]["k"].size(2) == h_kv, case  # native GQA: no repeat
                        continue
                    assert mode.names() == [FWD[op], FWD[op] + "_backward"], case
                    assert out.shape == q.shape and out.dtype == dtype, case
                    assert lse.shape == (b, h, s) and lse.dtype == torch.float32, case
                    assert (dq.shape, dk.shape, dv.shape) == (q.shape, k.shape, v.shape), case
                    kv_heads_in = mode.calls[0][1][1].size(1)
                    assert kv_heads_in == (h if op == "efficient" else h_kv), case  # native GQA: no repeat


def test_stand_in_rejects_the_old_argument_lists():
    """Negative controls: what the kernels passed before (and other near misses) is refused."""
    q = torch.empty(1, 2, 16, 64, dtype=torch.bfloat16, device="meta")  # [B, H, S, D]
    lse = torch.empty(1, 2, 16, device="meta")
    empty = torch.empty(0, device="meta")
    with CudaSdpaStandIn(), pytest.raises(ContractError, match="undefined"):
        torch.ops.aten._scaled_dot_product_flash_attention_backward(
            q, q, q, q, q, lse, empty, empty, 16, 16, 0.0, False, empty, empty, scale=0.1
        )
    seed = torch.zeros((), dtype=torch.int64, device="meta")
    q_ok = torch.empty(1, 16, 2, 64, dtype=torch.bfloat16, device="meta").transpose(1, 2)  # [B, S, H, D] rows
    with CudaSdpaStandIn(), pytest.raises(ContractError, match="logsumexp shape"):  # unpadded efficient lse
        torch.ops.aten._scaled_dot_product_efficient_attention_backward(
            q_ok, q_ok, q_ok, q_ok, None, q_ok, lse, seed, seed, 0.0, [True, True, True, False], False, scale=0.1
        )
    contiguous_bhsd = torch.empty(1, 2, 16, 64, dtype=torch.bfloat16, device="meta")
    with CudaSdpaStandIn(), pytest.raises(ContractError, match="strides"):
        torch.ops.aten._scaled_dot_product_cudnn_attention(q_ok, contiguous_bhsd, q_ok, None, True, scale=0.1)
    with CudaSdpaStandIn() as mode:  # control of the control: the right layout passes
        torch.ops.aten._scaled_dot_product_cudnn_attention(q_ok, q_ok, q_ok, None, True, scale=0.1)
    assert mode.names() == [FWD["cudnn"]]


# -- the stand-ins refuse what the real ops refuse (each rule: the real check it mirrors is cited
#    in tests/stand_ins/cuda_sdpa.py and flash_attn.py) ---------------------------------------------


@contextlib.contextmanager
def _deterministic(warn_only=False):
    """``torch.use_deterministic_algorithms(True)`` inside, the previous setting restored after."""
    before = (torch.are_deterministic_algorithms_enabled(), torch.is_deterministic_algorithms_warn_only_enabled())
    torch.use_deterministic_algorithms(True, warn_only=warn_only)
    try:
        yield
    finally:
        torch.use_deterministic_algorithms(before[0], warn_only=before[1])


def _rows(b, s, h, d, dtype=torch.bfloat16, *, offset=0, last_stride=1):
    """A ``[B, H, S, D]`` view of ``[B, S, H, D]`` rows on ``meta``, starting ``offset`` elements into its
    buffer, with last-dim stride ``last_stride``."""
    n = b * s * h * d * last_stride
    flat = torch.empty(n + offset, dtype=dtype, device="meta")[offset:]
    return flat.view(b, s, h, d * last_stride)[..., ::last_stride].transpose(1, 2)


_SDPA_OPS = ("flash", "flash_backward", "cudnn", "cudnn_backward", "efficient", "efficient_backward")


def _sdpa_call(op, *, d=64, sk=16, dtype=torch.bfloat16, causal=False, **given):
    """One valid call of the CUDA SDPA op ``op`` (``_SDPA_OPS``) on meta tensors (B=1, Sq=16, H=2),
    with any of ``q, k, v, out, dout, lse`` replaced by ``given``."""
    b, sq, h = 1, 16, 2
    t = dict(q=_rows(b, sq, h, d, dtype), k=_rows(b, sk, h, d, dtype), v=_rows(b, sk, h, d, dtype),
             out=_rows(b, sq, h, d, dtype), dout=_rows(b, sq, h, d, dtype))
    lse_len = {"flash_backward": (sq,), "cudnn_backward": (sq, 1), "efficient_backward": (-(-sq // 32) * 32,)}
    if op in lse_len:
        t["lse"] = torch.empty(b, h, *lse_len[op], device="meta")
    t.update(given)
    q, k, v, out, dout, lse = (t.get(n) for n in ("q", "k", "v", "out", "dout", "lse"))
    aten = torch.ops.aten
    seed = torch.zeros((), dtype=torch.int64, device="meta")
    if op == "flash":
        return aten._scaled_dot_product_flash_attention(q, k, v, 0.0, causal, False, scale=0.1)
    if op == "flash_backward":
        philox = torch.empty(2, dtype=torch.uint64, device="meta"), torch.empty((), dtype=torch.uint64, device="meta")
        return aten._scaled_dot_product_flash_attention_backward(
            dout, q, k, v, out, lse, None, None, sq, sk, 0.0, causal, *philox, scale=0.1)
    if op == "cudnn":
        return aten._scaled_dot_product_cudnn_attention(q, k, v, None, True, 0.0, causal, False, scale=0.1)
    if op == "cudnn_backward":
        return aten._scaled_dot_product_cudnn_attention_backward(
            dout, q, k, v, out, lse, seed, seed.clone(), None, None, None, sq, sk, 0.0, causal, scale=0.1)
    if op == "efficient":
        return aten._scaled_dot_product_efficient_attention(q, k, v, None, True, 0.0, causal, scale=0.1)
    return aten._scaled_dot_product_efficient_attention_backward(
        dout, q, k, v, None, out, lse, seed, seed.clone(), 0.0, [True, True, True, False], causal, scale=0.1)


_FP16_D12 = dict(d=12, dtype=torch.float16)


@pytest.mark.parametrize(
    "op, given, match",
    [
        *((op, dict(sk=1), "sequence length 1") for op in ("cudnn", "cudnn_backward")),
        *((op, dict(sk=0), "empty") for op in _SDPA_OPS),
        *((op, _FP16_D12, "multiple of 8") for op in _SDPA_OPS),
        *((op, {"out": _rows(1, 16, 2, 64, torch.float32)}, "query's") for op in _SDPA_OPS[1::2]),
        *((op, {"dout": _rows(1, 16, 2, 64, torch.float32)}, "query's") for op in _SDPA_OPS[1::2]),
        ("flash_backward", {"lse": torch.empty(1, 2, 32, device="meta")[..., ::2]}, "contiguous"),
        ("cudnn_backward", {"lse": torch.empty(1, 2, 32, 1, device="meta")[:, :, ::2]}, "contiguous"),
        ("efficient_backward", {"lse": torch.empty(1, 2, 64, device="meta")[..., ::2]}, "contiguous"),
        *((op, {"q": _rows(1, 16, 2, 64, offset=1)}, "aligned") for op in _SDPA_OPS),
        *((op, {"k": _rows(1, 16, 2, 64, offset=4)}, "aligned") for op in _SDPA_OPS),  # 8 bytes: still not 16
        *((op, {"dout": _rows(1, 16, 2, 64, offset=1)}, "aligned") for op in _SDPA_OPS[1::2]),
        *((op, {"v": _rows(1, 16, 2, 64, last_stride=2)}, "stride 1") for op in _SDPA_OPS),
    ],
)
def test_sdpa_stand_in_rejects_what_the_real_op_rejects(op, given, match):
    with CudaSdpaStandIn(), pytest.raises(ContractError, match=match):
        _sdpa_call(op, **given)


@pytest.mark.parametrize("op", _SDPA_OPS)
def test_sdpa_stand_in_controls_pass(op):
    """Controls of the rejections above: the valid call, a 16-byte offset, two keys (cuDNN), fp32 with
    head dim 12 (efficient), deterministic mode (except cuDNN) and ``warn_only`` all pass."""
    with CudaSdpaStandIn() as mode:
        _sdpa_call(op)
        _sdpa_call(op, q=_rows(1, 16, 2, 64, offset=8), k=_rows(1, 16, 2, 64, offset=64))  # 16 / 128 bytes
        if op.startswith("cudnn"):
            _sdpa_call(op, sk=2)
        if op.startswith("efficient"):
            _sdpa_call(op, d=12, dtype=torch.float32)
        if not op.startswith("cudnn"):
            with _deterministic():
                _sdpa_call(op)
        with _deterministic(warn_only=True):  # PyTorch's dispatcher runs every op under warn_only
            _sdpa_call(op)
    assert len(mode.calls) == (5 if op.startswith("efficient") else 4)


@pytest.mark.parametrize("op", ["cudnn", "cudnn_backward"])
def test_cudnn_stand_in_refuses_deterministic_mode(op):
    """The real cuDNN op called directly runs (a non-deterministic backward) under
    ``use_deterministic_algorithms(True)``: only PyTorch's dispatcher drops it. The stand-in refuses."""
    with CudaSdpaStandIn(), _deterministic(), pytest.raises(ContractError, match="not deterministic"):
        _sdpa_call(op)


def _fa_call(fa, which, *, d=16, dtype=torch.bfloat16, **given):
    """One valid call of the stand-in flash-attn ``which`` ("forward"/"backward") on meta tensors
    ``[B=1, S=8, H=2, D]``, in that version's positional argument list, with ``given`` replacing any."""
    t = lambda: torch.empty(1, 8, 2, d, dtype=dtype, device="meta")  # noqa: E731
    fai = fa.flash_attn_interface
    window = [(-1, -1)] if fa.__version__.startswith("2.6") else [-1, -1]
    a = dict(q=t(), k=t(), v=t(), dout=t(), out=t(), softmax_lse=torch.empty(1, 2, 8, device="meta"),
             dq=t(), dk=t(), dv=t(), window=window, alibi_slopes=None, deterministic=False)
    a.update(given)
    if which == "forward":
        return fai._flash_attn_forward(a["q"], a["k"], a["v"], 0.0, 0.25, False, *a["window"], 0.0, a["alibi_slopes"], False)
    return fai._flash_attn_backward(
        a["dout"], a["q"], a["k"], a["v"], a["out"], a["softmax_lse"], a["dq"], a["dk"], a["dv"], 0.0, 0.25, False,
        *a["window"], 0.0, a["alibi_slopes"], a["deterministic"], None)


_FA_VERSIONS = ["2.6.3", "2.7.4", "2.8.3"]


@pytest.mark.parametrize("version", _FA_VERSIONS)
def test_flash_attn_stand_in_rejects_what_the_real_op_rejects(version):
    fa = make_flash_attn(version)
    meta = lambda *shape, dtype=torch.bfloat16: torch.empty(*shape, dtype=dtype, device="meta")  # noqa: E731
    fp32 = meta(1, 8, 2, 16, dtype=torch.float32)
    cases = [  # (which, given, match): mha_fwd / mha_bwd checks, flash_api.cpp
        ("forward", dict(d=12, dtype=torch.float16), "multiple of 8"),
        ("backward", dict(d=12, dtype=torch.float16), "multiple of 8"),
        ("forward", dict(dtype=torch.float32), "dtype"),
        ("backward", dict(dout=fp32), "query and dout must have the same dtype"),
        ("backward", dict(out=fp32), "query and out must have the same dtype"),
        ("backward", dict(dq=meta(1, 8, 2, 32)[..., ::2]), "dq must have contiguous last dimension"),
        ("backward", dict(dk=fp32), "dk must have the same dtype as q"),
        ("backward", dict(softmax_lse=meta(1, 8, 2, dtype=torch.float32).transpose(1, 2)), "softmax_lse must be contiguous"),
        ("backward", dict(softmax_lse=meta(1, 2, 8)), r"softmax_lse must be \[B, H, Sq\] fp32"),
        ("forward", dict(q=meta(1 * 8 * 2 * 16 + 1)[1:].view(1, 8, 2, 16)), "aligned"),
        ("backward", dict(dv=meta(1 * 8 * 2 * 16 + 4)[4:].view(1, 8, 2, 16)), "aligned"),
        ("forward", dict(k=meta(1, 0, 2, 16), v=meta(1, 0, 2, 16)), "positive"),
    ]
    for which, given, match in cases:
        with pytest.raises(ContractError, match=match):
            _fa_call(fa, which, **given)
    with _deterministic(), pytest.raises(ContractError, match="deterministic=False"):
        _fa_call(fa, "backward")
    # the argument types the real functions accept: a custom op's schema (2.7+), pybind11 (2.6)
    bad_window = [(-1.0, -1)] if version.startswith("2.6") else [-1.0, -1]
    with pytest.raises(RuntimeError if not version.startswith("2.6") else ContractError, match="int|window_size"):
        _fa_call(fa, "forward", window=bad_window)
    if not version.startswith("2.6"):
        with pytest.raises(RuntimeError, match=r"Optional\[Tensor\]"):
            _fa_call(fa, "forward", alibi_slopes=0.0)
        with pytest.raises(RuntimeError, match="Expected a value of type 'int'"):  # 2.6's window tuple
            _fa_call(fa, "forward", window=[(-1, -1), -1])
    # controls: the valid calls, a 16-byte offset, deterministic=True in deterministic mode
    _fa_call(fa, "forward")
    _fa_call(fa, "forward", q=meta(1 * 8 * 2 * 16 + 8)[8:].view(1, 8, 2, 16))
    _fa_call(fa, "backward")
    with _deterministic():
        _fa_call(fa, "backward", deterministic=True)
    assert [c[0] for c in fa.calls[-4:]] == ["forward", "forward", "backward", "backward"]


# -- ... and kernels.py never sends it ------------------------------------------------------------


def _hostile_inputs(dtype, d, *, h=4, h_kv=2, n=24, seed=0):
    """q, k, v as views the fused ops refuse as given: q and v start one element into a flat buffer
    (misaligned), k has last-dim stride 2."""
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(n * h * d + 1, generator=g).to(dtype)[1:].view(1, n, h, d)
    k = torch.randn(1, n, h_kv, 2 * d, generator=g).to(dtype)[..., ::2]
    v = torch.randn(n * h_kv * d + 1, generator=g).to(dtype)[1:].view(1, n, h_kv, d)
    assert q.storage_offset() == 1 and k.stride(-1) == 2 and v.storage_offset() == 1
    return q, k, v


_KERNEL_PATHS = [  # (kernel factory, dtype, head dim, op it must run, tolerance)
    (lambda: _cuda(K.SDPAKernel), torch.float16, 16, "flash", 3e-3),
    (lambda: _cuda(K.SDPAKernel), torch.float32, 12, "efficient", 1e-5),
    (lambda: _cuda(K.EfficientKernel), torch.bfloat16, 16, "efficient", 2e-2),
    (lambda: _cuda(K.CudnnKernel), torch.bfloat16, 16, "cudnn", 2e-2),
    *((lambda v=v: _cuda(K.FlashAttnKernel, module=make_flash_attn(v)), torch.bfloat16, 16, "flash_attn", 2e-2)
      for v in _FA_VERSIONS),
    (lambda: _cuda(K.SDPAKernel), torch.float16, 12, "torch", 3e-3),  # head dim % 8: no fused op
    (lambda: _cuda(K.CudnnKernel), torch.float16, 12, "torch", 3e-3),
    (lambda: _cuda(K.FlashAttnKernel, module=make_flash_attn("2.8.3")), torch.bfloat16, 12, "torch", 2e-2),
]


@pytest.mark.parametrize("make, dtype, d, op, tol", _KERNEL_PATHS)
@pytest.mark.parametrize("kind", [MaskKind.FULL, MaskKind.CAUSAL])
def test_kernels_never_send_what_the_ops_reject(make, dtype, d, op, tol, kind):
    """Every CUDA path given what the ring loop or a user can hand it: misaligned and last-dim-strided
    q/k/v, an fp32 non-contiguous ``out`` and ``dout`` (the merged result), a non-contiguous lse, a
    0-dim tensor as the scale. The stand-ins (as strict as the real ops) accept every call, the op
    the rules pick runs, and forward and dQ/dK/dV equal dense fp64 attention."""
    kernel = make()
    q, k, v = _hostile_inputs(dtype, d)
    scale = torch.tensor(d**-0.5, dtype=torch.float64)
    assert kernel.choose(q, k, kind) == op
    causal = kind is MaskKind.CAUSAL
    with CudaSdpaStandIn() as mode:
        out, lse = kernel.forward(q, k, v, scale=scale, kind=kind, mask=None)
        out32 = out.float().transpose(1, 2).contiguous().transpose(1, 2)  # [B, S, H, D], strides of [B, H, S, D]
        lse_nc = lse.transpose(1, 2).contiguous().transpose(1, 2)  # [B, H, S], not contiguous
        dout = torch.randn(out.shape, generator=torch.Generator().manual_seed(1)).transpose(1, 2).contiguous().transpose(1, 2)
        assert not (out32.is_contiguous() or lse_nc.is_contiguous() or dout.is_contiguous())
        grads = kernel.backward(dout, q, k, v, out32, lse_nc, scale=scale, kind=kind, mask=None)
    fused = [c[0] for c in mode.calls]
    if op in ("flash", "efficient", "cudnn"):
        assert fused == [FWD[op], FWD[op] + "_backward"]
    else:
        assert fused == []  # flash-attn's calls are recorded by its stand-in module; torch runs no op
    qd, kd, vd = (t.detach().double().requires_grad_() for t in (q, k, v))
    ref = dense_attention(qd, kd, vd, causal=causal, scale=float(scale))
    ref_grads = torch.autograd.grad(ref, (qd, kd, vd), dout.double())
    rel = lambda a, b: ((a.double() - b).abs().max() / b.abs().max()).item()  # noqa: E731
    assert out.dtype == (K.accumulation_dtype(dtype) if op == "torch" else dtype) and rel(out, ref) < tol
    for g, r in zip(grads, ref_grads):
        assert g.shape == r.shape and rel(g, r) < tol
    other = dense_attention(qd, kd, vd, causal=not causal, scale=float(scale))
    assert rel(out, other) > 10 * tol  # control: the other mask is caught


def test_flash_attn_kernel_calls_reach_the_stand_in():
    """The flash-attn rows above really ran flash-attn (not the fallback): its stand-in saw each
    call, with 16-byte aligned, contiguous inputs and a float scale."""
    fa = make_flash_attn("2.7.4")
    kernel = _cuda(K.FlashAttnKernel, module=fa)
    q, k, v = _hostile_inputs(torch.bfloat16, 16)
    out, lse = kernel.forward(q, k, v, scale=torch.tensor(0.25), kind=MaskKind.CAUSAL, mask=None)
    kernel.backward(out.float(), q, k, v, out.float(), lse, scale=torch.tensor(0.25), kind=MaskKind.CAUSAL, mask=None)
    assert [c[0] for c in fa.calls] == ["forward", "backward"]
    for _, a in fa.calls:
        assert isinstance(a["softmax_scale"], float) and a["q"].storage_offset() == 0 and a["k"].is_contiguous()


# -- deterministic mode -----------------------------------------------------------------------------


def test_deterministic_mode_reaches_only_deterministic_ops():
    """Under ``torch.use_deterministic_algorithms(True)``: ``cudnn`` runs every block with the
    efficient op (cuDNN's backward is not deterministic, and the op does not check), ``sdpa`` keeps
    the flash op and flash-attn gets ``deterministic=True`` (both deterministic under the flag); the
    results stay exact. With ``warn_only=True`` cuDNN runs, as PyTorch's own dispatcher runs it."""
    with _deterministic():
        mode = _check_against_dense(_cuda(K.CudnnKernel), torch.bfloat16, causal=True, tol=2e-2)
        assert set(mode.names()) == {FWD["efficient"], FWD["efficient"] + "_backward"}
        mode = _check_against_dense(_cuda(K.SDPAKernel), torch.float16, causal=True, tol=3e-3)
        assert set(mode.names()) == {FWD["flash"], FWD["flash"] + "_backward"}
        for version in _FA_VERSIONS:
            fa = make_flash_attn(version)
            _check_against_dense(_cuda(K.FlashAttnKernel, module=fa), torch.bfloat16, causal=False, tol=2e-2)
            backward = [c[1] for c in fa.calls if c[0] == "backward"]
            assert backward and all(a["deterministic"] is True for a in backward)
    with _deterministic(warn_only=True):
        mode = _check_against_dense(_cuda(K.CudnnKernel), torch.bfloat16, causal=True, tol=2e-2)
        assert FWD["cudnn"] in mode.names()
    assert not torch.are_deterministic_algorithms_enabled()  # restored
    fa = make_flash_attn("2.8.3")  # control: outside the mode, flash-attn's faster backward
    _check_against_dense(_cuda(K.FlashAttnKernel, module=fa), torch.bfloat16, causal=False, tol=2e-2)
    assert all(c[1]["deterministic"] is False for c in fa.calls if c[0] == "backward")


# -- numerics through the stand-ins ----------------------------------------------------------------


def _run_blocks(kernel, q, k, v, *, causal, cu):
    """Local attention through the ring loop's single-rank path: one kernel call per document block,
    merged, and the backward of every block against the merged (out, lse)."""
    n = q.size(1)
    spec = BlockAttentionSpec(
        kernel=kernel, scale=q.size(-1) ** -0.5, causal=causal, q_runs=[Run(0, 0, n)],
        k_runs_by_rank=[[Run(0, 0, n)]], doc_bounds=cu.tolist(),
    )
    out = block_attention(q, k, v, spec)
    dout = torch.randn_like(out)
    return out, torch.autograd.grad(out, (q, k, v), dout), dout


def _check_against_dense(kernel, dtype, *, causal, tol, h=4, h_kv=2, d=16):
    torch.manual_seed(0)
    n = 48
    q = torch.randn(1, n, h, d, dtype=dtype, requires_grad=True)
    k = torch.randn(1, n, h_kv, d, dtype=dtype, requires_grad=True)
    v = torch.randn(1, n, h_kv, d, dtype=dtype, requires_grad=True)
    cu = torch.tensor([0, 17, 18, 40, n], dtype=torch.int32)  # a one-token document included
    with CudaSdpaStandIn() as mode:
        out, grads, dout = _run_blocks(kernel, q, k, v, causal=causal, cu=cu)
    qd, kd, vd = (t.detach().double().requires_grad_() for t in (q, k, v))
    ref = dense_attention(qd, kd, vd, causal=causal, cu_seqlens=cu)
    ref_grads = torch.autograd.grad(ref, (qd, kd, vd), dout.double())
    rel = lambda a, b: ((a.double() - b).abs().max() / b.abs().max()).item()  # noqa: E731
    assert rel(out, ref) < tol
    for g, r in zip(grads, ref_grads):
        assert rel(g, r) < tol
    no_docs = dense_attention(qd, kd, vd, causal=causal)
    assert rel(out, no_docs) > 10 * tol  # control: ignoring the documents is caught
    return mode


@pytest.mark.parametrize(
    "cls, dtype, op, tol",
    [
        (K.SDPAKernel, torch.float16, "flash", 3e-3),
        (K.SDPAKernel, torch.float32, "efficient", 1e-5),
        (K.CudnnKernel, torch.bfloat16, "cudnn", 2e-2),
        (K.EfficientKernel, torch.float16, "efficient", 3e-3),
    ],
)
@pytest.mark.parametrize("causal", [True, False])
def test_cuda_paths_match_dense_attention(cls, dtype, op, tol, causal):
    """Packed documents, one of them a single token: every block through the kernel's fused op,
    except the one-token document's ``1 x 1`` block under ``cudnn`` (cuDNN takes no ``S_k == 1``),
    which goes to the efficient op."""
    mode = _check_against_dense(_cuda(cls), dtype, causal=causal, tol=tol)
    key_len = {name: set() for name in mode.names()}
    for name, args, _ in mode.calls:
        key_len[name].add(args[2].size(2))  # value [B, H_kv, Sk, D]
    if op == "cudnn":
        assert key_len.keys() == {FWD[op], FWD[op] + "_backward", FWD["efficient"], FWD["efficient"] + "_backward"}
        assert 1 not in key_len[FWD[op]] | key_len[FWD[op] + "_backward"]
        assert key_len[FWD["efficient"]] == key_len[FWD["efficient"] + "_backward"] == {1}
    else:
        assert key_len.keys() == {FWD[op], FWD[op] + "_backward"}
        assert 1 in key_len[FWD[op]]  # the one-token document's block, through the same op
    assert len(mode.names()) >= 8  # several document blocks, each forward and backward


def _dense_mask_case(dtype):
    torch.manual_seed(1)
    sq, sk, h, d = 12, 20, 2, 8
    mask = torch.rand(sq, sk) > 0.6
    mask[[2, 7]] = False  # rows that see no key
    q = torch.randn(1, sq, h, d, dtype=dtype)
    k, v = torch.randn(1, sk, 1, d, dtype=dtype), torch.randn(1, sk, 1, d, dtype=dtype)
    return q, k, v, mask


@pytest.mark.parametrize(
    "kernel, dtype, tol",
    [
        (K.TorchBlockwiseKernel(block_q=5, block_k=7), torch.float64, 1e-12),
        (K.TorchBlockwiseKernel(), torch.bfloat16, 2e-2),
        (K.SDPAKernel(), torch.float64, 1e-12),
        (K.SDPAKernel(), torch.float32, 1e-5),
        (K.SDPAKernel(), torch.bfloat16, 2e-2),
        (_cuda(K.SDPAKernel), torch.float32, 1e-5),
        (_cuda(K.EfficientKernel), torch.float16, 3e-3),
        (_cuda(K.CudnnKernel), torch.float64, 1e-12),  # fp64 on CUDA: the torch kernel
    ],
)
def test_rows_without_keys_and_lse_dtype(kernel, dtype, tol):
    """Every kernel x dtype path: lse in fp32 (fp64 for fp64), ``-inf`` and ``out = 0`` for rows that
    saw no key, and a backward (given those -inf rows) equal to the fp64 reference, zero on them."""
    q, k, v, mask = _dense_mask_case(dtype)
    with CudaSdpaStandIn():
        out, lse = kernel.forward(q, k, v, scale=0.3, kind=MaskKind.DENSE, mask=mask)
        dout = torch.randn_like(q)
        dq, dk, dv = kernel.backward(dout, q, k, v, out.to(dtype), lse, scale=0.3, kind=MaskKind.DENSE, mask=mask)
    assert lse.dtype == K.accumulation_dtype(dtype) == (torch.float64 if dtype is torch.float64 else torch.float32)
    assert torch.isneginf(lse[:, :, [2, 7]]).all() and torch.isfinite(lse[:, :, mask.any(-1)]).all()
    assert (out[:, [2, 7]] == 0).all()
    ref_out, ref_lse = K.TorchBlockwiseKernel().forward(*(t.double() for t in (q, k, v)), scale=0.3, kind=MaskKind.DENSE, mask=mask)
    ref = K.TorchBlockwiseKernel().backward(
        dout.double(), *(t.double() for t in (q, k, v)), out.double(), lse.double(), scale=0.3, kind=MaskKind.DENSE, mask=mask
    )
    assert (out.double() - ref_out).abs().max() < tol
    for g, r in zip((dq, dk, dv), ref):
        assert torch.isfinite(g).all() and (g.double() - r).abs().max() < tol * max(1.0, r.abs().max().item())
    assert (dq[:, [2, 7]] == 0).all()
    wrong = K.TorchBlockwiseKernel().backward(  # control: a wrong scale is caught
        dout.double(), *(t.double() for t in (q, k, v)), out.double(), lse.double(), scale=0.5, kind=MaskKind.DENSE, mask=mask
    )
    assert (wrong[1] - ref[1]).abs().max() > 10 * tol * max(1.0, ref[1].abs().max().item())


def test_fused_backward_survives_a_minus_inf_row():
    """A FULL block whose merged lse is -inf on a row (its out is 0): the fused op gets +inf there
    (the stand-in refuses -inf) and that row contributes nothing."""
    torch.manual_seed(2)
    q, k, v = (torch.randn(1, 8, 2, 16, dtype=torch.float16) for _ in range(3))
    kernel = _cuda(K.SDPAKernel)
    with CudaSdpaStandIn():
        out, lse = kernel.forward(q, k, v, scale=0.25, kind=MaskKind.FULL, mask=None)
        out[:, 3], lse[:, :, 3] = 0, -math.inf
        dout = torch.randn_like(q)
        dq, dk, dv = kernel.backward(dout, q, k, v, out, lse, scale=0.25, kind=MaskKind.FULL, mask=None)
        dout_without = dout.clone()
        dout_without[:, 3] = 0
        _, dk0, dv0 = kernel.backward(dout_without, q, k, v, out, lse, scale=0.25, kind=MaskKind.FULL, mask=None)
    assert (dq[:, 3] == 0).all() and torch.equal(dk, dk0) and torch.equal(dv, dv0)
    assert dk.abs().max() > 0  # control: the other rows do contribute


# -- flash-attn 2.6 / 2.7 / 2.8 through stand-in packages -----------------------------------------


@pytest.mark.parametrize("version", ["2.6.3", "2.7.4.post1", "2.8.3"])
@pytest.mark.parametrize("causal", [True, False])
def test_flash_attn_versions(version, causal):
    fa = make_flash_attn(version)
    kernel = _cuda(K.FlashAttnKernel, module=fa)
    _check_against_dense(kernel, torch.bfloat16, causal=causal, tol=2e-2, h=8, h_kv=1)
    kinds = [c[0] for c in fa.calls]
    assert kinds.count("forward") >= 4 and kinds.count("backward") == kinds.count("forward")
    assert all(c[1]["k"].size(2) == 1 for c in fa.calls)  # GQA 8:1 passed natively


def test_flash_attn_stand_in_refuses_missing_arguments():
    """Negative control: the keyword call the old kernel built from ``inspect.signature`` (which sees
    ``(*args, **kwargs)`` from 2.7 on) misses required arguments and fails."""
    q = torch.randn(1, 8, 2, 16, dtype=torch.float16)
    fwd = make_flash_attn("2.7.4").flash_attn_interface._flash_attn_forward
    with pytest.raises(RuntimeError, match="missing value for argument 'window_size_left'"):  # the dispatcher's
        fwd(q, q, q, dropout_p=0.0, softmax_scale=0.25, causal=False)
    with pytest.raises(TypeError, match="window_size"):
        make_flash_attn("2.6.3").flash_attn_interface._flash_attn_forward(q, q, q, 0.0, 0.25, False)


def test_flash_attn_version_pinning(monkeypatch):
    for version, ok in (("2.6.3", True), ("2.8.3", True), ("2.5.9", False), ("3.0.0b1", False)):
        monkeypatch.setitem(sys.modules, "flash_attn", make_flash_attn(version if ok else "2.8.3"))
        if not ok:
            sys.modules["flash_attn"].__version__ = version
        monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
        assert K.flash_attn_available() is ok
        if ok:
            assert isinstance(K.make_kernel("flash_attn"), K.FlashAttnKernel)
            assert isinstance(K.make_kernel("auto"), K.FlashAttnKernel)
            assert K.FlashAttnKernel().version == version[:3]
        else:
            with pytest.raises(ValueError, match=r"not supported.*flash-attn>=2.6,<2.9"):
                K.make_kernel("flash_attn")
            assert isinstance(K.make_kernel("auto"), K.SDPAKernel)
        monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
        assert K.flash_attn_available() is False
        assert isinstance(K.make_kernel("auto"), K.SDPAKernel)


# -- names and devices -----------------------------------------------------------------------------


def test_kernel_names_and_cuda_only_kernels_on_cpu():
    assert {"auto", "torch", "sdpa", "flash_attn", "efficient", "cudnn"} <= set(K.KERNELS)
    assert isinstance(K.make_kernel("efficient"), K.EfficientKernel)
    assert isinstance(K.make_kernel("cudnn"), K.CudnnKernel)
    q = torch.randn(1, 4, 2, 8)
    for name in ("efficient", "cudnn"):
        with pytest.raises(ValueError, match="CUDA tensors only.*kernel='sdpa'"):
            K.make_kernel(name).forward(q, q, q, scale=0.3, kind=MaskKind.FULL, mask=None)
    with pytest.raises(ValueError, match="kernel must be one of"):
        K.make_kernel("triton")


# -- CPU GQA: K/V with H_kv heads go into the CPU op unrepeated -------------------------------------


@pytest.mark.parametrize("kind", [MaskKind.FULL, MaskKind.CAUSAL, MaskKind.DENSE])
@pytest.mark.parametrize("native", [True, False])
def test_cpu_sdpa_gqa_native_and_fallback(monkeypatch, kind, native):
    """``SDPAKernel`` on CPU with H=8, H_kv=2: forward and backward equal dense fp64 attention (autograd
    through ``tests.reference.dense_attention``), with the op's native GQA and with the ``expand_kv``
    fallback; natively the op sees K/V with 2 heads and no repeat happens."""
    if native:
        assert K.cpu_sdpa_takes_gqa()  # torch 2.13's CPU op takes H_kv < H
    else:
        monkeypatch.setattr(K, "cpu_sdpa_takes_gqa", lambda: False)
    g = torch.Generator().manual_seed(3)
    b, n, h, h_kv, d = 2, 24, 8, 2, 16
    q, k, v, dout = (torch.randn(b, n, hh, d, generator=g, dtype=torch.float64) for hh in (h, h_kv, h_kv, h))
    mask = torch.rand(n, n, generator=g) < 0.6 if kind is MaskKind.DENSE else None
    if mask is not None:
        mask[:, 0] = True  # every row sees a key (empty rows: test_rows_without_keys_and_lse_dtype)
    seen_heads = []
    real_fwd = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu

    class _Spy:  # records the K heads the op receives
        def __call__(self, q_, k_, *a, **kw):
            seen_heads.append(k_.size(1))
            return real_fwd(q_, k_, *a, **kw)

    monkeypatch.setattr(torch.ops.aten, "_scaled_dot_product_flash_attention_for_cpu", _Spy())
    kernel = K.SDPAKernel()
    out, lse = kernel.forward(q, k, v, scale=0.3, kind=kind, mask=mask)
    dq, dk, dv = kernel.backward(dout, q, k, v, out, lse, scale=0.3, kind=kind, mask=mask)
    assert seen_heads == [h_kv if native else h]

    # reference: dense fp64 with the same mask, gradients by autograd
    qr, kr, vr = (t.clone().requires_grad_() for t in (q, k, v))
    kx, vx = kr.repeat_interleave(h // h_kv, 2), vr.repeat_interleave(h // h_kv, 2)
    s = torch.einsum("bqhd,bkhd->bhqk", qr, kx) * 0.3
    visible = torch.ones(n, n, dtype=torch.bool).tril() if kind is MaskKind.CAUSAL else mask
    if visible is not None:
        s = s.masked_fill(~visible, -math.inf)
    ref = torch.einsum("bhqk,bkhd->bqhd", torch.softmax(s, -1), vx)
    ref.backward(dout)
    assert dk.shape == dv.shape == k.shape
    assert (out - ref).abs().max() < 1e-12
    for got, want in zip((dq, dk, dv), (qr.grad, kr.grad, vr.grad)):
        assert (got - want).abs().max() < 1e-11
    # control: the same tolerance catches a K/V head mapping that is off by one group
    k_wrong = k.roll(1, dims=2)
    out_wrong, _ = kernel.forward(q, k_wrong, v, scale=0.3, kind=kind, mask=mask)
    assert (out_wrong - ref).abs().max() > 1e-3


def test_every_kernel_refuses_heads_that_do_not_group():
    """``check_heads``: fewer query heads than K/V heads (which kills the process inside torch 2.13's CPU flash op
    with SIGFPE) or a non-multiple gets a ValueError that says what to change, from every kernel's forward and
    backward, on CPU and on the CUDA path (checked before any op is chosen). Control: H = 6, H_kv = 2 runs."""
    q2, q6, kv4, kv2 = (torch.randn(1, 8, h, 8) for h in (2, 6, 4, 2))
    kernels = [K.make_kernel("auto"), K.make_kernel("torch"), _cuda(K.SDPAKernel), _cuda(K.CudnnKernel)]
    for kernel in kernels:
        for q, kv in ((q2, kv4), (q6, kv4)):
            with pytest.raises(ValueError, match=f"q has {q.size(2)} heads and k/v have 4.*positive multiple"):
                kernel.forward(q, kv, kv, scale=0.3, kind=MaskKind.FULL, mask=None)
            with pytest.raises(ValueError, match="positive multiple"):
                kernel.backward(q, q, kv, kv, q, torch.zeros(1, q.size(2), 8), scale=0.3, kind=MaskKind.FULL,
                                mask=None)
    for kernel in kernels[:2]:  # the CPU ones run the control
        out, lse = kernel.forward(q6, kv2, kv2, scale=0.3, kind=MaskKind.FULL, mask=None)
        assert out.shape == q6.shape and kernel.backward(q6, q6, kv2, kv2, out, lse, scale=0.3, kind=MaskKind.FULL,
                                                         mask=None)[1].shape == kv2.shape
