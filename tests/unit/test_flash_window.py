"""flash-attn's window and soft-cap under ``kernel="flash_attn"``, checked on CPU through the stand-in packages
(``tests/stand_ins/flash_attn.py``: float64, the real ops' window normalisation, bottom-right alignment and
soft-cap): Note [flash-attn windows for DENSE blocks] and Note [flash-attn soft-capping] in ``ops/kernels.py``.

- ``flash_attn_window``: every window it returns reproduces ``StructuredMask.visible`` exactly through the
  real normalisation (forward and backward), and for every band it refuses no window does;
- block calls at several global offsets through ``kernel_for_call`` (forced CUDA path on CPU tensors, flash-attn
  2.6 / 2.7 / 2.8): out, lse, dQ, dK, dV against dense float64 with the same mask and soft-cap, the stand-in's
  record of the op that ran and its window/soft-cap, and negative controls (the window without the block's
  offset, the soft-cap dropped);
- the ring loop's single-rank path (``block_attention``) under a sliding window and a soft-cap, contiguous and
  zigzag-like query runs, against ``tests.reference.dense_attention``.
"""

import math
import random

import pytest
import torch

from lightning_sp.layout import Run
from lightning_sp.masks import AttentionMask, StructuredMask
from lightning_sp.ops import kernels as K
from lightning_sp.ops.plan import BlockCall, MaskKind, masked_dense, plan_blocks
from lightning_sp.ops.ring_attention import BlockAttentionSpec, block_attention
from tests.reference import dense_attention
from tests.stand_ins.cuda_sdpa import ContractError, CudaSdpaStandIn
from tests.stand_ins.flash_attn import flash_visible, make_flash_attn

H100 = (9, 0)
VERSIONS = ["2.6.3", "2.7.4", "2.8.3"]
N = 320  # global sequence length of the block cases
TOL = 3e-3  # fp16 inputs, results rounded to fp16 by flash-attn
BAND_REASONS = ("left bound", "right bound", "unbounded right side")


# -- flash_attn_window: exact, or no window exists ----------------------------------------------------


