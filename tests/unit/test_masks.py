"""The mask vocabulary over global positions (``lightning_sp/masks.py``) and plans under a mask: every visible
(query, key) pair is computed exactly once, no hidden pair ever, block classes agree with the dense mask."""

from __future__ import annotations

import itertools
import random

import pytest
import torch

from lightning_sp.layout import SequenceLayout, runs_for_ranks
from lightning_sp.masks import AttentionMask, BlockClass, StructuredMask
from lightning_sp.ops.plan import MaskKind, masked_dense, plan_blocks


def _dense(mask: StructuredMask, n: int) -> torch.Tensor:
    pos = torch.arange(n)
    return mask.visible(pos, pos)


def _slow_visible(mask: AttentionMask, causal: bool, docs, n: int) -> torch.Tensor:
    """The definition on the user's mask, pair by pair (not through ``StructuredMask``)."""
    out = torch.zeros(n, n, dtype=torch.bool)
    doc = lambda p: -1 if docs is None else sum(b <= p for b in docs)  # noqa: E731
    span = lambda p: next((i for i, (s, e) in enumerate(mask.bidirectional_spans) if s <= p < e), None)  # noqa: E731
    left, right = mask.window or (-1, -1)
    for q in range(n):
        for k in range(n):
            ok = doc(q) == doc(k)
            if causal:
                ok &= k <= q or (span(q) is not None and span(q) == span(k))
            if left != -1:
                ok &= q - k <= left
            if right != -1:
                ok &= k - q <= right
            if mask.chunk_size:
                ok &= q // mask.chunk_size == k // mask.chunk_size
            out[q, k] = ok
    return out


MASKS = [
    dict(window=(5, 0)), dict(window=(3, 4)), dict(window=(-1, 2)), dict(chunk_size=7),
    dict(bidirectional_spans=((3, 9), (20, 31))), dict(window=(6, 0), bidirectional_spans=((10, 18),)),
    dict(softcap=5.0), dict(),
]


@pytest.mark.parametrize("spec", MASKS, ids=lambda d: ",".join(d) or "plain")
@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("docs", [None, (0, 13, 14, 29, 45)])
def test_visible_matches_the_definition(spec, causal, docs):
    n = 45
    user = AttentionMask(**spec)
    mask = user.structured(causal=causal, doc_bounds=docs, padded_len=n)
    assert torch.equal(_dense(mask, n), _slow_visible(user, causal, docs, n))


@pytest.mark.parametrize("spec", MASKS, ids=lambda d: ",".join(d) or "plain")
@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("layout,world", [("contiguous", 1), ("contiguous", 3), ("zigzag", 2), ("zigzag", 4)])
def test_plans_cover_every_visible_pair_once(spec, causal, layout, world, monkeypatch):
    import lightning_sp.ops.plan as plan

    monkeypatch.setattr(plan, "MASK_TILE", 4)  # small tiles: the halving and the DENSE leaves are exercised
    plan._plan_masked_cached.cache_clear()
    n = 48
    mask = AttentionMask(**spec).structured(causal=causal, doc_bounds=(0, 13, 14, 29, 48), padded_len=n)
    want = _dense(mask, n).int()
    lay = SequenceLayout(layout)
    got = torch.zeros(n, n, dtype=torch.int)
    for r, s in itertools.product(range(world), repeat=2):
        q_runs, k_runs = runs_for_ranks(lay, world, n, (r,)), runs_for_ranks(lay, world, n, (s,))
        qg = torch.tensor([run.global_start + i for run in q_runs for i in range(run.length)])
        kg = torch.tensor([run.global_start + i for run in k_runs for i in range(run.length)])
        for c in plan_blocks(q_runs, k_runs, causal=causal, mask=mask):
            qpos = qg[c.q_start:c.q_start + c.q_len]
            kpos = kg[c.k_start:c.k_start + c.k_len]
            assert torch.equal(qpos, torch.arange(c.q_global, c.q_global + c.q_len))  # globally contiguous
            assert torch.equal(kpos, torch.arange(c.k_global, c.k_global + c.k_len))
            if c.kind is MaskKind.FULL:
                block = torch.ones(c.q_len, c.k_len, dtype=torch.int)
            elif c.kind is MaskKind.CAUSAL:
                assert c.q_len == c.k_len and c.q_global == c.k_global
                block = torch.ones(c.q_len, c.k_len, dtype=torch.int).tril()
            else:
                block = masked_dense(c, mask).int()
                assert block.any()
            got[qpos[:, None], kpos[None, :]] += block
    plan._plan_masked_cached.cache_clear()
    assert torch.equal(got, want)
    # negative control: the same plan checked against the mask without its window / spans misses
    plain = _dense(AttentionMask().structured(causal=causal, doc_bounds=(0, 13, 14, 29, 48), padded_len=n), n).int()
    if not torch.equal(want, plain):  # the mask hides something the plain one shows (or the reverse)
        assert not torch.equal(got, plain)


