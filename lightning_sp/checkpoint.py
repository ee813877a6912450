"""Checkpoint IO: sharded checkpoints through ``torch.distributed.checkpoint`` that reshard across tp /
sp / dp degrees and between DDP and FSDP2 (no rank ever gathers the whole state), and single-file ones
loaded into any layout. Saves are crash-consistent (Note [Crash-consistent checkpoints]); loading runs
no code from any file (allowlisted unpickler for DCP's ``.metadata``, ``weights_only`` for torch files)
and a damaged checkpoint raises ``CheckpointError`` on every rank, naming the file.

Note [Checkpoint chunks]
    Every parameter (and each optimizer state of its shape) is saved in its *global* shape, the shape
    of the one-process model, as the chunks this rank holds. A chunk is the intersection of the
    tensor-parallel split (``shard_range`` of each segment along the split dim) and the FSDP2 shard
    (rows ``[r0, r1)`` of the tp-local tensor)::

        qkv.weight [3h, h], tp=2, FSDP over 2 ranks (rows of the tp-local [3h/2, h] halved):
            tp rank 0 local rows = [q 0:h/2 | k 0:h/2 | v 0:h/2]      fsdp rank 0 keeps local rows [0, 3h/4)
            -> chunks at global rows [0, h/2) and [h, h + h/4)

    ``torch.distributed.checkpoint`` writes each distinct chunk once (replicas are de-duplicated) and,
    on load, reads whatever saved chunks overlap the chunks the *new* layout asks for: resharding is
    its job. Non-tensor state (loops, schedulers, hyper-parameters) goes to ``meta.pt``, written by
    rank 0 and read back with ``torch.load(weights_only=True)``; DCP reads tensor items ``weights_only``,
    ``SafeLoadPlanner`` refuses byte items and ``SafeFileSystemReader`` reads ``.metadata`` through an
    allowlist of DCP's metadata classes.
"""

from __future__ import annotations

import collections
import glob
import io
import json
import os
import pickle
import re
import secrets
import shutil
import sys
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint.api import CheckpointException  # a BaseException
from torch.distributed.checkpoint.metadata import ChunkStorageMetadata, MetadataIndex
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner, DefaultSavePlanner
from torch.distributed.checkpoint.planner import TensorProperties, TensorWriteData, WriteItem, WriteItemType

from lightning_sp.comm.device import group_device
from lightning_sp.comm.release import collective
from lightning_sp.tensor_parallel import ColumnParallelLinear, RowParallelLinear, VocabParallelEmbedding, shard_range


# ------------------------------------------------------------------------------------------ chunks
@dataclass
class ChunkedTensor:
    """The chunks of one global tensor that this rank holds: ``(offsets, local view)`` pairs.
    Implements the protocol ``torch.distributed.checkpoint`` uses for DTensor."""

    global_size: torch.Size
    chunks: list[tuple[tuple[int, ...], torch.Tensor]]

    def size(self) -> torch.Size:
        return self.global_size

    def __create_write_items__(self, fqn: str, obj: Any) -> list[WriteItem]:
        return [
            WriteItem(
                index=MetadataIndex(fqn, torch.Size(off)), type=WriteItemType.SHARD,
                tensor_data=TensorWriteData(chunk=ChunkStorageMetadata(offsets=torch.Size(off), sizes=t.size()),
                                            properties=TensorProperties.create_from_tensor(t), size=self.global_size),
            )
            for off, t in self.chunks
        ]

    def __create_chunk_list__(self) -> list[ChunkStorageMetadata]:
        return [ChunkStorageMetadata(offsets=torch.Size(off), sizes=t.size()) for off, t in self.chunks]

    def chunk_at(self, offset) -> torch.Tensor:
        for off, t in self.chunks:
            if torch.Size(off) == torch.Size(offset):
                return t
        raise ValueError(f"no chunk at offset {tuple(offset)}")


class ChunkedSavePlanner(DefaultSavePlanner):
    """``DefaultSavePlanner`` that finds ``ChunkedTensor`` chunks (state dicts here are already flat)."""

    def __init__(self) -> None:
        super().__init__(flatten_state_dict=False, flatten_sharded_tensors=False)

    def lookup_object(self, index: MetadataIndex) -> Any:
        obj = self.state_dict[index.fqn]
        if isinstance(obj, ChunkedTensor):
            return obj.chunk_at(index.offset).detach()
        return super().lookup_object(index)


class SafeLoadPlanner(DefaultLoadPlanner):
    """Loads into ``ChunkedTensor`` views in place (flat state dicts); refuses byte items (no unpickling)."""

    def __init__(self) -> None:
        super().__init__(flatten_state_dict=False, flatten_sharded_tensors=False)

    def set_up_planner(self, state_dict, metadata=None, is_coordinator: bool = False) -> None:
        # DefaultLoadPlanner's meta-device initialisation would replace ChunkedTensor values with None
        self.original_state_dict = self.state_dict = state_dict
        self.metadata, self.is_coordinator = metadata, is_coordinator

    def lookup_tensor(self, index: MetadataIndex) -> torch.Tensor:
        obj = self.state_dict[index.fqn]
        if isinstance(obj, ChunkedTensor):
            return obj.chunk_at(index.offset)
        return super().lookup_tensor(index)

    def load_bytes(self, read_item, value: io.BytesIO) -> None:
        raise ValueError(f"unexpected non-tensor item {read_item.dest_index.fqn!r} in the sharded checkpoint")


# ------------------------------------------------------------------------------------------ layout
@dataclass(frozen=True)
class _Split:
    """How a parameter is split over tp: along ``dim``, local pieces ``(local_start, length, global_start)``."""

    global_size: torch.Size
    dim: int
    pieces: tuple[tuple[int, int, int], ...]


def _tp_splits(module: nn.Module) -> dict[str, _Split]:
    """Parameter name -> its tensor-parallel split, for the split parameters of ``module``."""
    out: dict[str, _Split] = {}
    for name, m in module.named_modules():
        split = getattr(m, "_tp_split", None)
        if split is None or split[0] == 1:
            continue
        world, rank = split
        prefix = f"{name}." if name else ""
        if isinstance(m, ColumnParallelLinear):
            pieces, local, glob = [], 0, 0
            for n in m.output_sizes:
                a, b = shard_range(n, world, rank)
                pieces.append((local, b - a, glob + a))
                local, glob = local + b - a, glob + n
            out[prefix + "weight"] = _Split(torch.Size((m.out_features, m.in_features)), 0, tuple(pieces))
            if m.bias is not None:
                out[prefix + "bias"] = _Split(torch.Size((m.out_features,)), 0, tuple(pieces))
        elif isinstance(m, RowParallelLinear):
            a, b = shard_range(m.in_features, world, rank)
            out[prefix + "weight"] = _Split(torch.Size((m.out_features, m.in_features)), 1, ((0, b - a, a),))
        elif isinstance(m, VocabParallelEmbedding):
            a, b = shard_range(m.num_embeddings, world, rank)
            out[prefix + "weight"] = _Split(torch.Size((m.num_embeddings, m.embedding_dim)), 0, ((0, b - a, a),))
    return out


