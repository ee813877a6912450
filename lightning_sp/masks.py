"""Attention masks and score modifiers over *global* positions, so that every rank of a sequence-parallel group
can tell, for any (query block, key block) pair of global index ranges, whether the mask leaves it empty, full or
partial, without looking at a tensor.

    mask = AttentionMask(window=(4095, 0), bidirectional_spans=((10, 266),), softcap=50.0)
    attn = SequenceParallelAttention(causal=True, backend="zigzag_ring", group=g, mask=mask)
    out = attn(q, k, v, cu_seqlens=cu, sinks=model.sinks)      # sinks: learned [H] logits, with their gradient

Visibility of key ``k`` from query ``q`` (global positions; every part is optional and they are ANDed)::

    same document (cu_seqlens; padding is a document of its own; chunk_size cuts documents at multiples of it)
    and (k <= q if causal, unless q and k lie in the same bidirectional span)
    and q - left <= k <= q + right             (window=(left, right); -1: unbounded on that side)
    and mask_mod(b, h, q, k)                    (FlexAttention's form, on global indices)
    and start_b <= k < end_b                    (key_padding=((start_b, end_b), ...): row b's real tokens)

Scores (``s = q.k * scale``) are modified in this order: ``softcap * tanh(s / softcap)``, then ``- slope_h * |q - k|``
(ALiBi, one slope per query head), then ``+ table[bucket(k - q), h]`` (``relative_bias``: a learned relative-position
bias, T5's buckets by default; its table gets its gradient, Note [Relative-position bias gradient]), then
``score_mod(s, b, h, q, k)``. Attention sinks (gpt-oss) are one learned
logit per query head that joins every row's softmax with a zero value vector: ``out = sum_k p_k v_k`` with
``p = softmax([s_1 .. s_n, sink_h])``.

``b`` is the batch index, ``h`` the *global* query head index (Ulysses ranks hold a slice of the heads), ``q`` and
``k`` global positions; the callables receive broadcastable int64 tensors ``[B, 1, 1, 1]``, ``[1, H, 1, 1]``,
``[1, 1, Sq, 1]``, ``[1, 1, 1, Sk]`` and must be elementwise (as FlexAttention's). ``score_mod`` must be
differentiable by autograd (its gradient flows to the scores, not to parameters it closes over: a learned bias
indexed by ``k - q`` is ``relative_bias``, whose table does get its gradient).

    bias = RelativePositionBias(t5_layer.relative_attention_bias.weight, num_buckets=32, max_distance=128)
    out = attn(q, k, v, mask=AttentionMask(relative_bias=bias))   # T5 encoder attention; d(table) exact

Padding (``key_padding``, one global ``[start, end)`` of real tokens per batch row: left, right or both
sides padded): padded keys are never seen; a query row that sees no key at all (a causal query in the left
padding) outputs zeros, its gradients are zero, never NaN. Keys no row holds (the padding every row shares)
are skipped block by block like a window (``StructuredMask.keys``); rows that differ are told apart per
computed block, as a ``mask_mod``. ``padding_ranges(attention_mask)`` reads them from a ``[B, N]`` 0/1 mask.

Window conventions: flash-attn's ``window_size=(left, right)``. Hugging Face's ``sliding_window=W`` (Mistral,
Qwen2, Gemma) is ``window=(W - 1, 0)`` with ``causal=True``; chunked attention (Llama 4) is ``chunk_size`` on
global positions.

Note [Block classes from global ranges]
    ``StructuredMask.classify(q0, q1, k0, k1)`` answers for the pairs ``[q0, q1) x [k0, k1)`` with interval
    arithmetic only: a window is empty when the nearest pair is outside it (``q0 - (k1 - 1) > left``) and full
    when the farthest pair is inside it (``q1 - 1 - k0 <= left``); causality likewise on ``k0 > q1 - 1`` and
    ``k1 - 1 <= q0``. Ranges must not straddle a document, chunk or span boundary (``split_points``): the
    planner cuts them there first, so "same document / same span" is a property of the whole pair. The parts are
    ANDed, so any empty part makes the pair empty, and all-full parts make it full; otherwise it is partial and
    ``visible(qpos, kpos)`` gives its exact boolean mask. Because the answer is a pure function of global inputs
    (lengths, document bounds, window, spans, layout), every rank computes the same answer for every pair: the
    rings decide from it which K/V rows to send to whom, and the peer agrees without a message.
    ``mask_mod`` takes no part in the classes (it is evaluated on the blocks that are computed): it can only hide
    more, never reveal, so a pair the structured parts leave empty is empty.

Note [Relative-position bias gradient]
    ``relative_bias`` adds ``table[bucket(k - q), h]`` (``table [num_buckets, H]``, ``h`` the global query head)
    to every score, so ``d loss / d table[j, h] = sum over (b, q, k) with bucket(k - q) = j of dS[b, h, q, k]``,
    where ``dS`` is the gradient of the modified score, which every score-modifying backward has per computed
    block (``ScoreMods.backward_through``: autograd through the modifiers of one block, with the block's slice of
    the table as a leaf, whose gradient is that bucketed sum). Blocks a mask leaves empty have ``dS = 0`` and are
    skipped. Each (query, key) pair is computed exactly once over the group, by the rank that holds the query
    (Ulysses: of its heads, ``head_offset``), so the per-block sums, added into one ``[num_buckets, H]``
    accumulator per call (``ScoreMods.table_grad``), give on each rank its rows' share of the gradient; summed
    over the group they are the whole gradient, as the sinks' (Note [Attention sinks] in
    ``ops/ring_attention.py``): like any parameter's share, the data-parallel reduction over ``dp x sp`` sums them.
    The accumulator reaches autograd through ``route_table_gradient``: an identity on ``q`` whose backward
    returns ``dq`` unchanged and the accumulated ``d table``. Every node of the call's backward takes ``q`` (or
    what was made from it) as an input, so autograd runs them all before that identity's backward: the
    accumulator is complete when it is read (and emptied, so a second backward through a retained graph starts
    from zero).
"""

