"""Every backend against dense float64 attention on the full sequence, forward and backward, on real
gloo ranks (2 and 4). One spawn per world size runs the whole grid; the parent asserts per case."""

from __future__ import annotations

import itertools

import pytest
import torch

from lightning_sp import SequenceParallelAttention, gather_sequence, shard_sequence
from lightning_sp.comm.volume import forward_elements
from tests.distributed.harness import run_on_ranks
from tests.reference import dense_attention

pytestmark = pytest.mark.distributed

BACKENDS = ["ulysses", "ring", "zigzag_ring", "allgather_kv", "usp", "colossal", "auto"]
HEADS = {"mha": (4, 4), "gqa": (4, 2), "mqa": (4, 1)}
N = 37  # divisible by no degree: exercises padding everywhere
DOCS = [0, 10, 11, 30, 37]  # a length-1 document included
TOL = {torch.float64: 1e-10, torch.float32: 2e-5, torch.bfloat16: 3e-2}


def _case_tensors(seed, n, h, h_kv, d, dtype):
    g = torch.Generator().manual_seed(seed)
    b = 1
    q = torch.randn(b, n, h, d, generator=g, dtype=torch.float64)
    k = torch.randn(b, n, h_kv, d, generator=g, dtype=torch.float64)
    v = torch.randn(b, n, h_kv, d, generator=g, dtype=torch.float64)
    dout = torch.randn(b, n, h, d, generator=g, dtype=torch.float64)
    return [t.to(dtype) for t in (q, k, v, dout)]


def _run_case(group, backend, causal, heads, docs, dtype, kernel, seed):
    """Shard, run forward/backward, gather. Returns the errors against dense fp64 (and a control)."""
    h, h_kv = HEADS[heads]
    q, k, v, dout = _case_tensors(seed, N, h, h_kv, 8, dtype)
    cu = torch.tensor(DOCS, dtype=torch.int32) if docs else None
    attn = SequenceParallelAttention(causal=causal, backend=backend, group=group, kernel=kernel)
    layout = attn.layout
    local = [shard_sequence(t, group, layout=layout).requires_grad_(i < 3) for i, t in enumerate((q, k, v, dout))]
    out = attn(*local[:3], cu_seqlens=cu, seq_len=N)
    out.backward(local[3])
    got = [gather_sequence(t, group, layout=layout, seq_len=N) for t in (out.detach(), local[0].grad, local[1].grad, local[2].grad)]
    # reference: dense fp64 on the full sequence, same inputs
    qd, kd, vd = (t.double().requires_grad_() for t in (q, k, v))
    ref = dense_attention(qd, kd, vd, causal=causal, cu_seqlens=cu)
    ref_grads = torch.autograd.grad(ref, (qd, kd, vd), dout.double())
    errors = [float((a.double() - b.detach()).abs().max()) for a, b in zip(got, (ref, *ref_grads))]
    # negative control: the same comparison against the other mask must fail the tolerance
    control = dense_attention(q, k, v, causal=not causal, cu_seqlens=cu)
    control_err = float((got[0].double() - control).abs().max())
    return errors, control_err


def _grid(world):
    cases = []
    for backend, causal, heads, docs in itertools.product(BACKENDS, (True, False), HEADS, (False, True)):
        cases.append((backend, causal, heads, docs, torch.float64, "auto"))
    for backend in BACKENDS:  # the pure-PyTorch kernel, and low precision
        cases.append((backend, True, "gqa", True, torch.float64, "torch"))
        cases.append((backend, True, "gqa", False, torch.float32, "auto"))
        cases.append((backend, False, "mha", True, torch.bfloat16, "auto"))
    return cases


def _volume_cases():
    # (backend, heads); N divisible so the analytic formula applies exactly
    return [(b, hd) for b in ("ulysses", "ring", "zigzag_ring", "allgather_kv", "usp", "colossal") for hd in ("mha", "gqa")]


