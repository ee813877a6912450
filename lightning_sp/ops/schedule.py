"""What one rank of each backend does for one attention layer's forward + backward, counted from the
code the backends run: kernel calls (``plan_blocks`` on the backend's own runs, pieces and query
chunks), merges, in-place gradient sums, ring steps and messages, collectives. The cost model
(``lightning_sp.cost_model``) times these steps; it never re-derives them, so a change in the plan
or the loops changes the prediction with it.

    steps = rank_schedule("zigzag_ring", seq_len=4096, world=4, rank=0, heads=8, kv_heads=4, head_dim=32,
                          causal=True)
    steps.forward[1].calls      # the kernel calls of ring step 1: [KernelCall(q_len=..., k_len=..., ...)]

Beyond the backend, a layer call on ``P > 1`` ranks starts with ``SequenceParallelAttention``'s
cross-rank check of its inputs (``comm.agree.gather_rows``: one small all-gather), the first forward step.

A ``Step`` is the work between two points where a rank waits for another (a ring step, a
collective): the cost model takes, step by step, the slowest rank (or the cores' share of all
ranks' work when ranks share cores). Element counts are of tensors (tokens x heads x head_dim);
``*_acc`` counts are in the accumulation dtype (``merge.accumulation_dtype``), the others in the
input dtype. Documents (``doc_bounds``) and masks (``lightning_sp/masks.py``: the blocks and K/V rows they skip)
are not modelled; padding is computed like tokens.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from functools import lru_cache

from lightning_sp.layout import SequenceLayout, padded_length, runs_for_ranks
from lightning_sp.ops.backends import head_group_count, kv_head_replication
from lightning_sp.ops.plan import plan_blocks
from lightning_sp.ops.ring_attention import piece_bounds, piece_count, query_chunks, slice_runs

SCHEDULE_BACKENDS = ("local", "ulysses", "ring", "zigzag_ring", "allgather_kv", "usp", "colossal")


@dataclass(frozen=True)
class KernelCall:
    """One ``LocalKernel.forward`` or ``.backward`` call."""

    q_len: int
    k_len: int
    kind: str
    """``"full"``, ``"causal"`` (a square diagonal block) or ``"dense"`` (``plan.MaskKind`` values)."""
    heads: int
    kv_heads: int
    backward: bool


@dataclass
class Step:
    """One rank's work between two waits (see the module docstring)."""

    calls: list[KernelCall] = field(default_factory=list)
    merges: list[int] = field(default_factory=list)
    """Elements of each ``merge_into`` (``[B, q_len, H, D]``)."""
    accumulates: list[int] = field(default_factory=list)
    """Elements of each in-place gradient sum (``dq[...] += dq_c`` etc.)."""
    copies: int = 0
    """Elements copied outside the kernel (``index_select`` reorders, head-group ``cat``, all-to-all
    packing)."""
    overlapped_send: int = 0
    """Elements (input dtype) sent to / received from a peer while this step computes (K/V blocks)."""
    exposed_send_acc: int = 0
    """Elements (accumulation dtype) sent and waited for after this step's compute (dK/dV sums)."""
    messages: int = 0
    """Point-to-point exchanges started in this step (each ``RingComm`` exchange of a tuple is one)."""
    collective: tuple[str, int, int] | None = None
    """``(op, elements per rank, group size)``: ``"all_to_all"`` (elements of the send buffer) or
    ``"all_gather"`` (elements of this rank's input); the step is only that collective."""
    matmuls: list[tuple[int, int, int, int]] = field(default_factory=list)
    """``colossal``: batched matmuls ``(batch, m, n, k)``."""
    elementwise: int = 0
    """``colossal``: elements of score-sized elementwise passes (scale, mask, softmax's parts)."""
    scores: int = 0
    """``colossal``: this step's share of the score elements (``H x S/P x N`` per rank in all, an equal
    share to each of its ``4P`` ring steps) for a per-element calibration of the whole path."""
    score_share: float = 0.0
    """This step's share of ``colossal``'s fixed per-layer time."""


@dataclass
class RankSchedule:
    forward: list[Step]
    backward: list[Step]

    def calls(self) -> list[KernelCall]:
        return [c for s in self.forward + self.backward for c in s.calls]


