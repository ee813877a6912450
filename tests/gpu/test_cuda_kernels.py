"""Every CUDA kernel path against dense float64 attention, forward and dQ/dK/dV. Skipped without
CUDA: not CI coverage (CI checks the same code paths' argument lists and numerics through stand-ins
in tests/unit/test_kernel_contracts.py); run `make test-gpu` on a GPU machine and record the device.

Grid (one small case each, < 2 minutes on one GPU): kernel x dtype (bf16, fp16; fp32 for the paths
that take it) x causal x head dim 64/80/128/256 x {one sequence, packed documents}, GQA 8:1, through
``SequenceParallelAttention`` (per-document blocks merged, then each block's backward against the
merged out/lse, as the ring backends do), plus DENSE-mask blocks with rows that see no key, blocks
PyTorch's own dispatcher never sends (one key, misaligned or strided inputs, fp32 out/dout), and
bitwise reproducibility under ``torch.use_deterministic_algorithms(True)``.
"""

import math

import pytest
import torch

from lightning_sp import SequenceParallelAttention
from lightning_sp.masks import AttentionMask
from lightning_sp.ops import kernels as K
from lightning_sp.ops.plan import MaskKind

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA (not CI coverage)"),
]

TOL = {torch.bfloat16: 2e-2, torch.float16: 5e-3, torch.float32: 1e-4}
PATHS = [  # (kernel, dtype)
    ("sdpa", torch.bfloat16), ("sdpa", torch.float16), ("sdpa", torch.float32),
    ("efficient", torch.bfloat16), ("efficient", torch.float16), ("efficient", torch.float32),
    ("cudnn", torch.bfloat16), ("cudnn", torch.float16),
    ("flash_attn", torch.bfloat16), ("flash_attn", torch.float16),
]


def _skip_unavailable(kernel):
    if kernel == "flash_attn" and not K.flash_attn_available():
        pytest.skip("flash-attn 2.6-2.8 not installed")
    if kernel == "cudnn" and not torch.backends.cudnn.is_available():
        pytest.skip("cuDNN not available")


def _dense(q, k, v, *, causal, cu_seqlens, scale):
    """fp64 reference on the GPU: ``q [1, N, H, D]``, ``k, v [1, N, H_kv, D]``."""
    q, k, v = q.double(), k.double(), v.double()
    n, g = q.size(1), q.size(2) // k.size(2)
    k, v = k.repeat_interleave(g, dim=2), v.repeat_interleave(g, dim=2)
    s = torch.einsum("bqhd,bkhd->bhqk", q, k) * scale
    pos = torch.arange(n, device=q.device)
    visible = torch.ones(n, n, dtype=torch.bool, device=q.device)
    if causal:
        visible &= pos[None, :] <= pos[:, None]
    if cu_seqlens is not None:
        doc = torch.bucketize(pos, cu_seqlens.long(), right=True)
        visible &= doc[:, None] == doc[None, :]
    return torch.einsum("bhqk,bkhd->bqhd", torch.softmax(s.masked_fill(~visible, -math.inf), -1), v)


def _rel(a, b):
    return ((a.double() - b).abs().max() / b.abs().max()).item()


@pytest.mark.parametrize("kernel, dtype", PATHS)
def test_cuda_kernel_matches_dense(kernel, dtype):
    _skip_unavailable(kernel)
    tol = TOL[dtype]
    cap = torch.cuda.get_device_capability()
    chain = K.make_kernel(kernel)
    n, h, h_kv = 384, 8, 1
    for d in (64, 80, 128, 256):
        for causal in (True, False):
            for docs in (False, True):
                case = (kernel, dtype, d, causal, docs, cap)
                torch.manual_seed(d + causal + 2 * docs)
                q = torch.randn(1, n, h, d, device="cuda", dtype=dtype, requires_grad=True)
                k = torch.randn(1, n, h_kv, d, device="cuda", dtype=dtype, requires_grad=True)
                v = torch.randn(1, n, h_kv, d, device="cuda", dtype=dtype, requires_grad=True)
                cu = torch.tensor([0, 100, 101, 277, n], dtype=torch.int32, device="cuda") if docs else None
                out = SequenceParallelAttention(causal=causal, kernel=kernel)(q, k, v, cu_seqlens=cu)
                dout = torch.randn_like(out)
                grads = torch.autograd.grad(out, (q, k, v), dout)
                qd, kd, vd = (t.detach().double().requires_grad_() for t in (q, k, v))
                ref = _dense(qd, kd, vd, causal=causal, cu_seqlens=cu, scale=d**-0.5)
                ref_grads = torch.autograd.grad(ref, (qd, kd, vd), dout.double())
                assert out.dtype == dtype and _rel(out, ref) < tol, case
                for g, r in zip(grads, ref_grads):
                    assert g.shape == r.shape and _rel(g, r) < tol, case
                control = _dense(qd, kd, vd, causal=not causal, cu_seqlens=cu, scale=d**-0.5)
                assert _rel(out, control) > 10 * tol, case  # control: the other mask is caught
                op = chain.choose(q, k, MaskKind.CAUSAL if causal else MaskKind.FULL)
                expected = {"sdpa": ("flash", "efficient"), "efficient": ("efficient",),
                            "cudnn": ("cudnn", "efficient"), "flash_attn": ("flash_attn", "efficient")}[kernel]
                assert op in expected, (case, op)  # a fused op ran, not the Python fallback