def _random_masks(rng, n, count, *, structure=True):
    for _ in range(count):
        causal = rng.random() < 0.5
        docs = rng.choice([None, (0, n // 4, n), (0, 5 * n // 8, n)]) if structure else None
        spans = rng.choice([(), ((n // 8, n // 3),)]) if causal and structure else ()
        keys = rng.choice([None, (0, n), (3, n - 5)]) if structure else None
        mask = StructuredMask(causal, docs, rng.choice([None, 0, 1, 3, 7, 12]), rng.choice([None, 0, 1, 4, 9]),
                              spans, keys)
        q0, k0 = rng.randrange(n - 1), rng.randrange(n - 1)
        yield mask, q0, rng.randint(1, n - q0), k0, rng.randint(1, n - k0)


def _visible(mask, q0, sq, k0, sk):
    return mask.visible(torch.arange(q0, q0 + sq), torch.arange(k0, k0 + sk))


def test_window_reproduces_the_mask_exactly_or_is_refused():
    """20k random (mask, block) pairs with documents, spans, shared padding, causal and windows: a returned window,
    normalised as ``mha_fwd`` and ``mha_bwd`` normalise it, is exactly the block's mask. Control: the same window
    without the block's offset (global bounds passed as local ones) misses on most off-diagonal blocks (73% of them)."""
    rng = random.Random(0)
    taken = unshifted_misses = off_diagonal = 0
    for mask, q0, sq, k0, sk in _random_masks(rng, 40, 20000):
        window = K.flash_attn_window(mask, q0, sq, k0, sk)
        if isinstance(window, str):
            continue
        taken += 1
        want = _visible(mask, q0, sq, k0, sk)
        for backward in (False, True):
            assert torch.equal(flash_visible(sq, sk, False, *window, backward=backward), want), (mask, q0, sq, k0, sk)
        if q0 + sq != k0 + sk:  # not bottom-right aligned on the global diagonal
            off_diagonal += 1
            naive = (-1 if mask.left is None else mask.left, 0 if mask.causal else -1 if mask.right is None else mask.right)
            unshifted_misses += not torch.equal(flash_visible(sq, sk, False, *naive, backward=False), want)
    assert taken > 2000 and off_diagonal > 1000
    assert unshifted_misses > 0.6 * off_diagonal


def test_refused_bands_have_no_window():
    """Windows and causality only (a band on every block): where ``flash_attn_window`` refuses for the band's sake
    (a negative or over-long bound), an exhaustive search over every ``(left, right)`` flash-attn could be given
    finds none that reproduces the mask. Blocks refused for documents, padding or spans keep the old path by rule."""
    rng = random.Random(1)
    refused = 0
    for mask, q0, sq, k0, sk in _random_masks(rng, 20, 1500, structure=False):
        window = K.flash_attn_window(mask, q0, sq, k0, sk)
        if not (isinstance(window, str) and any(r in window for r in BAND_REASONS)):
            continue
        refused += 1
        want = _visible(mask, q0, sq, k0, sk)
        for left in range(-1, sk + 2):
            for right in range(-1, sk + 2):
                assert not torch.equal(flash_visible(sq, sk, False, left, right, backward=False), want), (
                    mask, q0, sq, k0, sk, window, (left, right))
    assert refused > 100


def test_refusal_reasons():
    causal_window = AttentionMask(window=(3, 0)).structured(causal=True, doc_bounds=None, padded_len=N)
    assert "left bound of -7" in K.flash_attn_window(causal_window, 50, 10, 40, 10)
    assert "empty" in K.flash_attn_window(causal_window, 0, 8, 20, 8)
    docs = AttentionMask(window=(30, 0)).structured(causal=True, doc_bounds=[0, 70, N], padded_len=N)
    assert "one document" in K.flash_attn_window(docs, 64, 16, 60, 16)
    assert K.flash_attn_window(docs, 72, 16, 70, 16) == (-1, 2)  # the same shape inside one document: a band
    spans = AttentionMask(window=(30, 5), bidirectional_spans=((66, 100),)).structured(
        causal=True, doc_bounds=None, padded_len=N)
    assert "span" in K.flash_attn_window(spans, 64, 16, 60, 16)
    assert K.flash_attn_window(spans, 70, 16, 70, 16) == (-1, 5)  # inside the span: the window only, both sides
    assert K.flash_attn_window(spans, 120, 16, 120, 16) == (-1, 0)  # outside: causal too
    padded = AttentionMask(window=(30, 0), key_padding=((0, 70),)).structured(causal=True, doc_bounds=None, padded_len=N)
    assert "padding" in K.flash_attn_window(padded, 64, 16, 60, 16)


def test_eligibility_reads_the_band():
    """``why_not``: a DENSE block goes to flash-attn only with a band, and says why not otherwise; the other ops
    ignore the band, and the other rules still apply to a banded block."""
    block = dict(dtype=torch.float16, head_dim=64, kind=MaskKind.DENSE, capability=H100, batch=1, heads=8,
                 seq_len_q=32, seq_len_k=32, deterministic=False)
    assert K.why_not("flash_attn", **block, band=(7, 0)) is None
    assert "no flash-attn window" in K.why_not("flash_attn", **block)
    refused = K.why_not("flash_attn", **block, band="its band needs a left bound of -7 < 0")
    assert "no flash-attn window" in refused and "left bound of -7" in refused
    for op in ("flash", "cudnn"):
        assert K.why_not(op, **block, band=(7, 0)) == "DENSE mask (needs FULL or CAUSAL)"
    assert K.why_not("efficient", **block, band=(7, 0)) is None
    assert "fp16 or bf16" in K.why_not("flash_attn", **{**block, "dtype": torch.float32}, band=(7, 0))
    assert "<= 256" in K.why_not("flash_attn", **{**block, "head_dim": 264}, band=(7, 0))


def _fa_forward(fa, *, window=(-1, -1), softcap=0.0, dropout=0.0, alibi=None, sq=8, sk=8):
    q = torch.randn(1, sq, 2, 16).to(torch.float16)
    k = torch.randn(1, sk, 2, 16).to(torch.float16)
    win = [tuple(window)] if fa.__version__.startswith("2.6") else list(window)
    return fa.flash_attn_interface._flash_attn_forward(q, k, k, dropout, 0.25, False, *win, softcap, alibi, False)


@pytest.mark.parametrize("version", VERSIONS)
def test_stand_in_refuses_what_the_real_op_refuses(version):
    """``mha_fwd``: a soft-cap with dropout is refused; a window size must be a C++ ``int``; and the stand-in,
    stricter, refuses any dropout or ALiBi (not modelled). Controls: a window and a soft-cap pass, and compute
    ``flash_visible``'s mask (a right bound >= S_k unbounded, then capped at S_k beside a left bound;
    bottom-right alignment; rows that see no key: lse +inf)."""
    fa = make_flash_attn(version)
    with pytest.raises(ContractError, match="Softcapping does not support dropout"):
        _fa_forward(fa, softcap=1.0, dropout=0.1)
    with pytest.raises(ContractError, match="not modelled"):
        _fa_forward(fa, dropout=0.1)
    with pytest.raises(ContractError, match="C\\+\\+ int"):
        _fa_forward(fa, window=(2**31, -1))
    with pytest.raises(ContractError, match="alibi_slopes are not modelled"):
        _fa_forward(fa, alibi=torch.ones(2))
    res = _fa_forward(fa, window=(2, 20), softcap=1.5, sq=12, sk=6)
    lse = res[5] if version.startswith("2.6") else res[1]
    # right 20 >= S_k: unbounded, then capped at S_k beside the left bound: j <= i + (S_k - S_q) + S_k = i
    i, j = torch.arange(12)[:, None], torch.arange(6)[None, :]
    visible = flash_visible(12, 6, False, 2, 20, backward=False)
    assert torch.equal(visible, (j >= i - 6 - 2) & (j <= i))
    assert torch.equal(visible, flash_visible(12, 6, False, 2, 20, backward=True))
    res = _fa_forward(fa, window=(-1, 1), softcap=1.5, sq=12, sk=6)  # j <= i - 5: rows 0-4 see no key
    out, lse = res[0], res[5] if version.startswith("2.6") else res[1]
    assert torch.equal(flash_visible(12, 6, False, -1, 1, backward=False), j <= i - 5)
    assert torch.isposinf(lse[0, :, :5]).all() and torch.isfinite(lse[0, :, 5:]).all() and (out[0, :5] == 0).all()


# -- block calls through the kernel -------------------------------------------------------------------


def _case(window=None, softcap=None, causal=True, alibi=False):
    mask = AttentionMask(window=window, softcap=softcap,
                         alibi_slopes=(0.1, 0.2, 0.3, 0.4) if alibi else None)
    return mask, causal


# (name, (AttentionMask, causal), call (q0, sq, k0, sk, kind), expected flash-attn window, or what runs instead)
BLOCKS = [
    ("causal window, diagonal", _case((7, 0)), (64, 32, 64, 32, MaskKind.DENSE), (7, 0)),
    ("causal window, ring block below the diagonal", _case((40, 0)), (96, 32, 64, 32, MaskKind.DENSE), (8, -1)),
    ("causal window, S_q < S_k", _case((20, 0)), (100, 24, 80, 40, MaskKind.DENSE), (16, 4)),
    ("causal window, S_q > S_k, first rows empty", _case((64, 0)), (32, 32, 40, 16, MaskKind.DENSE), (-1, 8)),
    ("bidirectional window, diagonal", _case((5, 3), causal=False), (64, 32, 64, 32, MaskKind.DENSE), (5, 3)),
    ("bidirectional window, S_q < S_k", _case((5, 3), causal=False), (64, 16, 60, 22, MaskKind.DENSE), (7, 1)),
    ("window covers the block", _case((100, 100), causal=False), (0, 32, 40, 32, MaskKind.DENSE), (-1, -1)),
    ("band needs a negative bound", _case((3, 0)), (50, 10, 40, 10, MaskKind.DENSE), "efficient"),
    ("mask leaves the block empty", _case((3, 0)), (0, 8, 20, 8, MaskKind.DENSE), "efficient"),
    ("softcap, causal diagonal", _case(softcap=2.0), (0, 32, 0, 32, MaskKind.CAUSAL), (-1, -1)),
    ("softcap, full block", _case(softcap=2.0), (32, 32, 0, 32, MaskKind.FULL), (-1, -1)),
    ("softcap and causal window", _case((7, 0), softcap=2.0), (64, 32, 64, 32, MaskKind.DENSE), (7, 0)),
    ("softcap and window, S_q < S_k", _case((20, 0), softcap=1.5), (100, 24, 80, 40, MaskKind.DENSE), (16, 4)),
    ("softcap, band needs a negative bound", _case((3, 0), softcap=2.0), (50, 10, 40, 10, MaskKind.DENSE), "score_mods"),
    ("softcap and ALiBi", _case((7, 0), softcap=2.0, alibi=True), (64, 32, 64, 32, MaskKind.DENSE), "score_mods"),
]


def _inputs(sq, sk, *, h=4, h_kv=2, d=16, seed=0):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(1, sq, h, d, generator=g).to(torch.float16)
    k = torch.randn(1, sk, h_kv, d, generator=g).to(torch.float16)
    v = torch.randn(1, sk, h_kv, d, generator=g).to(torch.float16)
    dout = torch.randn(1, sq, h, d, generator=g).to(torch.float16)
    return q, k, v, dout


def _reference(q, k, v, dout, *, scale, visible, mask, q0, k0):
    """float64 attention of one block: ``(out [B, Sq, H, D], lse [B, H, Sq], (dq, dk, dv))``, rows that see no key
    ``out = 0``, ``lse = -inf``; the scores modified as ``ScoreMods`` modifies them (soft-cap, then ALiBi)."""
    qd, kd, vd = (t.double().requires_grad_() for t in (q, k, v))
    g = q.size(2) // k.size(2)
    s = torch.einsum("bqhd,bkhd->bhqk", qd, kd.repeat_interleave(g, 2)) * scale
    if mask.softcap is not None:
        s = mask.softcap * torch.tanh(s / mask.softcap)
    if mask.alibi_slopes is not None:
        qpos, kpos = torch.arange(q0, q0 + q.size(1)), torch.arange(k0, k0 + k.size(1))
        slopes = torch.tensor(mask.alibi_slopes, dtype=torch.float64).view(1, -1, 1, 1)
        s = s - slopes * (qpos[:, None] - kpos[None, :]).abs()
    s = s.masked_fill(~visible, -1e30)  # finite: rows that see no key stay differentiable (their p is zeroed)
    p = torch.softmax(s, -1) * visible
    out = torch.einsum("bhqk,bkhd->bqhd", p, vd.repeat_interleave(g, 2))
    lse = torch.logsumexp(s, -1).masked_fill(~visible.any(-1), -math.inf).detach()
    return out.detach(), lse, torch.autograd.grad(out, (qd, kd, vd), dout.double())


def _rel(a, b):
    return ((a.double() - b).abs().max() / b.abs().max().clamp(min=1e-12)).item()


def _run(view, q, k, v, dout, *, scale, kind, dense):
    with CudaSdpaStandIn() as mode:
        out, lse = view.forward(q, k, v, scale=scale, kind=kind, mask=dense)
        grads = view.backward(dout, q, k, v, out, lse, scale=scale, kind=kind, mask=dense)
    return out, lse, grads, mode


@pytest.mark.parametrize("version", VERSIONS)
@pytest.mark.parametrize("name, case, block, expect", BLOCKS, ids=[b[0] for b in BLOCKS])
def test_block_calls_match_dense_float64(version, name, case, block, expect):
    attn_mask, causal = case
    q0, sq, k0, sk, kind = block
    structured = attn_mask.structured(causal=causal, doc_bounds=None, padded_len=N)
    mods = attn_mask.score_mods()
    call = BlockCall(0, sq, 0, sk, kind, q0, k0)
    dense = masked_dense(call, structured) if kind is MaskKind.DENSE else None
    visible = _visible(structured, q0, sq, k0, sk)
    fa = make_flash_attn(version)
    kernel = K.FlashAttnKernel(device_type="cuda", capability=H100, module=fa)
    view = K.kernel_for_call(kernel, mods, mask=structured, call=call, head_offset=0)
    q, k, v, dout = _inputs(sq, sk)
    scale = q.size(-1) ** -0.5
    out, lse, grads, mode = _run(view, q, k, v, dout, scale=scale, kind=kind, dense=dense)
    ref_out, ref_lse, ref_grads = _reference(q, k, v, dout, scale=scale, visible=visible, mask=attn_mask, q0=q0, k0=k0)

    assert _rel(out, ref_out) < TOL, name
    finite = torch.isfinite(ref_lse)
    assert torch.equal(torch.isfinite(lse), finite) and (lse[~finite] == -math.inf).all(), name  # our convention
    if finite.any():
        assert (lse[finite].double() - ref_lse[finite]).abs().max() < 1e-4, name
    for g, r in zip(grads, ref_grads):
        assert _rel(g, r) < TOL, name

    ran_flash = [c[0] for c in fa.calls]
    if isinstance(expect, tuple):  # flash-attn ran both passes, with the expected window and soft-cap
        assert ran_flash == ["forward", "backward"] and mode.names() == [], name
        for _, a in fa.calls:
            window = tuple(a["window_size"]) if version.startswith("2.6") else (a["window_size_left"], a["window_size_right"])
            assert window == expect and a["causal"] is (kind is MaskKind.CAUSAL), name
            assert a["softcap"] == (attn_mask.softcap or 0.0) and isinstance(a["softcap"], float), name
        assert view.reasons(q, k, kind)["flash_attn"] is None
    else:  # not flash-attn: the efficient op (no score modifier) or the exact score-modifying kernel
        assert ran_flash == [], name
        reason = None
        if isinstance(view, K.FlashAttnKernel):  # ALiBi: the score-modifying kernel itself
            assert view.choose(q, k, kind) in ("efficient", "torch")
            reason = view.reasons(q, k, kind)["flash_attn"]
        if expect == "efficient":
            assert mode.names() == ["_scaled_dot_product_efficient_attention",
                                    "_scaled_dot_product_efficient_attention_backward"], name
            assert "no flash-attn window" in reason and ("left bound of -7" in reason or "empty" in reason), reason
        else:
            assert mode.names() == [] and out.dtype == torch.float32, name  # ScoreModKernel, fp32 accumulation
            if attn_mask.alibi_slopes is None:
                assert "left bound of -7" in reason, reason

    # negative controls: the window without the block's offset, and the soft-cap dropped, are caught
    if isinstance(expect, tuple) and kind is MaskKind.DENSE and q0 != k0 and expect != (-1, -1):
        unshifted = (attn_mask.window[0], 0 if causal else attn_mask.window[1])
        wrong, _, _, _ = _run(view.for_call(band=unshifted, softcap=view.softcap, fallback=view._fallback),
                              q, k, v, dout, scale=scale, kind=kind, dense=dense)
        assert _rel(wrong, ref_out) > 10 * TOL, name
    if isinstance(expect, tuple) and attn_mask.softcap is not None:
        uncapped = view.for_call(band=view.band)
        assert uncapped.softcap == 0.0
        wrong, _, _, _ = _run(uncapped, q, k, v, dout, scale=scale * 8, kind=kind, dense=dense)
        capped_ref, _, _ = _reference(q, k, v, dout, scale=scale * 8, visible=visible, mask=attn_mask, q0=q0, k0=k0)
        assert _rel(wrong, capped_ref) > 10 * TOL, name


def test_plain_kernel_unchanged_without_window_or_softcap():
    """Calls without score modifiers that are not DENSE get the kernel itself; other kernels are untouched by
    ``kernel_for_call`` (score modifiers: ``score_mod_kernel`` as before)."""
    fa = make_flash_attn("2.8.3")
    kernel = K.FlashAttnKernel(device_type="cuda", capability=H100, module=fa)
    structured = AttentionMask(window=(7, 0)).structured(causal=True, doc_bounds=None, padded_len=N)
    full = BlockCall(0, 8, 0, 8, MaskKind.FULL, 16, 0)
    assert K.kernel_for_call(kernel, None, mask=structured, call=full, head_offset=0) is kernel
    sdpa = K.SDPAKernel(device_type="cuda", capability=H100)
    dense = BlockCall(0, 8, 0, 8, MaskKind.DENSE, 16, 16)
    assert K.kernel_for_call(sdpa, None, mask=structured, call=dense, head_offset=0) is sdpa
    mods = AttentionMask(softcap=2.0).score_mods()
    assert type(K.kernel_for_call(sdpa, mods, mask=structured, call=dense, head_offset=0)) is K.ScoreModKernel
    view = K.kernel_for_call(kernel, mods, mask=structured, call=dense, head_offset=0)
    assert view is not kernel and kernel.softcap == 0.0 and kernel.band is None  # a view; the kernel unchanged


def test_softcap_view_on_cpu_tensors_runs_the_exact_kernel():
    """Without the forced CUDA path (CPU tensors), a soft-capped flash-attn call runs its exact ``ScoreModKernel``,
    as every score-modified call did before; without a soft-cap the kernel still refuses CPU tensors."""
    fa = make_flash_attn("2.8.3")
    kernel = K.FlashAttnKernel(module=fa)
    mask = AttentionMask(softcap=2.0)
    call = BlockCall(0, 8, 0, 8, MaskKind.CAUSAL, 0, 0)
    view = K.kernel_for_call(kernel, mask.score_mods(), mask=mask.structured(causal=True, doc_bounds=None, padded_len=8),
                             call=call, head_offset=0)
    q, k, v, dout = _inputs(8, 8)
    out, lse = view.forward(q, k, v, scale=0.25, kind=MaskKind.CAUSAL, mask=None)
    ref_out, _, _ = _reference(q, k, v, dout, scale=0.25, visible=torch.ones(8, 8, dtype=torch.bool).tril(), mask=mask,
                               q0=0, k0=0)
    assert fa.calls == [] and _rel(out, ref_out) < 1e-3
    with pytest.raises(ValueError, match="CUDA tensors only"):
        kernel.forward(q, k, v, scale=0.25, kind=MaskKind.CAUSAL, mask=None)


# -- the ring loop's block path -----------------------------------------------------------------------


@pytest.mark.parametrize("version", ["2.6.3", "2.8.3"])
@pytest.mark.parametrize("softcap", [None, 2.0])
@pytest.mark.parametrize("zigzag", [False, True])
def test_block_attention_under_a_window(version, softcap, zigzag):
    """``block_attention`` (the ring loop, one rank) under a causal sliding window, optionally soft-capped: the
    plan's DENSE tiles that are bands run flash-attn with their window, the others the efficient op (or
    ``ScoreModKernel`` under a soft-cap); out and dQ/dK/dV equal dense float64 attention on the whole sequence.
    Contiguous: 512 tokens, window 100 (diagonal tiles take ``(100, 0)``, the window's far edge below them needs a
    negative bound). Zigzag: the queries are global rows [0, 100) and [400, 500) of 500 (a zigzag rank's two
    chunks), window 150, so tiles sit at other offsets and shapes (windows ``(-1, 0)`` and ``(34, -1)``).
    Control: the window ignored is caught."""
    n, window = (500, (150, 0)) if zigzag else (512, (100, 0))
    attn_mask = AttentionMask(window=window, softcap=softcap)
    structured = attn_mask.structured(causal=True, doc_bounds=None, padded_len=n)
    q_runs = [Run(0, 0, 100), Run(100, 400, 100)] if zigzag else [Run(0, 0, n)]
    rows = torch.cat([torch.arange(r.global_start, r.global_end) for r in q_runs])
    fa = make_flash_attn(version)
    kernel = K.FlashAttnKernel(device_type="cuda", capability=H100, module=fa)
    spec = BlockAttentionSpec(kernel=kernel, scale=16 ** -0.5, causal=True, q_runs=q_runs,
                              k_runs_by_rank=[[Run(0, 0, n)]], mask=structured, score_mods=attn_mask.score_mods())
    g = torch.Generator().manual_seed(3)
    q_all = torch.randn(1, n, 4, 16, generator=g).to(torch.float16)
    k = torch.randn(1, n, 2, 16, generator=g).to(torch.float16).requires_grad_()
    v = torch.randn(1, n, 2, 16, generator=g).to(torch.float16).requires_grad_()
    q = q_all[:, rows].clone().requires_grad_()
    with CudaSdpaStandIn() as mode:
        out = block_attention(q, k, v, spec)
        dout = torch.randn(out.shape, generator=g)
        grads = torch.autograd.grad(out, (q, k, v), dout)

    calls = plan_blocks(q_runs, [Run(0, 0, n)], causal=True, mask=structured)
    windows = [K.flash_attn_window(structured, c.q_global, c.q_len, c.k_global, c.k_len)
               for c in calls if c.kind is MaskKind.DENSE]
    bands = sorted(w for w in windows if isinstance(w, tuple))
    assert bands and len(bands) < len(windows)  # both paths are exercised
    for which in ("forward", "backward"):
        passed = sorted((a["window_size_left"], a["window_size_right"]) if "window_size_left" in a
                        else tuple(a["window_size"]) for c, a in fa.calls if c == which)
        assert [w for w in passed if w != (-1, -1)] == bands, which  # every band tile, with its window
    assert all(a["softcap"] == (softcap or 0.0) for _, a in fa.calls)
    if softcap is None:  # the refused tiles: the efficient op
        assert mode.names().count("_scaled_dot_product_efficient_attention") == len(windows) - len(bands)
    else:  # under a soft-cap: ScoreModKernel
        assert mode.names() == []

    qd = q_all.double().requires_grad_()
    kd, vd = (t.detach().double().requires_grad_() for t in (k, v))
    ref = dense_attention(qd, kd, vd, causal=True, mask=attn_mask, scale=16 ** -0.5)[:, rows]
    ref_grads = torch.autograd.grad(ref, (qd, kd, vd), dout.double())
    ref_grads = (ref_grads[0][:, rows], *ref_grads[1:])
    assert _rel(out, ref) < TOL
    for got, want in zip(grads, ref_grads):
        assert _rel(got, want) < TOL
    unwindowed = dense_attention(qd, kd, vd, causal=True, mask=AttentionMask(softcap=softcap), scale=16 ** -0.5)[:, rows]
    assert _rel(out, unwindowed) > 10 * TOL
