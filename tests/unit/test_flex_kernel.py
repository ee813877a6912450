"""``ops/flex.py``'s ``FlexKernel`` on CPU: its FlexAttention calls pass a stand-in at least as strict as the real
compiled op (``tests/stand_ins/flex_attention.py``), and the stand-in-backed path equals ``ScoreModKernel`` and
dense float64 attention, forward and dQ/dK/dV, for every mask kind, with blocks merged over a row and each block
differentiated against the merged row (as the ring backends call kernels); plus the real op's forward on CPU, the
dispatch rule and the block-mask cache bound. The CUDA runs are ``tests/gpu/test_flex_kernels.py``."""

import dataclasses
import math

import pytest
import torch

from lightning_sp import SequenceParallelAttention
from lightning_sp.masks import AttentionMask, ScoreMods
from lightning_sp.ops import flex
from lightning_sp.ops.kernels import (KERNELS, SDPAKernel, ScoreModKernel, TorchBlockwiseKernel, make_kernel,
                                      score_mod_kernel)
from lightning_sp.ops.merge import merge_into
from lightning_sp.ops.plan import MaskKind
from lightning_sp.ops.ring_attention import AttentionResult, absorb_sinks
from tests.reference import key_blocks
from tests.stand_ins.flex_attention import FlexAttentionStandIn

N, Q0, K_SPLIT = 200, 60, 130  # sequence length; the query block is [Q0, N); keys in [0, K_SPLIT) and [K_SPLIT, N)
B, H, H_KV, D, H_TOTAL, HEAD_OFFSET = 2, 4, 2, 16, 6, 1
SCALE = 0.4


def user_score_mod(s, b, h, q, k):
    return s + 0.05 * ((q - k) % 7).to(s.dtype) - 0.1 * h.to(s.dtype) + 0.2 * b.to(s.dtype)


def user_mask_mod(b, h, q, k):
    return (q + 2 * k + h + b) % 5 != 0


CASES = {  # name: (AttentionMask, causal, document bounds)
    "window": (AttentionMask(window=(40, 0)), True, None),
    "window_two_sided": (AttentionMask(window=(30, 20)), False, None),
    "spans": (AttentionMask(bidirectional_spans=((70, 110),)), True, None),
    "chunks": (AttentionMask(chunk_size=64), True, None),
    "packed_docs": (AttentionMask(), True, (0, 50, 51, 140, 200)),
    "softcap": (AttentionMask(softcap=1.5), True, None),
    "alibi": (AttentionMask(alibi_slopes=tuple(0.02 * (i + 1) for i in range(H_TOTAL))), False, None),
    "score_mod": (AttentionMask(score_mod=user_score_mod), True, None),
    "mask_mod": (AttentionMask(mask_mod=user_mask_mod), False, None),
    "key_padding": (AttentionMask(key_padding=((0, 170), (20, 200))), True, None),  # rows padded differently
    "all": (AttentionMask(window=(90, 0), softcap=2.0, alibi_slopes=tuple(0.01 * i for i in range(H_TOTAL)),
                          score_mod=user_score_mod, mask_mod=user_mask_mod), True, (0, 120, 200)),
}


def stand_in_ops(dtypes=(torch.float64,)):
    from torch.nn.attention import flex_attention as module

    stand_in = FlexAttentionStandIn(dtypes=dtypes)
    return flex.FlexOps(stand_in, module.create_block_mask, module.AuxRequest), stand_in


def _inputs(dtype=torch.float64, seed=0):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(B, N - Q0, H, D, generator=g, dtype=dtype)
    k = torch.randn(B, N, H_KV, D, generator=g, dtype=dtype)
    v = torch.randn(B, N, H_KV, D, generator=g, dtype=dtype)
    return q, k, v


def _visible(case):
    mask, causal, docs = CASES[case]
    return mask.structured(causal=causal, doc_bounds=docs, padded_len=N).visible(torch.arange(N), torch.arange(N))


def _blocks(case, q_start=Q0, key_ranges=((0, K_SPLIT), (K_SPLIT, N))):
    """``(k0, k1, kind, mask)`` of each key block for the query block ``[q_start, N)``, as the planner would hand
    them over (a block with no visible pair skipped)."""
    return key_blocks(_visible(case), q_start, key_ranges)


