"""Epoch plans for packed protein contexts, sharded across data-parallel replicas by record number.

Note [Packed-context plan]
    An epoch is planned from the residue counts alone (``IndexedFasta.lengths``); no sequence is read
    to plan it, and each replica then reads only the records in its own contexts::

        records 0..n-1 --seeded permutation (seed, epoch)--> position p holds record perm(p)
        replica r takes positions r, r+R, r+2R, ...       (R = data-parallel replicas)
        each record -> one document  <cls> residues <eos>   (L + 2 tokens)
            longer than the context: a seeded random window of context_len tokens (ESM-style crop)
        documents fill contexts of exactly context_len tokens (the token budget), either
          packing="split" (default): in order; a document that does not fit is split: its head ends
            one context, its tail starts the next (no padding at all), or
          packing="whole": never split; each bucket of `bucket_records` consecutive documents is
            sorted by length (the length bucket) and placed first-fit-decreasing into contexts, whose
            remaining room is one padding segment (PAD_RECORD: <pad> tokens, no loss)
        every replica yields the same number of contexts: min over replicas of
            floor(replica tokens / context_len), computed by every rank from the shared lengths (no
            collective: every rank derives the same number from the same index); "whole" packing
            makes at least that many (padding only adds contexts), so the rule holds for both

    The permutation is a keyed Feistel bijection of ``[0, n)`` evaluated only where needed (cycle
    walking keeps it inside ``[0, n)``), so a 100M-record epoch costs no 800 MB index array. Ranks of
    one sequence-parallel group share the data-parallel rank, hence the same plan and the same contexts.
"""

from __future__ import annotations

import math
from collections.abc import Iterator, Sequence
from dataclasses import dataclass

import numpy as np
from torch.utils.data import DataLoader, DistributedSampler, IterableDataset

_CHUNK = 1 << 16  # positions evaluated per vectorised step
PAD_RECORD = -1
"""Record number of a padding piece ``(PAD_RECORD, 0, n)``: ``n`` ``<pad>`` tokens ("whole" packing)."""
_M1, _M2 = np.uint64(0xBF58476D1CE4E5B9), np.uint64(0x94D049BB133111EB)


def _mix64(x: np.ndarray) -> np.ndarray:
    """splitmix64's finaliser, uint64 -> uint64 (multiplication wraps mod 2^64)."""
    x = (x ^ (x >> np.uint64(30))) * _M1
    x = (x ^ (x >> np.uint64(27))) * _M2
    return x ^ (x >> np.uint64(31))


