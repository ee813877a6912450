"""Merge math, block planning and local kernels, in float64, without a process group."""

import math

import pytest
import torch

from lightning_sp import SequenceParallelAttention
from lightning_sp.layout import Run, runs_of, token_indices
from lightning_sp.ops.kernels import SDPAKernel, TorchBlockwiseKernel, make_kernel
from lightning_sp.ops.merge import merge_into
from lightning_sp.ops.plan import MaskKind, plan_blocks, visibility
from tests.reference import dense_attention


def _partial(q, k, v, scale):
    s = torch.einsum("bqhd,bkhd->bhqk", q, k) * scale
    lse = torch.logsumexp(s, -1)
    return torch.einsum("bhqk,bkhd->bqhd", torch.softmax(s, -1), v), lse


def test_merge_of_two_halves_equals_softmax_over_all_keys():
    torch.manual_seed(0)
    q, k, v = (torch.randn(2, 5, 3, 4, dtype=torch.float64) for _ in range(3))
    scale = 0.5
    out, lse = _partial(q, k[:, :2], v[:, :2], scale)
    out, lse = out.clone(), lse.clone()
    o2, l2 = _partial(q, k[:, 2:], v[:, 2:], scale)
    merge_into(out, lse, o2, l2)
    ref_out, ref_lse = _partial(q, k, v, scale)
    assert torch.allclose(out, ref_out, atol=1e-14) and torch.allclose(lse, ref_lse, atol=1e-14)
    assert not torch.allclose(o2, ref_out, atol=1e-3)  # control: one half alone is not the answer


def test_merge_ignores_rows_that_saw_no_key():
    out = torch.randn(1, 3, 1, 2, dtype=torch.float64)
    lse = torch.randn(1, 1, 3, dtype=torch.float64)
    before = out.clone(), lse.clone()
    merge_into(out, lse, torch.zeros_like(out), torch.full_like(lse, -math.inf))
    assert torch.equal(out, before[0]) and torch.equal(lse, before[1])
    empty_out, empty_lse = torch.zeros_like(out), torch.full_like(lse, -math.inf)
    merge_into(empty_out, empty_lse, *before)
    assert torch.allclose(empty_out, before[0]) and torch.allclose(empty_lse, before[1])


def _covered(calls, causal, docs, q_runs, k_runs):
    """Rebuild the visibility matrix the plan implies (local coordinates) and count calls."""
    nq = sum(r.length for r in q_runs)
    nk = sum(r.length for r in k_runs)
    seen = torch.zeros(nq, nk, dtype=torch.int64)
    qpos = torch.cat([torch.arange(r.global_start, r.global_end) for r in q_runs])
    kpos = torch.cat([torch.arange(r.global_start, r.global_end) for r in k_runs])
    for c in calls:
        qs, ks = slice(c.q_start, c.q_start + c.q_len), slice(c.k_start, c.k_start + c.k_len)
        if c.kind is MaskKind.FULL:
            seen[qs, ks] += 1
        elif c.kind is MaskKind.CAUSAL:
            seen[qs, ks] += torch.ones(c.q_len, c.k_len, dtype=torch.int64).tril()
        else:
            seen[qs, ks] += c.dense_mask(causal, docs).long()
    return seen, visibility(qpos, kpos, causal=causal, doc_bounds=docs)


@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("docs", [None, [0, 5, 6, 21, 32]])
def test_plan_covers_each_visible_pair_exactly_once(causal, docs):
    world, n = 4, 32
    for r in range(world):
        q_runs = runs_of(token_indices("zigzag", world, n, r))
        for s in range(world):
            k_runs = runs_of(token_indices("zigzag", world, n, s))
            calls = plan_blocks(q_runs, k_runs, causal=causal, doc_bounds=docs)
            seen, visible = _covered(calls, causal, docs, q_runs, k_runs)
            assert torch.equal(seen, visible.long()), (r, s)


