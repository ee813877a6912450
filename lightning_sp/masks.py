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
(ALiBi, one slope per query head), then ``score_mod(s, b, h, q, k)``. Attention sinks (gpt-oss) are one learned
logit per query head that joins every row's softmax with a zero value vector: ``out = sum_k p_k v_k`` with
``p = softmax([s_1 .. s_n, sink_h])``.

``b`` is the batch index, ``h`` the *global* query head index (Ulysses ranks hold a slice of the heads), ``q`` and
``k`` global positions; the callables receive broadcastable int64 tensors ``[B, 1, 1, 1]``, ``[1, H, 1, 1]``,
``[1, 1, Sq, 1]``, ``[1, 1, 1, Sk]`` and must be elementwise (as FlexAttention's). ``score_mod`` must be
differentiable by autograd (its gradient flows to the scores, not to parameters it closes over).

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
"""

from __future__ import annotations

import bisect
import math
from dataclasses import dataclass, field
from enum import Enum
from typing import Callable

import torch

__all__ = ["AttentionMask", "StructuredMask", "ScoreMods", "BlockClass", "resolve_window", "padding_ranges"]


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


class _RowsKeyPadding:
    """``key_padding`` as a ``mask_mod``: key ``k`` of batch row ``b`` is visible iff ``start_b <= k < end_b``."""

    def __init__(self, ranges: tuple[tuple[int, int], ...], inner: Callable | None):
        self.bounds = torch.tensor(ranges, dtype=torch.long)  # [B, 2]
        self.inner = inner

    def __call__(self, b, h, q, k):
        if self.bounds.device != k.device:
            self.bounds = self.bounds.to(k.device)
        bounds = self.bounds[b.flatten()].view(-1, 1, 1, 1, 2)  # [B, 1, 1, 1, 2]
        visible = (k >= bounds[..., 0]) & (k < bounds[..., 1])  # [B, 1, 1, Sk]
        return visible if self.inner is None else visible & torch.as_tensor(self.inner(b, h, q, k), dtype=torch.bool)


def _callable_name(fn) -> str | None:
    if fn is None:
        return None
    return f"{getattr(fn, '__module__', '?')}.{getattr(fn, '__qualname__', type(fn).__name__)}"


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

    def signature(self) -> tuple:
        """A description every rank can compare (callables by qualified name)."""
        return (self.window, self.chunk_size, self.bidirectional_spans, self.softcap, self.alibi_slopes,
                _callable_name(self.mask_mod), _callable_name(self.score_mod), self.key_padding)

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
        )

    def score_mods(self) -> "ScoreMods | None":
        """The per-score parts (``None``: none), which need the score-modifying kernel. Rows padded alike need
        none (``StructuredMask.keys`` says it all); rows padded differently are told apart per block."""
        mask_mod = self.mask_mod
        if self.key_padding is not None and len(set(self.key_padding)) > 1:
            mask_mod = _RowsKeyPadding(self.key_padding, mask_mod)
        if self.softcap is None and self.alibi_slopes is None and mask_mod is None and self.score_mod is None:
            return None
        return ScoreMods(self.softcap, self.alibi_slopes, mask_mod, self.score_mod)

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
        if self.causal and not (span >= 0 and span == self._span(k0)):
            parts.append(BlockClass.EMPTY if k0 > q1 - 1 else BlockClass.FULL if k1 - 1 <= q0 else BlockClass.CAUSAL)
        if self.left is not None:  # q - k <= left
            parts.append(BlockClass.EMPTY if q0 - (k1 - 1) > self.left else
                         BlockClass.FULL if q1 - 1 - k0 <= self.left else BlockClass.PARTIAL)
        if self.right is not None:  # k - q <= right
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
        if self.right is not None and k1 - 1 - q0 > self.right:
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
                starts = torch.tensor([s for s, _ in self.spans], device=qpos.device)
                ends = torch.tensor([e for _, e in self.spans], device=qpos.device)

                def span_of(pos):
                    i = torch.bucketize(pos, starts, right=True) - 1
                    inside = (i >= 0) & (pos < ends[i.clamp(min=0)])
                    return torch.where(inside, i, torch.full_like(i, -1))

                sq, sk = span_of(qpos), span_of(kpos)
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
    """The per-score parts of a mask: applied to each computed block of scores by the score-modifying kernel."""

    softcap: float | None = None
    alibi_slopes: tuple[float, ...] | None = None
    mask_mod: Callable | None = None
    score_mod: Callable | None = None

    def check_heads(self, num_heads: int) -> None:
        if self.alibi_slopes is not None and len(self.alibi_slopes) != num_heads:
            raise ValueError(f"alibi_slopes has {len(self.alibi_slopes)} slopes but the attention has {num_heads} "
                             f"query heads: pass one slope per query head")

    def apply(self, s: torch.Tensor, b_idx, h_idx, q_idx, k_idx) -> torch.Tensor:
        """Scores ``s [B, H, Sq, Sk]`` (scaled) -> modified scores (``mask_mod`` not applied here)."""
        if self.softcap is not None:
            s = torch.tanh(s / self.softcap) * self.softcap
        if self.alibi_slopes is not None:
            slopes = torch.tensor(self.alibi_slopes, dtype=s.dtype, device=s.device)[h_idx.flatten()].view(1, -1, 1, 1)
            s = s - slopes * (q_idx - k_idx).abs().to(s.dtype)
        if self.score_mod is not None:
            s = self.score_mod(s, b_idx, h_idx, q_idx, k_idx)
        return s

    def visible(self, b_idx, h_idx, q_idx, k_idx) -> torch.Tensor | None:
        """``mask_mod`` on a block (broadcastable bool), ``None`` without one."""
        if self.mask_mod is None:
            return None
        return torch.as_tensor(self.mask_mod(b_idx, h_idx, q_idx, k_idx), dtype=torch.bool)
