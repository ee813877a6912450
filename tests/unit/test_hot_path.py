"""The attention hot path does no per-call Python rebuilding: block plans and the gathered-sequence
reorder of ``auto``'s Ulysses path are cached; the in-place merge stays exact."""

import math

import torch

from lightning_sp.layout import SequenceLayout, runs_of, token_indices
from lightning_sp.ops import backends
from lightning_sp.ops.kernels import TorchBlockwiseKernel
from lightning_sp.ops.merge import merge_into
from lightning_sp.ops.plan import plan_blocks, plan_cache_info
from tests.reference import dense_attention


def test_plan_blocks_is_cached_and_accepts_list_bounds():
    q_runs = runs_of(token_indices("zigzag", 4, 96, 1))  # a list of Runs
    k_runs = runs_of(token_indices("zigzag", 4, 96, 2))
    bounds = [0, 7, 50, 93, 96]  # a list, as attention passes it
    first = plan_blocks(q_runs, k_runs, causal=True, doc_bounds=bounds)
    before = plan_cache_info()
    again = plan_blocks(q_runs, k_runs, causal=True, doc_bounds=list(bounds))  # equal, not the same list
    after = plan_cache_info()
    assert again == first and isinstance(again, list)
    assert (after.hits, after.misses) == (before.hits + 1, before.misses)  # served from the cache
    again.clear()  # callers get a copy: mutating it cannot corrupt the cache
    assert plan_blocks(q_runs, k_runs, causal=True, doc_bounds=tuple(bounds)) == first
    # control: other bounds are a different key (a miss) and a different plan
    other = plan_blocks(q_runs, k_runs, causal=True, doc_bounds=[0, 96])
    assert plan_cache_info().misses == after.misses + 1 and other != first


def _gathered_case(world, n, layout, seed=0):
    """Full-length q, k, v in *rank order* (what an all-to-all hands ``_attend_gathered``)."""
    g = torch.Generator().manual_seed(seed)
    q, k, v = (torch.randn(1, n, 4, 8, generator=g, dtype=torch.float64) for _ in range(3))
    rank_order = torch.cat([token_indices(layout, world, n, r) for r in range(world)])
    call = backends.AttentionCall(
        kernel=TorchBlockwiseKernel(block_q=16, block_k=32), scale=1 / math.sqrt(8), causal=True,
        layout=layout, padded_len=n, doc_bounds=None, stats=None,
    )
    return call, (q, k, v), rank_order


def test_attend_gathered_reorder_is_cached_and_exact(monkeypatch):
    world, n = 4, 136  # a length no other test uses: the first call below must build the order
    layout = SequenceLayout(kind="zigzag")
    call, (q, k, v), rank_order = _gathered_case(world, n, layout)
    argsort_calls = []
    real_argsort = torch.argsort
    monkeypatch.setattr(torch, "argsort", lambda *a, **kw: argsort_calls.append(1) or real_argsort(*a, **kw))

    out1 = backends._attend_gathered(*(t[:, rank_order] for t in (q, k, v)), call, world)
    built = len(argsort_calls)
    out2 = backends._attend_gathered(*(t[:, rank_order] for t in (q, k, v)), call, world)
    assert built > 0  # control: the counter sees the first call's argsort
    assert len(argsort_calls) == built  # second call: no argsort, nothing rebuilt
    ref = dense_attention(q, k, v, causal=True)[:, rank_order]
    assert torch.allclose(out1, ref, atol=1e-12) and torch.equal(out1, out2)
    # control: the un-reordered (rank-order) sequence attended causally is not the answer
    wrong = dense_attention(q[:, rank_order], k[:, rank_order], v[:, rank_order], causal=True)
    assert (wrong - ref).abs().max() > 1e-3


def test_attend_gathered_order_cache_is_per_length_and_layout():
    world = 4
    for n, layout in ((64, SequenceLayout(kind="zigzag")), (80, SequenceLayout(kind="zigzag", ulysses_degree=2))):
        call, (q, k, v), rank_order = _gathered_case(world, n, layout, seed=n)
        out = backends._attend_gathered(*(t[:, rank_order] for t in (q, k, v)), call, world)
        assert torch.allclose(out, dense_attention(q, k, v, causal=True)[:, rank_order], atol=1e-12)


def test_merge_in_place_lerp_is_exact_and_handles_empty_rows():
    torch.manual_seed(3)
    b, s, h, d = 1, 6, 2, 4
    out = torch.randn(b, s, h, d, dtype=torch.float64)
    lse = torch.randn(b, h, s, dtype=torch.float64)
    lse[:, :, 0] = -math.inf  # the accumulator saw no key in row 0
    out[:, 0] = 0.0
    blk = torch.randn(b, s, h, d, dtype=torch.float64)
    blk_lse = torch.randn(b, h, s, dtype=torch.float64)
    blk_lse[:, :, 1] = -math.inf  # the block saw no key in row 1
    blk[:, 1] = 0.0
    want_lse = torch.logaddexp(lse, blk_lse)
    w = torch.sigmoid(blk_lse - lse).nan_to_num(nan=1.0).transpose(1, 2).unsqueeze(-1)
    want = out - w * (out - blk)
    want[:, 0] = blk[:, 0]  # only the block's keys
    ptr = out.data_ptr()
    merge_into(out, lse, blk, blk_lse)
    assert out.data_ptr() == ptr  # in place
    assert torch.allclose(out, want, atol=1e-14, rtol=0) and torch.allclose(lse, want_lse, atol=1e-14)
    # rows where neither side saw a key stay empty (no nan)
    empty, empty_lse = torch.zeros(b, s, h, d, dtype=torch.float64), torch.full((b, h, s), -math.inf, dtype=torch.float64)
    merge_into(empty, empty_lse, torch.zeros_like(empty), torch.full_like(empty_lse, -math.inf))
    assert torch.equal(empty, torch.zeros_like(empty)) and torch.isneginf(empty_lse).all()


def test_merge_bf16_block_into_fp32_accumulator():
    torch.manual_seed(4)
    out = torch.randn(1, 5, 2, 8)
    lse = torch.randn(1, 2, 5)
    blk = torch.randn(1, 5, 2, 8).bfloat16()
    blk_lse = torch.randn(1, 2, 5)
    w = torch.sigmoid(blk_lse - lse).transpose(1, 2).unsqueeze(-1)
    want = (out.double() - w.double() * (out.double() - blk.double())).float()
    merge_into(out, lse, blk, blk_lse)
    assert out.dtype == torch.float32 and torch.allclose(out, want, atol=1e-6)