@pytest.mark.parametrize("layout,world", [("contiguous", 2), ("zigzag", 2)])
def test_a_causal_window_with_right_zero_plans_as_the_causal_window(layout, world):
    """Hugging Face passes a causal sliding window as ``(W - 1, 0)``; under causality the right bound says nothing
    more, so the plan must equal that of ``(W - 1, -1)``: CAUSAL diagonal tiles, not DENSE ones with a bias."""
    n, lay = 2048, SequenceLayout(layout)
    q_runs = runs_for_ranks(lay, world, n, (0,))

    def plan_of(window, causal=True):
        mask = AttentionMask(window=window).structured(causal=causal, doc_bounds=None, padded_len=n)
        return plan_blocks(q_runs, q_runs, causal=causal, mask=mask)

    zero, unbounded = plan_of((511, 0)), plan_of((511, -1))
    assert zero == unbounded
    assert sum(c.kind is MaskKind.CAUSAL for c in zero) >= 1
    # control: without causality the right bound 0 is the whole constraint and plans differently
    assert plan_of((511, 0), causal=False) != plan_of((511, -1), causal=False)


def test_classify_agrees_with_the_dense_mask_on_random_blocks():
    rng = random.Random(0)
    n = 60
    for _ in range(300):
        spec = rng.choice(MASKS)
        causal = rng.random() < 0.7
        mask = AttentionMask(**spec).structured(causal=causal, doc_bounds=(0, 25, 60), padded_len=n)
        dense = _dense(mask, n)
        pts = (0, *mask.split_points(), n)
        q0 = rng.randrange(n)
        q1 = min(p for p in pts if p > q0)
        q1 = rng.randint(q0 + 1, q1)
        k0 = rng.randrange(n)
        k1 = rng.randint(k0 + 1, min(p for p in pts if p > k0))
        cls = mask.classify(q0, q1, k0, k1)
        block = dense[q0:q1, k0:k1]
        if cls is BlockClass.EMPTY:
            assert not block.any()
        elif cls is BlockClass.FULL:
            assert block.all()
        elif cls is BlockClass.CAUSAL:
            assert torch.equal(block, torch.ones_like(block).tril())
        lo, hi = mask.key_hull(q0, q1)
        outside = torch.ones(n, dtype=torch.bool)
        outside[max(lo, 0):min(hi, n)] = False
        assert not dense[q0:q1][:, outside].any()  # the hull holds every visible key


def test_bad_masks_raise_clear_errors():
    with pytest.raises(ValueError, match="window"):
        AttentionMask(window=(3,))
    with pytest.raises(ValueError, match="window"):
        AttentionMask(window=(-2, 0))
    with pytest.raises(ValueError, match="chunk_size"):
        AttentionMask(chunk_size=0)
    with pytest.raises(ValueError, match="sorted and disjoint"):
        AttentionMask(bidirectional_spans=((5, 9), (8, 12)))
    with pytest.raises(ValueError, match="start < end"):
        AttentionMask(bidirectional_spans=((5, 5),))
    with pytest.raises(ValueError, match="softcap"):
        AttentionMask(softcap=-1.0)
    with pytest.raises(ValueError, match="mask_mod"):
        AttentionMask(mask_mod=3)