def backend_layout(backend: str, ulysses_degree: int | None = None) -> SequenceLayout:
    """The layout each backend shards for (as ``attention.layout_for_backend``; ``ulysses``,
    ``ring`` and ``colossal``: contiguous)."""
    if backend in ("zigzag_ring", "allgather_kv"):
        return SequenceLayout("zigzag")
    if backend == "usp":
        return SequenceLayout("zigzag", ulysses_degree=ulysses_degree)
    return SequenceLayout("contiguous")


def rank_schedule(backend: str, *, seq_len: int, world: int, rank: int, heads: int, kv_heads: int, head_dim: int,
                  causal: bool, ulysses_degree: int | None = None, kv_pieces: int = 1,
                  layout: SequenceLayout | None = None) -> RankSchedule:
    """Rank ``rank``'s steps for one layer's fwd+bwd (cached). ``seq_len`` is padded as the layout pads
    it (padding is computed like tokens, as the backends do with their masks); ``kv_pieces`` as ``SequenceParallelAttention(kv_pieces=)`` resolved
    to an int."""
    if backend not in SCHEDULE_BACKENDS:
        raise ValueError(f"backend must be one of {SCHEDULE_BACKENDS}, got {backend!r}")
    layout = layout or backend_layout(backend, ulysses_degree)
    if world > 1 and backend != "local":
        seq_len = padded_length(seq_len, world, layout)  # what the shards hold, padding included
    return _rank_schedule(backend, seq_len, world, rank, heads, kv_heads, head_dim, bool(causal), ulysses_degree,
                          int(kv_pieces), layout)


@lru_cache(maxsize=4096)
def _rank_schedule(backend, n, p, rank, h, hkv, d, causal, u, kv_pieces, layout) -> RankSchedule:
    if p == 1 or backend == "local":
        return _local(n, h, hkv, d, causal)
    sched = _backend_schedule(backend, n, p, rank, h, hkv, d, causal, u, kv_pieces, layout)
    sched.forward.insert(0, Step(collective=("all_gather", 0, p)))  # the cross-rank check (attention.py)
    return sched