def _layout_grid(world):
    """Ulysses and usp under every layout they can be handed (Note [Sorting while gathering]): ``auto``
    shards zigzag and runs either; ``(backend, ulysses_degree, layout kind, layout's ulysses_degree)``."""
    runs = [("ulysses", world, "contiguous", 1), ("ulysses", world, "zigzag", 1)]
    if world == 4:
        runs += [("usp", 2, "zigzag", 1), ("usp", 2, "zigzag", 2)]
    # kv_pieces=1 only: at N=37 the shards are too short for more than one head group (piece_count)
    return [(*r, causal, docs, 1) for r in runs for causal in (True, False) for docs in (False, True)]


def _run_layout_case(group, world, backend, u, kind, layout_u, causal, docs, kv_pieces, seed, sort=True):
    """``ulysses_attention`` / ``usp_attention`` on shards of ``layout`` (fp64, GQA, padding), gathered:
    errors against dense fp64 for out, dq, dk, dv. ``sort=False`` (the negative control) skips sorting
    the gathered tokens while the plan still assumes them sorted."""
    from unittest import mock

    from lightning_sp.attention import _doc_bounds, make_usp_groups
    from lightning_sp.layout import SequenceLayout, padded_length
    from lightning_sp.ops import backends
    from lightning_sp.ops.kernels import make_kernel

    layout = SequenceLayout(kind, ulysses_degree=layout_u)
    q, k, v, dout = _case_tensors(seed, N, 4, 2, 8, torch.float64)
    padded = padded_length(N, world, layout)
    call = backends.AttentionCall(kernel=make_kernel("sdpa"), scale=8 ** -0.5, causal=causal, layout=layout,
                                  padded_len=padded, doc_bounds=_doc_bounds(tuple(DOCS) if docs else None, N, padded),
                                  stats=None, kv_pieces=kv_pieces)
    local = [shard_sequence(t, group, layout=layout).requires_grad_(i < 3) for i, t in enumerate((q, k, v, dout))]
    no_sort = lambda *args: None  # noqa: E731
    with mock.patch.object(backends, "_token_order", backends._token_order if sort else no_sort):
        if backend == "ulysses":
            out = backends.ulysses_attention(*local[:3], call, group=group)
        else:
            ug, rg = make_usp_groups(group, u)
            out = backends.usp_attention(*local[:3], call, ulysses_group=ug, ring_group=rg)
    out.backward(local[3])
    got = [gather_sequence(t, group, layout=layout, seq_len=N) for t in (out.detach(), *(t.grad for t in local[:3]))]
    cu = torch.tensor(DOCS, dtype=torch.int32) if docs else None
    qd, kd, vd = (t.clone().requires_grad_() for t in (q, k, v))
    ref = dense_attention(qd, kd, vd, causal=causal, cu_seqlens=cu)
    ref_grads = torch.autograd.grad(ref, (qd, kd, vd), dout)
    return [float((a - b).abs().max()) for a, b in zip(got, (ref, *ref_grads))]


def _worker(rank, world):
    import torch.distributed as dist

    group = dist.group.WORLD
    results = {}
    for i, (backend, causal, heads, docs, dtype, kernel) in enumerate(_grid(world)):
        results[(backend, causal, heads, docs, str(dtype), kernel)] = _run_case(group, backend, causal, heads, docs, dtype, kernel, seed=i)
    layouts = {case: _run_layout_case(group, world, *case, seed=i) for i, case in enumerate(_layout_grid(world))}
    unsorted = {case: _run_layout_case(group, world, *case, seed=i, sort=False)
                for i, case in enumerate(_layout_grid(world)) if case[2] == "zigzag" and case[3] == 1 and not case[5]}
    volumes = {}
    n = 16 * world
    for backend, heads in _volume_cases():
        h, h_kv = HEADS[heads]
        attn = SequenceParallelAttention(causal=True, backend=backend, group=group)
        q, k, v, _ = _case_tensors(0, n, h, h_kv, 8, torch.float64)
        local = [shard_sequence(t, group, layout=attn.layout) for t in (q, k, v)]
        attn(*local)  # warm-up creates usp sub-groups
        attn.comm_stats.reset()
        attn(*local)
        measured = attn.comm_stats.total_bytes / 8  # fp64 elements
        analytic = forward_elements(backend, seq_len=n, world=world, num_heads=h, num_kv_heads=h_kv, head_dim=8,
                                    ulysses_degree=attn.layout.ulysses_degree)
        volumes[(backend, heads)] = (measured, analytic)
    return {"cases": results, "volumes": volumes, "layouts": layouts, "unsorted": unsorted,
            "cross": _cross_attention_cases(group, world)}