from __future__ import annotations

import bisect
import math
from dataclasses import dataclass, field
from enum import Enum
from typing import Callable

import torch

__all__ = ["AttentionMask", "RelativePositionBias", "StructuredMask", "ScoreMods", "BlockClass", "resolve_window",
           "padding_ranges", "route_table_gradient", "t5_relative_position_bucket"]


class BlockClass(Enum):
    EMPTY = "empty"
    FULL = "full"
    PARTIAL = "partial"
    CAUSAL = "causal"
    """Partial, and exactly a square causal diagonal (``q`` range == ``k`` range, nothing else cuts it): the fast
    fused kernels take it without a mask."""


def resolve_window(window) -> tuple[int | None, int | None]:
    """``(left, right)`` flash-attn style (-1 or None: unbounded) -> ``(left or None, right or None)``."""
    if window is None:
        return None, None
    if not (isinstance(window, (tuple, list)) and len(window) == 2):
        raise ValueError(f"window must be (left, right) with ints >= -1 (-1: unbounded), got {window!r}")
    out = []
    for w in window:
        if w is None or (isinstance(w, int) and not isinstance(w, bool) and w == -1):
            out.append(None)
        elif isinstance(w, int) and not isinstance(w, bool) and w >= 0:
            out.append(int(w))
        else:
            raise ValueError(f"window must be (left, right) with ints >= -1 (-1: unbounded), got {window!r}")
    return out[0], out[1]


def padding_ranges(attention_mask: torch.Tensor) -> tuple[tuple[int, int], ...]:
    """``[B, N]`` 0/1 (or bool) padding mask, 1 = real token -> ``key_padding``: each row's ``(start, end)``.
    Raises unless every row's real tokens are one contiguous run (left, right or both sides padded)."""
    if not isinstance(attention_mask, torch.Tensor) or attention_mask.dim() != 2:
        raise ValueError(f"a padding mask must be a [B, N] tensor (1 = real token); got "
                         f"{tuple(getattr(attention_mask, 'shape', ())) or type(attention_mask).__name__}")
    real = attention_mask.bool().cpu()
    n = real.size(1)
    cols = torch.arange(n)
    counts = real.sum(-1)
    starts = torch.where(real.any(-1), real.int().argmax(-1), torch.zeros_like(counts))
    ends = starts + counts
    runs = (cols[None, :] >= starts[:, None]) & (cols[None, :] < ends[:, None])
    if not torch.equal(runs, real):
        bad = int((runs != real).any(-1).nonzero()[0])
        raise ValueError(
            f"row {bad} of the padding mask is not one run of real tokens (1s) between padding (0s) on the left and/or "
            f"right: {real[bad].int().tolist()[:32]}...; pack such sequences as documents (cu_seqlens) instead")
    return tuple((int(s), int(e)) for s, e in zip(starts.tolist(), ends.tolist()))


