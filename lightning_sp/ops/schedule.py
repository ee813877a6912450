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
input dtype. Without a mask or documents, padding is computed like tokens. With ``mask=`` (an ``AttentionMask``)
or ``doc_bounds=`` (packed documents) the schedule is the masked one (Note [Schedules under a mask]).

Note [Schedules under a mask]
    ``rank_schedule(..., mask=, doc_bounds=)`` resolves the mask as ``SequenceParallelAttention`` does
    (``resolve_masking``: padding a document of its own, ``AttentionMask.structured`` on the padded length, the K/V
    traffic following the mask for documents, windows, spans and chunks) and plans every call with
    ``plan_blocks(..., mask=)``: the blocks the mask leaves empty are not called, partial tiles are DENSE calls.
    Where the traffic follows the mask (rings, ``allgather_kv`` and ``usp``'s ring, whole K/V blocks) each step
    is the pairwise exchange of ``ops/ring_attention.py`` (Note [Traffic follows the mask]): rank ``r`` sends at
    step ``t`` the rows ``kv_rows_needed(r + t, r)`` of its block and receives ``kv_rows_needed(r, r - t)``, from
    the library's own function on the same runs, and in backward sends each step's dK/dV contribution back
    over the same rows. So the bytes are counted, not re-derived: a sliding window's rows, a document that
    never leaves its shard (nothing), whole or in pieces. Ulysses' all-to-alls and the plain all-gather move every row
    whatever the mask; only their kernel calls shrink.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from functools import lru_cache

from lightning_sp.layout import SequenceLayout, padded_length, runs_for_ranks
from lightning_sp.masks import AttentionMask, StructuredMask
from lightning_sp.ops.backends import head_group_count, kv_head_replication
from lightning_sp.ops.plan import plan_blocks
from lightning_sp.ops.ring_attention import piece_bounds, piece_count, query_chunks, rows_needed, slice_runs

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
    overlapped_recv: int = 0
    """Elements received meanwhile when they differ from those sent (a ring that follows the mask); else 0."""
    exposed_send_acc: int = 0
    """Elements (accumulation dtype) sent and waited for after this step's compute (dK/dV sums)."""
    exposed_recv_acc: int = 0
    """Elements (accumulation dtype) received and waited for, when they differ from those sent; else 0."""
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


@dataclass(frozen=True)
class Masking:
    """How a call is masked, as ``SequenceParallelAttention`` resolves it (``resolve_masking``)."""

    doc_bounds: tuple[int, ...] | None = None
    """Global document bounds on the padded sequence (padding a document of its own)."""
    mask: StructuredMask | None = None
    """The structured mask the plans use (``None``: ``causal`` and ``doc_bounds``)."""
    follow: bool = False
    """Whether rings and ``allgather_kv`` exchange only the rows the mask lets each rank see."""


NO_MASKING = Masking()


def resolve_masking(mask: AttentionMask | None, doc_bounds, *, causal: bool, seq_len: int,
                    padded_len: int) -> Masking:
    """``mask`` and the documents' global bounds ``doc_bounds`` (``[0, ..., seq_len]``, as ``cu_seqlens``; ``None``:
    one sequence) as ``SequenceParallelAttention`` resolves them for a ``padded_len``-position sequence (its
    ``_doc_bounds`` and ``_mask_fields``; a test keeps the two equal). ``NO_MASKING`` when both are ``None``."""
    if mask is not None and mask.signature() == AttentionMask().signature():
        mask = None  # an empty mask is no mask (as the module drops it)
    if mask is None and doc_bounds is None:
        return NO_MASKING
    if doc_bounds is not None:
        bounds = tuple(int(b) for b in doc_bounds)
        if bounds[0] != 0 or bounds[-1] != seq_len or any(b < a for a, b in zip(bounds, bounds[1:])):
            raise ValueError(f"doc_bounds must run from 0 to seq_len={seq_len} without decreasing, as cu_seqlens; "
                             f"got {list(bounds[:8])}{'...' if len(bounds) > 8 else ''}")
        docs = bounds + ((padded_len,) if seq_len < padded_len else ())
    else:
        docs = None if seq_len == padded_len else (0, seq_len, padded_len)
    if mask is None:
        return Masking(doc_bounds=docs, mask=None, follow=True)
    structured = mask.structured(causal=causal, doc_bounds=docs, padded_len=padded_len)
    follow = doc_bounds is not None or not structured.is_plain() or mask.chunk_size is not None
    return Masking(doc_bounds=docs, mask=structured, follow=follow)


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
                  layout: SequenceLayout | None = None, mask: AttentionMask | None = None,
                  doc_bounds=None) -> RankSchedule:
    """Rank ``rank``'s steps for one layer's fwd+bwd (cached). ``seq_len`` is padded as the layout pads
    it (padding is computed like tokens, as the backends do with their masks); ``kv_pieces`` as ``SequenceParallelAttention(kv_pieces=)`` resolved
    to an int. ``mask``, ``doc_bounds`` (``cu_seqlens``' values): Note [Schedules under a mask]."""
    if backend not in SCHEDULE_BACKENDS:
        raise ValueError(f"backend must be one of {SCHEDULE_BACKENDS}, got {backend!r}")
    layout = layout or backend_layout(backend, ulysses_degree)
    padded = padded_length(seq_len, world, layout) if world > 1 and backend != "local" else seq_len
    masking = resolve_masking(mask, doc_bounds, causal=bool(causal), seq_len=seq_len, padded_len=padded)
    return _rank_schedule(backend, padded, world, rank, heads, kv_heads, head_dim, bool(causal), ulysses_degree,
                          int(kv_pieces), layout, masking)