def _local_and_row_offset(t: torch.Tensor) -> tuple[torch.Tensor, int]:
    """This rank's data of ``t`` and the offset of its first row within the tp-local tensor (FSDP2)."""
    from torch.distributed.tensor import DTensor

    if not isinstance(t, DTensor):
        return t.data if isinstance(t, nn.Parameter) else t, 0
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

    _, offset = compute_local_shape_and_global_offset(t.shape, t.device_mesh, t.placements)
    return t.to_local().detach(), (offset[0] if len(offset) else 0)  # shares storage: loads in place


def _chunked(t: torch.Tensor, split: _Split | None) -> "ChunkedTensor | torch.Tensor":
    local, r0 = _local_and_row_offset(t)
    ndim = local.dim()
    if ndim == 0:  # a scalar (optimizer step): replicated, DCP's plain-tensor path loads it in place
        return local
    if split is None:  # replicated over tp: the tp-local tensor is the global one
        off = (r0,) + (0,) * (ndim - 1)
        return ChunkedTensor(torch.Size(t.shape), [(off, local)] if local.numel() else [])
    chunks = []
    r1 = r0 + local.size(0)
    for ls, n, gs in split.pieces:
        if split.dim == 0:  # tp split and FSDP shard on the same dim: intersect the row ranges
            a, b = max(ls, r0), min(ls + n, r1)
            if b > a:
                chunks.append(((gs + a - ls,) + (0,) * (ndim - 1), local.narrow(0, a - r0, b - a)))
        else:  # tp split along dim 1, FSDP rows along dim 0
            if local.size(0) and n:
                chunks.append(((r0, gs) + (0,) * (ndim - 2), local.narrow(1, ls, n)))
    return ChunkedTensor(split.global_size, chunks)


def model_state(module: nn.Module) -> dict[str, ChunkedTensor]:
    """``module``'s parameters and persistent buffers as chunks of their global (one-process) shapes."""
    splits = _tp_splits(module)
    out = {n: _chunked(p, splits.get(n)) for n, p in module.named_parameters()}
    for n, b in module.named_buffers():
        if b is not None and n.rsplit(".", 1)[-1] not in getattr(_owner(module, n), "_non_persistent_buffers_set", set()):
            out[n] = _chunked(b, None)
    return out


def _owner(module: nn.Module, name: str) -> nn.Module:
    path = name.rsplit(".", 1)[0] if "." in name else ""
    return module.get_submodule(path) if path else module


def _param_names(module: nn.Module, optimizer: torch.optim.Optimizer) -> list[list[str]]:
    names = {id(p): n for n, p in module.named_parameters()}
    try:
        return [[names[id(p)] for p in g["params"]] for g in optimizer.param_groups]
    except KeyError:
        raise ValueError("the optimizer holds a parameter that is not in the LightningModule") from None


def optimizer_state(module: nn.Module, optimizer: torch.optim.Optimizer) -> tuple[dict[str, ChunkedTensor], list[dict]]:
    """Per-parameter optimizer tensors as chunks (keys ``"<param>/<state>"``) and the param groups'
    hyper-parameters (with parameter names instead of indices)."""
    splits = _tp_splits(module)
    tensors: dict[str, ChunkedTensor] = {}
    groups = []
    for names, group in zip(_param_names(module, optimizer), optimizer.param_groups):
        for name, p in zip(names, group["params"]):
            for key, value in optimizer.state.get(p, {}).items():
                if not isinstance(value, torch.Tensor):
                    raise ValueError(f"optimizer state {name}/{key} is a {type(value).__name__}, not a tensor")
                same_shape = value.dim() > 0 and value.shape == p.shape
                tensors[f"{name}/{key}"] = _chunked(value, splits.get(name) if same_shape else None)
        groups.append({k: v for k, v in group.items() if k != "params"} | {"params": names})
    return tensors, groups


def init_optimizer_state(optimizer: torch.optim.Optimizer) -> None:
    """Create the optimizer's (lazy) per-parameter state so a checkpoint can be loaded into it."""
    if all(p in optimizer.state and optimizer.state[p] for g in optimizer.param_groups for p in g["params"]):
        return
    from torch.distributed.checkpoint.state_dict import _init_optim_state

    _init_optim_state(optimizer)


# ------------------------------------------------------------------------------------------ io
# Note [Crash-consistent checkpoints]
#     A sharded checkpoint ``<dir>/<name>`` is never written in place. Every save goes to a staging
#     sibling and is swapped into place only once it is complete::
#
#         <dir>/.lightning_sp-staging/<name>.saving-<save_id>/
#                 every rank: __<rank>_0.distcp; coordinator: .metadata (DCP)
#                 rank 0, after dcp.save returned everywhere: meta.pt, then commit.json (save id,
#                 DCP's save id, every file's size)
#         rank 0: exchange(staging, <name>) (renameat2 RENAME_EXCHANGE: one atomic step), then delete
#                 the staging name, which now holds the previous checkpoint
#
#     Staging lives in a folder of its own whose name holds neither "ckpt_" nor "last": Lightning finds
#     checkpoints by substring (``"hpc_ckpt_" in name`` for ``ckpt_path="hpc"`` / SLURM requeues, whose
#     digits it then parses; ``"last" in name`` for ``ckpt_path="last"``), so a staging sibling named
#     after its checkpoint would be taken for one. A single file is written under the same folder and
#     renamed into place (``save_single_file``). Staging left by a killed save is removed by the next
#     save of that name, and at setup / load by ``clean_stale_staging`` (never a complete copy whose
#     checkpoint is missing: the load error names it).
#
#     A rank killed at any instant leaves ``<name>`` either the previous complete checkpoint or the
#     new one, so ``ckpt_path="last"`` always finds a complete checkpoint. On load, every rank checks
#     the commit record (files present, sizes, ``meta.pt`` and ``.metadata`` of the same save) and the
#     ranks agree on the verdict with one all-gather, so a damaged checkpoint fails on every rank at
#     once, naming the file. Where the exchange is unsupported (not Linux, NFS), the old checkpoint is
#     renamed aside first: a kill between the two renames leaves ``<name>`` missing and the error on
#     load names the complete staging copy to rename back.
META_FILE = "meta.pt"
COMMIT_FILE = "commit.json"
METADATA_FILE = ".metadata"  # written by torch.distributed.checkpoint
COMMIT_FORMAT = "lightning_sp.dcp/1"
_SAVE_ID_KEY = "_lightning_sp_save_id"  # in meta.pt, popped by load_meta