# ----------------------------------------------------------------------------------------------
# the local backend (no process group): every kind, both CPU kernels, fwd + bwd + sinks, vs dense fp64
# ----------------------------------------------------------------------------------------------


def _score_mod(score, b, h, q, k):
    return score + 0.3 * torch.sin(0.7 * (q - k).to(score.dtype) + h)


def _mask_mod(b, h, q, k):
    return ((q + k + h) % 3 != 0) | (q == k)


LOCAL_KINDS = {  # kind -> (causal, mask, sinks, documents)
    "window": (True, AttentionMask(window=(5, 0)), False, False),
    "window_two_sided": (False, AttentionMask(window=(4, 3)), False, True),
    "chunked": (True, AttentionMask(chunk_size=7), False, True),
    "spans": (True, AttentionMask(bidirectional_spans=((3, 9), (20, 31))), False, True),
    "softcap": (True, AttentionMask(softcap=0.7), True, False),
    "alibi": (False, AttentionMask(alibi_slopes=(0.5, 0.25, 0.125, 0.0625)), False, True),
    "sinks": (True, None, True, True),
    "mask_mod": (False, AttentionMask(mask_mod=_mask_mod), False, False),
    "score_mod": (True, AttentionMask(score_mod=_score_mod), False, True),
    "mixed": (True, AttentionMask(window=(9, 0), bidirectional_spans=((10, 18),), softcap=1.0), True, True),
}


@pytest.mark.parametrize("kind", LOCAL_KINDS)
@pytest.mark.parametrize("kernel", ["sdpa", "torch"])
@pytest.mark.parametrize("backend", [None, "local"])
def test_local_attention_with_every_mask_kind_matches_dense_fp64(kind, kernel, backend):
    from lightning_sp import SequenceParallelAttention
    from tests.reference import dense_attention

    causal, mask, with_sinks, with_docs = LOCAL_KINDS[kind]
    n, h, h_kv, d = 45, 4, 2, 8
    g = torch.Generator().manual_seed(len(kind))
    q, k, v, dout = (torch.randn(1, n, hh, d, generator=g, dtype=torch.float64) for hh in (h, h_kv, h_kv, h))
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    if with_sinks:
        leaves.append(torch.randn(h, generator=g, dtype=torch.float64).requires_grad_())
    cu = torch.tensor([0, 13, 14, 29, n]) if with_docs else None
    attn = SequenceParallelAttention(causal=causal, mask=mask, kernel=kernel, backend=backend)
    out = attn(*leaves[:3], cu_seqlens=cu, sinks=leaves[3] if with_sinks else None)
    got = [out, *torch.autograd.grad(out, leaves, dout)]
    ref = dense_attention(*leaves[:3], causal=causal, cu_seqlens=cu, mask=mask, sinks=leaves[3] if with_sinks else None)
    want = [ref, *torch.autograd.grad(ref, leaves, dout)]
    for a, b in zip(got, want):
        assert float((a.detach() - b.detach()).abs().max()) < 1e-10
    control = dense_attention(q, k, v, causal=causal, cu_seqlens=cu)  # the mask (and sinks) ignored
    assert float((out.detach() - control).abs().max()) > 1e-3