@pytest.mark.parametrize("docs", [None, [0, 5, 6, 21, 32]])
def test_plan_of_pieces_and_chunks_is_exact_and_never_dense(docs):
    """K/V pieces and query chunks cut the causal diagonal anywhere: each cut diagonal becomes a
    CAUSAL square plus a FULL rectangle (no [Sq, Sk] mask), and still covers each visible pair once."""
    from lightning_sp.ops.ring_attention import piece_bounds, query_chunks, slice_runs

    world, n = 4, 32
    for r in range(world):
        q_runs = runs_of(token_indices("zigzag", world, n, r))
        for s in range(world):
            k_runs = runs_of(token_indices("zigzag", world, n, s))
            for parts in (2, 3, 5):
                kb = piece_bounds(n // world, parts)
                for q0, chunk in query_chunks(q_runs, n // world, parts):
                    for j in range(parts):
                        piece = slice_runs(k_runs, kb[j], kb[j + 1])
                        calls = plan_blocks(chunk, piece, causal=True, doc_bounds=docs)
                        assert all(c.kind is not MaskKind.DENSE for c in calls), (r, s, parts, calls)
                        seen, visible = _covered(calls, True, docs, chunk, piece)
                        assert torch.equal(seen, visible.long()), (r, s, parts, q0, j)
    # control: a diagonal cut in the middle is a causal square and a full block, nothing above it
    calls = plan_blocks([Run(0, 0, 8)], [Run(0, 2, 3)], causal=True)
    assert [(c.q_start, c.q_len, c.k_start, c.k_len, c.kind) for c in calls] == [
        (2, 3, 0, 3, MaskKind.CAUSAL), (5, 3, 0, 3, MaskKind.FULL)]


def test_zigzag_plan_skips_masked_halves():
    # 4 ranks, N=32, chunk 4. Rank 1 holds chunks 1, 6; source rank 2 holds chunks 2, 5.
    q_runs = runs_of(token_indices("zigzag", 4, 32, 1))
    k_runs = runs_of(token_indices("zigzag", 4, 32, 2))
    calls = plan_blocks(q_runs, k_runs, causal=True)
    # only the second query chunk (6) attends, to both key chunks, in one FULL call
    assert [(c.q_start, c.q_len, c.k_start, c.k_len, c.kind) for c in calls] == [(4, 4, 0, 8, MaskKind.FULL)]
    assert plan_blocks([Run(0, 0, 4)], [Run(0, 8, 4)], causal=True) == []  # keys after all queries


@pytest.mark.parametrize("kernel_cls", [TorchBlockwiseKernel, SDPAKernel])
@pytest.mark.parametrize("kind", list(MaskKind))
def test_kernel_forward_backward_match_dense(kernel_cls, kind):
    torch.manual_seed(1)
    kernel = kernel_cls() if kernel_cls is SDPAKernel else kernel_cls(block_q=4, block_k=8)  # several tiles
    q = torch.randn(2, 19, 4, 8, dtype=torch.float64, requires_grad=True)
    k = torch.randn(2, 19, 2, 8, dtype=torch.float64, requires_grad=True)
    v = torch.randn(2, 19, 2, 8, dtype=torch.float64, requires_grad=True)
    mask = torch.rand(19, 19) > 0.5 if kind is MaskKind.DENSE else None
    if mask is not None:
        mask[3] = False  # a row that sees no key at all
    out, lse = kernel.forward(q, k, v, scale=0.3, kind=kind, mask=mask)
    # reference with the same mask
    s = torch.einsum("bqhd,bkhd->bhqk", q, k.repeat_interleave(2, 2)) * 0.3
    visible = {MaskKind.FULL: torch.ones(19, 19, dtype=torch.bool), MaskKind.CAUSAL: torch.ones(19, 19, dtype=torch.bool).tril(), MaskKind.DENSE: mask}[kind]
    s = s.masked_fill(~visible, -math.inf)
    ref_lse = torch.logsumexp(s, -1)
    ref = torch.einsum("bhqk,bkhd->bqhd", torch.softmax(s, -1).nan_to_num(0.0), v.repeat_interleave(2, 2))
    assert torch.allclose(out.double(), ref, atol=1e-12)
    assert torch.equal(torch.isneginf(lse), torch.isneginf(ref_lse))
    finite = torch.isfinite(ref_lse)
    assert torch.allclose(lse[finite], ref_lse[finite], atol=1e-12)
    dout = torch.randn_like(ref)
    dq, dk, dv = kernel.backward(dout, q, k, v, ref.detach(), ref_lse.detach(), scale=0.3, kind=kind, mask=mask)
    rq, rk, rv = torch.autograd.grad(ref, (q, k, v), dout)
    for got, want in ((dq, rq), (dk, rk), (dv, rv)):
        assert torch.allclose(got.double(), want, atol=1e-11)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_local_attention_low_precision_keeps_dtype(dtype):
    torch.manual_seed(2)
    q, k, v = (torch.randn(1, 33, 2, 16, dtype=dtype) for _ in range(3))
    out = SequenceParallelAttention(causal=True)(q, k, v)
    assert out.dtype == dtype
    err = (out.double() - dense_attention(q, k, v, causal=True)).abs().max()
    assert err < (1e-5 if dtype == torch.float32 else 3e-2)


def test_unbound_module_is_local_attention_with_padding_masked():
    torch.manual_seed(3)
    q, k, v = (torch.randn(1, 12, 2, 4, dtype=torch.float64) for _ in range(3))
    out = SequenceParallelAttention(causal=False)(q, k, v, seq_len=9)
    ref = dense_attention(q[:, :9], k[:, :9], v[:, :9])
    assert torch.allclose(out[:, :9], ref, atol=1e-12)
    assert not torch.allclose(SequenceParallelAttention()(q, k, v)[:, :9], ref, atol=1e-3)  # control


def test_bad_configuration_and_inputs_raise_clear_errors():
    with pytest.raises(NotImplementedError, match="dropout"):
        SequenceParallelAttention(dropout_p=0.1)
    with pytest.raises(ValueError, match="window must be"):
        SequenceParallelAttention(window_size=(128, -3))
    with pytest.raises(ValueError, match="backend must be one of"):
        SequenceParallelAttention(backend="ringo")
    with pytest.raises(ValueError, match="kernel must be one of"):
        SequenceParallelAttention(kernel="triton")
    attn = SequenceParallelAttention()
    q = torch.randn(1, 8, 4, 8)
    with pytest.raises(ValueError, match="share a dtype"):
        attn(q, q.double(), q.double())
    with pytest.raises(ValueError, match="multiple of num_kv_heads"):
        attn(q, torch.randn(1, 8, 3, 8), torch.randn(1, 8, 3, 8))
    with pytest.raises(ValueError, match=r"\[B, S_local, H, D\]"):
        attn(q[0], q[0], q[0])
    with pytest.raises(ValueError, match="floating dtype"):
        attn(q.long(), q.long(), q.long())
    with pytest.raises(ValueError, match="batch size 1"):
        attn(torch.randn(2, 8, 4, 8), torch.randn(2, 8, 4, 8), torch.randn(2, 8, 4, 8), cu_seqlens=torch.tensor([0, 8], dtype=torch.int32))
    with pytest.raises(ValueError, match="never decrease"):
        attn(q, q, q, cu_seqlens=torch.tensor([0, 5, 3, 8], dtype=torch.int32))
    with pytest.raises(ValueError, match="global sequence"):
        attn(q, q, q, cu_seqlens=torch.tensor([0, 5, 12], dtype=torch.int32))
    with pytest.raises(NotImplementedError, match="cu_seqlens"):
        attn(q, q, q, attn_mask=torch.ones(8, 8))
    with pytest.raises(ValueError, match="flash-attn"):
        make_kernel("flash_attn") if not torch.cuda.is_available() else (_ for _ in ()).throw(ValueError("flash-attn"))
