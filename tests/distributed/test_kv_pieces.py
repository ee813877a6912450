"""K/V in pieces (``kv_pieces``, Note [K/V in pieces] in ``ops/ring_attention.py``): ``ring``,
``zigzag_ring``, ``usp`` (and ``allgather_kv``'s tiled backward) with pieces forced on tiny shapes
(``MIN_PIECE_TOKENS = 1``), and ``ulysses``/``usp`` in head groups (Note [Heads in groups] in
``ops/backends.py``), equal dense float64 attention, forward and backward, on 2 and 4 gloo ranks;
they send the same K/V bytes as whole blocks; and ``kv_pieces`` is validated. ``"auto"`` cases: ``ulysses``
with no budget, the cost rule of Note [Ulysses' head groups by default] opened up for these tiny shards
(``GROUPS_MIN_SHARD_TOKENS = 1``, any predicted cost), so it runs 2 head groups: the default's path, exact.
The rings with whole blocks hand the CPU SDPA kernel head-major q/K/V (Note [Head-major blocks]); in pieces
they do not (the negative control)."""

from __future__ import annotations

import pytest
import torch

from lightning_sp import SequenceParallelAttention, gather_sequence, shard_sequence
from tests.distributed.harness import run_on_ranks
from tests.reference import dense_attention

pytestmark = pytest.mark.distributed

N = 37  # divisible by no degree: padding in every layout
DOCS = [0, 10, 11, 30, 37]
CASES = {  # world -> [(backend, causal, (H, H_kv), docs, kv_pieces)]
    2: [
        ("ring", True, (4, 4), False, 3),
        ("zigzag_ring", True, (4, 1), True, 5),
        ("allgather_kv", True, (4, 2), True, 3),  # tiles in its backward; no ring sends
        ("ulysses", True, (8, 4), True, 2),  # 2 head groups (Note [Heads in groups])
        ("ulysses", False, (8, 8), False, 4),  # 4 head groups
        ("ulysses", True, (4, 4), True, "auto"),  # the default without a budget: 2 head groups
        ("ulysses/torch", True, (8, 4), True, 2),  # seq-major gathers (kernel="torch"): each group copied apart
    ],
    4: [
        ("ring", False, (4, 2), True, 4),
        ("zigzag_ring", True, (4, 2), False, 2),
        ("usp", True, (4, 2), False, 3),  # 1 K/V head per Ulysses rank: one head group
        ("usp", True, (8, 4), True, 4),  # 2 head groups, each a ring in pieces
        ("ulysses", True, (8, 8), True, 3),  # 2 head groups (the largest divisor of 2 heads <= 3)
        ("ulysses", False, (8, 2), True, 8),  # K/V heads replicated to 4: one per rank, one group
        ("auto->ulysses", True, (8, 8), True, 2),  # Ulysses on auto's zigzag layout: 2 head groups, reordered
        ("auto->ulysses", False, (16, 8), True, "auto"),  # both defaults: 2 head groups, reordered
    ],
}
HEAD_GROUPS = {(2, "ulysses", 4, 2): 2, (2, "ulysses", 8, 4): 4, (4, "usp", 2, 3): 1, (4, "usp", 4, 4): 2,
               (4, "ulysses", 8, 3): 2, (4, "ulysses", 2, 8): 1, (4, "auto->ulysses", 8, 2): 2,
               (2, "ulysses", 4, "auto"): 2, (4, "auto->ulysses", 8, "auto"): 2, (2, "ulysses/torch", 4, 2): 2}
"""(world, backend, H_kv, kv_pieces) -> head groups (``ulysses``: kernel calls per pass; ``usp``: rounds of all-to-alls)."""


def _tensors(seed, h, h_kv):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(1, N, hh, 8, generator=g, dtype=torch.float64) for hh in (h, h_kv, h_kv, h)]


def _attention(backend, causal, group, pieces):
    """The module for a case; ``"auto->ulysses"``: ``backend="auto"`` (zigzag layout) made to choose Ulysses;
    ``"ulysses/torch"``: Ulysses with ``kernel="torch"``, which takes seq-major gathers."""
    if backend == "ulysses/torch":
        return SequenceParallelAttention(causal=causal, backend="ulysses", kernel="torch", group=group, kv_pieces=pieces)
    if backend != "auto->ulysses":
        return SequenceParallelAttention(causal=causal, backend=backend, group=group, kv_pieces=pieces)
    attn = SequenceParallelAttention(causal=causal, backend="auto", group=group, kv_pieces=pieces)
    attn._resolve_auto = lambda *args: ("ulysses", None)
    return attn


def _rows_adjacent(x) -> bool:
    """``x [B, S, H, D]``: a head's rows are adjacent in memory (head-major, or a row slice of it)."""
    return x.stride(3) == 1 and x.stride(1) == x.size(3)