@lru_cache(maxsize=4096)
def _rank_schedule(backend, n, p, rank, h, hkv, d, causal, u, kv_pieces, layout, masking=NO_MASKING) -> RankSchedule:
    if p == 1 or backend == "local":
        return _local(n, h, hkv, d, causal, masking)
    sched = _backend_schedule(backend, n, p, rank, h, hkv, d, causal, u, kv_pieces, layout, masking)
    sched.forward.insert(0, Step(collective=("all_gather", 0, p)))  # the cross-rank check (attention.py)
    return sched


def _backend_schedule(backend, n, p, rank, h, hkv, d, causal, u, kv_pieces, layout, masking) -> RankSchedule:
    if backend in ("ring", "zigzag_ring"):
        runs = [runs_for_ranks(layout, p, n, (r,)) for r in range(p)]
        return _ring(runs[rank], runs, rank, p, n // p, h, hkv, d, causal, kv_pieces, masking)
    if backend == "allgather_kv":
        if masking.follow:  # the rings' pairwise exchange, in pieces too (backends.py)
            runs = [runs_for_ranks(layout, p, n, (r,)) for r in range(p)]
            return _ring(runs[rank], runs, rank, p, n // p, h, hkv, d, causal, kv_pieces, masking)
        return _allgather_kv(layout, n, p, rank, h, hkv, d, causal, kv_pieces, masking)
    if backend == "ulysses":
        return _ulysses(layout, n, p, h, hkv, d, causal, kv_pieces, masking)
    if backend == "usp":
        return _usp(layout, n, p, rank, u, h, hkv, d, causal, kv_pieces, masking)
    return _colossal(layout, n, p, rank, h, hkv, d, causal)


def _calls(q_runs, k_runs, causal, h, hkv, backward, masking=NO_MASKING) -> list[KernelCall]:
    return [KernelCall(c.q_len, c.k_len, c.kind.value, h, hkv, backward)
            for c in plan_blocks(q_runs, k_runs, causal=causal, doc_bounds=masking.doc_bounds, mask=masking.mask)]


def _single_or_merged(q_runs, k_runs, q_len, k_len, causal, h, hkv, d, masking=NO_MASKING) -> tuple[Step, Step]:
    """``block_attention_forward`` / ``_backward`` without a ring (``_single_call`` or one merged step)."""
    fwd = _calls(q_runs, k_runs, causal, h, hkv, False, masking)
    if len(fwd) == 1 and (fwd[0].q_len, fwd[0].k_len) == (q_len, k_len):
        return Step(calls=fwd), Step(calls=_calls(q_runs, k_runs, causal, h, hkv, True, masking))
    bwd = _calls(q_runs, k_runs, causal, h, hkv, True, masking)
    return (Step(calls=fwd, merges=[c.q_len * h * d for c in fwd]),
            Step(calls=bwd, accumulates=[(c.q_len * h + 2 * c.k_len * hkv) * d for c in bwd]))


def _local(n, h, hkv, d, causal, masking=NO_MASKING) -> RankSchedule:
    whole = (runs_for_ranks(SequenceLayout("contiguous"), 1, n, (0,)))
    f, b = _single_or_merged(whole, whole, n, n, causal, h, hkv, d, masking)
    return RankSchedule([f], [b])


def _ring(q_runs, runs, rank, p, c, h, hkv, d, causal, kv_pieces, masking=NO_MASKING) -> RankSchedule:
    """``block_attention_forward/backward`` on a ring of ``p`` (whole blocks or Note [K/V in pieces])."""
    m = piece_count(kv_pieces, c)
    kv = 2 * c * hkv * d  # K and V of one block
    fwd, bwd = [], []
    if masking.follow:
        return _selective_ring(q_runs, runs, rank, p, c, h, hkv, d, causal, masking, m)
    if m == 1:
        q_chunks = [(0, tuple(q_runs))]
        for t in range(p):
            src = (rank - t) % p
            calls = _calls(q_runs, runs[src], causal, h, hkv, False, masking)
            fwd.append(Step(calls=calls, merges=[x.q_len * h * d for x in calls],
                            overlapped_send=kv if t < p - 1 else 0, messages=int(t < p - 1)))
            bc = [x for _, cr in q_chunks for x in _calls(cr, runs[src], causal, h, hkv, True, masking)]
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
        calls = _calls(q_runs, piece_runs, causal, h, hkv, False, masking)
        fwd.append(Step(calls=calls, merges=[x.q_len * h * d for x in calls], overlapped_send=next_kv,
                        messages=int(sends_next)))
        bc = [x for _, cr in q_chunks for x in _calls(cr, piece_runs, causal, h, hkv, True, masking)]
        piece = 2 * (kb[j + 1] - kb[j]) * hkv * d
        bwd.append(Step(calls=bc, accumulates=[(x.q_len * h + 2 * x.k_len * hkv) * d for x in bc]
                        + ([piece] if t > 0 else []),
                        overlapped_send=next_kv, exposed_send_acc=piece if t > 0 else 0,
                        messages=int(sends_next) + int(t > 0)))
    return RankSchedule(fwd, bwd)


def _selective_ring(q_runs, runs, rank, p, c, h, hkv, d, causal, masking, pieces: int = 1) -> RankSchedule:
    """The ring that follows the mask (Note [Traffic follows the mask] in ``ops/ring_attention.py``): at step
    ``t`` the rows of ``rank - t``'s block this rank's queries see, exchanged pairwise, the next exchange in
    flight meanwhile; in backward each step's dK/dV contribution goes straight back to its owner. In ``pieces``
    (Note [K/V in pieces]) the same per piece (``piece_rows_needed``: the needed rows cut to the piece), every
    piece of step ``t`` before step ``t + 1``, the queries in ``pieces`` chunks in backward."""
    row = 2 * hkv * d  # K and V of one row
    kb = piece_bounds(c, pieces)
    q_chunks = query_chunks(q_runs, c, pieces)

    def need(dst, src, j):  # the library's own rows (ring_attention.piece_rows_needed)
        return rows_needed(runs[dst % p], runs[src % p], causal=causal, doc_bounds=masking.doc_bounds,
                           mask=masking.mask, piece=(kb[j], kb[j + 1]))

    def length(rows):
        return 0 if rows is None else rows[1] - rows[0]

    fwd, bwd = [], []
    order = [(t, j) for t in range(p) for j in range(pieces)]
    for i, (t, j) in enumerate(order):
        src = (rank - t) % p
        rows = (kb[j], kb[j + 1]) if t == 0 else need(rank, src, j)
        k_runs = None if rows is None else slice_runs(runs[src], *rows)
        calls = [] if k_runs is None else _calls(q_runs, k_runs, causal, h, hkv, False, masking)
        bcalls = [] if k_runs is None else [x for _, cr in q_chunks for x in _calls(cr, k_runs, causal, h, hkv, True,
                                                                                     masking)]
        sent = got = 0
        nxt = order[i + 1] if i + 1 < len(order) else None
        if nxt is not None and nxt[0] > 0:  # the next piece's exchange, in flight during this one
            sent, got = length(need(rank + nxt[0], rank, nxt[1])), length(need(rank, rank - nxt[0], nxt[1]))
        kv = dict(overlapped_send=sent * row, overlapped_recv=got * row, messages=int(bool(sent or got)))
        fwd.append(Step(calls=calls, merges=[x.q_len * h * d for x in calls], **kv))
        acc = [(x.q_len * h + 2 * x.k_len * hkv) * d for x in bcalls]
        grad = {}
        if t > 0:  # this piece's contribution back to `src`; the one for this rank's rows from `rank + t`
            back, mine = length(rows), length(need(rank + t, rank, j))
            acc += [mine * row] if mine else []
            grad = dict(exposed_send_acc=back * row, exposed_recv_acc=mine * row)
            kv["messages"] += int(bool(back or mine))
        bwd.append(Step(calls=bcalls, accumulates=acc, **kv, **grad))
    return RankSchedule(fwd, bwd)


def _allgather_kv(layout, n, p, rank, h, hkv, d, causal, kv_pieces, masking=NO_MASKING) -> RankSchedule:
    c = n // p
    q_runs = runs_for_ranks(layout, p, n, (rank,))
    all_runs = runs_for_ranks(layout, p, n, tuple(range(p)))
    gather = [Step(collective=("all_gather", c * hkv * d, p)) for _ in range(2)]  # K, then V
    f, _ = _single_or_merged(q_runs, all_runs, c, n, causal, h, hkv, d, masking)
    bwd = [Step(collective=("all_gather", c * hkv * d, p)) for _ in range(2)]
    m = piece_count(kv_pieces, c)
    kb = piece_bounds(c, m)
    q_chunks = query_chunks(q_runs, c, m)
    for j in range(m):
        piece = 2 * (kb[j + 1] - kb[j]) * hkv * d
        for step in range(p):
            chunk = (rank - step - 1) % p
            k_runs = slice_runs(runs_for_ranks(layout, p, n, (chunk,)), kb[j], kb[j + 1])
            bc = [x for _, cr in q_chunks for x in _calls(cr, k_runs, causal, h, hkv, True, masking)]
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


def _ulysses(layout, n, p, h, hkv, d, causal, kv_pieces, masking=NO_MASKING) -> RankSchedule:
    c = n // p
    hkv_r = _replicated_kv_heads(h, hkv, p)
    groups = _head_groups(kv_pieces, hkv_r // p, c)
    runs = runs_for_ranks(layout, p, n, tuple(range(p)))
    whole = runs_for_ranks(SequenceLayout("contiguous"), 1, n, (0,))
    # q, k, v gathered whole, then one kernel call per head group (Note [Heads in groups])
    f_attn, b_attn = _single_or_merged(whole, whole, n, n, causal, h // groups // p, hkv_r // groups // p, d, masking)
    if len(runs) > 1:  # the gathers reorder q, k, v and back (and the same in backward): each group its share
        reorder = (n * (h + 2 * hkv_r) // p * d + n * h // p * d) // groups
        f_attn.copies += reorder
        b_attn.copies += reorder
    fwd = _all_to_alls(c, (h, hkv_r, hkv_r), d, p) + [f_attn] * groups + _all_to_alls(c, (h,), d, p)
    bwd = _all_to_alls(c, (h,), d, p) + [b_attn] * groups + _all_to_alls(c, (h, hkv_r, hkv_r), d, p)
    return RankSchedule(fwd, bwd)


def _usp(layout, n, p, rank, u, h, hkv, d, causal, kv_pieces, masking=NO_MASKING) -> RankSchedule:
    if u is None or p % u:
        raise ValueError(f"usp needs ulysses_degree dividing world={p}, got {u}")
    r = p // u
    c = n // p
    ring_runs = [runs_for_ranks(layout, p, n, tuple(range(i * u, (i + 1) * u))) for i in range(r)]
    ring_rank = rank // u
    if u == 1:
        return _ring(ring_runs[ring_rank], ring_runs, ring_rank, r, n // r, h, hkv, d, causal, kv_pieces, masking)
    hkv_r = _replicated_kv_heads(h, hkv, u)
    groups = _head_groups(kv_pieces, hkv_r // u, c)
    hg, kg = h // groups, hkv_r // groups
    inner = _ring(ring_runs[ring_rank], ring_runs, ring_rank, r, n // r, hg // u, kg // u, d, causal, kv_pieces,
                  masking)
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