def span_index(pos: torch.Tensor, spans: tuple[tuple[int, int], ...]) -> torch.Tensor:
    """The index of the span ``[start, end)`` of ``spans`` (sorted, disjoint) holding each global position of
    ``pos`` (any shape), ``-1`` outside every span."""
    starts = torch.tensor([s for s, _ in spans], device=pos.device)
    ends = torch.tensor([e for _, e in spans], device=pos.device)
    i = torch.bucketize(pos, starts, right=True) - 1
    inside = (i >= 0) & (pos < ends[i.clamp(min=0)])
    return torch.where(inside, i, torch.full_like(i, -1))


class _RowsKeyPadding:
    """``key_padding`` as a ``mask_mod``: key ``k`` of batch row ``b`` is visible iff ``start_b <= k < end_b``."""

    def __init__(self, ranges: tuple[tuple[int, int], ...], inner: Callable | None):
        self.bounds = torch.tensor(ranges, dtype=torch.long)  # [B, 2]
        self.inner = inner

    def __call__(self, b, h, q, k):
        # ``b`` of any shape that broadcasts with ``k``: ``[B, 1, 1, 1]`` from ``ScoreModKernel``, one index per
        # call from FlexAttention's vmapped ``mask_mod``
        bounds = self.bounds.to(k.device)[b]  # [*b.shape, 2]
        visible = (k >= bounds[..., 0]) & (k < bounds[..., 1])  # [B, 1, 1, Sk] / per element
        return visible if self.inner is None else visible & torch.as_tensor(self.inner(b, h, q, k), dtype=torch.bool)


def _callable_name(fn) -> str | None:
    """How ranks compare a callable: its qualified name, plus its ``signature()`` if it has one (a mask held as
    data, e.g. the Hugging Face integration's rows of a 4-D mask, says which data)."""
    if fn is None:
        return None
    name = f"{getattr(fn, '__module__', '?')}.{getattr(fn, '__qualname__', type(fn).__name__)}"
    describe = getattr(fn, "signature", None)
    return name if not callable(describe) else f"{name}:{describe()}"


def t5_relative_position_bucket(relative_position: torch.Tensor, *, bidirectional: bool = True, num_buckets: int = 32,
                                max_distance: int = 128) -> torch.Tensor:
    """T5's bucket of each relative position ``k - q`` (int tensor, any shape) -> int64 in ``[0, num_buckets)``, the
    same as Hugging Face's ``T5Attention._relative_position_bucket`` (its float32 logarithm included, so bit for bit).

    Bidirectional: half the buckets for keys after the query (``k > q``), half for the others. Unidirectional
    (decoders): only ``k <= q`` is told apart (later keys share bucket 0). Of each half, distances below
    ``exact = half // 2`` get one bucket each; larger ones ``exact + floor(log(d / exact) / log(max_distance / exact)
    * (half - exact))``, capped at ``half - 1`` (every distance ``>= max_distance`` shares the last bucket)."""
    rel = relative_position.to(torch.int64)
    half = num_buckets
    if bidirectional:
        half //= 2
        side = (rel > 0).to(torch.int64) * half  # later keys: the upper half
        distance = rel.abs()
    else:
        side = torch.zeros_like(rel)
        distance = (-rel).clamp(min=0)  # later keys: distance 0
    exact = half // 2
    # log of a distance >= exact only (smaller ones take the exact branch; log(0) would be cast from -inf)
    log_bucket = exact + (torch.log(distance.clamp(min=exact).float() / exact) / math.log(max_distance / exact)
                          * (half - exact)).to(torch.int64)
    return side + torch.where(distance < exact, distance, log_bucket.clamp(max=half - 1))


