"""The attention hot path does no per-call Python rebuilding: block plans and the gathered-sequence
order of ``auto``'s Ulysses path are cached; the in-place merge stays exact."""

import math

import torch

from lightning_sp.layout import Run, SequenceLayout, runs_of, token_indices
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



# ---- Note [One causal call for a rank's own block] and Note [First write assigns] (per-rank efficiency)


def _masked_reference(q, k, v, qpos, kpos, doc_bounds=None):
    """Dense fp64 attention of ``q [1, Sq, H, D]`` over ``k, v`` with the visibility of the global
    positions (causal, same document): ``(out, lse [1, H, Sq])``."""
    from lightning_sp.ops.plan import visibility

    vis = visibility(qpos, kpos, causal=True, doc_bounds=doc_bounds)  # [Sq, Sk]
    s = torch.einsum("bqhd,bkhd->bhqk", q, k) / math.sqrt(q.size(-1))
    s = s.masked_fill(~vis, -math.inf)
    lse = torch.logsumexp(s, -1)
    return torch.einsum("bhqk,bkhd->bqhd", torch.softmax(s, -1).nan_to_num(0.0), v), lse


def _spec(q_runs, k_runs, doc_bounds=None):
    from lightning_sp.ops.ring_attention import BlockAttentionSpec

    return BlockAttentionSpec(kernel=TorchBlockwiseKernel(block_q=8, block_k=16), scale=1 / math.sqrt(8), causal=True,
                              q_runs=list(q_runs), k_runs_by_rank=[list(k_runs)], doc_bounds=doc_bounds)


def _run_block(spec, q, k, v, dout):
    from lightning_sp.ops.ring_attention import block_attention

    q, k, v = (t.clone().requires_grad_() for t in (q, k, v))
    out = block_attention(q, k, v, spec)
    out.backward(dout)
    return out.detach(), q.grad, k.grad, v.grad


def _positions(runs):
    return torch.cat([torch.arange(r.global_start, r.global_end) for r in runs])