# --------------------------------------------------------------------------- cross-attention
MEMORY = 23  # a memory length that is neither N nor a shard's length


def _dense_cross_attention(q, k, v):
    """``q [B, N, H, D]`` over the whole memory ``k, v [B, M, H_kv, D]``, float64, no mask."""
    rep = q.size(2) // k.size(2)
    k, v = k.double().repeat_interleave(rep, dim=2), v.double().repeat_interleave(rep, dim=2)
    scores = torch.einsum("bqhd,bkhd->bhqk", q.double(), k) / q.size(-1) ** 0.5
    return torch.einsum("bhqk,bkhd->bqhd", torch.softmax(scores, dim=-1), v)


def _cross_case(group, backend, heads, memory_len, kernel, seed, *, kv_layout="replicated", validate=True):
    """Queries of the N-token sequence sharded with ``backend``'s layout, a ``memory_len``-token memory whole on
    every rank: out and dq gathered, dk/dv summed over the group (the memory's gradient) and this rank's own,
    each against dense float64 cross-attention. Returns ``{name: max error}`` or ``{"error": message}``."""
    import torch.distributed as dist

    h, h_kv = HEADS[heads]
    g = torch.Generator().manual_seed(seed)
    q, dout = (torch.randn(2, N, h, 8, generator=g, dtype=torch.float64) for _ in range(2))
    k, v = (torch.randn(2, memory_len, h_kv, 8, generator=g, dtype=torch.float64) for _ in range(2))
    attn = SequenceParallelAttention(backend=backend, group=group, kernel=kernel, validate_inputs=validate)
    q_local, dout_local = (shard_sequence(t, group, layout=attn.layout) for t in (q, dout))
    q_local.requires_grad_()
    k_mem, v_mem = (t.clone().requires_grad_() for t in (k, v))
    try:
        out = attn(q_local, k_mem, v_mem, kv_layout=kv_layout)
    except ValueError as err:
        return {"error": str(err)}
    out.backward(dout_local)
    dk_sum, dv_sum = k_mem.grad.clone(), v_mem.grad.clone()
    dist.all_reduce(dk_sum, group=group)
    dist.all_reduce(dv_sum, group=group)
    got = {"out": gather_sequence(out.detach(), group, layout=attn.layout, seq_len=N),
           "dq": gather_sequence(q_local.grad, group, layout=attn.layout, seq_len=N), "dk": dk_sum, "dv": dv_sum,
           "dk_own": k_mem.grad, "dv_own": v_mem.grad}
    qd, kd, vd = (t.clone().requires_grad_() for t in (q, k, v))
    ref = _dense_cross_attention(qd, kd, vd)
    dq, dk, dv = torch.autograd.grad(ref, (qd, kd, vd), dout)
    want = {"out": ref.detach(), "dq": dq, "dk": dk, "dv": dv, "dk_own": dk, "dv_own": dv}
    return {name: float((got[name] - want[name]).abs().max()) for name in got}