@dataclass(frozen=True, eq=False)
class RelativePositionBias:
    """A learned per-head bias of the scores, indexed by a bucket of the relative position ``k - q`` (global
    positions): ``s[b, h, q, k] += table[bucket(k - q), h]`` (T5, MT5, UMT5; ``table`` is their first layer's
    ``relative_attention_bias.weight``). ``table`` gets its exact gradient on every backend (Note
    [Relative-position bias gradient]). ``bucket_fn(relative_position) -> bucket`` (elementwise on int64 tensors,
    values in ``[0, table.size(0))``) replaces T5's bucketing (``num_buckets``, ``max_distance`` and
    ``bidirectional`` are then unused)."""

    table: torch.Tensor
    """``[num_buckets, H]`` floating: one column per (global) query head."""
    num_buckets: int = 32
    max_distance: int = 128
    bidirectional: bool = True
    """T5's encoders: ``True``; its decoders (causal): ``False``."""
    bucket_fn: Callable | None = None

    def __post_init__(self):
        t = self.table
        if not isinstance(t, torch.Tensor) or t.dim() != 2 or not t.is_floating_point():
            got = f"{t.dtype} {tuple(t.shape)}" if isinstance(t, torch.Tensor) else type(t).__name__
            raise ValueError(f"RelativePositionBias.table must be a floating [num_buckets, H] tensor, got {got}")
        if self.bucket_fn is not None:
            if not callable(self.bucket_fn):
                raise ValueError(f"bucket_fn must be a callable (relative_position) -> bucket, got {self.bucket_fn!r}")
            return
        for name in ("num_buckets", "max_distance"):
            if isinstance(getattr(self, name), bool) or not isinstance(getattr(self, name), int):
                raise ValueError(f"{name} must be an int, got {getattr(self, name)!r}")
        half = self.num_buckets // 2 if self.bidirectional else self.num_buckets
        if half < 2 or self.max_distance <= half // 2:
            raise ValueError(
                f"T5 buckets need num_buckets >= {4 if self.bidirectional else 2} and max_distance > "
                f"{max(half // 2, 1)} (the exact buckets' reach), got num_buckets={self.num_buckets}, "
                f"max_distance={self.max_distance}")
        if t.size(0) != self.num_buckets:
            raise ValueError(f"RelativePositionBias.table has {t.size(0)} rows but num_buckets={self.num_buckets}: "
                             f"pass the [num_buckets, H] table (HF T5: relative_attention_bias.weight)")

    @property
    def num_heads(self) -> int:
        return self.table.size(1)

    def buckets(self, relative_position: torch.Tensor) -> torch.Tensor:
        """``k - q`` (int64, any shape) -> bucket indices into ``table`` (int64, same shape)."""
        if self.bucket_fn is None:
            return t5_relative_position_bucket(relative_position, bidirectional=self.bidirectional,
                                               num_buckets=self.num_buckets, max_distance=self.max_distance)
        return torch.as_tensor(self.bucket_fn(relative_position)).to(torch.int64)

    def bucket_error(self, length: int) -> str | None:
        """Why the buckets of a ``length``-token sequence (every ``k - q`` in ``(-length, length)``) do not index the
        table, or ``None``. A pure function of global inputs: the attention checks it before any collective, so every
        rank raises together (the kernels index the table without checking)."""
        if self.bucket_fn is None or length < 1:
            return None
        bucket = self.buckets(torch.arange(1 - length, length))
        if bucket.shape != (2 * length - 1,):
            return f"bucket_fn returned shape {tuple(bucket.shape)} for relative positions of shape {(2 * length - 1,)}"
        low, high = int(bucket.min()), int(bucket.max())
        if low < 0 or high >= self.table.size(0):
            rows = self.table.size(0)
            return (f"bucket_fn returned buckets in [{low}, {high}], outside the table's [0, {rows}) rows "
                    f"(relative positions {1 - length}..{length - 1})")
        return None

    def signature(self) -> tuple:
        """What every rank compares (the table by shape and dtype: its values are a parameter's)."""
        return (tuple(self.table.shape), str(self.table.dtype), self.num_buckets, self.max_distance,
                self.bidirectional, _callable_name(self.bucket_fn))


