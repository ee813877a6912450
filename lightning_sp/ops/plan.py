r"""Which (query slice, key slice, mask) kernel calls one block of attention needs.

Every backend reduces to "these local queries attend to these local keys", where both sides are
described by their global positions as ``Run``s. ``plan_blocks`` turns that into the fewest kernel
calls, each with a mask the fast kernels understand:

- ``FULL``: every query sees every key (keys strictly before the queries, or bidirectional);
- ``CAUSAL``: a square diagonal block, key ``j`` visible to query ``i`` iff ``j <= i``;
- ``DENSE``: anything else, as an explicit boolean mask. ``plan_blocks`` never needs it: queries
  are split at document boundaries, and a diagonal whose keys cover only part of the queries (a
  K/V piece, a query chunk) becomes a CAUSAL square plus a FULL rectangle below it (the queries
  before the keys see none of them). The kernels still accept it.

Blocks no query can see (keys after every query under a causal mask, other documents, padding) are
never computed: this is how zigzag and causal rings skip fully masked work.

Documents: ``doc_bounds`` is the sorted list ``[0, l1, l1+l2, ..., N, (N_pad)]`` of global document
boundaries (padding, if any, is a last document of its own so no real token attends to it).

Note [One causal call for a rank's own block]
    Zigzag gives rank ``r`` chunks ``r`` and ``2P-1-r``; attending causally to its own block the plan
    would make three calls (diagonal of each chunk, and the later chunk's queries over the earlier
    chunk's keys, FULL), all merged::

        keys ->   c_r   c_2P-1-r                 keys ->  c_r  c_2P-1-r
        c_r       \                       ==     c_r      \
        c_2P-1-r  FULL  \                        c_2P-1-r  \ \   (one CAUSAL square)

    Because both sides are the same tokens in increasing global order, "key position <= query
    position" is "local key row <= local query row": one CAUSAL call on the whole block computes
    exactly those pairs (the same ``n^2/2`` pairs, no skipped work), with no merge. Any run list
    that is the same on both sides, increasing, starting at local row 0 and inside one document
    qualifies (the contiguous layout's single run trivially).

    The keys may hold more than the rank's own block: ``allgather_kv`` attends to every rank's
    block at once, gathered in rank order, so its own block sits at rows ``[r n, (r + 1) n)`` of
    the keys. The rule is the same there: the key runs that repeat the query runs, consecutive and
    shifted by one local offset, are one CAUSAL call; the other key runs are planned as usual (and
    their FULL calls coalesced). At P = 2 the zigzag forward of ``allgather_kv`` went from four
    calls, a zero-filled ``out`` and four merges to two calls and one merge over half the rows
    (the first call covers every query: Note [First write assigns] in ``ops/ring_attention.py``).

Note [Plans under a mask]
    With an ``AttentionMask`` (windows, bidirectional spans, chunks, score modifiers: ``lightning_sp/masks.py``)
    ``plan_blocks(..., mask=)`` plans each (query piece, key piece) pair, both cut at the mask's
    ``split_points`` and the keys trimmed to the queries' ``key_hull``, by its block class: EMPTY pairs are
    skipped, FULL and square CAUSAL ones are one call, a pair that only causality cuts gets the causal
    decomposition above, and any other PARTIAL pair is halved along its longer side (at a multiple of
    ``MASK_TILE`` global positions) until it is classified or at most ``MASK_TILE x MASK_TILE``, which runs as a
    DENSE call (its boolean mask from ``StructuredMask.visible``). Every call covers globally contiguous
    queries and keys (no multi-run CAUSAL call), so a score modifier knows each element's global position.

Plans are cached: the same (runs, bounds, causal) recur at every layer and step, so ``plan_blocks``
computes a plan once (keyed on the runs and bounds as tuples; lists are accepted) and afterwards only
copies the cached list. ``plan_cache_info()`` reports hits and misses.
"""

from __future__ import annotations

import bisect
from dataclasses import dataclass
from enum import Enum
from functools import lru_cache

import torch

from lightning_sp.layout import Run
from lightning_sp.masks import BlockClass, StructuredMask

MASK_TILE = 128
"""The smallest partial block a masked plan computes with a DENSE mask (Note [Plans under a mask])."""


class MaskKind(Enum):
    FULL = "full"
    CAUSAL = "causal"
    DENSE = "dense"