def run_row(make, q, k, v, blocks, *, sinks=None, dout=None):
    """Forward every block with ``make(k_global=...)``'s kernel, merge, absorb ``sinks``, then each block's
    backward against the merged row. -> ``out [B, Sq, H, D]``, ``dq``, ``dk``, ``dv`` (zero outside the blocks)."""
    acc = torch.float64 if q.dtype == torch.float64 else torch.float32
    out = torch.zeros(*q.shape[:3], v.size(-1), dtype=acc)
    lse = torch.full((q.size(0), q.size(2), q.size(1)), -math.inf, dtype=acc)
    for k0, k1, kind, mask in blocks:
        o_b, l_b = make(k_global=k0).forward(q, k[:, k0:k1], v[:, k0:k1], scale=SCALE, kind=kind, mask=mask)
        merge_into(out, lse, o_b, l_b)
    out, lse = absorb_sinks(AttentionResult(out, lse), sinks, HEAD_OFFSET)
    dout = torch.ones_like(out) if dout is None else dout
    dq, dk, dv = torch.zeros(q.shape, dtype=acc), torch.zeros(k.shape, dtype=acc), torch.zeros(v.shape, dtype=acc)
    for k0, k1, kind, mask in blocks:
        g = make(k_global=k0).backward(dout, q, k[:, k0:k1], v[:, k0:k1], out, lse, scale=SCALE, kind=kind, mask=mask)
        dq += g[0]
        dk[:, k0:k1] += g[1]
        dv[:, k0:k1] += g[2]
    return out, dq, dk, dv


