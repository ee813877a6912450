"""The attention hot path does no per-call Python rebuilding: block plans and the gathered-sequence
order of ``auto``'s Ulysses path are cached; the in-place merge stays exact."""

import math

import torch

from lightning_sp.layout import Run, SequenceLayout, runs_of, token_indices
from lightning_sp.ops import backends
from lightning_sp.ops.merge import merge_into
from lightning_sp.ops.plan import plan_blocks, plan_cache_info


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


def test_token_order_is_cached_and_sorts_the_gathered_tokens(monkeypatch):
    """Note [Sorting while gathering]: the permutation Ulysses' all-to-all applies is built once per layout,
    length and ranks, sorts the gathered tokens, and its inverse undoes it."""
    world, n = 4, 136  # a length no other test uses: the first call below must build the order
    layout = SequenceLayout(kind="zigzag")
    everyone = tuple(range(world))
    argsort_calls = []
    real_argsort = torch.argsort
    monkeypatch.setattr(torch, "argsort", lambda *a, **kw: argsort_calls.append(1) or real_argsort(*a, **kw))
    first = backends._token_order(layout, world, n, everyone, torch.device("cpu"))
    built = len(argsort_calls)
    again = backends._token_order(layout, world, n, everyone, torch.device("cpu"))
    assert built > 0 and len(argsort_calls) == built and again is first  # second call: nothing rebuilt
    gathered = torch.cat([token_indices(layout, world, n, r) for r in everyone])  # what the all-to-all hands over
    assert torch.equal(gathered[first.sort], torch.arange(n))
    assert torch.equal(gathered[first.sort][first.unsort], gathered)
    assert backends._sorted_runs(layout, world, n, everyone) == (Run(0, 0, n),)
    # usp under auto's zigzag: a Ulysses group's 2U chunks sort into the zigzag pair of its ring rank
    pair = backends._token_order(layout, world, n, (0, 1), torch.device("cpu"))
    gathered = torch.cat([token_indices(layout, world, n, r) for r in (0, 1)])
    assert runs_of(gathered[pair.sort]) == list(backends._sorted_runs(layout, world, n, (0, 1)))
    assert len(backends._sorted_runs(layout, world, n, (0, 1))) == 2 < len(runs_of(gathered))
    # control: nothing to sort (contiguous; usp on its own zigzag(U) layout) gives no permutation at all
    assert backends._token_order(SequenceLayout(), world, n, everyone, torch.device("cpu")) is None
    assert backends._token_order(SequenceLayout("zigzag", 2), world, n, (0, 1), torch.device("cpu")) is None


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