@dataclass(frozen=True)
class BlockCall:
    q_start: int  # local offset into the queries
    q_len: int
    k_start: int  # local offset into the keys
    k_len: int
    kind: MaskKind
    q_global: int  # global position of the first query / key (for DENSE masks)
    k_global: int

    def dense_mask(self, causal: bool, doc_bounds: list[int] | None, device=None) -> torch.Tensor:
        """``[q_len, k_len]`` bool, True = visible."""
        qpos = torch.arange(self.q_global, self.q_global + self.q_len, device=device)
        kpos = torch.arange(self.k_global, self.k_global + self.k_len, device=device)
        return visibility(qpos, kpos, causal=causal, doc_bounds=doc_bounds)


def visibility(qpos: torch.Tensor, kpos: torch.Tensor, *, causal: bool, doc_bounds: list[int] | None) -> torch.Tensor:
    """``[Sq, Sk]`` bool from global positions: same document and (if causal) key not after query."""
    visible = torch.ones(qpos.numel(), kpos.numel(), dtype=torch.bool, device=qpos.device)
    if causal:
        visible &= kpos[None, :] <= qpos[:, None]
    if doc_bounds is not None:
        bounds = torch.tensor(doc_bounds, device=qpos.device)
        qdoc = torch.bucketize(qpos, bounds, right=True)
        kdoc = torch.bucketize(kpos, bounds, right=True)
        visible &= qdoc[:, None] == kdoc[None, :]
    return visible


def _split_at_docs(run: Run, doc_bounds: list[int] | None) -> list[Run]:
    """Cut ``run`` where a document ends, so that every piece lies inside one document."""
    if doc_bounds is None:
        return [run]
    pieces, start = [], run.global_start
    while start < run.global_end:
        j = bisect.bisect_right(doc_bounds, start)
        stop = min(run.global_end, doc_bounds[j]) if j < len(doc_bounds) else run.global_end
        pieces.append(Run(run.local_start + start - run.global_start, start, stop - start))
        start = stop
    return pieces


def _sub_run(run: Run, start: int, stop: int) -> Run:
    """The part of ``run`` at global positions ``[start, stop)``."""
    return Run(run.local_start + start - run.global_start, start, stop - start)


def plan_blocks(
    q_runs: "list[Run] | tuple[Run, ...]",
    k_runs: "list[Run] | tuple[Run, ...]",
    *,
    causal: bool,
    doc_bounds: "list[int] | tuple[int, ...] | None" = None,
    mask: StructuredMask | None = None,
) -> list[BlockCall]:
    """Kernel calls so that each query attends exactly to its visible keys among ``k_runs``.
    Cached on ``(q_runs, k_runs, causal, doc_bounds)``; returns a fresh list each call. ``mask``: plan under
    it instead (it carries its own causality and documents; Note [Plans under a mask])."""
    if mask is not None:
        return list(_plan_masked_cached(tuple(q_runs), tuple(k_runs), mask))
    bounds = None if doc_bounds is None else tuple(int(b) for b in doc_bounds)
    return list(_plan_blocks_cached(tuple(q_runs), tuple(k_runs), bool(causal), bounds))


def plan_cache_info():
    """``functools`` cache statistics of ``plan_blocks`` (hits, misses, maxsize, currsize)."""
    return _plan_blocks_cached.cache_info()


def _own_block_in_keys(q_runs: tuple[Run, ...], k_runs: tuple[Run, ...], doc_bounds) -> tuple[int, int] | None:
    """Where the queries' own tokens sit among the keys, when one CAUSAL call can attend to them all
    (Note [One causal call for a rank's own block]): ``(i, offset)`` with ``k_runs[i : i + len(q_runs)]``
    the query runs in the same order, their local rows shifted by ``offset``; ``None`` otherwise. The
    queries must be stored in increasing global order from local row 0 and lie inside one document:
    the visibility is then exactly ``local key row - offset <= local query row``."""
    m = len(q_runs)
    if not q_runs or len(k_runs) < m:
        return None
    local = 0
    for j, r in enumerate(q_runs):
        if r.local_start != local or (j and r.global_start < q_runs[j - 1].global_end):
            return None
        local += r.length
    if doc_bounds is not None:  # one document: the first token's document ends after the last token
        d = bisect.bisect_right(doc_bounds, q_runs[0].global_start)
        if d < len(doc_bounds) and doc_bounds[d] < q_runs[-1].global_end:
            return None
    for i in range(len(k_runs) - m + 1):
        offset = k_runs[i].local_start
        if all((k.global_start, k.length, k.local_start) == (q.global_start, q.length, q.local_start + offset)
               for q, k in zip(q_runs, k_runs[i:i + m])):
            return i, offset
    return None