@pytest.mark.parametrize("kernel, dtype", [p for p in PATHS if p[0] in ("sdpa", "efficient")])
def test_dense_mask_blocks_with_empty_rows(kernel, dtype):
    """DENSE blocks (the efficient op with a bias): rows with no key get out 0 / lse -inf, and the
    backward given those rows stays finite and exact."""
    tol = TOL[dtype]
    torch.manual_seed(0)
    sq, sk, h, d = 100, 150, 8, 64
    mask = torch.rand(sq, sk, device="cuda") > 0.7
    mask[[3, 50]] = False
    q = torch.randn(1, sq, h, d, device="cuda", dtype=dtype)
    k, v = (torch.randn(1, sk, 1, d, device="cuda", dtype=dtype) for _ in range(2))
    kern = K.make_kernel(kernel)
    assert kern.choose(q, k, MaskKind.DENSE) == "efficient"
    out, lse = kern.forward(q, k, v, scale=0.125, kind=MaskKind.DENSE, mask=mask)
    dout = torch.randn_like(q)
    grads = kern.backward(dout, q, k, v, out.to(dtype), lse, scale=0.125, kind=MaskKind.DENSE, mask=mask)
    ref = K.TorchBlockwiseKernel()
    args = [t.double() for t in (q, k, v)]
    ref_out, ref_lse = ref.forward(*args, scale=0.125, kind=MaskKind.DENSE, mask=mask)
    ref_grads = ref.backward(dout.double(), *args, ref_out, ref_lse, scale=0.125, kind=MaskKind.DENSE, mask=mask)
    assert lse.dtype == torch.float32 and torch.isneginf(lse[:, :, [3, 50]]).all() and (out[:, [3, 50]] == 0).all()
    assert _rel(out, ref_out) < tol
    for g, r in zip(grads, ref_grads):
        assert torch.isfinite(g).all() and _rel(g, r) < tol
    wrong = ref.forward(*args, scale=0.125, kind=MaskKind.FULL, mask=None)[0]
    assert _rel(out, wrong) > 10 * tol  # control: ignoring the mask is caught


def _misaligned(shape, dtype, *, seed):
    """A ``[B, S, H, D]`` tensor starting one element into its buffer (not 16-byte aligned)."""
    g = torch.Generator(device="cuda").manual_seed(seed)
    n = math.prod(shape)
    return torch.randn(n + 1, device="cuda", generator=g).to(dtype)[1:].view(shape)


@pytest.mark.parametrize("kernel", ["sdpa", "efficient", "cudnn", "flash_attn"])
def test_blocks_the_dispatcher_never_sends(kernel):
    """Blocks PyTorch's own SDPA dispatcher would never hand these ops, called directly: one key (cuDNN
    takes no ``S_k == 1``: the block goes to the efficient op), q/k/v one element off 16-byte alignment
    and with last-dim stride 2, fp32 ``out``/``dout`` as the merge hands them; exact vs fp64."""
    _skip_unavailable(kernel)
    dtype, h, h_kv, d = torch.bfloat16, 8, 2, 64
    kern = K.make_kernel(kernel)
    ref = K.TorchBlockwiseKernel()
    for sq, sk, kind in ((64, 1, MaskKind.FULL), (1, 1, MaskKind.CAUSAL), (64, 77, MaskKind.FULL), (64, 64, MaskKind.CAUSAL)):
        case = (kernel, sq, sk, kind)
        q = _misaligned((1, sq, h, d), dtype, seed=sq)
        k = torch.randn(1, sk, h_kv, 2 * d, device="cuda", dtype=dtype)[..., ::2]
        v = _misaligned((1, sk, h_kv, d), dtype, seed=sk + 1)
        op = kern.choose(q, k, kind)
        if kernel == "cudnn":
            assert op == ("efficient" if sk == 1 else "cudnn"), case
        assert op != "torch", case
        out, lse = kern.forward(q, k, v, scale=0.125, kind=kind, mask=None)
        dout = torch.randn(out.shape, device="cuda")
        grads = kern.backward(dout, q, k, v, out.float(), lse, scale=0.125, kind=kind, mask=None)
        args = [t.double() for t in (q, k, v)]
        ref_out, ref_lse = ref.forward(*args, scale=0.125, kind=kind, mask=None)
        ref_grads = ref.backward(dout.double(), *args, ref_out, ref_lse, scale=0.125, kind=kind, mask=None)
        assert _rel(out, ref_out) < TOL[dtype], case
        # one key: the softmax is 1 whatever the score, so dQ = dK = 0 exactly and only dV carries a gradient; the
        # kernels return rounding noise there (~1e-8), so those two are measured against dV's scale, not zero's
        floor = ref_grads[2].abs().max() if sk == 1 else 0.0
        for g, r in zip(grads, ref_grads):
            err = ((g.double() - r).abs().max() / max(r.abs().max(), floor)).item()
            assert torch.isfinite(g).all() and err < TOL[dtype], (case, err)
        wrong = ref.forward(*args, scale=0.25, kind=kind, mask=None)[0]
        assert sk == 1 or _rel(out, wrong) > 10 * TOL[dtype], case  # control (one key: out = v whatever the scale)