def test_mask_arguments_are_validated():
    from lightning_sp import SequenceParallelAttention

    q = torch.randn(1, 8, 4, 8)
    with pytest.raises(ValueError, match="sinks must be a floating"):
        SequenceParallelAttention(causal=True)(q, q, q, sinks=torch.zeros(3))
    with pytest.raises(ValueError, match="one slope per query head"):
        SequenceParallelAttention(mask=AttentionMask(alibi_slopes=(1.0, 2.0)))(q, q, q)
    with pytest.raises(ValueError, match="disagree"):
        SequenceParallelAttention(window_size=(3, 0), mask=AttentionMask(window=(4, 0)))
    with pytest.raises(ValueError, match="AttentionMask"):
        SequenceParallelAttention(mask="causal")
    with pytest.raises(ValueError, match="AttentionMask"):
        SequenceParallelAttention()(q, q, q, mask=(3, 0))
    # window_size is the same as mask=AttentionMask(window=...)
    a = SequenceParallelAttention(causal=True, window_size=(2, 0))(q, q, q)
    b = SequenceParallelAttention(causal=True, mask=AttentionMask(window=(2, 0)))(q, q, q)
    assert torch.equal(a, b)
    # a forward mask's set fields override the constructor's
    c = SequenceParallelAttention(causal=True, window_size=(5, 0))(q, q, q, mask=AttentionMask(window=(2, 0)))
    assert torch.equal(a, c)


def test_batch_and_head_indices_reach_mask_mod_and_score_mod():
    """``b`` and ``h`` as FlexAttention passes them (B = 2), with a window / chunks and sinks; control: the mods
    made independent of ``b`` must miss on the second row."""
    from lightning_sp import SequenceParallelAttention
    from tests.reference import dense_attention

    def mask_mod(b, h, q, k):
        return ((q + k + b + h) % 3 != 0) | (q == k)

    def score_mod(s, b, h, q, k):
        return s + 0.2 * b - 0.1 * h

    g = torch.Generator().manual_seed(0)
    for mask in (AttentionMask(mask_mod=mask_mod, window=(6, 0)), AttentionMask(score_mod=score_mod, chunk_size=5)):
        q, k, v, dout = (torch.randn(2, 23, 4, 8, generator=g, dtype=torch.float64) for _ in range(4))
        leaves = [t.clone().requires_grad_() for t in (q, k, v)] + [torch.randn(4, generator=g, dtype=torch.float64).requires_grad_()]
        out = SequenceParallelAttention(causal=True, mask=mask)(*leaves[:3], sinks=leaves[3])
        ref = dense_attention(*leaves[:3], causal=True, mask=mask, sinks=leaves[3])
        for a, b in zip([out, *torch.autograd.grad(out, leaves, dout)], [ref, *torch.autograd.grad(ref, leaves, dout)]):
            assert float((a.detach() - b.detach()).abs().max()) < 1e-10
        blind = AttentionMask(mask_mod=lambda b, h, q, k: mask_mod(0 * b, h, q, k), window=(6, 0)) if mask.mask_mod \
            else AttentionMask(score_mod=lambda s, b, h, q, k: score_mod(s, 0 * b, h, q, k), chunk_size=5)
        control = dense_attention(q, k, v, causal=True, mask=blind, sinks=leaves[3].detach())
        assert float((out.detach() - control)[1].abs().max()) > 1e-3


# ------------------------------------------------------------------------------ learned relative-position bias


def _hf_t5_bucket():
    pytest.importorskip("transformers")
    from transformers.models.t5.modeling_t5 import T5Attention

    return T5Attention._relative_position_bucket