@dataclass(frozen=True)
class AttentionMask:
    """What a ``SequenceParallelAttention`` call attends to beyond ``causal`` and ``cu_seqlens`` (module
    docstring). All positions are global (before sharding)."""

    window: tuple[int, int] | None = None
    """``(left, right)``: query ``q`` sees keys ``q - left ... q + right``; ``-1``: unbounded on that side."""
    chunk_size: int | None = None
    """Attend only inside chunks ``[c * chunk_size, (c + 1) * chunk_size)`` of global positions."""
    bidirectional_spans: tuple[tuple[int, int], ...] = ()
    """Global ``[start, end)`` ranges (sorted, disjoint) whose tokens see each other fully inside a causal
    stream (prefix-LM prefixes, image tokens)."""
    softcap: float | None = None
    alibi_slopes: tuple[float, ...] | None = None
    """One slope per query head (``H`` of them): ``s - slope_h * |q - k|``."""
    mask_mod: Callable | None = field(default=None, compare=False)
    score_mod: Callable | None = field(default=None, compare=False)
    relative_bias: RelativePositionBias | None = field(default=None, compare=False)
    """A learned bias ``table[bucket(k - q), h]`` added to the scores (T5), whose table gets its gradient."""
    key_padding: tuple[tuple[int, int], ...] | None = None
    """One global ``[start, end)`` of real tokens per batch row (``padding_ranges(attention_mask)``): keys
    outside are never seen; a query that sees no key outputs zeros (module docstring)."""

    def __post_init__(self):
        resolve_window(self.window)
        if self.chunk_size is not None and (isinstance(self.chunk_size, bool) or not isinstance(self.chunk_size, int)
                                            or self.chunk_size < 1):
            raise ValueError(f"chunk_size must be an int >= 1, got {self.chunk_size!r}")
        spans = tuple((int(s), int(e)) for s, e in self.bidirectional_spans)
        for i, (s, e) in enumerate(spans):
            if not 0 <= s < e:
                raise ValueError(f"bidirectional_spans must be [start, end) with 0 <= start < end, got {(s, e)}")
            if i and s < spans[i - 1][1]:
                raise ValueError(f"bidirectional_spans must be sorted and disjoint, got {spans[i - 1]} then {(s, e)}")
        object.__setattr__(self, "bidirectional_spans", spans)
        if self.softcap is not None and not (isinstance(self.softcap, (int, float)) and self.softcap > 0):
            raise ValueError(f"softcap must be a positive number, got {self.softcap!r}")
        if self.alibi_slopes is not None:
            object.__setattr__(self, "alibi_slopes", tuple(float(s) for s in self.alibi_slopes))
        if self.key_padding is not None:
            ranges = tuple((int(s), int(e)) for s, e in self.key_padding)
            if not ranges or any(not 0 <= s <= e for s, e in ranges):
                raise ValueError(f"key_padding must be one (start, end) with 0 <= start <= end per batch row, got "
                                 f"{self.key_padding!r}")
            object.__setattr__(self, "key_padding", ranges)
        for name in ("mask_mod", "score_mod"):
            fn = getattr(self, name)
            if fn is not None and not callable(fn):
                raise ValueError(f"{name} must be a callable (b, h, q_idx, kv_idx) as FlexAttention's, got {fn!r}")
        if self.relative_bias is not None and not isinstance(self.relative_bias, RelativePositionBias):
            raise ValueError(f"relative_bias must be a lightning_sp.RelativePositionBias, got "
                             f"{type(self.relative_bias).__name__}")

    def signature(self) -> tuple:
        """A description every rank can compare (callables by qualified name)."""
        return (self.window, self.chunk_size, self.bidirectional_spans, self.softcap, self.alibi_slopes,
                _callable_name(self.mask_mod), _callable_name(self.score_mod), self.key_padding,
                None if self.relative_bias is None else self.relative_bias.signature())

    def merged(self, other: "AttentionMask | None") -> "AttentionMask":
        """``other``'s set fields over this one's (a forward's mask over the constructor's)."""
        if other is None:
            return self
        pick = lambda a, b: b if b not in (None, ()) else a  # noqa: E731
        return AttentionMask(
            window=pick(self.window, other.window), chunk_size=pick(self.chunk_size, other.chunk_size),
            bidirectional_spans=pick(self.bidirectional_spans, other.bidirectional_spans),
            softcap=pick(self.softcap, other.softcap), alibi_slopes=pick(self.alibi_slopes, other.alibi_slopes),
            mask_mod=pick(self.mask_mod, other.mask_mod), score_mod=pick(self.score_mod, other.score_mod),
            key_padding=pick(self.key_padding, other.key_padding),
            relative_bias=pick(self.relative_bias, other.relative_bias),
        )

    def score_mods(self) -> "ScoreMods | None":
        """The per-score parts (``None``: none), which need the score-modifying kernel. Rows padded alike need
        none (``StructuredMask.keys`` says it all); rows padded differently are told apart per block."""
        mask_mod = self.mask_mod
        if self.key_padding is not None and len(set(self.key_padding)) > 1:
            mask_mod = _RowsKeyPadding(self.key_padding, mask_mod)
        if (self.softcap is None and self.alibi_slopes is None and mask_mod is None and self.score_mod is None
                and self.relative_bias is None):
            return None
        return ScoreMods(self.softcap, self.alibi_slopes, mask_mod, self.score_mod, self.relative_bias)

    def structured(self, *, causal: bool, doc_bounds, padded_len: int) -> "StructuredMask":
        """The structural parts resolved against a sequence of ``padded_len`` positions: ``chunk_size`` becomes
        more document bounds (``doc_bounds``: the global ones, padding included, or ``None``)."""
        bounds = list(doc_bounds) if doc_bounds is not None else None
        if self.chunk_size is not None:
            cuts = set(range(0, padded_len, self.chunk_size)) | {padded_len}
            bounds = sorted(cuts | set(bounds or ()))
        left, right = resolve_window(self.window)
        spans = tuple((s, min(e, padded_len)) for s, e in self.bidirectional_spans if s < padded_len)
        keys = None  # keys no row holds: [min start, max end) over the rows
        if self.key_padding is not None:
            keys = (min(s for s, _ in self.key_padding), min(max(e for _, e in self.key_padding), padded_len))
        return StructuredMask(bool(causal), None if bounds is None else tuple(bounds), left, right,
                              spans if causal else (), keys)