def _record_kernel_layouts(seen: list, storages: list) -> None:
    """Make the CPU SDPA kernel append, per call, whether its q, k, v came head-major (``_rows_adjacent``) to
    ``seen``, and, per forward call of it or of the ``torch`` kernel, where q's memory is to ``storages``."""
    from lightning_sp.ops.kernels import SDPAKernel, TorchBlockwiseKernel

    torch_forward = TorchBlockwiseKernel.forward

    def blockwise_forward(self, q, k, v, **kw):
        storages.append(q.untyped_storage().data_ptr())
        return torch_forward(self, q, k, v, **kw)

    TorchBlockwiseKernel.forward = blockwise_forward

    fwd, bwd = SDPAKernel._cpu_forward, SDPAKernel._cpu_backward

    def forward(self, q, k, v, **kw):
        seen.append(tuple(_rows_adjacent(t) for t in (q, k, v)))
        storages.append(q.untyped_storage().data_ptr())
        return fwd(self, q, k, v, **kw)

    def backward(self, dout, q, k, v, out, lse, **kw):
        seen.append(tuple(_rows_adjacent(t) for t in (q, k, v)))
        return bwd(self, dout, q, k, v, out, lse, **kw)

    SDPAKernel._cpu_forward, SDPAKernel._cpu_backward = forward, backward


def _worker(rank, world):
    import torch.distributed as dist

    from lightning_sp import choices
    from lightning_sp.ops import ring_attention

    ring_attention.MIN_PIECE_TOKENS = 1  # pieces on a 10-token block
    choices.GROUPS_MIN_SHARD_TOKENS, choices.GROUPS_MAX_PREDICTED_COST = 1, float("inf")  # "auto": head groups here
    group = dist.group.WORLD
    seen = []  # (q, k, v head-major?) per CPU SDPA kernel call
    storages = []  # q's storage per forward kernel call
    _record_kernel_layouts(seen, storages)
    errors = {}
    for i, (backend, causal, (h, h_kv), docs, pieces) in enumerate(CASES[world]):
        del seen[:], storages[:]
        q, k, v, dout = _tensors(i, h, h_kv)
        cu = torch.tensor(DOCS, dtype=torch.int32) if docs else None
        attn = _attention(backend, causal, group, pieces)
        local = [shard_sequence(t, group, layout=attn.layout).requires_grad_(j < 3) for j, t in enumerate((q, k, v, dout))]
        before = attn.comm_stats.calls_by_op.get("all_to_all", 0)
        out = attn(*local[:3], cu_seqlens=cu, seq_len=N)
        forward_all_to_alls = attn.comm_stats.calls_by_op.get("all_to_all", 0) - before
        out.backward(local[3])
        head_major = [all(call) for call in seen]  # per CPU SDPA call: q, k, v all in [B, H, S, D] memory
        group_memory = list(storages)  # q's storage per forward kernel call
        got = [gather_sequence(t, group, layout=attn.layout, seq_len=N) for t in (out.detach(), *(x.grad for x in local[:3]))]
        qd, kd, vd = (t.clone().requires_grad_() for t in (q, k, v))
        ref = dense_attention(qd, kd, vd, causal=causal, cu_seqlens=cu)
        ref_grads = torch.autograd.grad(ref, (qd, kd, vd), dout)
        errs = [float((a - b).abs().max()) for a, b in zip(got, (ref.detach(), *ref_grads))]
        control = float((got[0] - dense_attention(q, k, v, causal=not causal, cu_seqlens=cu)).abs().max())
        # bytes: forward and backward of pieces vs whole blocks (kv_pieces=1), same shards
        sent, layouts = {}, {}
        for p in (pieces, 1):
            a = _attention(backend, causal, group, p)
            x = [t.detach().clone().requires_grad_() for t in local[:3]]
            a(*x, cu_seqlens=cu, seq_len=N)  # warm-up (usp sub-groups)
            a.comm_stats.reset()
            del seen[:]
            a(*x, cu_seqlens=cu, seq_len=N).backward(local[3])
            sent[p], layouts[p] = dict(a.comm_stats.snapshot()), list(seen)
        if backend in ("ring", "zigzag_ring"):  # whole blocks under a memory budget: no head-major copies
            a = SequenceParallelAttention(causal=causal, backend=backend, group=group, kv_pieces=1, memory_budget=1 << 40)
            x = [t.detach().clone().requires_grad_() for t in local[:3]]
            del seen[:]
            a(*x, cu_seqlens=cu, seq_len=N).backward(local[3])
            layouts["budget"] = list(seen)
        ring_world = world // attn.layout.ulysses_degree if backend == "usp" else world
        errors[(backend, causal, h_kv, docs, pieces)] = (errs, control, sent, ring_world, forward_all_to_alls,
                                                         group_memory, head_major, layouts)
    return errors



@pytest.fixture(scope="module", params=[2, 4], ids=lambda w: f"world{w}")
def results(request):
    return request.param, run_on_ranks(_worker, request.param, timeout_s=240, pg_timeout_s=60)