class CheckpointError(RuntimeError):
    """A checkpoint that cannot be trusted: incomplete, corrupted, or holding objects that are not plain
    data. Raised on every rank, naming the checkpoint and the file."""


def _damaged(path: Path, file: str, reason: str) -> CheckpointError:
    return CheckpointError(
        f"checkpoint {path} is incomplete or corrupted: {file}: {reason}. Resume from another checkpoint "
        f"(an interrupted save never replaces the previous one) or delete this one"
    )


def _unsafe(path: Path, file: str, err: BaseException) -> CheckpointError:
    return CheckpointError(
        f"checkpoint {path}: {file} holds objects that loading refuses to unpickle ({err}); lightning_sp "
        f"checkpoints hold plain data only, so this file was crafted or written by other code. Loading never "
        f"runs code from a file; load a file you trust yourself with torch.load(weights_only=False)"
    )


def _plain(obj: Any) -> Any:
    """Containers as plain dict / list / tuple so ``torch.load(weights_only=True)`` reads them."""
    if isinstance(obj, Mapping):
        return {k: _plain(v) for k, v in obj.items()}
    if isinstance(obj, list):
        return [_plain(v) for v in obj]
    if isinstance(obj, tuple) and not hasattr(obj, "_fields"):
        return tuple(_plain(v) for v in obj)
    return obj


def _is_distributed(process_group) -> bool:
    return dist.is_available() and dist.is_initialized()


def _group_rank(process_group) -> int:
    return dist.get_rank(process_group) if _is_distributed(process_group) else 0


def _gather_ints(value: int, process_group) -> list[int]:
    """Every group rank's ``value``, identical on every rank (one all-gather, always issued)."""
    if not _is_distributed(process_group):
        return [value]
    device = group_device(process_group)  # NCCL takes CUDA tensors only (Note [Collectives on the group's device])
    out = [torch.zeros(1, dtype=torch.int64, device=device) for _ in range(dist.get_world_size(process_group))]
    collective(dist.all_gather, out, torch.tensor([value], dtype=torch.int64, device=device), group=process_group)
    return [int(v) for v in out]


def _agree(ok: bool, process_group) -> list[int]:
    """The group ranks whose ``ok`` is False, identical on every rank."""
    return [r for r, bad in enumerate(_gather_ints(0 if ok else 1, process_group)) if bad]


def _raise_on_every_rank(problem: CheckpointError | None, path: Path, process_group) -> None:
    """Agree (collective), then raise ``problem`` on the ranks that found it and a ``CheckpointError`` naming
    those ranks on the others: a damaged checkpoint fails everywhere, never on some ranks only."""
    bad = _agree(problem is None, process_group)
    if problem is not None:
        raise problem
    if bad:
        raise CheckpointError(f"checkpoint {path} is incomplete or corrupted as rank(s) {bad} read it (their errors "
                              f"name the file); this rank found no problem: is it on a shared filesystem?")


def _broadcast_from_first(value: int, process_group) -> int:
    """``value`` of group rank 0 on every rank."""
    if not _is_distributed(process_group):
        return value
    t = torch.tensor([value], dtype=torch.int64, device=group_device(process_group))
    collective(dist.broadcast, t, src=dist.get_global_rank(process_group, 0) if process_group is not None else 0,
               group=process_group)
    return int(t)


STAGING_DIR = ".lightning_sp-staging"  # Note [Crash-consistent checkpoints]: no "ckpt_", no "last"
_STAGING_KINDS = ("saving", "retired", "writing")  # sharded save, the previous one moved aside, a single file


def _staging_path(path: Path, save_id: str, kind: str = "saving") -> Path:
    return path.parent / STAGING_DIR / f"{path.name}.{kind}-{save_id}"


def _staged_copies(path: Path) -> list[Path]:
    """Staging directories of ``path`` (and the sibling names older versions staged under)."""
    staged = list((path.parent / STAGING_DIR).glob(f"{glob.escape(path.name)}.saving-*"))
    return sorted(staged + list(path.parent.glob(f".{glob.escape(path.name)}.saving-*")))


class CheckpointSaveError(RuntimeError):
    """A save that did not complete (a full disk, a read-only directory, a writer that raised): raised on
    every rank, naming the checkpoint and the cause. Nothing is left under the checkpoint's name: a
    previous checkpoint of that name is unchanged."""


def _save_failed(path: Path, cause: str, ranks: list[int] | str) -> CheckpointSaveError:
    return CheckpointSaveError(
        f"saving the checkpoint {path} failed on rank(s) {ranks}: {cause}. Nothing was written under its name "
        f"(a previous checkpoint of that name is unchanged). Free space in {path.parent} or make it writable, or "
        f"point ModelCheckpoint(dirpath=...) / Trainer(default_root_dir=...) at a directory every rank can write"
    )


def _error_code(err: BaseException | None) -> int:
    """What crosses the process group for a failure: 0 none, the errno of an ``OSError``, -1 another error."""
    if err is None:
        return 0
    return err.errno if isinstance(err, OSError) and isinstance(err.errno, int) and err.errno > 0 else -1


def _cause(code: int, err: BaseException | None) -> str:
    """The words for ``_error_code``'s ``code``: this rank's own error if it has one."""
    if err is not None:
        return f"{type(err).__name__}: {err}"
    return f"[Errno {code}] {os.strerror(code)}" if code > 0 else "an error (its traceback is on that rank)"


def _unwrapped(failure: Any) -> Any:
    """The exception in one of ``CheckpointException.failures``' values (``(exception, traceback)``)."""
    return failure[0] if isinstance(failure, tuple) and failure else getattr(failure, "exception", failure)


def _ordinary(err: BaseException) -> bool:
    """An error the saving process survives (a full disk, a writer that raised), not an interrupt: only
    then is a failed save's staging removed at once (a kill leaves it to ``clean_stale_staging``)."""
    if isinstance(err, CheckpointException):
        return all(isinstance(_unwrapped(f), Exception) for f in err.failures.values())
    return isinstance(err, Exception)