@pytest.mark.parametrize("kernel", ["sdpa", "efficient", "cudnn", "flash_attn"])
def test_deterministic_mode_is_bitwise_reproducible(kernel):
    """Under ``torch.use_deterministic_algorithms(True)`` no block reaches cuDNN (its backward is not
    deterministic and the op does not check), and two identical fwd+bwd runs agree bit for bit."""
    _skip_unavailable(kernel)
    torch.manual_seed(0)
    n, h, h_kv, d = 2048, 16, 4, 128
    q = torch.randn(1, n, h, d, device="cuda", dtype=torch.bfloat16)
    k, v = (torch.randn(1, n, h_kv, d, device="cuda", dtype=torch.bfloat16) for _ in range(2))
    dout = torch.randn_like(q)
    kern = K.make_kernel(kernel)
    before = torch.are_deterministic_algorithms_enabled()
    torch.use_deterministic_algorithms(True)
    try:
        assert kern.choose(q, k, MaskKind.CAUSAL) != "cudnn"
        runs = []
        for _ in range(2):
            out, lse = kern.forward(q, k, v, scale=d**-0.5, kind=MaskKind.CAUSAL, mask=None)
            runs.append((out, *kern.backward(dout, q, k, v, out, lse, scale=d**-0.5, kind=MaskKind.CAUSAL, mask=None)))
    finally:
        torch.use_deterministic_algorithms(before)
    for a, b in zip(*runs):
        assert torch.equal(a, b), kernel


# -- flash-attn's window and soft-cap (Note [flash-attn windows for DENSE blocks], Note [flash-attn soft-capping]) --


def _flash_view(band=None, softcap=0.0):
    """The real ``FlashAttnKernel`` as a per-call view with ``band`` / ``softcap`` (``kernel_for_call`` makes them)."""
    kern = K.make_kernel("flash_attn")
    fallback = K.ScoreModKernel(AttentionMask(softcap=softcap).score_mods(), q_global=0, k_global=0,
                                head_offset=0) if softcap else None
    return kern.for_call(band=band, softcap=softcap, fallback=fallback)


