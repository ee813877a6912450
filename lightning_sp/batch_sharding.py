"""Sharding a batch along the sequence for ``SequenceParallelStrategy.batch_to_device``: every tensor under
``sequence_keys`` is split along dim 1 with the bound layout (``lightning_sp.layout.shard_sequence``),
padded where the length does not divide (labels with ``ignore_index``), ``context.global_seq_len`` set so
padding is never attended, and global ``position_ids`` added when requested and absent.

``BatchSharder`` holds the keys and the once-only reporting state; the context, layout and degrees come
from its ``source`` (the strategy, or anything with ``context``, ``layout`` and ``parallel_dims``), read
at every call, so it runs without a Trainer. Messages go through Lightning's rank-zero utilities, as the
strategy's own do.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence
from typing import Any, Protocol

import torch
import torch.distributed as dist
from lightning.pytorch.utilities.rank_zero import rank_zero_info, rank_zero_warn

from lightning_sp.context import SequenceParallelContext
from lightning_sp.layout import SequenceLayout
from lightning_sp.topology import ParallelDims

log = logging.getLogger(__name__)

DEFAULT_SEQUENCE_KEYS = ("input_ids", "labels", "position_ids", "attention_mask", "loss_mask", "inputs_embeds")


class ShardingSource(Protocol):
    """Where a ``BatchSharder`` reads the current groups and layout (``SequenceParallelStrategy``)."""

    @property
    def context(self) -> SequenceParallelContext: ...

    @property
    def layout(self) -> SequenceLayout: ...

    @property
    def parallel_dims(self) -> ParallelDims: ...


class BatchSharder:
    """Shards batches for ``source``'s sequence-parallel group (see the module docstring; the arguments are
    ``SequenceParallelStrategy``'s of the same names)."""

    def __init__(self, source: ShardingSource, *, sequence_keys: Sequence[str | int] = DEFAULT_SEQUENCE_KEYS,
                 label_keys: Sequence[str | int] = ("labels",), position_ids_key: str | None = "position_ids",
                 ignore_index: int = -100, pad_value: int | float = 0) -> None:
        if isinstance(sequence_keys, str):
            raise ValueError(f"sequence_keys must be a sequence of keys, got the string {sequence_keys!r}; use ({sequence_keys!r},)")
        self.source = source
        self.sequence_keys = tuple(sequence_keys)
        self.label_keys = tuple(label_keys)
        self.position_ids_key = position_ids_key
        self.ignore_index = ignore_index
        self.pad_value = pad_value
        self._warned_tuple_positions = False
        self._padding_reported: set[tuple[int, int]] = set()
        self._reported_gather = False
        self.last_shard: tuple[int, int] | None = None
        """``(N, S_local)`` of the last batch ``shard_batch`` sharded (``None``: the last was not sharded here)."""

    @property
    def context(self) -> SequenceParallelContext:
        return self.source.context

    @property
    def layout(self) -> SequenceLayout:
        return self.source.layout

    @property
    def parallel_dims(self) -> ParallelDims:
        return self.source.parallel_dims

    def shard_batch(self, batch: Any) -> Any:
        """Shard every tensor under ``sequence_keys`` along dim 1 (``[B, N, ...] -> [B, N_pad/P, ...]``),
        set ``context.global_seq_len = N`` and add global ``position_ids`` if requested and absent."""
        from lightning_sp.layout import sequence_positions, shard_sequence

        group, layout = self.context.group, self.layout
        sharding = self.parallel_dims.sp > 1
        self.last_shard = None
        items, lengths, error = self.sequence_tensors(batch)
        self.agree_on_batch(batch, items, lengths, error)
        if not lengths:
            return batch
        seq_len = next(iter(lengths.values()))
        if sharding and isinstance(batch, (list, tuple)) and not self._warned_tuple_positions:
            self._warned_tuple_positions = True
            rank_zero_warn(
                f"SequenceParallelStrategy shards the {type(batch).__name__} batch at positions "
                f"{sorted(lengths)} but cannot add `position_ids` to it. Positions from `arange(S_local)` are "
                f"wrong under sequence parallelism: use a dict batch (the strategy then adds global "
                f"`{self.position_ids_key}`), or lightning_sp.sequence_positions(N, strategy.sp_group, "
                f"layout=strategy.layout)."
            )
        sharded = {}
        for k, t in items:
            if t.dim() < 2:
                continue
            pad = self.ignore_index if k in self.label_keys else self.pad_value
            sharded[k] = shard_sequence(t, group, dim=1, layout=layout, pad_value=pad)
        if isinstance(batch, Mapping):
            key = self.position_ids_key
            if key is not None and key in self.sequence_keys and key not in batch:
                ref = next(iter(sharded.values()))
                # [S_local] global positions; padding (>= N) clamped so embedding lookups stay in range
                pos = sequence_positions(seq_len, group, layout=layout, device=ref.device).clamp_(max=seq_len - 1)
                sharded[key] = pos.unsqueeze(0).expand(ref.size(0), -1)  # [B, S_local]
            out: Any = dict(batch)
            out.update(sharded)
            if not isinstance(batch, dict):
                try:
                    out = type(batch)(out)
                except TypeError:
                    pass
        else:
            as_list = list(batch)
            for k, t in sharded.items():
                as_list[k] = t
            out = type(batch)(as_list) if not hasattr(batch, "_fields") else type(batch)(*as_list)
        self.context.global_seq_len = seq_len
        if sharded:
            self.last_shard = (seq_len, next(iter(sharded.values())).size(1))
        self._report_padding(seq_len)
        return out

    def gather_outputs(self, outputs: Any) -> Any:
        """``outputs`` (a ``predict_step``'s: tensors, or dicts/lists/tuples of them) with every tensor
        ``[B, S_local, ...]`` cut like the last batch ``shard_batch`` sharded (dim 1 of ``S_local`` positions)
        gathered along dim 1 with the layout and cut to the global length: ``[B, N, ...]``, the sequence in
        its original order without padding, on every rank of the group (``gather_sequence``). Other tensors
        and values are returned as they are; nothing is gathered after a batch that was not sharded here.
        Every rank of the group must return outputs of the same structure and shapes (as one program does)."""
        from lightning.fabric.utilities.apply_func import apply_to_collection

        from lightning_sp.layout import gather_sequence

        if self.last_shard is None or self.parallel_dims.sp == 1:
            return outputs
        seq_len, shard_len = self.last_shard
        group, layout = self.context.group, self.layout
        gathered: list[tuple[int, ...]] = []

        def gather(t: torch.Tensor) -> torch.Tensor:
            if t.dim() < 2 or t.size(1) != shard_len:
                return t
            gathered.append(tuple(t.shape))
            return gather_sequence(t, group, dim=1, layout=layout, seq_len=seq_len, stats=self.context.comm)

        outputs = apply_to_collection(outputs, torch.Tensor, gather)
        if gathered and not self._reported_gather:
            self._reported_gather = True
            rank_zero_info(
                f"SequenceParallelStrategy: predictions are whole sequences in their original order: the outputs "
                f"{gathered} (dim 1 = this rank's {shard_len} positions) are gathered over sp={self.parallel_dims.sp} "
                f"ranks ({self.layout} layout) to [B, {seq_len}, ...] without padding, on every rank; "
                f"SequenceParallelStrategy(gather_predictions=False) returns each rank's shard instead")
        return outputs

    def sequence_tensors(self, batch: Any) -> tuple[list, dict, tuple[int, str] | None]:
        """``(items, lengths, error)``: the ``(key, tensor)`` pairs under ``sequence_keys``, the length (dim 1)
        of each that has one, and ``(code, message)`` if the batch cannot be sharded (raised after
        ``agree_on_batch``, so every rank raises)."""
        if isinstance(batch, Mapping):
            items = [(k, batch[k]) for k in self.sequence_keys if k in batch and isinstance(batch[k], torch.Tensor)]
        elif isinstance(batch, (list, tuple)):
            items = [(k, batch[k]) for k in self.sequence_keys
                     if isinstance(k, int) and -len(batch) <= k < len(batch) and isinstance(batch[k], torch.Tensor)]
        else:
            items = []
        lengths = {k: t.size(1) for k, t in items if t.dim() >= 2}
        error = None
        if not lengths and self.parallel_dims.sp > 1:  # every rank would silently train on the whole sequence
            error = (1, self._unsharded_batch_message(batch))
        elif len(set(lengths.values())) > 1:
            error = (2, f"sequence_keys tensors disagree on the sequence length (dim 1): {lengths}")
        return items, lengths, error

    _BATCH_ERRORS = ("", "no sequence tensor under sequence_keys", "sequence_keys tensors disagree on the length")
    _BATCH_FIELDS = ("error", "dp rank", "seq_len", "batch size", "hash(keys, shapes, dtypes)")

    def agree_only(self, batch: Any) -> None:
        """``agree_on_batch`` without sharding, for a module that shards its own batches (its ``shard_inputs``
        judges what it cannot shard): the ranks still compare their batches every step."""
        self.last_shard = None
        items, lengths, _ = self.sequence_tensors(batch)
        self.agree_on_batch(batch, items, lengths, None)

    def agree_on_batch(self, batch: Any, items: list, lengths: dict, error: tuple[int, str] | None) -> None:
        """Every rank of the world joins one tiny all-gather per batch (whatever its batch holds), then all
        raise if any rank's batch is bad, or if ranks of one data-parallel replica (which must shard the
        same sample) got batches of different lengths, sizes, keys or dtypes: every rank raises at once,
        naming the ranks and values, before any collective of the step could hang on it (Note [Cross-rank
        checks are decided together] in ``comm/agree.py``). Replicas may differ from each other."""
        from lightning_sp.comm.agree import describe_disagreement, gather_rows, stable_hash

        if not dist.is_initialized() or dist.get_world_size() == 1:  # nothing to agree with (also: no Trainer)
            if error is not None:
                raise ValueError(error[1])
            return
        # [B, N, ...] of every sequence tensor, N left out (it is seq_len); the batch's keys (a key present
        # on some ranks only makes a model take another branch, e.g. a metric's all-reduce)
        described = [(str(k), tuple(t.shape[:1]) + tuple(t.shape[2:]), str(t.dtype)) for k, t in items]
        keys = (sorted(map(str, batch.keys())) if isinstance(batch, Mapping)
                else len(batch) if isinstance(batch, (list, tuple)) else type(batch).__name__)
        seq_len = next(iter(lengths.values())) if lengths and error is None else -1
        batch_size = next((t.size(0) for _, t in items if t.dim() >= 1), -1)
        me = dist.get_rank()
        row = (error[0] if error is not None else 0, self.parallel_dims.dp_rank(me), seq_len, batch_size,
               stable_hash(keys, described))
        rows = gather_rows(row, dist.group.WORLD)  # on NCCL: the current CUDA device, which Lightning set
        if error is not None:
            raise ValueError(error[1])
        failed = {r: self._BATCH_ERRORS[row[0]] for r, row in enumerate(rows) if row[0]}
        if failed:
            raise ValueError(f"SequenceParallelStrategy: other ranks could not shard their batch (each raises the "
                             f"details; global rank: problem): {failed}")
        replicas: dict[int, list[int]] = {}
        for r, row in enumerate(rows):
            replicas.setdefault(row[1], []).append(r)
        lines = []
        for dp_rank, ranks in sorted(replicas.items()):
            differ = describe_disagreement([rows[r][2:] for r in ranks], self._BATCH_FIELDS[2:], ranks)
            if differ is not None:
                lines.append(f" data-parallel replica {dp_rank} (global ranks {ranks}):\n{differ}")
        if lines:
            raise ValueError(
                "SequenceParallelStrategy: ranks that shard the same sample got different batches at this step "
                "(every rank raises this; a data loader must give every rank of a sequence-parallel group the same "
                "sample, e.g. the same seed and the strategy's distributed sampler):\n" + "\n".join(lines)
                + f"\n this rank ({me}): seq_len={seq_len}, sequence tensors (key, shape without dim 1, dtype): "
                f"{described}"
            )

    def _unsharded_batch_message(self, batch: Any) -> str:
        found = (f"keys {sorted(map(str, batch.keys()))}" if isinstance(batch, Mapping)
                 else f"{len(batch)} positions" if isinstance(batch, (list, tuple)) else f"a {type(batch).__name__}")
        return (
            f"SequenceParallelStrategy(sequence_parallel_size={self.parallel_dims.sp}) found no sequence tensor "
            f"([B, N, ...]) in the batch ({found}) under sequence_keys={self.sequence_keys}: without sharding, "
            f"every rank would train on the whole sequence. Return a dict batch with one of those keys, pass "
            f"sequence_keys=<your keys> (for a tuple batch, positions such as (0, 1)), or use "
            f"sequence_parallel_size=1."
        )

    def _report_padding(self, seq_len: int) -> None:
        from lightning_sp.layout import padded_length

        padded = padded_length(seq_len, self.parallel_dims.sp, self.layout)
        if padded == seq_len or (seq_len, padded) in self._padding_reported:
            return
        first = not self._padding_reported
        self._padding_reported.add((seq_len, padded))
        message = (f"SequenceParallelStrategy: sequences of {seq_len} tokens are padded to {padded} (+{padded - seq_len}) "
                   f"for an even {self.layout} split over sp={self.parallel_dims.sp} ranks; padded positions are never "
                   f"attended and labels there are ignore_index={self.ignore_index}")
        if first:
            rank_zero_info(message + " (other lengths: logged at debug level)")
        else:
            log.debug(message)