def dense_reference(case, q, k, v, *, sinks=None, dout=None):
    """fp64 attention of the rows ``[Q0, N)`` over all keys, with autograd: ``(out, dq, dk, dv)``."""
    mask, _, _ = CASES[case]
    mods = mask.score_mods()
    q, k, v = (t.detach().double().requires_grad_() for t in (q, k, v))
    kx, vx = (t.repeat_interleave(H // H_KV, dim=2) for t in (k, v))
    s = torch.einsum("bqhd,bkhd->bhqk", q, kx) * SCALE  # [B, H, Sq, N]
    idx = (torch.arange(B).view(B, 1, 1, 1), torch.arange(HEAD_OFFSET, HEAD_OFFSET + H).view(1, H, 1, 1),
           torch.arange(Q0, N).view(1, 1, -1, 1), torch.arange(N).view(1, 1, 1, -1))
    visible = _visible(case)[Q0:]
    if mods is not None:
        s = mods.apply(s, *idx)
        extra = mods.visible(*idx)
        visible = visible if extra is None else visible & extra
    s = s.masked_fill(~visible, -math.inf)
    if sinks is not None:
        sink = sinks[HEAD_OFFSET:HEAD_OFFSET + H].double().view(1, H, 1, 1).expand(B, H, N - Q0, 1)
        p = torch.softmax(torch.cat([s, sink], -1), -1)[..., :-1]
    else:
        p = torch.softmax(s, -1).nan_to_num(0.0)
    out = torch.einsum("bhqk,bkhd->bqhd", p, vx)
    out.backward(torch.ones_like(out) if dout is None else dout.double())
    return out.detach(), q.grad, k.grad, v.grad


def flex_kernel(mods, *, q_global, k_global, head_offset=HEAD_OFFSET, **options):
    """A ``FlexKernel`` with its production fallback (``ScoreModKernel``, or SDPA without modifiers)."""
    fallback = (SDPAKernel() if mods is None else
                ScoreModKernel(mods, q_global=q_global, k_global=k_global, head_offset=head_offset))
    return flex.FlexKernel(mods, fallback=fallback, q_global=q_global, k_global=k_global, head_offset=head_offset,
                           **options)


def flex_maker(case, ops, **extra):
    mods = CASES[case][0].score_mods()
    return lambda k_global: flex_kernel(mods, q_global=Q0, k_global=k_global, ops=ops, device_type="cuda",
                                        dtypes=(torch.float64,), **extra)


def score_mod_maker(case):
    mods = CASES[case][0].score_mods()
    if mods is None:
        return lambda k_global: TorchBlockwiseKernel()
    return lambda k_global: ScoreModKernel(mods, q_global=Q0, k_global=k_global, head_offset=HEAD_OFFSET)


def _err(a, b):
    return (a.double() - b.double()).abs().max().item()


@pytest.mark.parametrize("case", sorted(CASES))
def test_flex_path_equals_score_mod_kernel_and_dense_fp64(case):
    q, k, v = _inputs()
    blocks = _blocks(case)
    assert len(blocks) == 2 or case == "packed_docs"  # rows merge over two blocks: lse_b != the row's lse
    ops, stand_in = stand_in_ops()
    got = run_row(flex_maker(case, ops), q, k, v, blocks)
    assert stand_in.calls, "the flex path was not taken"
    ref_kernel = run_row(score_mod_maker(case), q, k, v, blocks)
    ref = dense_reference(case, q, k, v)
    for name, g, r, d in zip(("out", "dq", "dk", "dv"), got, ref_kernel, ref):
        assert _err(g, r) < 1e-10, (case, name, _err(g, r))
        assert _err(g, d) < 1e-10, (case, name, _err(g, d))


@pytest.mark.parametrize("case", ["all", "packed_docs"])
def test_flex_path_with_sinks_and_a_causal_diagonal(case):
    """Sinks join the merged lse the backward receives; a square diagonal block runs as CAUSAL."""
    q, k, v = _inputs(seed=1)
    sinks = torch.linspace(-1.0, 1.5, H_TOTAL, dtype=torch.float64)
    dout = torch.randn(B, N - Q0, H, D, generator=torch.Generator().manual_seed(5), dtype=torch.float64)
    ops, _ = stand_in_ops()
    got = run_row(flex_maker(case, ops), q, k, v, _blocks(case), sinks=sinks, dout=dout)
    ref = dense_reference(case, q, k, v, sinks=sinks, dout=dout)
    for g, r in zip(got, ref):
        assert _err(g, r) < 1e-10
    # the diagonal block of a plain causal row: kinds FULL then CAUSAL
    diagonal = [(0, 100, MaskKind.FULL, None), (100, 200, MaskKind.CAUSAL, None)]
    qd = q[:, 40:]
    make = lambda k_global: flex_kernel(CASES["softcap"][0].score_mods(), q_global=100, k_global=k_global,  # noqa: E731
                                        ops=ops, device_type="cuda", dtypes=(torch.float64,))
    ref_make = lambda k_global: ScoreModKernel(CASES["softcap"][0].score_mods(), q_global=100,  # noqa: E731
                                               k_global=k_global, head_offset=HEAD_OFFSET)
    for g, r in zip(run_row(make, qd, k, v, diagonal), run_row(ref_make, qd, k, v, diagonal)):
        assert _err(g, r) < 1e-10


def test_negative_controls_fail():
    """The same checks with the bugs reintroduced: the block's own backward (no merged-row correction), the lse
    term dropped, a query offset off by one."""
    q, k, v = _inputs()
    ops, _ = stand_in_ops()
    ref = dense_reference("alibi", q, k, v)
    original = flex._block_grads_against_row

    def own_backward(o_b, lse_b, dout, out, lse):
        return dout.to(o_b.dtype), torch.zeros_like(lse_b)

    def without_lse_term(o_b, lse_b, dout, out, lse):
        grad_o, grad_lse = original(o_b, lse_b, dout, out, lse)
        return grad_o, torch.zeros_like(grad_lse)

    for wrong in (own_backward, without_lse_term):
        flex._block_grads_against_row = wrong
        try:
            _, dq, dk, _ = run_row(flex_maker("alibi", ops), q, k, v, _blocks("alibi"))
        finally:
            flex._block_grads_against_row = original
        assert _err(dq, ref[1]) > 1e-3 and _err(dk, ref[2]) > 1e-3, wrong.__name__
    mods = CASES["alibi"][0].score_mods()
    shifted = lambda k_global: flex_kernel(mods, q_global=Q0 + 1, k_global=k_global, ops=ops,  # noqa: E731
                                           device_type="cuda", dtypes=(torch.float64,))
    assert _err(run_row(shifted, q, k, v, _blocks("alibi"))[0], ref[0]) > 1e-3


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_arguments_pass_the_strict_stand_in(dtype):
    """CUDA dtypes only, strided caller inputs (a slice of a longer tensor, head-minor memory), GQA: every call
    the kernel makes passes the stand-in's rules, with ``enable_gqa``, a float scale and a matching BlockMask."""
    ops, stand_in = stand_in_ops(dtypes=flex.FLEX_DTYPES)
    big_q, k, v = _inputs(dtype=dtype, seed=3)
    q = torch.cat([big_q, big_q], dim=3)[..., :D]  # non-contiguous
    case = "all"
    make = lambda k_global: flex_kernel(CASES[case][0].score_mods(), q_global=Q0, k_global=k_global,  # noqa: E731
                                        ops=ops, device_type="cuda")
    got = run_row(make, q, k, v, _blocks(case))
    ref = run_row(score_mod_maker(case), q.double(), k.double(), v.double(), _blocks(case))
    tol = {torch.float32: 1e-4, torch.bfloat16: 6e-2, torch.float16: 1e-2}[dtype]
    for g, r in zip(got, ref):
        assert _err(g, r) < tol * max(1.0, r.abs().max().item())
    assert len(stand_in.calls) == 4  # two forwards, two recomputed forwards in backward
    for call in stand_in.calls:
        assert call["enable_gqa"] is True and type(call["scale"]) is float
        assert call["q"].dtype == dtype and call["block_mask"].shape[-2:] == (N - Q0, call["k"].size(2))


@pytest.mark.parametrize("bad", ["non_contiguous", "gqa_not_divisible", "gqa_flag_missing", "head_dim_8", "fp64",
                                 "mask_shape", "tensor_scale"])
def test_stand_in_refuses_what_the_real_op_refuses(bad):
    from torch.nn.attention.flex_attention import create_block_mask

    stand_in = FlexAttentionStandIn()
    q, k, v = torch.randn(1, 4, 32, 16), torch.randn(1, 2, 48, 16), torch.randn(1, 2, 48, 16)
    kwargs = dict(enable_gqa=True, scale=0.25, return_lse=True)
    if bad == "non_contiguous":
        q = q.transpose(1, 2).contiguous().transpose(1, 2)
    elif bad == "gqa_not_divisible":
        q = torch.randn(1, 3, 32, 16)
    elif bad == "gqa_flag_missing":
        kwargs["enable_gqa"] = False
    elif bad == "head_dim_8":
        q, k, v = q[..., :8].contiguous(), k[..., :8].contiguous(), v[..., :8].contiguous()
    elif bad == "fp64":
        q, k, v = q.double(), k.double(), v.double()
    elif bad == "mask_shape":
        kwargs["block_mask"] = create_block_mask(lambda b, h, qi, ki: qi >= ki, None, None, 32, 32, device="cpu")
    elif bad == "tensor_scale":
        kwargs["scale"] = torch.tensor(0.25)
    with pytest.raises((ValueError, TypeError, NotImplementedError, RuntimeError)):
        stand_in(q, k, v, **kwargs)
    stand_in(torch.randn(1, 4, 32, 16), torch.randn(1, 2, 48, 16), torch.randn(1, 2, 48, 16), enable_gqa=True,
             scale=0.25, return_lse=True)  # the valid call passes


@pytest.mark.filterwarnings("ignore:flex_attention called without torch.compile")
@pytest.mark.parametrize("case", ["window", "packed_docs", "softcap", "alibi", "score_mod", "mask_mod", "key_padding",
                                  "all"])
def test_real_flex_attention_forward_on_cpu(case):
    """PyTorch's own FlexAttention (uncompiled; CPU has no backward) through the kernel's closures and block masks
    equals ``ScoreModKernel``, so the stand-in's semantics are the real op's."""
    q, k, v = _inputs(seed=7)
    real = flex_maker(case, flex.eager_flex_ops())
    ref = score_mod_maker(case)
    with torch.no_grad():
        for k0, k1, kind, mask in _blocks(case):
            o, lse = real(k_global=k0).forward(q, k[:, k0:k1], v[:, k0:k1], scale=SCALE, kind=kind, mask=mask)
            o_r, lse_r = ref(k_global=k0).forward(q, k[:, k0:k1], v[:, k0:k1], scale=SCALE, kind=kind, mask=mask)
            assert _err(o, o_r) < 1e-10
            assert torch.equal(torch.isneginf(lse), torch.isneginf(lse_r))
            assert _err(lse.nan_to_num(neginf=0.0), lse_r.nan_to_num(neginf=0.0)) < 1e-10


def test_dispatch_rule():
    mods = CASES["all"][0].score_mods()
    q, k, v = _inputs(dtype=torch.float32)
    chosen = score_mod_kernel(make_kernel("flex"), mods, q_global=Q0, k_global=0, head_offset=HEAD_OFFSET)
    assert isinstance(chosen, flex.FlexKernel)
    for other in (TorchBlockwiseKernel(), SDPAKernel(), make_kernel("auto")):  # opt-in until run on a GPU
        assert type(score_mod_kernel(other, mods, q_global=0, k_global=0, head_offset=0)) is ScoreModKernel
    assert "device cpu" in chosen.why_not(q, k, v)  # CPU blocks run ScoreModKernel ...
    ops, stand_in = stand_in_ops(dtypes=flex.FLEX_DTYPES)
    on_cpu = flex_kernel(mods, q_global=Q0, k_global=0, ops=ops)
    kind, mask = _blocks("all")[0][2:]
    got = on_cpu.forward(q, k[:, :K_SPLIT], v[:, :K_SPLIT], scale=SCALE, kind=kind, mask=mask)
    want = ScoreModKernel(mods, q_global=Q0, k_global=0, head_offset=HEAD_OFFSET).forward(
        q, k[:, :K_SPLIT], v[:, :K_SPLIT], scale=SCALE, kind=kind, mask=mask)
    assert not stand_in.calls and all(torch.equal(a, b) for a, b in zip(got, want))  # ... bit for bit
    forced = dict(device_type="cuda")
    assert flex.why_not_flex(q, k, v, mods, **forced) is None
    assert "dtype" in flex.why_not_flex(q.double(), k, v, mods, **forced)
    assert "head dims" in flex.why_not_flex(q[..., :8], k[..., :8], v[..., :8], mods, **forced)
    assert "empty" in flex.why_not_flex(q[:, :0], k, v, mods, **forced)

    @dataclasses.dataclass(frozen=True, eq=False)
    class WithLearnedBias(ScoreMods):
        relative_bias: object = None

    assert flex.why_not_flex(q, k, v, WithLearnedBias(softcap=2.0), **forced) is None
    assert "relative_bias" in flex.why_not_flex(q, k, v, WithLearnedBias(relative_bias=torch.zeros(3)), **forced)


def test_kernel_flex_by_name():
    assert "flex" in KERNELS and isinstance(make_kernel("flex"), flex.FlexKernel)
    q, k, v = (t[:1].float() for t in _inputs(seed=2))  # packed documents: one row
    k, v = k[:, Q0:], v[:, Q0:]
    cu = torch.tensor([0, 50, 51, N - Q0], dtype=torch.int32)
    out = SequenceParallelAttention(causal=True, kernel="flex")(q, k, v, cu_seqlens=cu)  # CPU: the SDPA fallback
    want = SequenceParallelAttention(causal=True, kernel="sdpa")(q, k, v, cu_seqlens=cu)
    assert torch.allclose(out, want, atol=1e-6)


def test_block_mask_cache_is_bounded_and_keyed_on_offsets():
    ops, _ = stand_in_ops()
    cache = flex._BlockMaskCache(size=3)
    mods = CASES["mask_mod"][0].score_mods()
    q, k, v = _inputs()
    masks = []
    for q_global in range(6):
        kern = flex_kernel(mods, q_global=q_global, k_global=0, head_offset=0, ops=ops, device_type="cuda",
                           dtypes=(torch.float64,), block_masks=cache)
        masks.append(kern._block_mask(MaskKind.CAUSAL, None, B, H, 20, 20, q.device, kern._offsets(q.device)))
        assert len(cache) <= 3
    assert len({id(m) for m in masks}) == 6  # every offset its own mask (the user's mask_mod reads positions)
    again = flex_kernel(mods, q_global=5, k_global=0, head_offset=0, ops=ops, device_type="cuda",
                        dtypes=(torch.float64,), block_masks=cache)
    assert again._block_mask(MaskKind.CAUSAL, None, B, H, 20, 20, q.device, again._offsets(q.device)) is masks[-1]