@lru_cache(maxsize=4096)
def _plan_blocks_cached(
    q_runs: tuple[Run, ...], k_runs: tuple[Run, ...], causal: bool, doc_bounds: tuple[int, ...] | None
) -> tuple[BlockCall, ...]:
    own = _own_block_in_keys(q_runs, k_runs, doc_bounds) if causal else None
    if own is None:
        return tuple(_coalesce(_plan_runs(q_runs, k_runs, causal, doc_bounds)))
    i, offset = own  # one CAUSAL call for the queries' own tokens; the other keys planned as usual
    n, g0 = sum(r.length for r in q_runs), q_runs[0].global_start
    others = k_runs[:i] + k_runs[i + len(q_runs):]
    return (BlockCall(0, n, offset, n, MaskKind.CAUSAL, g0, g0), *_coalesce(_plan_runs(q_runs, others, causal, doc_bounds)))


def _plan_runs(q_runs, k_runs, causal: bool, doc_bounds) -> list[BlockCall]:
    """A call per visible (query run, key run) pair, split at documents; under a causal mask a key run
    inside the queries' range is a CAUSAL square and the FULL rectangle below it."""
    calls: list[BlockCall] = []
    for q_run in q_runs:
        for q in _split_at_docs(q_run, doc_bounds):  # each piece lies inside one document
            qs, qe = q.global_start, q.global_end
            if doc_bounds is not None:
                i = bisect.bisect_right(doc_bounds, qs) - 1
                lo, doc_end = doc_bounds[i], doc_bounds[i + 1]
            else:
                lo, doc_end = 0, None
            hi = qe if causal else doc_end  # keys in [lo, hi) may be visible
            for k in k_runs:
                a0 = max(k.global_start, lo)
                a1 = k.global_end if hi is None else min(k.global_end, hi)
                if a0 >= a1:
                    continue  # nothing visible: skipped, never computed
                pieces = []
                if causal:
                    if a0 < qs:  # keys before every query: fully visible
                        pieces.append((a0, min(a1, qs), MaskKind.FULL, q))
                    d0, d1 = max(a0, qs), a1  # keys inside the query range (d1 <= qe): the diagonal
                    if d0 < d1:  # queries before d0 see none of these keys: skipped
                        pieces.append((d0, d1, MaskKind.CAUSAL, _sub_run(q, d0, d1)))
                        if d1 < qe:  # queries after the keys see them all
                            pieces.append((d0, d1, MaskKind.FULL, _sub_run(q, d1, qe)))
                else:
                    pieces.append((a0, a1, MaskKind.FULL, q))
                for k0, k1, kind, qq in pieces:
                    calls.append(
                        BlockCall(
                            q_start=qq.local_start, q_len=qq.length,
                            k_start=k.local_start + k0 - k.global_start, k_len=k1 - k0,
                            kind=kind, q_global=qq.global_start, k_global=k0,
                        )
                    )
    return calls


def _coalesce(calls: list[BlockCall], contiguous: bool = False) -> list[BlockCall]:
    """Merge FULL calls that share a key slice and have adjacent query slices (and vice versa). ``contiguous``:
    only where the merged slices are also adjacent in global positions (masked plans: Note [Plans under a mask])."""
    if len(calls) < 2:
        return calls
    merged = True
    while merged:
        merged = False
        out: list[BlockCall] = []
        for c in sorted(calls, key=lambda c: (c.kind.value, c.k_start, c.k_len, c.q_start, c.q_len)):
            p = out[-1] if out else None
            if (
                p is not None and p.kind is MaskKind.FULL and c.kind is MaskKind.FULL
                and (p.k_start, p.k_len) == (c.k_start, c.k_len) and p.q_start + p.q_len == c.q_start
                and (not contiguous or p.q_global + p.q_len == c.q_global)
            ):
                out[-1] = BlockCall(p.q_start, p.q_len + c.q_len, p.k_start, p.k_len, MaskKind.FULL, p.q_global, p.k_global)
                merged = True
            else:
                out.append(c)
        calls = out
        out = []
        for c in sorted(calls, key=lambda c: (c.kind.value, c.q_start, c.q_len, c.k_start, c.k_len)):
            p = out[-1] if out else None
            if (
                p is not None and p.kind is MaskKind.FULL and c.kind is MaskKind.FULL
                and (p.q_start, p.q_len) == (c.q_start, c.q_len) and p.k_start + p.k_len == c.k_start
                and (not contiguous or p.k_global + p.k_len == c.k_global)
            ):
                out[-1] = BlockCall(p.q_start, p.q_len, p.k_start, p.k_len + c.k_len, MaskKind.FULL, p.q_global, p.k_global)
                merged = True
            else:
                out.append(c)
        calls = out
    return calls