def _block_reference(q, k, v, dout, *, scale, visible, softcap):
    """float64 ``(out, lse, (dq, dk, dv))`` of one block; rows that see no key: out 0, lse -inf."""
    qd, kd, vd = (t.detach().double().requires_grad_() for t in (q, k, v))
    g = q.size(2) // k.size(2)
    s = torch.einsum("bqhd,bkhd->bhqk", qd, kd.repeat_interleave(g, 2)) * scale
    if softcap:
        s = softcap * torch.tanh(s / softcap)
    s = s.masked_fill(~visible, -1e30)
    p = torch.softmax(s, -1) * visible
    out = torch.einsum("bhqk,bkhd->bqhd", p, vd.repeat_interleave(g, 2))
    lse = torch.logsumexp(s, -1).masked_fill(~visible.any(-1), -math.inf)
    return out.detach(), lse.detach(), torch.autograd.grad(out, (qd, kd, vd), dout.double())


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_flash_attn_window_normalisation_matches_the_stand_in(dtype):
    """The real flash-attn given raw windows (``mha_fwd``/``mha_bwd`` normalise them: a bound >= S_k unbounded, an
    unbounded side beside a bounded one capped at S_k, bottom-right alignment) computes exactly the visibility
    the stand-in models (``tests/stand_ins/flash_attn.py``, ``flash_visible``), which the CPU tests of
    ``flash_attn_window`` rely on; with and without a soft-cap; out, lse, dQ/dK/dV vs float64."""
    if not K.flash_attn_available():
        pytest.skip("flash-attn 2.6-2.8 not installed")
    from tests.stand_ins.flash_attn import flash_visible

    tol, h, h_kv, d = TOL[dtype], 8, 2, 64
    cases = [(64, 64, 5, 3), (40, 72, 9, -1), (72, 40, 6, -1), (72, 40, -1, 4), (48, 48, 100, 0), (64, 32, 3, 31),
             (33, 65, 0, 40), (80, 20, 10, 50), (20, 80, 70, 1)]
    for sq, sk, left, right in cases:
        for softcap in (0.0, 1.5):
            case = (dtype, sq, sk, left, right, softcap)
            torch.manual_seed(sq + sk)
            q = torch.randn(1, sq, h, d, device="cuda", dtype=dtype)
            k, v = (torch.randn(1, sk, h_kv, d, device="cuda", dtype=dtype) for _ in range(2))
            dout = torch.randn_like(q)
            visible = flash_visible(sq, sk, False, left, right, backward=False).cuda()
            assert torch.equal(visible.cpu(), flash_visible(sq, sk, False, left, right, backward=True)), case
            view = _flash_view((left, right), softcap)
            assert view.choose(q, k, MaskKind.DENSE) == "flash_attn", case
            out, lse = view.forward(q, k, v, scale=d**-0.5, kind=MaskKind.DENSE, mask=visible)
            grads = view.backward(dout, q, k, v, out, lse, scale=d**-0.5, kind=MaskKind.DENSE, mask=visible)
            ref_out, ref_lse, ref_grads = _block_reference(q, k, v, dout, scale=d**-0.5, visible=visible, softcap=softcap)
            assert _rel(out, ref_out) < tol, case
            finite = torch.isfinite(ref_lse)
            assert torch.equal(torch.isfinite(lse), finite), case
            if finite.any():
                assert (lse[finite].double() - ref_lse[finite]).abs().max() < 1e-3, case
            for g, r in zip(grads, ref_grads):
                assert torch.isfinite(g).all() and _rel(g, r) < tol, case
            top_left = torch.ones(sq, sk, dtype=torch.bool, device="cuda").triu(-left if left >= 0 else -sq).tril(
                right if right >= 0 else sk)  # control: the same window aligned top-left is another mask
            if not torch.equal(top_left, visible):
                wrong, _, _ = _block_reference(q, k, v, dout, scale=d**-0.5, visible=top_left, softcap=softcap)
                assert _rel(out, wrong) > 10 * tol, case


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("softcap", [None, 2.0])
def test_flash_attn_sliding_window_end_to_end(dtype, softcap):
    """``SequenceParallelAttention(kernel="flash_attn")`` on one GPU under HF's ``sliding_window=101`` (``window=(100,
    0)``, causal) and optionally a soft-cap (Gemma-2): the plan's band tiles run flash-attn with their windows,
    the rest the efficient op or ``ScoreModKernel``; out and dQ/dK/dV vs dense float64. Control: window ignored."""
    if not K.flash_attn_available():
        pytest.skip("flash-attn 2.6-2.8 not installed")
    from tests.reference import dense_attention

    tol, n, h, h_kv, d = TOL[dtype], 512, 8, 2, 64
    mask = AttentionMask(window=(100, 0), softcap=softcap)
    torch.manual_seed(1)
    q = torch.randn(1, n, h, d, device="cuda", dtype=dtype, requires_grad=True)
    k, v = (torch.randn(1, n, h_kv, d, device="cuda", dtype=dtype, requires_grad=True) for _ in range(2))
    out = SequenceParallelAttention(causal=True, kernel="flash_attn", mask=mask)(q, k, v)
    dout = torch.randn_like(out)
    grads = torch.autograd.grad(out, (q, k, v), dout)
    qd, kd, vd = (t.detach().cpu().double().requires_grad_() for t in (q, k, v))
    ref = dense_attention(qd, kd, vd, causal=True, mask=mask)
    ref_grads = torch.autograd.grad(ref, (qd, kd, vd), dout.cpu().double())
    assert _rel(out.cpu(), ref) < tol
    for g, r in zip(grads, ref_grads):
        assert _rel(g.cpu(), r) < tol
    control = dense_attention(qd, kd, vd, causal=True, mask=AttentionMask(softcap=softcap))
    assert _rel(out.cpu(), control) > 10 * tol