@dataclass(frozen=True)
class StructuredMask:
    """The part of a mask that decides block classes (Note [Block classes from global ranges]); hashable, so
    plans are cached on it."""

    causal: bool
    doc_bounds: tuple[int, ...] | None
    left: int | None
    right: int | None
    spans: tuple[tuple[int, int], ...] = ()
    keys: tuple[int, int] | None = None
    """Global ``[lo, hi)``: no query sees a key outside it (padding that every batch row has)."""

    def is_plain(self) -> bool:
        """Only causality and documents: the original planner's masks."""
        return self.left is None and self.right is None and not self.spans and self.keys is None

    def split_points(self) -> tuple[int, ...]:
        """Global positions where a block must be cut so that it lies in one document and one span (or gap)."""
        pts = set(self.doc_bounds or ())
        for s, e in self.spans:
            pts.update((s, e))
        return tuple(sorted(pts))

    def _doc(self, pos: int) -> int:
        return -1 if self.doc_bounds is None else bisect.bisect_right(self.doc_bounds, pos)

    def _span(self, pos: int) -> int:
        i = bisect.bisect_right(self.spans, (pos, math.inf)) - 1
        return i if i >= 0 and self.spans[i][0] <= pos < self.spans[i][1] else -1

    def classify(self, q0: int, q1: int, k0: int, k1: int) -> BlockClass:
        """Class of ``[q0, q1) x [k0, k1)`` (neither range straddling ``split_points``)."""
        if self._doc(q0) != self._doc(k0):
            return BlockClass.EMPTY
        parts = []
        span = self._span(q0)
        causal_cuts = self.causal and not (span >= 0 and span == self._span(k0))
        if causal_cuts:
            parts.append(BlockClass.EMPTY if k0 > q1 - 1 else BlockClass.FULL if k1 - 1 <= q0 else BlockClass.CAUSAL)
        if self.left is not None:  # q - k <= left
            parts.append(BlockClass.EMPTY if q0 - (k1 - 1) > self.left else
                         BlockClass.FULL if q1 - 1 - k0 <= self.left else BlockClass.PARTIAL)
        if self.right is not None and not (causal_cuts and self.right >= 0):  # k - q <= right (causality implies it)
            parts.append(BlockClass.EMPTY if k0 - (q1 - 1) > self.right else
                         BlockClass.FULL if k1 - 1 - q0 <= self.right else BlockClass.PARTIAL)
        if self.keys is not None:  # lo <= k < hi
            lo, hi = self.keys
            parts.append(BlockClass.EMPTY if k1 <= lo or k0 >= hi else
                         BlockClass.FULL if lo <= k0 and k1 <= hi else BlockClass.PARTIAL)
        if BlockClass.EMPTY in parts:
            return BlockClass.EMPTY
        partial = [p for p in parts if p is not BlockClass.FULL]
        if not partial:
            return BlockClass.FULL
        if partial == [BlockClass.CAUSAL] and (q0, q1) == (k0, k1):
            return BlockClass.CAUSAL
        return BlockClass.PARTIAL

    def only_causal_cuts(self, q0: int, q1: int, k0: int, k1: int) -> bool:
        """Whether causality is the only part that cuts this (partial) pair: the window keeps every pair and the
        span rule does not apply, so the original causal decomposition plans it."""
        span = self._span(q0)
        if span >= 0 and span == self._span(k0):
            return False
        if self.left is not None and q1 - 1 - k0 > self.left:
            return False
        if self.right is not None and not (self.causal and self.right >= 0) and k1 - 1 - q0 > self.right:  # causality implies right >= 0
            return False
        if self.keys is not None and (k0 < self.keys[0] or k1 > self.keys[1]):
            return False
        return True

    def key_hull(self, q0: int, q1: int) -> tuple[int, int]:
        """Keys ``[lo, hi)`` some query of ``[q0, q1)`` (inside one document) may see: a superset."""
        lo, hi = 0, math.inf
        if self.doc_bounds is not None:
            i = bisect.bisect_right(self.doc_bounds, q0) - 1
            lo = self.doc_bounds[i] if i >= 0 else 0
            hi = self.doc_bounds[i + 1] if i + 1 < len(self.doc_bounds) else math.inf
        if self.causal:
            reach = q1
            span = self._span(q1 - 1)
            if span >= 0:
                reach = max(reach, self.spans[span][1])
            hi = min(hi, reach)
        if self.left is not None:
            lo = max(lo, q0 - self.left)
        if self.right is not None:
            hi = min(hi, q1 + self.right)
        if self.keys is not None:
            lo, hi = max(lo, self.keys[0]), min(hi, self.keys[1])
        return lo, hi

    def visible(self, qpos: torch.Tensor, kpos: torch.Tensor) -> torch.Tensor:
        """``[Sq, Sk]`` bool, True = visible, for global positions ``qpos [Sq]``, ``kpos [Sk]``."""
        qp, kp = qpos[:, None], kpos[None, :]
        visible = torch.ones(qpos.numel(), kpos.numel(), dtype=torch.bool, device=qpos.device)
        if self.doc_bounds is not None:
            bounds = torch.tensor(self.doc_bounds, device=qpos.device)
            visible &= torch.bucketize(qpos, bounds, right=True)[:, None] == torch.bucketize(kpos, bounds, right=True)[None, :]
        if self.causal:
            order = kp <= qp
            if self.spans:
                sq, sk = span_index(qpos, self.spans), span_index(kpos, self.spans)
                order = order | ((sq[:, None] == sk[None, :]) & (sq[:, None] >= 0))
            visible &= order
        if self.left is not None:
            visible &= qp - kp <= self.left
        if self.right is not None:
            visible &= kp - qp <= self.right
        if self.keys is not None:
            visible &= (kp >= self.keys[0]) & (kp < self.keys[1])
        return visible