def _first_failure(err: BaseException) -> BaseException:
    """DCP's ``CheckpointException`` gathers every rank's error: the first one, as raised."""
    if isinstance(err, CheckpointException) and err.failures:
        first = _unwrapped(err.failures[min(err.failures)])
        return first if isinstance(first, BaseException) else err
    return err


def _fsync_dir(path: Path) -> None:
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:  # not supported on this platform / filesystem
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def _write_durably(path: Path, data: bytes) -> None:
    with open(path, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())


def _exchange(a: Path, b: Path) -> bool:
    """Atomically swap the names ``a`` and ``b`` (Linux ``renameat2(RENAME_EXCHANGE)``); False where the
    platform or filesystem cannot."""
    if not sys.platform.startswith("linux"):
        return False
    import ctypes
    import errno

    libc = ctypes.CDLL(None, use_errno=True)
    renameat2 = getattr(libc, "renameat2", None)
    if renameat2 is None:
        return False
    at_fdcwd, rename_exchange = -100, 2
    if renameat2(at_fdcwd, os.fsencode(a), at_fdcwd, os.fsencode(b), rename_exchange) == 0:
        return True
    code = ctypes.get_errno()
    if code in (errno.EINVAL, errno.ENOSYS, errno.EOPNOTSUPP, errno.EXDEV):
        return False
    raise OSError(code, f"cannot exchange {a} and {b}: {os.strerror(code)}")


def _remove(path: Path) -> None:
    if path.is_dir() and not path.is_symlink():
        shutil.rmtree(path, ignore_errors=True)
    elif path.exists() or path.is_symlink():
        path.unlink(missing_ok=True)


def _move_into_place(staging: Path, path: Path) -> None:
    """Make the complete ``staging`` directory the checkpoint ``path`` (rank 0); see Note [Crash-consistent
    checkpoints]."""
    if not (path.exists() or path.is_symlink()):
        os.rename(staging, path)
    elif _exchange(staging, path):
        _remove(staging)  # now the previous checkpoint
    else:
        retired = _staging_path(path, staging.name.rsplit("-", 1)[-1], "retired")
        os.rename(path, retired)
        os.rename(staging, path)
        _remove(retired)
    _fsync_dir(path.parent)
    for stale in _staged_copies(path):  # left by saves that were killed
        _remove(stale)
    _remove_empty_staging(path.parent)


def _remove_empty_staging(directory: Path) -> None:
    try:
        (directory / STAGING_DIR).rmdir()
    except OSError:  # absent, or holds another save's staging
        pass


def clean_stale_staging(directory: str | os.PathLike) -> list[Path]:
    """Remove what killed saves left in ``directory`` (rank 0, while no save is in flight: at setup and
    at load); return what was removed. Never removes a complete staging copy (``commit.json`` written)
    whose checkpoint is missing: a kill between two renames left it, and loading names it."""
    directory = Path(directory)
    staging = directory / STAGING_DIR
    candidates = list(staging.iterdir()) if staging.is_dir() else []
    candidates += [p for p in directory.glob(".*") if re.fullmatch(r"\..+\.(saving|retired)-[0-9a-f]{16}", p.name)]
    removed = []
    for entry in candidates:
        match = re.fullmatch(r"\.?(.+)\.(saving|retired|writing)-[0-9a-f]{16}", entry.name)
        if match is None:
            continue
        name, kind = match.groups()
        orphaned_complete = kind == "saving" and (entry / COMMIT_FILE).is_file() and not (directory / name).exists()
        if not orphaned_complete:
            _remove(entry)
            removed.append(entry)
    _remove_empty_staging(directory)
    return removed


def _commit_record(staging: Path, save_id: str) -> dict[str, Any]:
    files = {p.name: p.stat().st_size for p in sorted(staging.iterdir()) if p.is_file() and p.name != COMMIT_FILE}
    dcp_save_id = _read_dcp_metadata(staging).storage_meta.save_id
    return {"format": COMMIT_FORMAT, "save_id": save_id, "dcp_save_id": dcp_save_id, "files": files}


def save(path: str | os.PathLike, tensors: dict[str, ChunkedTensor], meta: dict[str, Any], *, process_group=None) -> None:
    """Write ``tensors`` (every rank its chunks) and ``meta`` (rank 0) as the directory ``path``, crash-
    consistently (Note [Crash-consistent checkpoints]). Collective over ``process_group`` (default: world)."""
    path = Path(path)
    rank = _group_rank(process_group)
    number, meta_bytes, problem = secrets.randbits(62), b"", None
    if rank == 0:
        buf = io.BytesIO()
        torch.save(_plain(meta) | {_SAVE_ID_KEY: f"{number:016x}"}, buf)
        try:  # fail now, not at resume time
            torch.load(io.BytesIO(buf.getvalue()), weights_only=True)
        except Exception as err:  # noqa: BLE001 - reported on every rank below
            problem = err
        meta_bytes = buf.getvalue()
    # rank 0's save id doubles as its verdict on meta (-1: refused), so no rank is left in dcp.save alone
    number = _broadcast_from_first(-1 if problem is not None else number, process_group)
    if number < 0:
        raise ValueError(
            f"checkpoint metadata holds objects that weights_only loading refuses ({problem if rank == 0 else 'see rank 0'}); "
            "keep hyper-parameters, callback and loop states to numbers, strings, tensors and containers of them"
        ) from None
    save_id = f"{number:016x}"
    staging = _staging_path(path, save_id)
    try:
        dcp.save(tensors, storage_writer=dcp.FileSystemWriter(str(staging)), planner=ChunkedSavePlanner(),
                 process_group=process_group)
    except (Exception, CheckpointException) as err:  # DCP raises every rank's write errors on every rank
        if not _ordinary(err):
            raise  # an interrupt: leave the files as a kill would
        if rank == 0:
            _remove(staging)
            _remove_empty_staging(path.parent)
        _broadcast_from_first(0, process_group)  # every rank raises once the staging is gone
        cause = _first_failure(err)
        ranks = sorted(err.failures) if isinstance(err, CheckpointException) else [rank]
        raise _save_failed(path, f"{type(cause).__name__}: {cause}", ranks) from err
    # dcp.save has returned on every rank: every shard and .metadata are written
    failure = None
    if rank == 0:
        try:
            _write_durably(staging / META_FILE, meta_bytes)
            _write_durably(staging / COMMIT_FILE, json.dumps(_commit_record(staging, save_id), indent=1).encode())
            _fsync_dir(staging)
            _move_into_place(staging, path)
        except Exception as err:  # noqa: BLE001 - re-raised below, after every rank knows
            failure = err
            _remove(staging)
            _remove_empty_staging(path.parent)
    # every rank returns only once the checkpoint is in place, and fails if rank 0 could not commit it
    code = _broadcast_from_first(_error_code(failure), process_group)
    if code:
        raise _save_failed(path, _cause(code, failure), [0]) from failure