def _cross_attention_cases(group, world):
    """Cross-attention (Note [Cross-attention over a replicated memory]) under every backend's query layout, with
    a memory of another length and one of exactly the shard's length; the detections; a memory held in shards
    and gathered."""
    import torch.distributed as dist

    from lightning_sp.layout import padded_length

    rank = dist.get_rank()
    exact, refused = {}, {}
    for i, (backend, heads) in enumerate(itertools.product(BACKENDS, ("mha", "gqa"))):
        layout = SequenceParallelAttention(backend=backend, group=group).layout
        shard_len = padded_length(N, world, layout) // world
        for memory_len in (MEMORY, shard_len):
            exact[(backend, heads, memory_len == shard_len, "auto")] = _cross_case(group, backend, heads, memory_len,
                                                                                  "auto", seed=100 + i)
        if heads != "mha":
            continue
        # the bug this mode fixes: the whole memory of the shard's length passed as if it were shards
        exact[(backend, heads, "as-shards", "auto")] = _cross_case(group, backend, heads, shard_len, "auto",
                                                                   seed=100 + i, kv_layout="sharded", validate=False)
        refused[(backend, heads, "shard length")] = _cross_case(group, backend, heads, shard_len, "auto",
                                                                seed=100 + i, kv_layout="sharded")
        refused[(backend, heads, "other length")] = _cross_case(group, backend, heads, MEMORY, "auto",
                                                                seed=100 + i, kv_layout="sharded")
    for backend in ("zigzag_ring", "usp"):
        exact[(backend, "gqa", False, "torch")] = _cross_case(group, backend, "gqa", MEMORY, "torch", seed=7)

    # a "replicated" memory that differs across ranks (each rank passed its own shard of it), and causal
    g = torch.Generator().manual_seed(50 + rank)
    q, k, v = (torch.randn(1, 4, 4, 8, generator=g, dtype=torch.float64) for _ in range(3))
    for name, module in (("memory differs", SequenceParallelAttention(backend="ring", group=group)),
                         ("causal", SequenceParallelAttention(causal=True, backend="ring", group=group))):
        try:
            module(q, k, v, kv_layout="replicated", seq_len=4 * world)
            refused[name] = {}
        except ValueError as err:
            refused[name] = {"error": str(err)}

    # a memory held in shards (contiguous, padded) and gathered: gather_sequence's backward sums the ranks' parts
    g = torch.Generator().manual_seed(3)
    q, dout = (torch.randn(1, N, 4, 8, generator=g, dtype=torch.float64) for _ in range(2))
    k, v = (torch.randn(1, MEMORY, 2, 8, generator=g, dtype=torch.float64) for _ in range(2))
    attn = SequenceParallelAttention(backend="zigzag_ring", group=group)
    q_local, dout_local = (shard_sequence(t, group, layout=attn.layout) for t in (q, dout))
    k_shard, v_shard = (shard_sequence(t, group).requires_grad_() for t in (k, v))
    k_mem, v_mem = (gather_sequence(t, group, seq_len=MEMORY) for t in (k_shard, v_shard))
    attn(q_local, k_mem, v_mem, kv_layout="replicated").backward(dout_local)
    kd, vd = k.clone().requires_grad_(), v.clone().requires_grad_()
    dk, dv = torch.autograd.grad(_dense_cross_attention(q, kd, vd), (kd, vd), dout)
    gathered = {"dk": float((gather_sequence(k_shard.grad, group, seq_len=MEMORY) - dk).abs().max()),
                "dv": float((gather_sequence(v_shard.grad, group, seq_len=MEMORY) - dv).abs().max())}
    return {"exact": exact, "refused": refused, "gathered": gathered}


@pytest.fixture(scope="module", params=[2, 4], ids=lambda w: f"world{w}")
def grid_results(request):
    return request.param, run_on_ranks(_worker, request.param, timeout_s=600)


