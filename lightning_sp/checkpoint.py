"""Sharded checkpoints through ``torch.distributed.checkpoint`` that reshard across tp / sp / dp degrees
and between DDP and FSDP2. No rank ever gathers the whole state; loading never unpickles objects.

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
    rank 0 and read back with ``torch.load(weights_only=True)``; DCP's own byte items are loaded with
    ``weights_only=True`` too (``SafeLoadPlanner``).
"""

from __future__ import annotations

import io
import os
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint.metadata import ChunkStorageMetadata, MetadataIndex
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner, DefaultSavePlanner
from torch.distributed.checkpoint.planner import TensorProperties, TensorWriteData, WriteItem, WriteItemType

from lightning_sp.tensor_parallel import ColumnParallelLinear, RowParallelLinear, VocabParallelEmbedding, shard_range

META_FILE = "meta.pt"


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
def _plain(obj: Any) -> Any:
    """Containers as plain dict / list / tuple so ``torch.load(weights_only=True)`` reads them."""
    if isinstance(obj, Mapping):
        return {k: _plain(v) for k, v in obj.items()}
    if isinstance(obj, list):
        return [_plain(v) for v in obj]
    if isinstance(obj, tuple) and not hasattr(obj, "_fields"):
        return tuple(_plain(v) for v in obj)
    return obj


def save(path: str | os.PathLike, tensors: dict[str, ChunkedTensor], meta: dict[str, Any], *, process_group=None) -> None:
    """Write ``tensors`` (every rank its chunks) and ``meta`` (rank 0) to the directory ``path``."""
    path = Path(path)
    meta = _plain(meta)
    if dist.get_rank() == 0:
        path.mkdir(parents=True, exist_ok=True)
        buf = io.BytesIO()
        torch.save(meta, buf)
        try:  # fail now, not at resume time
            torch.load(io.BytesIO(buf.getvalue()), weights_only=True)
        except Exception as err:
            raise ValueError(
                f"checkpoint metadata holds objects that weights_only loading refuses ({err}); keep hyper-parameters, "
                "callback and loop states to numbers, strings, tensors and containers of them"
            ) from None
        (path / META_FILE).write_bytes(buf.getvalue())
    dcp.save(tensors, checkpoint_id=str(path), planner=ChunkedSavePlanner(), process_group=process_group)


def load_meta(path: str | os.PathLike) -> dict[str, Any]:
    return torch.load(Path(path) / META_FILE, weights_only=True, map_location="cpu")


def load(path: str | os.PathLike, tensors: dict[str, ChunkedTensor], *, process_group=None) -> None:
    """Read every chunk of ``tensors`` (in place) from the directory ``path``, whatever layout saved it."""
    dcp.load(tensors, checkpoint_id=str(path), planner=SafeLoadPlanner(), process_group=process_group)


def is_sharded_checkpoint(path: str | os.PathLike) -> bool:
    return Path(path).is_dir() and (Path(path) / META_FILE).is_file()


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
    with empty ``state_dict`` / ``optimizer_states`` placeholders (already loaded)."""
    meta = load_meta(path)
    tensors = {f"model/{k}": v for k, v in model_state(module).items()}
    saved_groups = meta.pop("optimizer_param_groups", [])
    restore_optim = bool(optimizers) and len(saved_groups) == len(optimizers)
    if restore_optim:
        for i, opt in enumerate(optimizers):
            init_optimizer_state(opt)
            state, _ = optimizer_state(module, opt)
            tensors.update({f"optimizer{i}/{k}": v for k, v in state.items()})
    load(path, tensors)  # every rank reads the chunks it holds, in place
    if restore_optim:
        for opt, groups in zip(optimizers, saved_groups):
            for group, saved in zip(opt.param_groups, groups):
                group.update({k: v for k, v in saved.items() if k != "params"})
        meta["optimizer_states"] = [{} for _ in optimizers]
    meta["state_dict"] = {}
    return meta