def save_single_file(path: str | os.PathLike, write: Callable[[str], None], *, in_place: bool = False,
                     process_group=None) -> None:
    """Write a single-file checkpoint: ``write(target)`` on every rank (Lightning's own writer writes on
    rank 0 only) to a staging file, which rank 0 renames to ``path`` once it is whole (``in_place``: write
    ``path`` itself, for remote storage or a writer that finishes later). If the write fails (a full
    disk, a read-only directory), every rank raises ``CheckpointSaveError`` naming ``path`` and the cause,
    and nothing is left under ``path``'s name. Collective over ``process_group`` (default: world)."""
    path_str = str(path)
    rank = _group_rank(process_group)
    in_place = in_place or "://" in path_str
    local = Path(path_str)
    staged = local if in_place else _staging_path(local, f"{secrets.randbits(62):016x}", "writing")
    failure = None
    try:
        if rank == 0 and not in_place:
            staged.parent.mkdir(parents=True, exist_ok=True)
        write(str(staged) if not in_place else path_str)
        if rank == 0 and not in_place:
            os.replace(staged, local)  # same directory tree and filesystem: one atomic step
            _fsync_dir(local.parent)
    except Exception as err:  # noqa: BLE001 - re-raised below, after every rank knows
        failure = err
    if rank == 0 and not in_place:
        if failure is not None:
            _remove(staged)
        _remove_empty_staging(local.parent)
    codes = _gather_ints(_error_code(failure), process_group)  # every rank learns every rank's verdict
    bad = [r for r, c in enumerate(codes) if c]
    if bad:
        first = rank if failure is not None else bad[0]
        raise _save_failed(local, _cause(codes[first], failure), bad) from failure


def probe_directories(directories, *, process_group=None) -> None:
    """Check that every rank can create and write a file in each of ``directories`` (created if missing),
    before any training time is spent, and remove what killed saves left there (rank 0). Collective: the
    ranks agree (one all-gather per directory) and, if any rank cannot write, every rank raises
    ``CheckpointSaveError`` naming the directory, the ranks and the cause, and what to change."""
    rank = _group_rank(process_group)
    for directory in directories:
        directory = Path(directory)
        failure = None
        try:
            directory.mkdir(parents=True, exist_ok=True)
            probe = directory / f".lightning_sp-probe-{rank}-{secrets.randbits(62):016x}"
            try:
                _write_durably(probe, b"lightning_sp checks that checkpoints can be written here\n")
            finally:
                probe.unlink(missing_ok=True)
            if rank == 0:
                clean_stale_staging(directory)
        except Exception as err:  # noqa: BLE001 - reported on every rank below
            failure = err
        codes = _gather_ints(_error_code(failure), process_group)
        bad = [r for r, c in enumerate(codes) if c]
        if bad:
            cause = _cause(codes[bad[0]], failure if rank == bad[0] else None)
            raise CheckpointSaveError(
                f"the checkpoint directory {directory} is not writable on rank(s) {bad} ({cause}); checkpoints "
                f"would fail after the training time is spent. Make it writable on every rank, or point "
                f"ModelCheckpoint(dirpath=...) / Trainer(default_root_dir=...) at a directory every rank can write"
            ) from failure


# ------------------------------------------------------------------------------------------ loading
def _allowed_globals() -> dict[tuple[str, str], Any]:
    """The classes a DCP ``.metadata`` file is made of (nothing that can run code)."""
    import pathlib

    from torch.distributed.checkpoint import filesystem, metadata

    allowed: dict[tuple[str, str], Any] = {
        ("torch", "Size"): torch.Size,
        ("torch.serialization", "_get_layout"): torch.serialization._get_layout,
        ("collections", "OrderedDict"): collections.OrderedDict,
        ("torch.distributed.checkpoint.filesystem", "_StorageInfo"): filesystem._StorageInfo,
    }
    for name in ("Metadata", "TensorStorageMetadata", "BytesStorageMetadata", "ChunkStorageMetadata", "MetadataIndex",
                 "TensorProperties", "StorageMeta", "_MEM_FORMAT_ENCODING"):
        if hasattr(metadata, name):
            allowed[("torch.distributed.checkpoint.metadata", name)] = getattr(metadata, name)
    for name in ("PosixPath", "WindowsPath", "PurePosixPath", "PureWindowsPath"):
        allowed[("pathlib", name)] = getattr(pathlib, name)
    for name, value in vars(torch).items():
        if isinstance(value, (torch.dtype, torch.layout, torch.memory_format)):
            allowed[("torch", name)] = value
    return allowed


class _MetadataUnpickler(pickle.Unpickler):
    """Unpickles DCP metadata and nothing else: any other global (a function, a class with side effects)
    raises ``pickle.UnpicklingError``."""

    _allowed: dict[tuple[str, str], Any] | None = None

    def find_class(self, module: str, name: str) -> Any:
        if _MetadataUnpickler._allowed is None:
            _MetadataUnpickler._allowed = _allowed_globals()
        try:
            return _MetadataUnpickler._allowed[(module, name)]
        except KeyError:
            raise pickle.UnpicklingError(f"{module}.{name} is not a torch.distributed.checkpoint metadata class") from None


def _read_dcp_metadata(path: Path):
    """DCP's ``.metadata`` of ``path`` through the allowlisted unpickler."""
    from torch.distributed.checkpoint.metadata import Metadata

    file = path / METADATA_FILE
    try:
        with open(file, "rb") as f:
            md = _MetadataUnpickler(f).load()
    except pickle.UnpicklingError as err:
        if "not a torch.distributed.checkpoint metadata class" in str(err):
            raise _unsafe(path, METADATA_FILE, err) from None
        raise _damaged(path, METADATA_FILE, f"{type(err).__name__}: {err}") from None
    except FileNotFoundError:
        raise _damaged(path, METADATA_FILE, "missing") from None
    except Exception as err:  # noqa: BLE001 - truncated / garbled: say which file
        raise _damaged(path, METADATA_FILE, f"{type(err).__name__}: {err}") from None
    if not isinstance(md, Metadata):
        raise _damaged(path, METADATA_FILE, f"holds a {type(md).__name__}, not torch.distributed.checkpoint Metadata")
    return md