def test_every_backend_matches_dense_fp64(grid_results):
    world, per_rank = grid_results
    failures = []
    for key, (errors, control_err) in per_rank[0]["cases"].items():
        dtype = {str(d): d for d in TOL}[key[4]]
        tol = TOL[dtype]
        if max(errors) > tol:
            failures.append(f"{key}: out/dq/dk/dv errors {errors} > {tol}")
        if control_err < 10 * tol:
            failures.append(f"{key}: negative control passed ({control_err}): the comparison cannot fail")
    assert not failures, f"world={world}:\n" + "\n".join(failures)
    # every rank reports the same gathered results
    assert per_rank[0]["cases"].keys() == per_rank[-1]["cases"].keys()


def test_forward_bytes_equal_analytic_volume(grid_results):
    world, per_rank = grid_results
    for rank_result in per_rank:
        for key, (measured, analytic) in rank_result["volumes"].items():
            assert analytic > 0
            assert measured / analytic == pytest.approx(1.0, abs=1e-9), f"world={world} {key}: {measured} vs {analytic}"


def test_ulysses_and_usp_exact_under_every_layout(grid_results):
    """Note [Sorting while gathering]: Ulysses on contiguous and zigzag shards, usp(2) on auto's zigzag and on its
    own zigzag(2), causal and not, documents; the control drops the sort and must be caught."""
    world, per_rank = grid_results
    for rank_result in per_rank:
        assert len(rank_result["layouts"]) == len(_layout_grid(world))
        for case, errors in rank_result["layouts"].items():
            assert max(errors) < 1e-10, f"world={world} {case}: out/dq/dk/dv errors {errors}"
        assert rank_result["unsorted"]  # the control ran
        for case, errors in rank_result["unsorted"].items():
            assert errors[0] > 1e-3, f"world={world} {case}: attention on unsorted tokens went unnoticed ({errors})"


def test_cross_attention_over_a_replicated_memory_is_exact(grid_results):
    """kv_layout="replicated": out and dq equal dense float64 cross-attention, the memory's dK/dV summed over the
    ranks equal its gradient, for a memory of another length and of exactly the shard's, under every backend's
    query layout, both kernels. Controls: each rank's own dK/dV is only its queries' part (the sum is needed),
    and the same memory passed as shards (the silent error this mode replaces) is off."""
    world, per_rank = grid_results
    for rank, res in enumerate(per_rank):
        for case, errors in res["cross"]["exact"].items():
            assert "error" not in errors, (world, rank, case, errors)
            if case[2] == "as-shards":
                assert max(errors["out"], errors["dk"], errors["dv"]) > 1e-3, (world, rank, case, errors)
                continue
            worst = max(errors[name] for name in ("out", "dq", "dk", "dv"))
            assert worst < 1e-10, (world, rank, case, errors)
            assert min(errors["dk_own"], errors["dv_own"]) > 1e-3, (world, rank, case, errors)
        assert max(res["cross"]["gathered"].values()) < 1e-10, (world, rank, res["cross"]["gathered"])


def test_cross_attention_passed_as_shards_is_refused_on_every_rank(grid_results):
    """The default kv_layout="sharded" with a whole memory: a length other than q's, and one equal to the
    shard's (found by the cross-rank check's sums), raise on every rank naming cross-attention and
    kv_layout='replicated'; a "replicated" memory that differs across ranks, and causal cross-attention, raise."""
    world, per_rank = grid_results
    for rank, res in enumerate(per_rank):
        refused = res["cross"]["refused"]
        for case, outcome in refused.items():
            message = outcome.get("error")
            assert message is not None, (world, rank, case, "not refused")
            if case[-1] in ("shard length", "other length"):
                assert "cross-attention" in message and "kv_layout='replicated'" in message, (case, message)
        assert "looks like cross-attention" in refused[("ring", "mha", "shard length")]["error"]
        assert "needs the same k and v" in refused["memory differs"]["error"]
        assert "does not take causal=True" in refused["causal"]["error"]
