"""How a global sequence is split across a sequence-parallel group, for any sequence length.

Layouts (``SequenceLayout``; the strings ``"contiguous"`` and ``"zigzag"`` are accepted too):

- ``contiguous``: rank ``g`` holds tokens ``[g*L, (g+1)*L)``, ``L = N_pad / P``.
- ``zigzag``: see Note [Zigzag layout]. With ``ulysses_degree = U > 1`` (the ``usp`` layout) the
  zigzag runs over the ``R = P / U`` ring ranks and each ring rank's tokens are split contiguously
  among its ``U`` Ulysses ranks (group rank ``g`` = ring index ``g // U``, Ulysses index ``g % U``).
- ``chunks``: an explicit table (``SequenceLayout.from_chunks``): the padded sequence is cut into
  ``C = len(chunk_ranks)`` equal chunks and chunk ``c`` goes to ring rank ``chunk_ranks[c]``; a ring
  rank's chunks, in increasing order, are split among its ``U`` Ulysses ranks as under zigzag (which is
  the table ``0 1 .. R-1 R-1 .. 1 0``). ``SequenceLayout.balanced_for`` builds the table that evens
  out a mask's work (Note [Balancing a mask's work]).

Note [Zigzag layout]
    Causal attention gives late tokens more keys than early ones, so a contiguous split leaves rank
    ``P-1`` with ``2P-1`` times the work of rank 0. Cut the sequence into ``2R`` equal chunks and give
    ring rank ``i`` chunks ``i`` and ``2R-1-i``: every rank then holds one cheap and one expensive
    chunk and does the same work at every ring step (Brandon et al. 2023; ring-flash-attn)::

        chunks:  0  1  2  3  4  5  6  7        (R = 4)
        rank:    0  1  2  3  3  2  1  0

Note [Balancing a mask's work]
    Zigzag evens out plain causal work, but a bidirectional span (prefix-LM) gives its rows the
    span's whole width: at ``s = N/2`` rank 0 of zigzag holds the first and last chunks, and the
    first chunk's rows now see ``s`` keys, not a few (busiest rank 1.10x the mean at P = 2, 1.15x at
    P = 4; 1.375x / 1.44x causal's busiest, for 1.25x the pairs). ``balanced_for`` counts the visible
    keys of every row exactly from the mask's structure (each part is an interval of keys per row:
    documents, causality extended to the end of the row's span, window, key padding; ``mask_mod``
    only hides, so it is not counted), sums them per chunk of ``C = k*R`` equal chunks, and assigns
    chunks heaviest first, each to the lightest ring rank that still holds fewer than ``k`` (greedy
    LPT with equal counts), then swaps pairs of chunks between the busiest rank and another while
    that lowers the busiest rank's work. Under plain causal work with ``k = 2`` the greedy pass gives
    exactly zigzag (chunk work is linear in the chunk index, so mirrored pairs tie). ``k`` is the
    smallest in ``2 .. max_chunks_per_rank`` whose busiest rank is within ``tolerance`` (3%) of the
    best ``k``'s: more chunks mean more runs, more and smaller kernel calls (at P = 4, N = 16K, a
    10% span: 8 chunks per rank ran 68 calls per rank against zigzag's 9, and 9% slower on CPU, for a
    busiest rank 1.011x the mean instead of 1.030x), so a few percent of balance is not worth them;
    only the ``k`` that pad ``seq_len`` least are tried, so a length zigzag splits evenly is not padded. The table is a
    pure function of its arguments, so every rank builds the same one; it is balanced for the length
    and mask it was built for and exact for any (another length scales the chunks with the padded
    length, and the mask's spans do not move with it).

Lengths that no degree divides are padded at the end to ``padded_length(N, P, layout)``; the
attention treats positions ``>= N`` as padding that no real token attends to, the loss ignores them,
and ``gather_sequence(..., seq_len=N)`` trims them off again.

Note [The global length travels with the shard]
    A rank cannot tell from its shard whether the last positions of the global sequence are padding,
    and attending to padded keys is silently wrong (DeepSpeed #7384). So the length always reaches the
    attention, by one of (first wins): ``attn(..., seq_len=N)``; the tensors themselves, which
    ``shard_sequence`` tags with ``N`` (``global_seq_len_of``); the bound context's ``global_seq_len``,
    set by ``SequenceParallelStrategy`` for every batch. Over more than one rank, an attention call
    that finds none of them raises an error naming ``seq_len`` instead of guessing.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache
from typing import NamedTuple

import torch
import torch.distributed as dist
import torch.nn.functional as F

from lightning_sp.comm.collectives import all_gather_along, all_gather_replicated_loss
from lightning_sp.comm.stats import CommStats
from lightning_sp.masks import AttentionMask, StructuredMask

__all__ = [
    "SequenceLayout",
    "Run",
    "as_layout",
    "padded_length",
    "token_indices",
    "runs_of",
    "runs_for_ranks",
    "sequence_positions",
    "shard_sequence",
    "gather_sequence",
    "group_size_and_rank",
    "global_seq_len_of",
    "visible_keys_per_row",
]

_SEQ_LEN_ATTR = "_lightning_sp_global_seq_len"


def global_seq_len_of(x: torch.Tensor) -> int | None:
    """The unpadded global length ``shard_sequence`` recorded on ``x`` (``None``: not a shard it made).
    See Note [The global length travels with the shard]."""
    return getattr(x, _SEQ_LEN_ATTR, None)


LAYOUT_KINDS = ("contiguous", "zigzag", "chunks")


@dataclass(frozen=True)
class SequenceLayout:
    kind: str = "contiguous"
    """``"contiguous"``, ``"zigzag"`` or ``"chunks"`` (an explicit table: ``from_chunks``, ``balanced_for``)."""
    ulysses_degree: int = 1
    """For zigzag and chunks: the Ulysses degree inside each ring rank (``usp``); 1 for a plain ring."""
    chunk_ranks: tuple[int, ...] | None = None
    """For ``"chunks"``: the ring rank of each of the ``len(chunk_ranks)`` equal chunks of the padded
    sequence, in sequence order; every ring rank ``0 .. R-1`` holds the same number of chunks."""

    def __post_init__(self) -> None:
        if self.kind not in LAYOUT_KINDS:
            raise ValueError(f"layout kind must be 'contiguous' or 'zigzag' (or 'chunks' with chunk_ranks, see "
                             f"SequenceLayout.from_chunks / balanced_for), got {self.kind!r}")
        if isinstance(self.ulysses_degree, bool) or not isinstance(self.ulysses_degree, int) or self.ulysses_degree < 1:
            raise ValueError(f"layout ulysses_degree must be an int >= 1, got {self.ulysses_degree!r}")
        if self.kind == "contiguous" and self.ulysses_degree != 1:
            raise ValueError("a contiguous layout has no Ulysses sub-split; use ulysses_degree=1")
        if (self.kind == "chunks") != (self.chunk_ranks is not None):
            raise ValueError("chunk_ranks goes with kind='chunks' and only with it: build a chunk table with "
                             "SequenceLayout.from_chunks(chunk_ranks) or SequenceLayout.balanced_for(...)")
        if self.chunk_ranks is not None:
            _check_chunk_ranks(self.chunk_ranks)

    @property
    def ring_size(self) -> int | None:
        """Ring ranks a ``"chunks"`` table is built for (``None``: the layout fits any group)."""
        return None if self.chunk_ranks is None else max(self.chunk_ranks) + 1

    def __str__(self) -> str:
        name = self.kind
        if self.chunk_ranks is not None:
            name = f"chunks({' '.join(map(str, self.chunk_ranks))})"
        return name if self.ulysses_degree == 1 else f"{name}(ulysses={self.ulysses_degree})"

    @classmethod
    def from_chunks(cls, chunk_ranks, *, ulysses_degree: int = 1) -> "SequenceLayout":
        """The layout that cuts the padded sequence into ``len(chunk_ranks)`` equal chunks and gives chunk
        ``c`` to ring rank ``chunk_ranks[c]`` (``[0, 1, 1, 0]`` is zigzag over 2 ranks)."""
        if isinstance(chunk_ranks, (str, bytes)) or not hasattr(chunk_ranks, "__iter__"):
            raise ValueError(f"chunk_ranks must be a sequence of ring ranks, one per chunk; got {chunk_ranks!r}")
        return cls("chunks", ulysses_degree, tuple(chunk_ranks))

    @classmethod
    def balanced_for(cls, seq_len: int, world_size: int, mask: AttentionMask | None = None, *, causal: bool = True,
                     ulysses_degree: int = 1, chunks_per_rank: int | None = None, max_chunks_per_rank: int = 8,
                     tolerance: float = 0.03) -> "SequenceLayout":
        """The chunk table that evens out the visible (query, key) pairs of ``mask`` (with ``causal``) over
        ``world_size / ulysses_degree`` ring ranks at global length ``seq_len`` (Note [Balancing a mask's
        work]); pass it as ``SequenceParallelAttention(..., layout=)`` with ``ring``, ``zigzag_ring``,
        ``allgather_kv`` or ``usp`` (the same ``ulysses_degree``), and shard with it. ``chunks_per_rank``
        (``k``): fixed, else the smallest in ``2 .. max_chunks_per_rank`` whose busiest ring rank's work is within
        ``tolerance`` of the best of them, among those that pad ``seq_len`` least."""
        for name, value in (("seq_len", seq_len), ("world_size", world_size)):
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"balanced_for: {name} must be an int >= 1, got {value!r}")
        if mask is not None and not isinstance(mask, AttentionMask):
            raise ValueError(f"balanced_for: mask must be a lightning_sp.AttentionMask or None, got "
                             f"{type(mask).__name__}")
        if isinstance(ulysses_degree, bool) or not isinstance(ulysses_degree, int) or ulysses_degree < 1 \
                or world_size % ulysses_degree:
            raise ValueError(f"balanced_for: ulysses_degree={ulysses_degree!r} must be an int >= 1 dividing "
                             f"world_size={world_size}")
        if chunks_per_rank is not None and (isinstance(chunks_per_rank, bool) or not isinstance(chunks_per_rank, int)
                                            or chunks_per_rank < 1):
            raise ValueError(f"balanced_for: chunks_per_rank must be an int >= 1 or None (chosen), got "
                             f"{chunks_per_rank!r}")
        if isinstance(max_chunks_per_rank, bool) or not isinstance(max_chunks_per_rank, int) or max_chunks_per_rank < 2:
            raise ValueError(f"balanced_for: max_chunks_per_rank must be an int >= 2, got {max_chunks_per_rank!r}")
        ring = world_size // ulysses_degree
        candidates = [chunks_per_rank] if chunks_per_rank is not None else list(range(2, max_chunks_per_rank + 1))
        # the least padding first: a table whose chunks do not divide seq_len would pad what zigzag does not
        least = min(-(-seq_len // (k * world_size)) * k * world_size for k in candidates)
        tables = []  # (busiest rank over the mean, table), fewest chunks first
        for k in (k for k in candidates if -(-seq_len // (k * world_size)) * k * world_size == least):
            table, loads = _balanced_table(seq_len, ring, ulysses_degree, k, mask, bool(causal))
            tables.append((max(loads) / (sum(loads) / ring) if sum(loads) else 1.0, table))
        best = min(imbalance for imbalance, _ in tables)
        return cls("chunks", ulysses_degree, next(t for imbalance, t in tables if imbalance <= best * (1 + tolerance)))


def _check_chunk_ranks(chunk_ranks: tuple[int, ...]) -> None:
    if not chunk_ranks or any(isinstance(r, bool) or not isinstance(r, int) or r < 0 for r in chunk_ranks):
        raise ValueError(f"chunk_ranks must be a non-empty sequence of ring ranks (ints >= 0), one per chunk; "
                         f"got {chunk_ranks!r}")
    ring = max(chunk_ranks) + 1
    counts = [chunk_ranks.count(r) for r in range(ring)]
    if min(counts) != max(counts):
        raise ValueError(f"chunk_ranks must give every ring rank 0..{ring - 1} the same number of chunks (equal "
                         f"shards); got counts {counts} from {chunk_ranks!r}")


def visible_keys_per_row(structured: StructuredMask, length: int) -> torch.Tensor:
    """How many keys each query row ``0 .. length-1`` sees under ``structured`` (``[length]`` int64), exact:
    every structural part admits an interval of keys per row, so the count is the width of their
    intersection (causality reaches to the end of the row's bidirectional span, if any)."""
    q = torch.arange(length, dtype=torch.long)
    lo = torch.zeros_like(q)
    hi = torch.full_like(q, length)
    if structured.doc_bounds is not None:
        bounds = torch.tensor(structured.doc_bounds, dtype=torch.long)
        i = torch.bucketize(q, bounds, right=True)  # bounds[i-1] <= q < bounds[i]
        edges = torch.cat([torch.zeros(1, dtype=torch.long), bounds, torch.full((1,), length, dtype=torch.long)])
        lo, hi = torch.maximum(lo, edges[i]), torch.minimum(hi, edges[i + 1])
    if structured.causal:
        reach = q + 1
        for s, e in structured.spans:
            inside = (q >= s) & (q < e)
            reach = torch.where(inside, torch.full_like(q, e), reach)
        hi = torch.minimum(hi, reach)
    if structured.left is not None:
        lo = torch.maximum(lo, q - structured.left)
    if structured.right is not None:
        hi = torch.minimum(hi, q + structured.right + 1)
    if structured.keys is not None:
        lo, hi = torch.clamp(lo, min=structured.keys[0]), torch.clamp(hi, max=structured.keys[1])
    return (hi - lo).clamp(min=0)


def _balanced_table(seq_len: int, ring: int, u: int, k: int, mask: AttentionMask | None,
                    causal: bool) -> tuple[tuple[int, ...], list[int]]:
    """``(chunk_ranks, work per ring rank)`` for ``k`` chunks per ring rank (Note [Balancing a mask's work])."""
    chunks = k * ring
    padded = -(-seq_len // (chunks * u)) * (chunks * u)
    doc_bounds = (0, seq_len, padded) if padded > seq_len else None  # padding is a document of its own
    structured = (mask or AttentionMask()).structured(causal=causal, doc_bounds=doc_bounds, padded_len=padded)
    rows = visible_keys_per_row(structured, padded)
    work = [int(w) for w in rows.view(chunks, padded // chunks).sum(1).tolist()]
    owner = [-1] * chunks
    loads, held = [0] * ring, [0] * ring
    for c in sorted(range(chunks), key=lambda c: (-work[c], -c)):  # heaviest first; ties: the later chunk
        r = min((r for r in range(ring) if held[r] < k), key=lambda r: (loads[r], r))
        owner[c], loads[r], held[r] = r, loads[r] + work[c], held[r] + 1
    for _ in range(4 * chunks):  # swaps that lower the busiest rank's work
        busiest = max(range(ring), key=lambda r: (loads[r], -r))
        best = None
        for x in (c for c in range(chunks) if owner[c] == busiest):
            for y in (c for c in range(chunks) if owner[c] != busiest and work[c] < work[x]):
                delta = work[x] - work[y]
                peak = max(loads[busiest] - delta, loads[owner[y]] + delta)
                if peak < loads[busiest] and (best is None or peak < best[0]):
                    best = (peak, x, y)
        if best is None:
            break
        _, x, y = best
        other, delta = owner[y], work[x] - work[y]
        owner[x], owner[y] = other, busiest
        loads[busiest] -= delta
        loads[other] += delta
    return tuple(owner), loads


def as_layout(layout: "SequenceLayout | str") -> SequenceLayout:
    if isinstance(layout, SequenceLayout):
        return layout
    if isinstance(layout, str):
        return SequenceLayout(kind=layout)
    raise TypeError(f"layout must be a SequenceLayout or 'contiguous'/'zigzag', got {type(layout).__name__}")


def _check_degrees(layout: SequenceLayout, world_size: int) -> None:
    if world_size % layout.ulysses_degree:
        raise ValueError(
            f"layout {layout} needs the group size ({world_size}) to be a multiple of its "
            f"ulysses_degree ({layout.ulysses_degree})"
        )
    if layout.ring_size is not None and world_size // layout.ulysses_degree != layout.ring_size:
        raise ValueError(
            f"layout {layout} is a chunk table for {layout.ring_size} ring ranks, but a group of {world_size} "
            f"with ulysses_degree={layout.ulysses_degree} has {world_size // layout.ulysses_degree}: build it for "
            f"this group (SequenceLayout.balanced_for(seq_len, world_size={world_size}, ...))"
        )


def padded_length(seq_len: int, world_size: int, layout: "SequenceLayout | str" = "contiguous") -> int:
    """Smallest length >= ``seq_len`` that ``layout`` splits evenly over ``world_size`` ranks."""
    layout = as_layout(layout)
    _check_degrees(layout, world_size)
    if layout.kind == "contiguous":
        multiple = world_size
    elif layout.kind == "zigzag":
        multiple = 2 * world_size
    else:  # equal chunks, each ring rank's share split evenly among its Ulysses ranks
        multiple = len(layout.chunk_ranks) * layout.ulysses_degree
    return -(-seq_len // multiple) * multiple


def _zigzag_table(ring_size: int) -> tuple[int, ...]:
    """Note [Zigzag layout] as a chunk table: ring rank ``i`` holds chunks ``i`` and ``2R-1-i``."""
    return tuple(range(ring_size)) + tuple(reversed(range(ring_size)))


@lru_cache(maxsize=256)
def _token_indices_cached(layout: SequenceLayout, world_size: int, padded_len: int, rank: int) -> tuple[int, ...]:
    local = padded_len // world_size
    if layout.kind == "contiguous":
        return tuple(range(rank * local, (rank + 1) * local))
    u = layout.ulysses_degree
    ring_size = world_size // u
    ring_idx, ulysses_idx = divmod(rank, u)
    table = layout.chunk_ranks if layout.chunk_ranks is not None else _zigzag_table(ring_size)
    chunk = padded_len // len(table)
    ring_tokens = [t for c, owner in enumerate(table) if owner == ring_idx for t in range(c * chunk, (c + 1) * chunk)]
    return tuple(ring_tokens[ulysses_idx * local : (ulysses_idx + 1) * local])


def token_indices(layout: "SequenceLayout | str", world_size: int, padded_len: int, rank: int) -> torch.Tensor:
    """Global indices of the tokens rank ``rank`` holds, in local order. ``[padded_len / world_size]``."""
    layout = as_layout(layout)
    if padded_len != padded_length(padded_len, world_size, layout):
        raise ValueError(
            f"padded_len={padded_len} does not split evenly for layout {layout} over {world_size} ranks; "
            f"use padded_length() = {padded_length(padded_len, world_size, layout)}"
        )
    return torch.tensor(_token_indices_cached(layout, world_size, padded_len, rank), dtype=torch.long)


class Run(NamedTuple):
    """A stretch of tokens contiguous both locally and globally."""

    local_start: int
    global_start: int
    length: int

    @property
    def global_end(self) -> int:
        return self.global_start + self.length


def runs_of(indices: "torch.Tensor | list[int]") -> list[Run]:
    """Split a list of global token indices into maximal runs of consecutive tokens."""
    idx = indices.tolist() if isinstance(indices, torch.Tensor) else list(indices)
    runs: list[Run] = []
    start = 0
    for i in range(1, len(idx) + 1):
        if i == len(idx) or idx[i] != idx[i - 1] + 1:
            runs.append(Run(start, idx[start], i - start))
            start = i
    return runs


@lru_cache(maxsize=1024)
def runs_for_ranks(layout: SequenceLayout, world_size: int, padded_len: int, ranks: tuple[int, ...]) -> tuple[Run, ...]:
    """Runs of the tokens of ``ranks`` concatenated in that order (e.g. all ranks after an
    all-gather). Cached: the same layouts recur at every layer and step."""
    indices: list[int] = []
    for r in ranks:
        indices.extend(_token_indices_cached(layout, world_size, padded_len, r))
    return tuple(runs_of(indices))


def group_size_and_rank(group) -> tuple[int, int]:
    """``(1, 0)`` when there is no group or no process group is initialised."""
    if group is None and not dist.is_initialized():
        return 1, 0
    return dist.get_world_size(group), dist.get_rank(group)


def sequence_positions(
    seq_len: int, group, *, layout: "SequenceLayout | str" = "contiguous", device=None
) -> torch.Tensor:
    """Global position of each of this rank's tokens (``>= seq_len`` marks padding). ``[S_local]``."""
    world, rank = group_size_and_rank(group)
    layout = as_layout(layout)
    return token_indices(layout, world, padded_length(seq_len, world, layout), rank).to(device)


def shard_sequence(
    x: torch.Tensor, group, *, dim: int = 1, layout: "SequenceLayout | str" = "contiguous", pad_value=0
) -> torch.Tensor:
    """This rank's shard of the global sequence ``x`` (same on every rank), padded with ``pad_value``
    to an even split. ``[..., N, ...] -> [..., N_pad / P, ...]``.

    The result records ``N`` (``global_seq_len_of``), so ``SequenceParallelAttention`` called on it
    directly never attends to the padding (Note [The global length travels with the shard]). A tensor
    computed *from* the shard (a projection) does not carry it: pass ``seq_len=N`` to the attention.
    """
    world, rank = group_size_and_rank(group)
    layout = as_layout(layout)
    seq_len = x.size(dim)
    n_pad = padded_length(seq_len, world, layout)
    if n_pad != seq_len:
        dim_ = dim % x.dim()
        pad = [0, 0] * (x.dim() - 1 - dim_) + [0, n_pad - seq_len]
        x = F.pad(x, pad, value=pad_value)
    if world > 1:
        idx = token_indices(layout, world, n_pad, rank).to(x.device)
        x = x.index_select(dim, idx)
    elif x.size(dim) == seq_len and n_pad == seq_len:
        x = x.view_as(x)  # a new tensor object: never tag the caller's own tensor
    setattr(x, _SEQ_LEN_ATTR, seq_len)
    return x


def gather_sequence(
    x_local: torch.Tensor,
    group,
    *,
    dim: int = 1,
    layout: "SequenceLayout | str" = "contiguous",
    seq_len: int | None = None,
    stats: CommStats | None = None,
    reduce_grad: bool = True,
) -> torch.Tensor:
    """The whole sequence on every rank: the exact inverse of ``shard_sequence`` (pass ``seq_len`` to
    drop the padding; it defaults to the length ``shard_sequence`` recorded on ``x_local``, if any).

    Gradient rule. With ``reduce_grad=True`` (default) the backward is a reduce-scatter: this shard's
    gradient is the *sum* over ranks of the gradients each rank's loss sends to it. That is right when
    each rank's loss is a different part of the total (e.g. every rank scores its own slice of the
    gathered output). If instead every rank computes the *same* loss from the gathered sequence, the
    sum counts that loss ``P`` times: the gradient is ``P`` times the single-process one. For that
    pattern pass ``reduce_grad=False``: the backward keeps this rank's slice of its own gradient (no
    communication), which is exactly the single-process gradient::

        full = gather_sequence(out_local, group, layout=layout, seq_len=N, reduce_grad=False)
        loss = criterion(full, target)          # identical on every rank
        loss.backward()                         # shard gradients == single-process gradients
    """
    world, _ = group_size_and_rank(group)
    layout = as_layout(layout)
    if seq_len is None:
        seq_len = global_seq_len_of(x_local)
    if world == 1:
        gathered = x_local
    else:
        local = x_local.size(dim)
        n_pad = local * world
        gather = all_gather_along if reduce_grad else all_gather_replicated_loss
        gathered = gather(x_local, group, dim=dim, stats=stats)  # rank order
        perm = torch.cat([token_indices(layout, world, n_pad, r) for r in range(world)])
        gathered = gathered.index_select(dim, torch.argsort(perm).to(x_local.device))
    if seq_len is not None:
        if seq_len > gathered.size(dim):
            raise ValueError(f"seq_len={seq_len} exceeds the gathered length {gathered.size(dim)}")
        gathered = gathered.narrow(dim, 0, seq_len)
    return gathered