class SafeFileSystemReader(dcp.FileSystemReader):
    """``FileSystemReader`` whose ``.metadata`` goes through an allowlisted unpickler (DCP's own uses
    plain ``pickle``, which runs whatever a crafted file asks); shards are read ``weights_only`` by DCP."""

    def read_metadata(self, *args: Any, **kwargs: Any):
        from torch.distributed.checkpoint.metadata import StorageMeta

        md = _read_dcp_metadata(Path(self.path))
        if getattr(md, "storage_meta", None) is None:
            md.storage_meta = StorageMeta()
        md.storage_meta.load_id = self.load_id
        return md


def _verify_locally(path: Path) -> CheckpointError | None:
    """What is wrong with the sharded checkpoint ``path`` as this rank sees it, or None."""
    if not path.exists():
        staged = _staged_copies(path)
        complete = [s for s in staged if (s / COMMIT_FILE).is_file()]
        hint = f"; a complete copy was left by an interrupted rename: rename {complete[-1]} to {path}" if complete else ""
        return CheckpointError(f"checkpoint {path} does not exist{hint}")
    if not path.is_dir():
        return _damaged(path, path.name, "a sharded checkpoint is a directory; this is a file")
    try:
        record = json.loads((path / COMMIT_FILE).read_text())
        files, save_id = dict(record["files"]), str(record["save_id"])
        if record.get("format") != COMMIT_FORMAT:
            return _damaged(path, COMMIT_FILE, f"format {record.get('format')!r}, expected {COMMIT_FORMAT!r}")
    except FileNotFoundError:
        return _damaged(path, COMMIT_FILE, "missing: the save that wrote this directory never completed (or it was "
                                           "written before lightning_sp wrote commit records)")
    except Exception as err:  # noqa: BLE001
        return _damaged(path, COMMIT_FILE, f"unreadable ({type(err).__name__}: {err})")
    for name, size in files.items():
        file = path / name
        if not file.is_file():
            return _damaged(path, name, "missing")
        if file.stat().st_size != size:
            return _damaged(path, name, f"{file.stat().st_size} bytes, the commit record says {size}")
    if META_FILE not in files or METADATA_FILE not in files:
        return _damaged(path, COMMIT_FILE, f"does not list {META_FILE} and {METADATA_FILE}")
    try:
        md = _read_dcp_metadata(path)
    except CheckpointError as err:
        return err
    if md.storage_meta is None or md.storage_meta.save_id != record.get("dcp_save_id"):
        return _damaged(path, METADATA_FILE, "written by another save than the commit record's")
    shards = {info.relative_path for info in (md.storage_data or {}).values()}
    if not shards <= set(files):
        return _damaged(path, sorted(shards - set(files))[0], "not listed in the commit record")
    try:
        meta_id = _load_meta_unverified(path).get(_SAVE_ID_KEY)
    except CheckpointError as err:
        return err
    if meta_id != save_id:
        return _damaged(path, META_FILE, f"written by save {meta_id}, the commit record is save {save_id}")
    return None


def verify(path: str | os.PathLike, *, process_group=None) -> None:
    """Check the sharded checkpoint ``path`` against its commit record on every rank of ``process_group``
    (default: world) and agree: if any rank finds a problem, every rank raises ``CheckpointError``.
    Collective: every rank must call it."""
    path = Path(path)
    problem = _verify_locally(path)
    _raise_on_every_rank(problem, path, process_group)


def _load_meta_unverified(path: Path) -> dict[str, Any]:
    try:
        return torch.load(path / META_FILE, weights_only=True, map_location="cpu")
    except pickle.UnpicklingError as err:
        raise _unsafe(path, META_FILE, err) from None
    except FileNotFoundError:
        raise _damaged(path, META_FILE, "missing") from None
    except Exception as err:  # noqa: BLE001
        raise _damaged(path, META_FILE, f"{type(err).__name__}: {err}") from None


def load_meta(path: str | os.PathLike) -> dict[str, Any]:
    """The non-tensor part (``meta.pt``) of the checkpoint ``path``, read ``weights_only``."""
    meta = _load_meta_unverified(Path(path))
    meta.pop(_SAVE_ID_KEY, None)
    return meta


def load(path: str | os.PathLike, tensors: dict[str, ChunkedTensor], *, process_group=None, verified: bool = False) -> None:
    """Read every chunk of ``tensors`` (in place) from the directory ``path``, whatever layout saved it.
    Collective; checks the commit record first (every rank agrees) unless ``verified``."""
    path = Path(path)
    if not verified:
        verify(path, process_group=process_group)
    try:
        dcp.load(tensors, storage_reader=SafeFileSystemReader(str(path)), planner=SafeLoadPlanner(),
                 process_group=process_group)
    except CheckpointError:
        raise
    except (Exception, CheckpointException) as err:  # noqa: BLE001 - DCP gathers every rank's read errors, raises them on all
        raise _damaged(path, "its shards (*.distcp)", f"{type(err).__name__}: {err}") from None


def is_sharded_checkpoint(path: str | os.PathLike, *, process_group=None) -> bool:
    """A directory (whole or damaged) is a sharded checkpoint; a file is a single-file one. With a process
    group initialised, the ranks agree (each format's loader issues other collectives) and raise
    ``CheckpointError`` together if they see ``path`` differently."""
    kinds = _gather_ints(int(Path(path).is_dir()), process_group)
    if len(set(kinds)) > 1:
        raise CheckpointError(f"checkpoint {path} is a directory on rank(s) {[r for r, k in enumerate(kinds) if k]} "
                              f"and not on the others: is it on a filesystem every rank shares?")
    return bool(kinds[0])


def load_single_file(path: str | os.PathLike, read, *, process_group=None) -> dict[str, Any]:
    """``read()`` the single-file checkpoint ``path`` (e.g. Lightning's ``CheckpointIO.load_checkpoint``
    with ``weights_only=True``) on every rank; if any rank cannot, every rank raises ``CheckpointError``
    naming the file. Collective."""
    path = Path(path)
    checkpoint, problem = None, None
    try:
        checkpoint = read()
    except FileNotFoundError as err:
        problem = err
    except pickle.UnpicklingError as err:
        problem = _unsafe(path, path.name, err)
    except Exception as err:  # noqa: BLE001 - truncated or garbled
        problem = _damaged(path, path.name, f"{type(err).__name__}: {err}")
    if problem is None and not isinstance(checkpoint, Mapping):
        problem = _damaged(path, path.name, f"holds a {type(checkpoint).__name__}, not a checkpoint dict")
    _raise_on_every_rank(problem, path, process_group)
    return checkpoint