def test_pieces_match_dense_fp64(results):
    world, per_rank = results
    for key, (errs, control, *_) in per_rank[0].items():
        assert max(errs) < 1e-10, f"world={world} {key}: out/dq/dk/dv errors {errs}"
        assert control > 1e-3, f"world={world} {key}: negative control passed ({control})"


def test_pieces_send_the_same_kv_bytes_and_fewer_gradient_bytes(results):
    """K/V bytes equal the neighbour ring's; dK/dV: each of the P-1 other ranks' contributions is sent
    once, straight to its owner (the ring sends the partial sum P times, the last to its owner)."""
    world, per_rank = results
    for rank_result in per_rank:
        for key, (_, _, sent, ring_world, *_) in rank_result.items():
            pieces, whole = sent[key[-1]], sent[1]
            if key[0] in ("ulysses", "auto->ulysses", "ulysses/torch"):  # no ring: the same bytes
                assert pieces == whole, (world, key)
                continue
            if key[3]:  # documents: whole blocks follow the mask (Note [Traffic follows the mask]), never more
                kv = lambda sent: sum(b for op, b in sent.items() if op != "all_to_all")  # noqa: E731
                assert kv(whole) <= kv(pieces), (world, key, whole, pieces)
                assert pieces.get("all_to_all", 0) == whole.get("all_to_all", 0)
                continue
            if key[0] == "allgather_kv":  # no ring: the same bytes
                assert pieces == whole, (world, key)
                continue
            assert pieces["ring_send"] == whole["ring_send"] > 0, (world, key)
            assert pieces["ring_send_grad"] * ring_world == whole["ring_send_grad"] * (ring_world - 1), (world, key)
            assert pieces.get("all_to_all", 0) == whole.get("all_to_all", 0)


def test_ulysses_and_usp_run_in_head_groups(results):
    """``ulysses`` gathers q, k, v whole (3 forward all-to-alls, the output's 1) and attends per head group, each
    group's q in memory of its own (so what a group saves is freed when its backward is done); ``usp`` runs one
    round of all-to-alls per group. Control: with one group, one kernel call on one storage."""
    world, per_rank = results
    for key, (*_, forward_all_to_alls, group_memory, _, _) in per_rank[0].items():
        backend, h_kv, pieces = key[0], key[2], key[-1]
        if backend in ("ulysses", "auto->ulysses", "ulysses/torch"):
            groups = HEAD_GROUPS[(world, backend, h_kv, pieces)]
            assert forward_all_to_alls == 4, (world, key, forward_all_to_alls)
            assert len(set(group_memory)) == groups, (world, key, group_memory)  # a call per group and document
        elif backend == "usp":
            groups = HEAD_GROUPS[(world, backend, h_kv, pieces)]
            assert forward_all_to_alls == 4 * groups, (world, key, forward_all_to_alls)


def test_rings_hand_the_kernel_heads_major_blocks_only_when_whole(results):
    """Note [Head-major blocks]: with whole blocks every CPU SDPA call of ``ring``/``zigzag_ring`` reads q, k, v
    head-major (step 0's own block included); in pieces, or whole under a memory budget, K is read strided."""
    world, per_rank = results
    for rank_result in per_rank:
        for key, (*_, layouts) in rank_result.items():
            if key[0] not in ("ring", "zigzag_ring") or key[3]:  # documents: whole blocks follow the mask, pairwise
                continue
            whole, pieces, budget = layouts[1], layouts[key[-1]], layouts["budget"]
            assert whole and all(all(call) for call in whole), (world, key, whole)
            if key[2] > 1:  # H_kv > 1: [B, S, H_kv, D] rows are not adjacent (with one head, both layouts are)
                assert any(not call[1] for call in pieces), (world, key, pieces)
                # a memory budget's predicted peak does not count the copies: whole blocks stay strided then
                assert budget and not any(call[1] for call in budget), (world, key, budget)


def test_ulysses_hands_the_cpu_kernel_head_major_tensors(results):
    """Ulysses' gathered q, k, v reach the CPU flash op in ``[B, H, S, D]`` memory (dout in ``[B, S, H, D]``), through head
    groups, token reordering and GQA replication (Note [Head-major gather]); control: ``allgather_kv``'s
    shards (``[B, S, H, D]`` memory, H > 1) do not, so the check can fail."""
    world, per_rank = results
    for rank_result in per_rank:
        for key, (*_, head_major, _) in rank_result.items():
            if key[0] in ("ulysses", "auto->ulysses"):
                assert head_major and all(head_major), (world, key, head_major)
            elif key[0] == "allgather_kv":
                assert head_major and not any(head_major), (world, key, head_major)


@pytest.mark.parametrize("bad", [0, -1, 2.0, True, "8"])
def test_kv_pieces_is_validated(bad):
    with pytest.raises(ValueError, match="kv_pieces must be an int >= 1"):
        SequenceParallelAttention(backend="ring", kv_pieces=bad)