@pytest.mark.parametrize("bidirectional", [True, False])
@pytest.mark.parametrize("num_buckets,max_distance", [(32, 128), (8, 12), (6, 7), (4, 3), (33, 200), (320, 1000)])
def test_t5_buckets_equal_hugging_faces_bit_for_bit(bidirectional, num_buckets, max_distance):
    """Every relative position in [-5000, 5000] (far beyond max_distance both ways) lands in HF's bucket."""
    from lightning_sp.masks import t5_relative_position_bucket

    rel = torch.arange(-5000, 5001).view(1, -1) - torch.zeros(3, 1, dtype=torch.int64)  # [3, 10001]
    ours = t5_relative_position_bucket(rel, bidirectional=bidirectional, num_buckets=num_buckets,
                                       max_distance=max_distance)
    hf = _hf_t5_bucket()(rel, bidirectional=bidirectional, num_buckets=num_buckets, max_distance=max_distance)
    assert ours.dtype == torch.int64 and torch.equal(ours, hf)
    assert int(ours.min()) >= 0 and int(ours.max()) < num_buckets
    # control: the other direction convention is told apart (the comparison above can fail)
    flipped = t5_relative_position_bucket(-rel, bidirectional=bidirectional, num_buckets=num_buckets,
                                          max_distance=max_distance)
    assert not torch.equal(flipped, hf)


def test_relative_position_bias_arguments_are_validated():
    from lightning_sp import RelativePositionBias

    table = torch.zeros(8, 4, dtype=torch.float64)
    with pytest.raises(ValueError, match="floating \\[num_buckets, H\\]"):
        RelativePositionBias(torch.zeros(8, dtype=torch.float64), num_buckets=8)
    with pytest.raises(ValueError, match="floating"):
        RelativePositionBias(torch.zeros(8, 4, dtype=torch.int64), num_buckets=8)
    with pytest.raises(ValueError, match="8 rows but num_buckets=32"):
        RelativePositionBias(table)
    with pytest.raises(ValueError, match="max_distance"):
        RelativePositionBias(table, num_buckets=8, max_distance=2)
    with pytest.raises(ValueError, match="num_buckets >= 4"):
        RelativePositionBias(torch.zeros(2, 4), num_buckets=2)
    with pytest.raises(ValueError, match="bucket_fn must be a callable"):
        RelativePositionBias(table, bucket_fn=3)
    with pytest.raises(ValueError, match="relative_bias must be a lightning_sp.RelativePositionBias"):
        AttentionMask(relative_bias=table)
    out_of_range = RelativePositionBias(table, bucket_fn=lambda rel: rel.abs())
    assert out_of_range.bucket_error(8) is None  # |k - q| <= 7
    assert "buckets in [0, 8], outside the table's [0, 8) rows" in out_of_range.bucket_error(9)
    from lightning_sp import SequenceParallelAttention

    q = torch.randn(1, 9, 4, 8, dtype=torch.float64)
    with pytest.raises(ValueError, match="mask.relative_bias: bucket_fn returned buckets in \\[0, 8\\]"):
        SequenceParallelAttention(causal=False)(q, q, q, mask=AttentionMask(relative_bias=out_of_range))


def _bias_case(seed=0, n=150, h=4, h_kv=2, d=8, rows=16):
    g = torch.Generator().manual_seed(seed)
    q, k, v, dout = (torch.randn(1, n, hh, d, generator=g, dtype=torch.float64) for hh in (h, h_kv, h_kv, h))
    table = torch.randn(rows, h, generator=g, dtype=torch.float64)
    return q, k, v, dout, table


def _bias_as_score_mod(bias, table):
    """The same bias written as a plain ``score_mod`` closing over the table: dense attention differentiates it by
    autograd on the whole matrix (the reference for ``d table``)."""
    def score_mod(s, b, h, q, k):
        return s + table[bias.buckets(k - q)[0, 0]][..., h.flatten()].permute(2, 0, 1).unsqueeze(0)
    return score_mod