# ------------------------------------------------------------------------------------------ Lightning
def save_lightning_checkpoint(checkpoint: dict[str, Any], path: str | os.PathLike, **extra_meta: Any) -> None:
    """Write a Lightning checkpoint dict whose ``state_dict`` came from ``model_state`` and whose
    ``optimizer_states`` from ``{"tensors", "param_groups"}`` of ``optimizer_state`` (every rank)."""
    meta = {k: v for k, v in checkpoint.items() if k not in ("state_dict", "optimizer_states")}
    tensors = {f"model/{k}": v for k, v in checkpoint["state_dict"].items()}
    groups = []
    for i, state in enumerate(checkpoint.get("optimizer_states", [])):
        tensors.update({f"optimizer{i}/{k}": v for k, v in state["tensors"].items()})
        groups.append(state["param_groups"])
    meta["optimizer_param_groups"] = groups
    meta["lightning_sp"] = extra_meta
    save(path, tensors, meta)


def load_lightning_checkpoint(path: str | os.PathLike, module: nn.Module,
                              optimizers: list[torch.optim.Optimizer]) -> dict[str, Any]:
    """Load the model (and, if the checkpoint has as many, the optimizers) in place from ``path``, in
    whatever layout ``module`` and ``optimizers`` are now; return the rest of the Lightning checkpoint
    with empty ``state_dict`` / ``optimizer_states`` placeholders (already loaded). Collective: checks the
    commit record on every rank first (``verify``); raises ``CheckpointError`` on every rank if damaged."""
    verify(path)
    meta = load_meta(path)
    tensors = {f"model/{k}": v for k, v in model_state(module).items()}
    saved_groups = meta.pop("optimizer_param_groups", [])
    restore_optim = bool(optimizers) and len(saved_groups) == len(optimizers)
    if restore_optim:
        for i, opt in enumerate(optimizers):
            init_optimizer_state(opt)
            state, _ = optimizer_state(module, opt)
            tensors.update({f"optimizer{i}/{k}": v for k, v in state.items()})
    load(path, tensors, verified=True)  # every rank reads the chunks it holds, in place
    if restore_optim:
        for opt, groups in zip(optimizers, saved_groups):
            for group, saved in zip(opt.param_groups, groups):
                group.update({k: v for k, v in saved.items() if k != "params"})
        meta["optimizer_states"] = [{} for _ in optimizers]
    meta["state_dict"] = {}
    return meta


# ------------------------------------------------------------------------------------------ single files
def _copy_full_into(full: torch.Tensor, target: "ChunkedTensor | torch.Tensor", name: str) -> None:
    """Copy the whole (one-process) tensor ``full`` into this rank's chunks of it, in place."""
    if not isinstance(full, torch.Tensor):
        raise ValueError(f"checkpoint entry {name!r} is a {type(full).__name__}, not a tensor")
    if isinstance(target, ChunkedTensor):
        if tuple(full.shape) != tuple(target.global_size):
            raise ValueError(f"checkpoint entry {name!r} has shape {tuple(full.shape)}, the model's is "
                             f"{tuple(target.global_size)}")
        with torch.no_grad():
            for offsets, view in target.chunks:
                index = tuple(slice(o, o + s) for o, s in zip(offsets, view.shape))
                view.copy_(full[index])
        return
    if full.shape != target.shape:
        raise ValueError(f"checkpoint entry {name!r} has shape {tuple(full.shape)}, the model's is {tuple(target.shape)}")
    with torch.no_grad():
        target.copy_(full)


def load_full_model_state(module: nn.Module, state_dict: Mapping[str, torch.Tensor], *, strict: bool = True) -> None:
    """Load a whole (unsharded) model state dict, as a single-file checkpoint holds it, into ``module``
    in place, whatever its layout now (DDP, FSDP2, tensor-parallel): each rank copies the chunks it holds."""
    chunks = model_state(module)
    missing, unexpected = sorted(set(chunks) - set(state_dict)), sorted(set(state_dict) - set(chunks))
    if strict and (missing or unexpected):
        raise ValueError(f"the checkpoint does not match the model: missing {missing}, unexpected {unexpected}")
    for name, target in chunks.items():
        if name in state_dict:
            _copy_full_into(state_dict[name], target, name)


def _optimizer_state_by_name(saved: Mapping[str, Any], names: list[list[str]]) -> tuple[dict[str, dict], list[dict]]:
    """A whole optimizer state dict keyed by parameter name, from either format a single file holds:
    ``optimizer.state_dict()`` (parameters numbered in param-group order: DDP) or FQN-keyed
    (``get_optimizer_state_dict(full_state_dict=True)``: FSDP)."""
    groups = list(saved.get("param_groups", []))
    if [len(g["params"]) for g in groups] != [len(n) for n in names]:
        raise ValueError(f"the checkpoint's optimizer has parameter groups of sizes {[len(g['params']) for g in groups]}, "
                         f"this optimizer {[len(n) for n in names]}: configure_optimizers must build the same groups")
    key_to_name = {key: name for g, group_names in zip(groups, names) for key, name in zip(g["params"], group_names)}
    state = {}
    for key, value in saved.get("state", {}).items():
        if key not in key_to_name:
            raise ValueError(f"the checkpoint's optimizer state has an entry {key!r} that is in no parameter group")
        state[key_to_name[key]] = value
    return state, groups


def is_name_keyed(saved_states: list[Mapping[str, Any]]) -> bool:
    """Whether single-file optimizer states key parameters by name (FSDP's full state dict), not by number."""
    return any(isinstance(p, str) for s in saved_states for g in s.get("param_groups", []) for p in g.get("params", []))


def load_full_optimizer_states(module: nn.Module, optimizers: list[torch.optim.Optimizer],
                               saved_states: list[Mapping[str, Any]]) -> None:
    """Load whole optimizer state dicts (either single-file format, see ``_optimizer_state_by_name``) into
    ``optimizers`` of ``module`` in place, whatever the layout now; restores the groups' hyper-parameters."""
    if len(saved_states) != len(optimizers):
        raise ValueError(f"the checkpoint has {len(saved_states)} optimizer state(s), the model {len(optimizers)}")
    for optimizer, saved in zip(optimizers, saved_states):
        names = _param_names(module, optimizer)
        by_name, groups = _optimizer_state_by_name(saved, names)
        init_optimizer_state(optimizer)
        targets, _ = optimizer_state(module, optimizer)  # "<param>/<state>" -> this rank's chunks
        for pname, values in by_name.items():
            for key, value in values.items():
                target = targets.get(f"{pname}/{key}")
                if target is None:
                    raise ValueError(f"the checkpoint's optimizer state {pname}/{key} does not exist in this optimizer")
                _copy_full_into(value if isinstance(value, torch.Tensor) else torch.tensor(value), target, f"{pname}/{key}")
        for group, saved_group in zip(optimizer.param_groups, groups):
            group.update({k: v for k, v in saved_group.items() if k != "params"})