@dataclass(frozen=True, eq=False)
class ScoreMods:
    """The per-score parts of a mask: applied to each computed block of scores by the score-modifying kernel. One
    per attention call (``AttentionMask.score_mods``): it carries that call's ``table_grad``."""

    softcap: float | None = None
    alibi_slopes: tuple[float, ...] | None = None
    mask_mod: Callable | None = None
    score_mod: Callable | None = None
    relative_bias: RelativePositionBias | None = None
    table_grad: dict = field(default_factory=dict, repr=False)
    """``{"grad": [num_buckets, H]}``: this call's share of ``d loss / d relative_bias.table`` so far, in the
    accumulation dtype (Note [Relative-position bias gradient]); empty until a backward adds to it."""

    def check_heads(self, num_heads: int) -> None:
        if self.alibi_slopes is not None and len(self.alibi_slopes) != num_heads:
            raise ValueError(f"alibi_slopes has {len(self.alibi_slopes)} slopes but the attention has {num_heads} "
                             f"query heads: pass one slope per query head")
        if self.relative_bias is not None and self.relative_bias.num_heads != num_heads:
            raise ValueError(f"relative_bias.table has {self.relative_bias.num_heads} columns but the attention has "
                             f"{num_heads} query heads: pass a [num_buckets, H] table, one column per query head")

    def _table_slice(self, h_idx, dtype, device) -> torch.Tensor | None:
        """``[num_buckets, H_block]``: the table's columns of the block's (global) heads, detached, in ``dtype``."""
        if self.relative_bias is None:
            return None
        return self.relative_bias.table.detach().to(device=device, dtype=dtype)[:, h_idx.flatten().to(device)]

    def apply(self, s: torch.Tensor, b_idx, h_idx, q_idx, k_idx, *, table: torch.Tensor | None = None) -> torch.Tensor:
        """Scores ``s [B, H, Sq, Sk]`` (scaled) -> modified scores (``mask_mod`` not applied here). ``table``: the
        block's ``[num_buckets, H]`` slice of the relative bias (default: the detached table's)."""
        if self.softcap is not None:
            s = torch.tanh(s / self.softcap) * self.softcap
        if self.alibi_slopes is not None:
            slopes = torch.tensor(self.alibi_slopes, dtype=s.dtype, device=s.device)[h_idx.flatten()].view(1, -1, 1, 1)
            s = s - slopes * (q_idx - k_idx).abs().to(s.dtype)
        if self.relative_bias is not None:
            if table is None:
                table = self._table_slice(h_idx, s.dtype, s.device)
            bucket = self.relative_bias.buckets((k_idx - q_idx).flatten(0, 2).to(s.device))  # [Sq, Sk]
            s = s + table[bucket].permute(2, 0, 1).unsqueeze(0)  # [Sq, Sk, H] -> [1, H, Sq, Sk]
        if self.score_mod is not None:
            s = self.score_mod(s, b_idx, h_idx, q_idx, k_idx)
        return s

    def differentiable(self, raw: torch.Tensor, b_idx, h_idx, q_idx, k_idx):
        """One block's raw (scaled) scores ``raw [B, H, Sq, Sk]`` -> ``(modified, backward)``: the modified scores
        (detached) and ``backward(ds) -> d raw``, by autograd through the modifiers, which also adds the block's
        bucketed sum of ``ds`` to ``table_grad`` (Note [Relative-position bias gradient])."""
        learned = self.relative_bias is not None and self.relative_bias.table.requires_grad
        with torch.enable_grad():
            leaf = raw.detach().requires_grad_()
            table = self._table_slice(h_idx, raw.dtype, raw.device)
            if learned:
                table.requires_grad_()
            modified = self.apply(leaf, b_idx, h_idx, q_idx, k_idx, table=table)

        def backward(ds: torch.Tensor) -> torch.Tensor:
            if not modified.requires_grad:  # no modifier depends on the scores nor on a learned table
                return ds
            inputs = (leaf, table) if learned else (leaf,)
            grads = torch.autograd.grad(modified, inputs, ds, allow_unused=True)
            if learned:
                self._add_table_grad(grads[1], h_idx)
            return torch.zeros_like(ds) if grads[0] is None else grads[0]

        return modified.detach(), backward

    def backward_through(self, raw: torch.Tensor, ds: torch.Tensor, b_idx, h_idx, q_idx, k_idx) -> torch.Tensor:
        """``differentiable(raw, ...)[1](ds)``: ``ds``, the gradient of one block's modified scores, -> the gradient
        of its raw scores (and the block's share of the table's, into ``table_grad``)."""
        return self.differentiable(raw, b_idx, h_idx, q_idx, k_idx)[1](ds)

    def _add_table_grad(self, grad: torch.Tensor | None, h_idx) -> None:
        if grad is None:
            return
        total = self.table_grad.get("grad")
        if total is None:
            table = self.relative_bias.table
            total = self.table_grad["grad"] = torch.zeros(table.shape, dtype=grad.dtype, device=grad.device)
        total[:, h_idx.flatten().to(grad.device)] += grad

    def visible(self, b_idx, h_idx, q_idx, k_idx) -> torch.Tensor | None:
        """``mask_mod`` on a block (broadcastable bool), ``None`` without one."""
        if self.mask_mod is None:
            return None
        return torch.as_tensor(self.mask_mod(b_idx, h_idx, q_idx, k_idx), dtype=torch.bool)


class _TableGradient(torch.autograd.Function):
    """Identity on ``q``; its backward hands the call's accumulated table gradient to autograd (Note
    [Relative-position bias gradient])."""

    @staticmethod
    def forward(ctx, q, table, mods):
        ctx.mods = mods
        return q.view_as(q)

    @staticmethod
    def backward(ctx, dq):
        table = ctx.mods.relative_bias.table
        grad = ctx.mods.table_grad.pop("grad", None)
        grad = torch.zeros_like(table) if grad is None else grad.to(device=table.device, dtype=table.dtype)
        return dq, grad, None


def route_table_gradient(q: torch.Tensor, mods: ScoreMods | None) -> torch.Tensor:
    """``q`` itself, routed through ``_TableGradient`` when the call has a relative bias whose table needs a
    gradient (call it on the ``q`` the backends get, once per call)."""
    if mods is None or mods.relative_bias is None or not torch.is_grad_enabled():
        return q
    table = mods.relative_bias.table
    if not table.requires_grad:
        return q
    return _TableGradient.apply(q, table, mods)