def test_own_zigzag_block_is_one_causal_call_and_exact():
    from lightning_sp.ops.plan import MaskKind

    n = 64
    for world in (2, 4):
        for rank in range(world):
            runs = runs_of(token_indices("zigzag", world, n, rank))
            calls = plan_blocks(runs, runs, causal=True)
            assert [(c.q_start, c.q_len, c.k_start, c.k_len, c.kind) for c in calls] == [(0, n // world, 0, n // world, MaskKind.CAUSAL)]
            g = torch.Generator().manual_seed(world * 10 + rank)
            q, k, v, dout = (torch.randn(1, n // world, 4, 8, generator=g, dtype=torch.float64) for _ in range(4))
            pos = _positions(runs)
            want = _masked_reference(q, k, v, pos, pos)[0]
            got = _run_block(_spec(runs, runs), q, k, v, dout)
            qr, kr, vr = (t.clone().requires_grad_() for t in (q, k, v))
            _masked_reference(qr, kr, vr, pos, pos)[0].backward(dout)
            for a, b in zip(got, (want, qr.grad, kr.grad, vr.grad)):
                assert torch.allclose(a, b, atol=1e-12, rtol=0)
            if len(runs) == 2:  # control: the later chunk's queries must see the whole earlier chunk; without
                # that FULL part (each chunk its own causal square) the answer differs
                split = [0, runs[1].global_start, n]
                assert (_masked_reference(q, k, v, pos, pos, split)[0] - want).abs().max() > 1e-3


def test_causal_self_block_needs_same_increasing_runs_in_one_document():
    from lightning_sp.layout import Run

    inc = [Run(0, 0, 8), Run(8, 40, 8)]
    assert len(plan_blocks(inc, inc, causal=True)) == 1
    for q_runs, k_runs, bounds in (
        ([Run(0, 40, 8), Run(8, 0, 8)], [Run(0, 40, 8), Run(8, 0, 8)], None),  # decreasing: key 0 is before query 40's row
        (inc, [Run(0, 0, 8), Run(8, 48, 8)], None),  # other keys
        (inc, inc, [0, 20, 64]),  # two documents: the later chunk must not see the earlier one
        ([Run(4, 0, 8), Run(12, 40, 8)], [Run(4, 0, 8), Run(12, 40, 8)], None),  # not from local row 0
    ):
        calls = plan_blocks(q_runs, k_runs, causal=True, doc_bounds=bounds)
        assert len(calls) > 1 or calls[0].q_len != 16, (q_runs, k_runs, bounds, calls)
        if q_runs[0].local_start == 0:  # exact through the general plan
            g = torch.Generator().manual_seed(7)
            q, k, v, dout = (torch.randn(1, 16, 4, 8, generator=g, dtype=torch.float64) for _ in range(4))
            want = _masked_reference(q, k, v, _positions(q_runs), _positions(k_runs), bounds)[0]
            got = _run_block(_spec(q_runs, k_runs, bounds), q, k, v, dout)[0]
            assert torch.allclose(got, want, atol=1e-12, rtol=0)
    # inside one document it still qualifies
    assert len(plan_blocks(inc, inc, causal=True, doc_bounds=[0, 64, 80])) == 1


def test_own_block_among_gathered_keys_is_one_causal_call_and_exact():
    """``allgather_kv``'s forward: the keys are every rank's zigzag block in rank order, so this rank's own
    block sits at rows ``[r n, (r + 1) n)``; it is one CAUSAL call there, the rest FULL calls, and exact."""
    from lightning_sp.layout import Run
    from lightning_sp.ops.plan import MaskKind, _coalesce, _plan_runs

    n = 64
    for world in (2, 4):
        blocks = [runs_of(token_indices("zigzag", world, n, r)) for r in range(world)]
        k_runs = [Run(r * (n // world) + run.local_start, run.global_start, run.length)
                  for r in range(world) for run in blocks[r]]
        kpos = _positions(k_runs)
        for rank in range(world):
            q_runs = blocks[rank]
            calls = plan_blocks(q_runs, k_runs, causal=True)
            causal = [c for c in calls if c.kind is MaskKind.CAUSAL]
            assert [(c.q_start, c.q_len, c.k_start, c.k_len) for c in causal] == [(0, n // world, rank * n // world, n // world)]
            assert calls[0] is causal[0] and all(c.kind is MaskKind.FULL for c in calls[1:])
            # the general plan: each chunk's diagonal and the earlier chunk below the later, two calls more (one
            # run, where the two chunks meet in the middle, was one CAUSAL square already)
            general = _coalesce(_plan_runs(q_runs, k_runs, True, None))
            assert len(calls) == len(general) - (2 if len(q_runs) == 2 else 0) and len(calls) <= world, (calls, general)
            g = torch.Generator().manual_seed(world * 10 + rank)
            q, dout = (torch.randn(1, n // world, 4, 8, generator=g, dtype=torch.float64) for _ in range(2))
            k, v = (torch.randn(1, n, 4, 8, generator=g, dtype=torch.float64) for _ in range(2))
            qr, kr, vr = (t.clone().requires_grad_() for t in (q, k, v))
            want = _masked_reference(qr, kr, vr, _positions(q_runs), kpos)[0]
            want.backward(dout)
            got = _run_block(_spec(q_runs, k_runs), q, k, v, dout)
            for a, b in zip(got, (want.detach(), qr.grad, kr.grad, vr.grad)):
                assert torch.allclose(a, b, atol=1e-12, rtol=0)
            # control: the causal square placed at the wrong rank's rows is a different answer
            wrong = (rank + 1) % world
            moved = torch.cat([k[:, wrong * n // world:(wrong + 1) * n // world], k[:, rank * n // world:(rank + 1) * n // world]], 1)
            swapped = k.clone()
            swapped[:, rank * n // world:(rank + 1) * n // world], swapped[:, wrong * n // world:(wrong + 1) * n // world] = moved.chunk(2, 1)
            assert (_masked_reference(q, swapped, v, _positions(q_runs), kpos)[0] - want).abs().max() > 1e-3
    # the query runs among the keys, but not consecutive or not in the same order: the general plan, still exact
    inc = [Run(0, 0, 8), Run(8, 40, 8)]
    for k_runs in ([Run(0, 0, 8), Run(8, 20, 8), Run(16, 40, 8)], [Run(0, 40, 8), Run(8, 0, 8)]):
        assert not any(c.kind is MaskKind.CAUSAL and c.q_len == 16 for c in plan_blocks(inc, k_runs, causal=True))
        g = torch.Generator().manual_seed(5)
        q, dout = (torch.randn(1, 16, 4, 8, generator=g, dtype=torch.float64) for _ in range(2))
        k, v = (torch.randn(1, sum(r.length for r in k_runs), 4, 8, generator=g, dtype=torch.float64) for _ in range(2))
        want = _masked_reference(q, k, v, _positions(inc), _positions(k_runs))[0]
        assert torch.allclose(_run_block(_spec(inc, k_runs), q, k, v, dout)[0], want, atol=1e-12, rtol=0)


def test_first_write_assigns_and_mixed_first_writes_stay_exact():
    """Two calls that both cover every query (keys before the queries, then their diagonal): the first
    result becomes ``out`` and ``dq``; neither covers every key, so dK/dV start from zeros."""
    from lightning_sp.layout import Run
    from lightning_sp.ops.ring_attention import add_rows

    q_runs, k_runs = [Run(0, 100, 16)], [Run(0, 0, 8), Run(8, 100, 16)]
    assert len(plan_blocks(q_runs, k_runs, causal=True)) == 2
    g = torch.Generator().manual_seed(11)
    q, dout = (torch.randn(1, 16, 4, 8, generator=g, dtype=torch.float64) for _ in range(2))
    k, v = (torch.randn(1, 24, 4, 8, generator=g, dtype=torch.float64) for _ in range(2))
    qpos, kpos = _positions(q_runs), _positions(k_runs)
    got = _run_block(_spec(q_runs, k_runs), q, k, v, dout)
    qr, kr, vr = (t.clone().requires_grad_() for t in (q, k, v))
    want_out = _masked_reference(qr, kr, vr, qpos, kpos)[0]
    want_out.backward(dout)
    for a, b in zip(got, (want_out.detach(), qr.grad, kr.grad, vr.grad)):
        assert torch.allclose(a, b, atol=1e-12, rtol=0)
    # control: only the first call's keys is a different answer
    assert (_masked_reference(q, k[:, :8], v[:, :8], qpos, kpos[:8])[0] - want_out).abs().max() > 1e-3

    # add_rows: a covering first write is the value itself (no copy); a partial one zero-fills the rest
    val = torch.randn(1, 6, 2, 4)
    assert add_rows(None, slice(0, 6), val, val.shape, torch.float32) is val
    part = add_rows(None, slice(2, 4), val[:, :2], val.shape, torch.float32)
    assert torch.equal(part[:, 2:4], val[:, :2]) and not part[:, :2].any() and not part[:, 4:].any()
    half = add_rows(None, slice(0, 6), val.bfloat16(), val.shape, torch.float32)
    assert half.dtype == torch.float32  # a half-precision kernel result is summed in fp32