@pytest.mark.parametrize("causal,bidirectional", [(False, True), (True, False)])
@pytest.mark.parametrize("extra", ["none", "softcap_docs_sinks", "bucket_fn"])
def test_local_attention_with_a_relative_bias_matches_dense_fp64_with_its_table_gradient(causal, bidirectional, extra):
    """Blocks of 128 x 512 over 150 tokens (several tiles per call): out, dq/dk/dv and d(table) against dense
    float64 attention with the same bias as a ``score_mod`` whose table autograd differentiates; the bias ignored
    misses."""
    from lightning_sp import RelativePositionBias, SequenceParallelAttention
    from tests.reference import dense_attention

    q, k, v, dout, table = _bias_case()
    bucket_fn = (lambda rel: (rel.abs() % 7) + 7 * (rel > 0)) if extra == "bucket_fn" else None  # noqa: E731
    rows = 14 if bucket_fn else 16
    table = table[:rows].clone()
    softcap = 0.9 if extra == "softcap_docs_sinks" else None
    cu = torch.tensor([0, 40, 41, 150], dtype=torch.int32) if extra == "softcap_docs_sinks" else None
    sinks = torch.randn(4, dtype=torch.float64) if extra == "softcap_docs_sinks" else None
    leaves = [t.clone().requires_grad_() for t in (q, k, v, table)]
    leaves += [sinks.clone().requires_grad_()] if sinks is not None else []
    bias = RelativePositionBias(leaves[3], num_buckets=rows, max_distance=40, bidirectional=bidirectional,
                                bucket_fn=bucket_fn)
    attn = SequenceParallelAttention(causal=causal, kernel="torch")
    out = attn(*leaves[:3], cu_seqlens=cu, mask=AttentionMask(softcap=softcap, relative_bias=bias),
               sinks=leaves[4] if sinks is not None else None)
    got = [out, *torch.autograd.grad(out, leaves, dout)]
    ref_leaves = [t.clone().requires_grad_() for t in leaves]
    ref_bias = RelativePositionBias(ref_leaves[3], num_buckets=rows, max_distance=40, bidirectional=bidirectional,
                                    bucket_fn=bucket_fn)
    ref = dense_attention(*ref_leaves[:3], causal=causal, cu_seqlens=cu,
                          mask=AttentionMask(softcap=softcap, score_mod=_bias_as_score_mod(ref_bias, ref_leaves[3])),
                          sinks=ref_leaves[4] if sinks is not None else None)
    refs = [ref, *torch.autograd.grad(ref, ref_leaves, dout)]
    errors = [float((a.detach() - b.detach()).abs().max()) for a, b in zip(got, refs)]
    assert max(errors) < 1e-11, errors
    assert float(refs[4].abs().max()) > 1e-2  # the table's gradient is not trivially zero
    ignored = dense_attention(q, k, v, causal=causal, cu_seqlens=cu, mask=AttentionMask(softcap=softcap),
                              sinks=sinks)
    assert float((out.detach() - ignored).abs().max()) > 1e-3


def test_relative_bias_table_gradient_per_backward_and_frozen_table():
    """Two backwards through one retained graph each give the gradient once (the call's accumulator is emptied);
    one table shared by two calls gets the sum; a table that needs no gradient adds no autograd node."""
    from lightning_sp import RelativePositionBias, SequenceParallelAttention
    from tests.reference import dense_attention

    q, k, v, dout, table = _bias_case(seed=1, n=40)
    table = table.requires_grad_()
    attn = SequenceParallelAttention(causal=False)
    mask = AttentionMask(relative_bias=RelativePositionBias(table, num_buckets=16, max_distance=30))
    out = attn(q, k, v, mask=mask) + attn(q.flip(1), k, v, mask=mask)
    out.backward(dout, retain_graph=True)
    first = table.grad.clone()
    out.backward(dout)
    ref_table = table.detach().clone().requires_grad_()
    sm = _bias_as_score_mod(RelativePositionBias(ref_table, num_buckets=16, max_distance=30), ref_table)
    ref_mask = AttentionMask(score_mod=sm)
    ref = dense_attention(q, k, v, mask=ref_mask) + dense_attention(q.flip(1), k, v, mask=ref_mask)
    (expected,) = torch.autograd.grad(ref, ref_table, dout)
    assert float((first - expected).abs().max()) < 1e-11
    assert float((table.grad - 2 * expected).abs().max()) < 1e-11
    frozen = RelativePositionBias(table.detach(), num_buckets=16, max_distance=30)
    out = attn(q.requires_grad_(), k, v, mask=AttentionMask(relative_bias=frozen))
    assert "_TableGradientBackward" not in _graph_nodes(out.grad_fn)
    assert "_TableGradientBackward" in _graph_nodes(attn(q, k, v, mask=mask).grad_fn)