def _backend_schedule(backend, n, p, rank, h, hkv, d, causal, u, kv_pieces, layout) -> RankSchedule:
    if backend in ("ring", "zigzag_ring"):
        runs = [runs_for_ranks(layout, p, n, (r,)) for r in range(p)]
        return _ring(runs[rank], runs, rank, p, n // p, h, hkv, d, causal, kv_pieces)
    if backend == "allgather_kv":
        return _allgather_kv(layout, n, p, rank, h, hkv, d, causal, kv_pieces)
    if backend == "ulysses":
        return _ulysses(layout, n, p, h, hkv, d, causal, kv_pieces)
    if backend == "usp":
        return _usp(layout, n, p, rank, u, h, hkv, d, causal, kv_pieces)
    return _colossal(layout, n, p, rank, h, hkv, d, causal)


def _calls(q_runs, k_runs, causal, h, hkv, backward) -> list[KernelCall]:
    return [KernelCall(c.q_len, c.k_len, c.kind.value, h, hkv, backward)
            for c in plan_blocks(q_runs, k_runs, causal=causal)]


def _single_or_merged(q_runs, k_runs, q_len, k_len, causal, h, hkv, d) -> tuple[Step, Step]:
    """``block_attention_forward`` / ``_backward`` without a ring (``_single_call`` or one merged step)."""
    fwd = _calls(q_runs, k_runs, causal, h, hkv, False)
    if len(fwd) == 1 and (fwd[0].q_len, fwd[0].k_len) == (q_len, k_len):
        return Step(calls=fwd), Step(calls=_calls(q_runs, k_runs, causal, h, hkv, True))
    bwd = _calls(q_runs, k_runs, causal, h, hkv, True)
    return (Step(calls=fwd, merges=[c.q_len * h * d for c in fwd]),
            Step(calls=bwd, accumulates=[(c.q_len * h + 2 * c.k_len * hkv) * d for c in bwd]))


def _local(n, h, hkv, d, causal) -> RankSchedule:
    whole = (runs_for_ranks(SequenceLayout("contiguous"), 1, n, (0,)))
    f, b = _single_or_merged(whole, whole, n, n, causal, h, hkv, d)
    return RankSchedule([f], [b])


def _ring(q_runs, runs, rank, p, c, h, hkv, d, causal, kv_pieces) -> RankSchedule:
    """``block_attention_forward/backward`` on a ring of ``p`` (whole blocks or Note [K/V in pieces])."""
    m = piece_count(kv_pieces, c)
    kv = 2 * c * hkv * d  # K and V of one block
    fwd, bwd = [], []
    if m == 1:
        q_chunks = [(0, tuple(q_runs))]
        for t in range(p):
            src = (rank - t) % p
            calls = _calls(q_runs, runs[src], causal, h, hkv, False)
            fwd.append(Step(calls=calls, merges=[x.q_len * h * d for x in calls],
                            overlapped_send=kv if t < p - 1 else 0, messages=int(t < p - 1)))
            bc = [x for _, cr in q_chunks for x in _calls(cr, runs[src], causal, h, hkv, True)]
            bwd.append(Step(calls=bc, accumulates=[(x.q_len * h + 2 * x.k_len * hkv) * d for x in bc],
                            overlapped_send=kv if t < p - 1 else 0, exposed_send_acc=kv,
                            messages=int(t < p - 1) + 1))
        return RankSchedule(fwd, bwd)
    kb = piece_bounds(c, m)
    q_chunks = query_chunks(q_runs, c, m)
    order = [(t, j) for t in range(p) for j in range(m)]
    for i, (t, j) in enumerate(order):
        src = (rank - t) % p
        piece_runs = slice_runs(runs[src], kb[j], kb[j + 1])
        nxt = order[i + 1] if i + 1 < len(order) else None
        sends_next = nxt is not None and nxt[0] > 0  # the next piece is fetched during this one
        next_kv = 2 * (kb[nxt[1] + 1] - kb[nxt[1]]) * hkv * d if sends_next else 0
        calls = _calls(q_runs, piece_runs, causal, h, hkv, False)
        fwd.append(Step(calls=calls, merges=[x.q_len * h * d for x in calls], overlapped_send=next_kv,
                        messages=int(sends_next)))
        bc = [x for _, cr in q_chunks for x in _calls(cr, piece_runs, causal, h, hkv, True)]
        piece = 2 * (kb[j + 1] - kb[j]) * hkv * d
        bwd.append(Step(calls=bc, accumulates=[(x.q_len * h + 2 * x.k_len * hkv) * d for x in bc]
                        + ([piece] if t > 0 else []),
                        overlapped_send=next_kv, exposed_send_acc=piece if t > 0 else 0,
                        messages=int(sends_next) + int(t > 0)))
    return RankSchedule(fwd, bwd)


def _allgather_kv(layout, n, p, rank, h, hkv, d, causal, kv_pieces) -> RankSchedule:
    c = n // p
    q_runs = runs_for_ranks(layout, p, n, (rank,))
    all_runs = runs_for_ranks(layout, p, n, tuple(range(p)))
    gather = [Step(collective=("all_gather", c * hkv * d, p)) for _ in range(2)]  # K, then V
    f, _ = _single_or_merged(q_runs, all_runs, c, n, causal, h, hkv, d)
    bwd = [Step(collective=("all_gather", c * hkv * d, p)) for _ in range(2)]
    m = piece_count(kv_pieces, c)
    kb = piece_bounds(c, m)
    q_chunks = query_chunks(q_runs, c, m)
    for j in range(m):
        piece = 2 * (kb[j + 1] - kb[j]) * hkv * d
        for step in range(p):
            chunk = (rank - step - 1) % p
            k_runs = slice_runs(runs_for_ranks(layout, p, n, (chunk,)), kb[j], kb[j + 1])
            bc = [x for _, cr in q_chunks for x in _calls(cr, k_runs, causal, h, hkv, True)]
            bwd.append(Step(calls=bc, accumulates=[(x.q_len * h + 2 * x.k_len * hkv) * d for x in bc],
                            exposed_send_acc=piece if step < p - 1 else 0, messages=int(step < p - 1)))
    return RankSchedule(gather + [f], bwd)


def _head_groups(kv_pieces, kv_heads_per_rank, shard_len) -> int:
    return head_group_count(kv_pieces, kv_heads_per_rank, shard_len)


def _replicated_kv_heads(h, hkv, degree) -> int:
    """K/V heads after ``backends.kv_head_replication`` for an all-to-all over ``degree`` ranks."""
    return hkv * kv_head_replication(h, hkv, degree)


def _all_to_alls(c, heads_each, d, g) -> list[Step]:
    """One all-to-all per tensor of ``heads_each`` heads: ``[B, c, H', D]`` send buffers (packing copies)."""
    return [Step(collective=("all_to_all", c * hh * d, g), copies=2 * c * hh * d) for hh in heads_each]


def _ulysses(layout, n, p, h, hkv, d, causal, kv_pieces) -> RankSchedule:
    c = n // p
    hkv_r = _replicated_kv_heads(h, hkv, p)
    groups = _head_groups(kv_pieces, hkv_r // p, c)
    runs = runs_for_ranks(layout, p, n, tuple(range(p)))
    whole = runs_for_ranks(SequenceLayout("contiguous"), 1, n, (0,))
    # q, k, v gathered whole, then one kernel call per head group (Note [Heads in groups])
    f_attn, b_attn = _single_or_merged(whole, whole, n, n, causal, h // groups // p, hkv_r // groups // p, d)
    if len(runs) > 1:  # the gathers reorder q, k, v and back (and the same in backward): each group its share
        reorder = (n * (h + 2 * hkv_r) // p * d + n * h // p * d) // groups
        f_attn.copies += reorder
        b_attn.copies += reorder
    fwd = _all_to_alls(c, (h, hkv_r, hkv_r), d, p) + [f_attn] * groups + _all_to_alls(c, (h,), d, p)
    bwd = _all_to_alls(c, (h,), d, p) + [b_attn] * groups + _all_to_alls(c, (h, hkv_r, hkv_r), d, p)
    return RankSchedule(fwd, bwd)


def _usp(layout, n, p, rank, u, h, hkv, d, causal, kv_pieces) -> RankSchedule:
    if u is None or p % u:
        raise ValueError(f"usp needs ulysses_degree dividing world={p}, got {u}")
    r = p // u
    c = n // p
    ring_runs = [runs_for_ranks(layout, p, n, tuple(range(i * u, (i + 1) * u))) for i in range(r)]
    ring_rank = rank // u
    if u == 1:
        return _ring(ring_runs[ring_rank], ring_runs, ring_rank, r, n // r, h, hkv, d, causal, kv_pieces)
    hkv_r = _replicated_kv_heads(h, hkv, u)
    groups = _head_groups(kv_pieces, hkv_r // u, c)
    hg, kg = h // groups, hkv_r // groups
    inner = _ring(ring_runs[ring_rank], ring_runs, ring_rank, r, n // r, hg // u, kg // u, d, causal, kv_pieces)
    fwd, bwd = [], []
    for _ in range(groups):
        fwd += _all_to_alls(c, (hg, kg, kg), d, u) + inner.forward + _all_to_alls(c, (hg,), d, u)
        bwd += _all_to_alls(c, (hg,), d, u) + inner.backward + _all_to_alls(c, (hg, kg, kg), d, u)
    if groups > 1:
        fwd.append(Step(copies=c * h * d))
    return RankSchedule(fwd, bwd)


def _colossal(layout, n, p, rank, h, hkv, d, causal) -> RankSchedule:
    """``ops/colossal.py``: RingQK, softmax over ``[B, H, c, N]``, RingAV; backward ring V then ring K."""
    c = n // p
    blk = h * c * c  # one [B, H, c, c] score block
    kb = c * hkv * d
    share = dict(scores=blk // 4, score_share=1 / (4 * p))

    def ring(matmuls, elementwise, grads):
        return [Step(matmuls=matmuls, elementwise=elementwise, overlapped_send=kb if t < p - 1 else 0,
                     exposed_send_acc=kb if grads else 0, messages=int(t < p - 1) + int(grads), **share)
                for t in range(p)]

    fwd = ring([(h, c, c, d)], 3 * blk, False)  # QK^T, scale, masked_fill (+ the mask)
    fwd.append(Step(elementwise=3 * p * blk))  # softmax over the whole rows
    fwd += ring([(h, c, d, c)], h * c * d, False)  # out += P V
    # backward: ring V (dP block, dV block), softmax backward, ring K (dQ, dK block); grads travel behind
    bwd = ring([(h, c, c, d), (h, c, d, c)], 0, True)
    bwd.append(Step(elementwise=4 * p * blk))
    bwd += ring([(h, c, d, c), (h, c, d, c)], 2 * h * c * d, True)
    return RankSchedule(fwd, bwd)