# ------------------------------------------------------------------------------------------ the strategy's hooks
class StrategyCheckpointIO:
    """What ``SequenceParallelStrategy``'s checkpoint hooks do, with no Lightning import: each method gets the
    ``LightningModule`` (``module``), and Lightning's own hook as a callable for the cases where the format
    is Lightning's. ``is_fsdp_root()``: whether the model is wrapped by FSDP2 now (it is only while fitting).

    Single file (``distributed=False``; the default for DDP without tensor parallelism): with DDP, Lightning's
    checkpoint (nothing is sharded by sp, so any sp degree resumes); with FSDP the full (unsharded) state dict
    is gathered on every rank and written once by rank 0. Either resumes under any layout: each rank copies
    the whole tensors into the chunks it holds (``load_full_model_state`` / ``load_full_optimizer_states``).
    Read ``weights_only``.

    Sharded (``distributed=True``): Note [Checkpoint chunks]. Model and optimizer state stay chunked until
    ``save`` hands them to DCP; ``load`` reads them in place (after setup: the model is converted, wrapped
    and split), so the restore hooks that follow have nothing left to do (``restored_sharded``).
    """

    def __init__(self, *, distributed: bool | None, data_parallel: str, tensor_parallel_size: int,
                 is_fsdp_root: Callable[[], bool]) -> None:
        if tensor_parallel_size > 1 and distributed is False:
            raise ValueError("distributed_checkpoint=False (one file) cannot hold a tensor-parallel model; drop it: "
                             "sharded checkpoints resume under any layout, DDP and FSDP included")
        self.distributed = (tensor_parallel_size > 1 or data_parallel == "fsdp") if distributed is None else bool(distributed)
        self.data_parallel = data_parallel
        self.tensor_parallel_size = tensor_parallel_size
        self.is_fsdp_root = is_fsdp_root
        self.restored_sharded = False
        """The last ``load`` read a sharded checkpoint into the model and optimizers already."""

    def _fsdp_full_state(self) -> bool:
        return self.data_parallel == "fsdp" and self.is_fsdp_root()

    def _whole_tensors_to_chunks(self) -> bool:
        """A single file's whole tensors must be copied into this rank's chunks (not loaded as they are)."""
        return self.tensor_parallel_size > 1 or self._fsdp_full_state()

    @staticmethod
    def _fsdp_options(**kw: Any):
        from torch.distributed.checkpoint.state_dict import StateDictOptions

        return StateDictOptions(full_state_dict=True, cpu_offload=True, **kw)

    def save(self, checkpoint: dict[str, Any], path: Any, storage_options: Any, *, dims, lightning_save,
             in_place: bool = False) -> None:
        """``Strategy.save_checkpoint``; ``dims``: the ``ParallelDims`` recorded with a sharded checkpoint.
        A single file is staged and renamed into place (``in_place``: Lightning's writer writes ``path``
        itself: a plugin that writes later); any failure raises on every rank (``save_single_file``)."""
        if not self.distributed:
            return save_single_file(path, lambda target: lightning_save(checkpoint, target, storage_options=storage_options),
                                    in_place=in_place)
        if storage_options is not None:
            raise TypeError("storage_options is not supported with distributed_checkpoint=True")
        save_lightning_checkpoint(checkpoint, path, dp=dims.dp, sp=dims.sp, tp=dims.tp, data_parallel=self.data_parallel)

    def load(self, path: Any, weights_only: bool | None, module: nn.Module, optimizers: list[torch.optim.Optimizer],
             lightning_load) -> dict[str, Any]:
        """``Strategy.load_checkpoint``: a directory is sharded (read in place), a file Lightning's
        (``weights_only`` unless the caller passes ``False`` for a file they trust)."""
        self.restored_sharded = False
        if _group_rank(None) == 0 and "://" not in str(path) and Path(path).parent.is_dir():
            clean_stale_staging(Path(path).parent)  # no save is in flight; the others wait in the next collective
        if not is_sharded_checkpoint(path):
            return load_single_file(path, lambda: lightning_load(path, weights_only=weights_only is not False))
        checkpoint = load_lightning_checkpoint(path, module, optimizers)
        self.restored_sharded = True
        return checkpoint

    def model_state(self, module: nn.Module, wrapped: nn.Module, lightning_state) -> dict[str, Any]:
        """``Strategy.lightning_module_state_dict`` (``wrapped``: the DDP / FSDP2 model)."""
        if self.distributed:
            return model_state(module)
        if self._fsdp_full_state():
            from torch.distributed.checkpoint.state_dict import get_model_state_dict

            return get_model_state_dict(wrapped, options=self._fsdp_options())
        return lightning_state()

    def optimizer_state(self, module: nn.Module, wrapped: nn.Module, optimizer: torch.optim.Optimizer,
                        lightning_state) -> dict[str, Any]:
        """``Strategy.optimizer_state``."""
        if self.distributed:
            tensors, groups = optimizer_state(module, optimizer)
            return {"tensors": tensors, "param_groups": groups}
        if self._fsdp_full_state():
            from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict

            return get_optimizer_state_dict(wrapped, optimizer, options=self._fsdp_options())
        return lightning_state(optimizer)

    def load_model_state(self, module: nn.Module, checkpoint: Mapping[str, Any], strict: bool, lightning_load) -> None:
        """``Strategy.load_model_state_dict``."""
        if self.restored_sharded:
            return
        if self._whole_tensors_to_chunks():
            return load_full_model_state(module, checkpoint["state_dict"], strict=strict)
        lightning_load(checkpoint, strict=strict)

    def load_optimizer_states(self, module: nn.Module, optimizers: list[torch.optim.Optimizer],
                              checkpoint: Mapping[str, Any], lightning_load) -> None:
        """``Strategy.load_optimizer_state_dict``."""
        if self.restored_sharded:
            return
        states = checkpoint["optimizer_states"]
        if self._whole_tensors_to_chunks() or is_name_keyed(states):
            return load_full_optimizer_states(module, optimizers, states)
        lightning_load(checkpoint)