def _graph_nodes(fn) -> set[str]:
    """Class names of every autograd node behind ``fn``."""
    seen, names, todo = set(), set(), [fn]
    while todo:
        node = todo.pop()
        if node is not None and id(node) not in seen:
            seen.add(id(node))
            names.add(type(node).__name__)
            todo.extend(n for n, _ in node.next_functions)
    return names


def test_relative_bias_of_the_wrong_width_is_refused():
    from lightning_sp import RelativePositionBias, SequenceParallelAttention

    q = torch.randn(1, 8, 4, 8, dtype=torch.float64)
    bias = RelativePositionBias(torch.zeros(8, 3, dtype=torch.float64), num_buckets=8, max_distance=20)
    with pytest.raises(ValueError, match="relative_bias.table has 3 columns but q has 4 heads"):
        SequenceParallelAttention(causal=False)(q, q[:, :, :2], q[:, :, :2], mask=AttentionMask(relative_bias=bias))


@pytest.mark.parametrize("use_reentrant", [False, True])
def test_relative_bias_table_gradient_under_activation_checkpointing(use_reentrant):
    """The recompute in backward builds a second call (and accumulator); the table still gets the gradient once."""
    from torch.utils.checkpoint import checkpoint

    from lightning_sp import RelativePositionBias, SequenceParallelAttention

    q, k, v, dout, table = _bias_case(seed=2, n=40)
    q, table = q.requires_grad_(), table[:8].clone().requires_grad_()
    attn = SequenceParallelAttention(causal=False)

    def layer(x):
        return attn(x * 1.0, k, v, mask=AttentionMask(relative_bias=RelativePositionBias(table, num_buckets=8,
                                                                                           max_distance=10)))

    layer(q).backward(dout)
    expected, expected_dq = table.grad.clone(), q.grad.clone()
    table.grad = q.grad = None
    checkpoint(layer, q, use_reentrant=use_reentrant).backward(dout)
    assert float(expected.abs().max()) > 1e-2
    assert torch.allclose(table.grad, expected, rtol=0, atol=1e-12)
    assert torch.allclose(q.grad, expected_dq, rtol=0, atol=1e-12)


def test_a_relative_bias_runs_the_kernel_that_accumulates_its_table_gradient_and_trials_add_none():
    """Under ``kernel="flex"`` a call with a relative bias still runs ``ScoreModKernel`` (FlexAttention's backward
    would not accumulate the table's gradient); ``backend="auto"``'s timed trials get the table detached."""
    from types import SimpleNamespace

    from lightning_sp import RelativePositionBias
    from lightning_sp.attention import _without_learned_tables
    from lightning_sp.ops.kernels import ScoreModKernel, score_mod_kernel

    table = torch.zeros(8, 4, dtype=torch.float64, requires_grad=True)
    mask = AttentionMask(softcap=2.0, relative_bias=RelativePositionBias(table, num_buckets=8, max_distance=10))
    flex = SimpleNamespace(name="flex")
    chosen = score_mod_kernel(flex, mask.score_mods(), q_global=0, k_global=0, head_offset=0)
    assert type(chosen) is ScoreModKernel
    trial = _without_learned_tables(mask)
    assert not trial.relative_bias.table.requires_grad and trial.relative_bias.table.data_ptr() == table.data_ptr()
    assert trial.signature() == mask.signature() and trial.softcap == 2.0
    assert _without_learned_tables(AttentionMask(softcap=2.0)) == AttentionMask(softcap=2.0)
