"""How a global sequence is split across a sequence-parallel group, for any sequence length.

Layouts (``SequenceLayout``; the strings ``"contiguous"`` and ``"zigzag"`` are accepted too):

- ``contiguous``: rank ``g`` holds tokens ``[g*L, (g+1)*L)``, ``L = N_pad / P``.
- ``zigzag``: see Note [Zigzag layout]. With ``ulysses_degree = U > 1`` (the ``usp`` layout) the
  zigzag runs over the ``R = P / U`` ring ranks and each ring rank's tokens are split contiguously
  among its ``U`` Ulysses ranks (group rank ``g`` = ring index ``g // U``, Ulysses index ``g % U``).

Note [Zigzag layout]
    Causal attention gives late tokens more keys than early ones, so a contiguous split leaves rank
    ``P-1`` with ``2P-1`` times the work of rank 0. Cut the sequence into ``2R`` equal chunks and give
    ring rank ``i`` chunks ``i`` and ``2R-1-i``: every rank then holds one cheap and one expensive
    chunk and does the same work at every ring step (Brandon et al. 2023; ring-flash-attn)::

        chunks:  0  1  2  3  4  5  6  7        (R = 4)
        rank:    0  1  2  3  3  2  1  0

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
]

_SEQ_LEN_ATTR = "_lightning_sp_global_seq_len"


def global_seq_len_of(x: torch.Tensor) -> int | None:
    """The unpadded global length ``shard_sequence`` recorded on ``x`` (``None``: not a shard it made).
    See Note [The global length travels with the shard]."""
    return getattr(x, _SEQ_LEN_ATTR, None)


@dataclass(frozen=True)
class SequenceLayout:
    kind: str = "contiguous"
    """``"contiguous"`` or ``"zigzag"``."""
    ulysses_degree: int = 1
    """For zigzag: the Ulysses degree inside each ring rank (``usp``); 1 for plain zigzag."""

    def __post_init__(self) -> None:
        if self.kind not in ("contiguous", "zigzag"):
            raise ValueError(f"layout kind must be 'contiguous' or 'zigzag', got {self.kind!r}")
        if self.ulysses_degree < 1:
            raise ValueError(f"layout ulysses_degree must be >= 1, got {self.ulysses_degree}")
        if self.kind == "contiguous" and self.ulysses_degree != 1:
            raise ValueError("a contiguous layout has no Ulysses sub-split; use ulysses_degree=1")

    def __str__(self) -> str:
        return self.kind if self.ulysses_degree == 1 else f"{self.kind}(ulysses={self.ulysses_degree})"


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


def padded_length(seq_len: int, world_size: int, layout: "SequenceLayout | str" = "contiguous") -> int:
    """Smallest length >= ``seq_len`` that ``layout`` splits evenly over ``world_size`` ranks."""
    layout = as_layout(layout)
    _check_degrees(layout, world_size)
    multiple = world_size if layout.kind == "contiguous" else 2 * world_size
    return -(-seq_len // multiple) * multiple


@lru_cache(maxsize=256)
def _token_indices_cached(layout: SequenceLayout, world_size: int, padded_len: int, rank: int) -> tuple[int, ...]:
    local = padded_len // world_size
    if layout.kind == "contiguous":
        return tuple(range(rank * local, (rank + 1) * local))
    u = layout.ulysses_degree
    ring_size = world_size // u
    ring_idx, ulysses_idx = divmod(rank, u)
    chunk = padded_len // (2 * ring_size)
    first, second = ring_idx, 2 * ring_size - 1 - ring_idx
    ring_tokens = list(range(first * chunk, (first + 1) * chunk)) + list(range(second * chunk, (second + 1) * chunk))
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