def permute_positions(positions: np.ndarray, n: int, key: Sequence[int]) -> np.ndarray:
    """``perm(positions)`` for a bijection ``perm`` of ``[0, n)`` chosen by ``key`` (ints).

    Memory is O(len(positions)): a 4-round Feistel network on ``2 * half`` bits
    (``2^(2*half) >= n``), re-applied to outputs ``>= n`` until they fall inside (cycle walking).
    """
    if n < 1:
        raise ValueError(f"cannot permute an empty range (n={n})")
    half = max(1, ((n - 1).bit_length() + 1) // 2)
    mask, shift = np.uint64((1 << half) - 1), np.uint64(half)
    round_keys = np.random.SeedSequence([int(k) for k in key]).generate_state(4, np.uint64)
    positions = np.asarray(positions, dtype=np.int64)
    if positions.size and (positions.min() < 0 or positions.max() >= n):
        raise ValueError(f"positions must lie in [0, {n})")
    out = positions.astype(np.uint64)
    pending = np.arange(out.shape[0])
    while pending.size:
        x = out[pending]
        left, right = x >> shift, x & mask
        for k in round_keys:
            left, right = right, left ^ (_mix64(right ^ k) & mask)
        x = (left << shift) | right
        out[pending] = x
        pending = pending[x >= np.uint64(n)]
    return out.astype(np.int64)


@dataclass(frozen=True)
class ContextSpec:
    """One context to build: what ``ProteinContextDataset.__getitem__`` receives from the sampler."""

    kind: str
    """``"single"`` (packed proteins) or ``"family"`` (a homolog-family window)."""
    sample_seed: int
    """Seeds masking (and, for ``family``, the family, member order and window)."""
    pieces: tuple[tuple[int, int, int], ...] = ()
    """``single``: ``(record, start, stop)`` token ranges of ``<cls> residues <eos>``, in order
    (``record == PAD_RECORD``: ``stop - start`` padding tokens)."""


def _document_tokens(lengths: np.ndarray, context_len: int) -> np.ndarray:
    """Tokens each record contributes: ``min(L + 2, context_len)`` (int64)."""
    return np.minimum(lengths.astype(np.int64) + 2, context_len)


def _replica_positions(n: int, replicas: int, rank: int) -> Iterator[np.ndarray]:
    for start in range(rank, n, _CHUNK * replicas):
        yield np.arange(start, min(n, start + _CHUNK * replicas), replicas, dtype=np.int64)


def _record_order(positions: np.ndarray, n: int, *, shuffle: bool, seed: int, epoch: int) -> np.ndarray:
    return permute_positions(positions, n, (seed, epoch, 0x5EED)) if shuffle else positions


def contexts_per_replica(
    lengths: np.ndarray, context_len: int, *, replicas: int, shuffle: bool, seed: int, epoch: int
) -> list[int]:
    """``floor(tokens / context_len)`` for every replica's share of this epoch (see the Note)."""
    n = int(lengths.shape[0])
    tokens = np.zeros(replicas, dtype=np.int64)
    for start in range(0, n, _CHUNK * replicas):
        pos = np.arange(start, min(n, start + _CHUNK * replicas), dtype=np.int64)
        rec = _record_order(pos, n, shuffle=shuffle, seed=seed, epoch=epoch)
        tokens += np.bincount(pos % replicas, weights=_document_tokens(lengths[rec], context_len), minlength=replicas).astype(np.int64)
    return [int(t) // context_len for t in tokens]


def crop_start(record: int, length: int, context_len: int, *, seed: int, epoch: int) -> int:
    """First token of the window kept of a document of ``length + 2`` tokens (0 when it fits)."""
    excess = length + 2 - context_len
    if excess <= 0:
        return 0
    draw = int(_mix64(np.array([record], dtype=np.uint64) ^ np.uint64((seed * 0x9E3779B1 + epoch * 0x85EBCA77 + 1) & (2**64 - 1)))[0])
    return draw % (excess + 1)


def packed_contexts(
    lengths: np.ndarray, context_len: int, *, replicas: int, rank: int, shuffle: bool, seed: int, epoch: int,
    record_offset: int = 0, packing: str = "split", bucket_records: int = 256,
) -> Iterator[tuple[tuple[int, int, int], ...]]:
    """This replica's contexts, in order, as ``(record + record_offset, start, stop)`` pieces.

    Streams: memory is one chunk of positions plus one context (one bucket for ``"whole"``).
    """
    n = int(lengths.shape[0])

    def documents() -> Iterator[tuple[int, int, int]]:  # (record, first token, end token) after the crop
        for pos in _replica_positions(n, replicas, rank):
            for rec in _record_order(pos, n, shuffle=shuffle, seed=seed, epoch=epoch).tolist():
                length = int(lengths[rec])
                begin = crop_start(rec, length, context_len, seed=seed, epoch=epoch)
                yield rec + record_offset, begin, begin + min(length + 2, context_len)

    if packing == "whole":
        yield from _first_fit_buckets(documents(), context_len, bucket_records)
        return
    if packing != "split":
        raise ValueError(f"packing must be 'split' or 'whole', got {packing!r}")
    pieces: list[tuple[int, int, int]] = []
    room = context_len
    for rec, begin, end in documents():
        while begin < end:
            take = min(room, end - begin)
            pieces.append((rec, begin, begin + take))
            begin += take
            room -= take
            if room == 0:
                yield tuple(pieces)
                pieces, room = [], context_len


def _first_fit_buckets(
    documents: Iterator[tuple[int, int, int]], context_len: int, bucket_records: int
) -> Iterator[tuple[tuple[int, int, int], ...]]:
    """Whole documents, first-fit-decreasing within buckets of ``bucket_records``, padded to the budget."""
    if bucket_records < 1:
        raise ValueError(f"bucket_records must be >= 1, got {bucket_records}")
    bucket: list[tuple[int, int, int]] = []

    def flush() -> Iterator[tuple[tuple[int, int, int], ...]]:
        bins: list[list[tuple[int, int, int]]] = []
        rooms: list[int] = []
        for doc in sorted(bucket, key=lambda d: d[1] - d[2]):  # longest first
            size = doc[2] - doc[1]
            k = next((k for k, room in enumerate(rooms) if room >= size), None)
            if k is None:
                bins.append([])
                rooms.append(context_len)
                k = len(bins) - 1
            bins[k].append(doc)
            rooms[k] -= size
        for pieces, room in zip(bins, rooms):
            yield tuple(pieces) + (((PAD_RECORD, 0, room),) if room else ())
        bucket.clear()

    for doc in documents:
        bucket.append(doc)
        if len(bucket) == bucket_records:
            yield from flush()
    yield from flush()


class PackedContextSampler(DistributedSampler):
    """Yields ``ContextSpec``s for one data-parallel replica (Note [Packed-context plan]).

    A ``DistributedSampler`` subclass so that Lightning, which would otherwise wrap a custom sampler
    in a second distributed split, leaves it alone; ``set_epoch`` (called by Lightning every epoch)
    reshuffles. ``kinds`` cycle per context (``("single", "family")``: single, family, single, ...);
    ``max_contexts`` caps the contexts of all replicas together (split evenly, rounded up);
    ``packing`` / ``bucket_records``: see the Note.
    """

    def __init__(
        self,
        lengths: np.ndarray,
        *,
        context_len: int,
        num_replicas: int = 1,
        rank: int = 0,
        shuffle: bool = True,
        seed: int = 0,
        kinds: Sequence[str] = ("single",),
        max_contexts: int | None = None,
        record_offset: int = 0,
        packing: str = "split",
        bucket_records: int = 256,
    ) -> None:  # DistributedSampler.__init__ is not called: it needs a dataset length and a process group
        if num_replicas < 1 or not 0 <= rank < num_replicas:
            raise ValueError(f"need 0 <= rank < num_replicas, got rank={rank}, num_replicas={num_replicas}")
        if context_len < 2:
            raise ValueError(f"context_len must be >= 2, got {context_len}")
        kinds = tuple(kinds)
        if not kinds or set(kinds) - {"single", "family"}:
            raise ValueError(f"kinds must be a non-empty tuple of 'single'/'family', got {kinds}")
        if "single" not in kinds and max_contexts is None:
            raise ValueError("with kinds=('family',) only, set samples_per_epoch (max_contexts): there is no pass over records to end an epoch")
        if max_contexts is not None and max_contexts < 1:
            raise ValueError(f"samples_per_epoch (max_contexts) must be >= 1 or None, got {max_contexts}")
        self.lengths, self.context_len, self.kinds = lengths, context_len, kinds
        self.num_replicas, self.rank, self.shuffle, self.seed = num_replicas, rank, shuffle, seed
        self.max_contexts, self.record_offset = max_contexts, record_offset
        if packing not in ("split", "whole"):
            raise ValueError(f"packing must be 'split' or 'whole', got {packing!r}")
        if bucket_records < 1:
            raise ValueError(f"bucket_records must be >= 1, got {bucket_records}")
        self.packing, self.bucket_records = packing, bucket_records
        self.epoch = 0
        self.drop_last = True
        self._length_cache: tuple[int, int] | None = None  # (plan epoch, len): len is O(n) to compute

    def _plan_epoch(self) -> int:
        return self.epoch if self.shuffle else 0  # unshuffled (validation): the same contexts every epoch

    def __len__(self) -> int:
        epoch = self._plan_epoch()
        if self._length_cache is not None and self._length_cache[0] == epoch:
            return self._length_cache[1]
        cap = math.inf if self.max_contexts is None else -(-self.max_contexts // self.num_replicas)
        if "single" not in self.kinds:
            length = int(cap)
        else:
            per_replica = contexts_per_replica(
                self.lengths, self.context_len, replicas=self.num_replicas, shuffle=self.shuffle, seed=self.seed, epoch=epoch,
            )
            if min(per_replica) == 0:
                raise ValueError(
                    f"a data-parallel replica gets fewer than context_len={self.context_len} tokens this epoch "
                    f"({len(self.lengths)} proteins over {self.num_replicas} replicas): use more data, a shorter "
                    "context or fewer data-parallel replicas"
                )
            length = int(min(cap, min(per_replica) * len(self.kinds)))
        self._length_cache = (epoch, length)
        return length

    def __iter__(self) -> Iterator[ContextSpec]:
        epoch, total = self._plan_epoch(), len(self)
        singles = packed_contexts(
            self.lengths, self.context_len, replicas=self.num_replicas, rank=self.rank, shuffle=self.shuffle,
            seed=self.seed, epoch=epoch, record_offset=self.record_offset, packing=self.packing,
            bucket_records=self.bucket_records,
        ) if "single" in self.kinds else iter(())
        seeds = np.random.SeedSequence([self.seed, epoch, self.rank]).generate_state(max(total, 1), np.uint32)
        for j in range(total):
            kind = self.kinds[j % len(self.kinds)]
            sample_seed = int(seeds[j])
            yield ContextSpec(kind, sample_seed, next(singles) if kind == "single" else ())


# ------------------------------------------------------------------------------------------ resuming mid-epoch
# Note [Resuming mid-epoch]
#     A checkpoint written at step k of an epoch (``ModelCheckpoint(every_n_train_steps=...)``, a preemption)
#     records the training loader's position; a resume reads the rest of that epoch, so the run sees the same
#     samples in the same order as one that was never stopped::
#
#         save:   fit loop -> CombinedLoader._state_dicts() -> loader.state_dict() = {epoch e, batches k}
#         resume: fit loop -> loader.load_state_dict(...) before the epoch's iterator starts
#                 first batch requested: the sampler's epoch is e -> skip k index batches (indices only,
#                 nothing is loaded), then batches k, k+1, ... of epoch e; another epoch -> no skip
#
#     Lightning calls ``state_dict`` / ``load_state_dict`` on a training loader that has both (its
#     ``_Stateful`` protocol); a plain ``DataLoader`` would restart the epoch from its first sample (Lightning
#     only warns). The skip is taken from the *index* sampler (batch sampler), so it costs no data reading and
#     holds with worker processes. The position is counted in batches of the global batch: with the same
#     global batch size a ``DistributedSampler`` gives replica ``r`` of ``R`` the global samples
#     ``[k G, (k+1) G)`` at step ``k`` for any ``R``, so a resume under another data-parallel degree is exact
#     too. Lightning's prefetching is off for loaders with a length, so the batches handed out are the
#     batches trained on when the checkpoint is written.
class _SkipFirstBatches:
    """``index_sampler`` without its first ``skip`` items; ``len`` stays the whole epoch's (Lightning counts
    the epoch's batches from it, and the restored loop counts the skipped ones as done)."""

    def __init__(self, index_sampler, skip: int) -> None:
        self.index_sampler, self.skip = index_sampler, skip

    def __len__(self) -> int:
        return len(self.index_sampler)

    def __iter__(self) -> Iterator:
        it = iter(self.index_sampler)
        for _ in range(self.skip):
            if next(it, _END) is _END:
                return
        yield from it


_END = object()


def _sampler_epoch(loader: DataLoader) -> int | None:
    """The epoch the loader's sampler plans (``set_epoch``'s), or None for a sampler without epochs."""
    for sampler in (loader.sampler, getattr(loader.batch_sampler, "sampler", None)):
        epoch = getattr(sampler, "epoch", None)
        if isinstance(epoch, int):
            return epoch
    return None


class ResumableDataLoader(DataLoader):
    """A ``DataLoader`` that saves and restores its position in the epoch (Note [Resuming mid-epoch]).

    Same arguments as ``DataLoader``. ``state_dict()`` is ``{"epoch": the sampler's epoch (None without
    ``set_epoch``), "batches": batches handed out this epoch}``; after ``load_state_dict`` the next iterator
    of that epoch starts at that batch. Lightning's fit loop calls both, so a checkpoint written mid-epoch
    resumes exactly; Lightning's distributed sampler injection re-creates the loader with its own
    ``DistributedSampler`` and keeps this class.
    """

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        if isinstance(self.dataset, IterableDataset):
            raise TypeError("ResumableDataLoader resumes by skipping its sampler's first batches; an IterableDataset "
                            "has no sampler to skip in: make the dataset itself resumable (state_dict / "
                            "load_state_dict on the loader, e.g. torchdata's StatefulDataLoader), or use a map-style "
                            "dataset")
        self._batches_handed_out = 0
        self._epoch_handed_out: int | None = None
        self._resume_at: dict[str, int | None] | None = None  # a loaded position not yet applied
        self._skip_now = 0  # read by _index_sampler while an iterator is being built

    @property
    def _index_sampler(self):  # DataLoader's: what its iterators draw indices (or index batches) from
        index_sampler = super()._index_sampler
        return _SkipFirstBatches(index_sampler, self._skip_now) if self._skip_now else index_sampler

    def __iter__(self) -> Iterator:
        return self._batches()

    def _batches(self) -> Iterator:
        # a generator: nothing below runs before the first batch is asked for, by when Lightning has called
        # the sampler's set_epoch for this epoch
        epoch = _sampler_epoch(self)
        skip = 0
        if self._resume_at is not None:
            if self._resume_at["epoch"] is None or self._resume_at["epoch"] == epoch:
                skip = int(self._resume_at["batches"])
            self._resume_at = None  # applies once: to the epoch it was saved in
        self._skip_now = skip
        try:
            iterator = super().__iter__()  # builds the iterator, which reads _index_sampler
        finally:
            self._skip_now = 0
        self._epoch_handed_out, self._batches_handed_out = epoch, min(skip, len(self))
        for batch in iterator:
            self._batches_handed_out += 1
            yield batch

    def state_dict(self) -> dict[str, int | None]:
        """This epoch's position: plain ints (a checkpoint reads it back with ``weights_only``)."""
        return {"epoch": self._epoch_handed_out, "batches": self._batches_handed_out}

    def load_state_dict(self, state_dict: dict[str, int | None]) -> None:
        """Start the next iterator of epoch ``state_dict["epoch"]`` at batch ``state_dict["batches"]``."""
        batches, epoch = state_dict.get("batches"), state_dict.get("epoch")
        if not isinstance(batches, int) or batches < 0 or not (epoch is None or isinstance(epoch, int)):
            raise ValueError(f"a ResumableDataLoader state is {{'epoch': int or None, 'batches': int >= 0}}, got "
                             f"{state_dict!r}: the checkpoint was written for another loader")
        self._resume_at = {"epoch": epoch, "batches": batches}