# ----------------------------------------------------------------------------------------------
# plans under a mask (Note [Plans under a mask])
# ----------------------------------------------------------------------------------------------


def _split_at(run: Run, points: tuple[int, ...]) -> list[Run]:
    """``run`` cut at every global position of ``points`` inside it."""
    pieces, start = [], run.global_start
    i = bisect.bisect_right(points, start)
    while start < run.global_end:
        stop = min(run.global_end, points[i]) if i < len(points) else run.global_end
        pieces.append(_sub_run(run, start, stop))
        start, i = stop, i + 1
    return pieces


def _call(kind: MaskKind, q: Run, k: Run) -> BlockCall:
    return BlockCall(q.local_start, q.length, k.local_start, k.length, kind, q.global_start, k.global_start)


def _plan_pair(mask: StructuredMask, q: Run, k: Run, calls: list[BlockCall]) -> None:
    qs, qe, ks, ke = q.global_start, q.global_end, k.global_start, k.global_end
    cls = mask.classify(qs, qe, ks, ke)
    if cls is BlockClass.EMPTY:
        return
    if cls is BlockClass.FULL:
        calls.append(_call(MaskKind.FULL, q, k))
        return
    if cls is BlockClass.CAUSAL:
        calls.append(_call(MaskKind.CAUSAL, q, k))
        return
    if mask.only_causal_cuts(qs, qe, ks, ke):  # the causal decomposition of _plan_runs
        a1 = min(ke, qe)
        if ks < qs:
            calls.append(_call(MaskKind.FULL, q, _sub_run(k, ks, min(a1, qs))))
        d0, d1 = max(ks, qs), a1
        if d0 < d1:
            calls.append(_call(MaskKind.CAUSAL, _sub_run(q, d0, d1), _sub_run(k, d0, d1)))
            if d1 < qe:
                calls.append(_call(MaskKind.FULL, _sub_run(q, d1, qe), _sub_run(k, d0, d1)))
        return
    if q.length <= MASK_TILE and k.length <= MASK_TILE:
        calls.append(_call(MaskKind.DENSE, q, k))
        return
    run, start, end = (q, qs, qe) if q.length >= k.length else (k, ks, ke)
    mid = (start + (end - start) // 2) // MASK_TILE * MASK_TILE
    if mid <= start:
        mid = min(end - 1, start + MASK_TILE) if end - start > MASK_TILE else start + (end - start) // 2
    halves = (_sub_run(run, start, mid), _sub_run(run, mid, end))
    for half in halves:
        if run is q:
            _plan_pair(mask, half, k, calls)
        else:
            _plan_pair(mask, q, half, calls)


@lru_cache(maxsize=4096)
def _plan_masked_cached(q_runs: tuple[Run, ...], k_runs: tuple[Run, ...], mask: StructuredMask) -> tuple[BlockCall, ...]:
    points = mask.split_points()
    calls: list[BlockCall] = []
    for q_run in q_runs:
        for q in _split_at(q_run, points):
            lo, hi = mask.key_hull(q.global_start, q.global_end)
            for k_run in k_runs:
                a0, a1 = max(k_run.global_start, lo), min(k_run.global_end, hi)
                if a0 >= a1:
                    continue  # no query of this piece sees these keys: skipped, never computed
                for k in _split_at(_sub_run(k_run, a0, a1), points):
                    _plan_pair(mask, q, k, calls)
    return tuple(_coalesce(calls, contiguous=True))


def masked_dense(call: BlockCall, mask: StructuredMask, device=None) -> torch.Tensor:
    """``[q_len, k_len]`` bool of a call planned under ``mask``."""
    qpos = torch.arange(call.q_global, call.q_global + call.q_len, device=device)
    kpos = torch.arange(call.k_global, call.k_global + call.k_len, device=device)
    return mask.visible(qpos, kpos)
