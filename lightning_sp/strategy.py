"""``SequenceParallelStrategy``: Lightning training over orthogonal sequence- and data-parallel groups.

Built on Lightning's ``DDPStrategy``, so launching (``popen``/``spawn``, torchrun, SLURM, multi-node),
precision plugins, checkpoint IO and cluster environments are Lightning's own. On top it

- lays the world out as a ``(dp, sp)`` mesh, ``sp = ring x ulysses`` (``lightning_sp.topology``),
  creates the groups on every rank and binds every ``SequenceParallelAttention`` of the model to a
  ``SequenceParallelContext`` (no globals);
- gives the ``DistributedSampler`` the data-parallel axis only, so every rank of an sp group reads
  the same sample, then shards each tensor under ``sequence_keys`` along dim 1 with the backend's
  layout (``batch_to_device``), padding lengths that do not divide (labels with ``ignore_index``),
  setting ``context.global_seq_len`` so padded keys are never attended, and supplying global
  ``position_ids`` when the key is requested but absent (right under the zigzag layout too);
- with ``tensor_parallel_size=t``, adds the innermost ``tp`` axis (Megatron TP+SP, ``lightning_sp.
  tensor_parallel``): one ``DeviceMesh`` ``dp x ring x ulysses x tp`` (``lightning_sp.mesh``), the
  model's tensor-parallel layers keep their weight slices, DDP / FSDP2 run over ``dp x sp`` only, and
  replicated parameters' gradients are summed over ``tp`` before each optimizer step; checkpoints
  are sharded ``torch.distributed.checkpoint`` directories (``lightning_sp.checkpoint``);
- reduces gradients over the whole world: see Note [Gradient reduction over dp x sp]
    Replica ``d`` (an sp group of ``P`` ranks) has loss ``L_d = sum_s l_{d,s} / n_d``, the token mean of
    its sequence, where ``l_{d,s}`` sums the token losses of shard ``s``. ``sequence_parallel_cross_entropy``
    returns ``L_d`` on every sp rank and its backward is that of an all-reduce: each of the ``P`` copies
    of ``L_d`` sends gradient 1 back, so rank ``(d, s)`` holds ``P * dL_d/dtheta`` *through its shard*
    (attention communication routes the cross-shard terms)::

        rank (d, s) grad  = P * g_{d,s}              sum_s g_{d,s} = dL_d/dtheta
        mean over s       = sum_s g_{d,s}            = replica d's gradient
        mean over d       = global-batch gradient    (equal token counts per replica)

    So a plain MEAN over all ``dp * sp`` ranks is exactly the non-parallel gradient: DDP over the
    world (``data_parallel="ddp"``) or FSDP2's reduce-scatter over the flattened world mesh
    (``"fsdp"``). The distributed tests check it to 1e-10 in float64.
"""

from __future__ import annotations

import logging
import re
from collections.abc import Iterable, Mapping, Sequence
from contextlib import contextmanager
from datetime import timedelta
from typing import TYPE_CHECKING, Any, Literal

import torch
import torch.distributed as dist
import torch.utils.checkpoint
from lightning.pytorch.strategies import DDPStrategy, StrategyRegistry
from lightning.pytorch.utilities.rank_zero import rank_zero_info, rank_zero_warn
from torch import nn
from torch.utils.data import DistributedSampler
from typing_extensions import override

from lightning_sp.attention import default_ulysses_degree
from lightning_sp.context import SequenceParallelContext
from lightning_sp.mesh import ParallelMesh, build_parallel_mesh
from lightning_sp.ops.backends import BACKENDS
from lightning_sp.tensor_parallel import TensorParallelContext, bind_tensor_parallel
from lightning_sp.topology import MeshAxis, ParallelDims

if TYPE_CHECKING:
    import lightning.pytorch as pl
    from torch.distributed.device_mesh import DeviceMesh

log = logging.getLogger(__name__)

DATA_PARALLEL = ("ddp", "fsdp")
DEFAULT_SEQUENCE_KEYS = ("input_ids", "labels", "position_ids", "attention_mask", "loss_mask", "inputs_embeds")


def _recompute_in_backward(module: nn.Module) -> None:
    """Make ``module``'s forward non-reentrant-checkpointed (idempotent). The recomputation repeats the
    module's collectives during backward, in the same order on every rank."""
    if getattr(module, "_lightning_sp_checkpointed", False):
        return
    forward = module.forward

    def checkpointed_forward(*args: Any, **kwargs: Any) -> Any:
        return torch.utils.checkpoint.checkpoint(forward, *args, use_reentrant=False, **kwargs)

    module.forward = checkpointed_forward
    module._lightning_sp_checkpointed = True


class SequenceParallelStrategy(DDPStrategy):
    """Sequence (context) parallelism x data parallelism for a Lightning ``Trainer``.

    Args:
        sequence_parallel_size: ranks sharing one sequence (the ``sp`` degree); must divide
            ``num_nodes * devices``. ``None``: all ranks (no data parallelism).
        backend: attention backend for modules built with ``backend=None`` (see README).
        ulysses_degree: for ``backend="usp"``, the inner Ulysses degree (must divide
            ``sequence_parallel_size``); ``None`` picks ``default_ulysses_degree``. Only for ``usp``.
        data_parallel: ``"ddp"`` (replicated parameters, all-reduce over the world) or ``"fsdp"``
            (FSDP2 ``fully_shard`` over the flattened ``dp x sp`` ranks, ZeRO-3 style).
        sequence_keys: batch keys (for a Mapping batch) or positions (for a tuple/list batch) whose
            tensors are sharded along dim 1. With ``sp > 1`` a batch holding none of them raises (it
            would otherwise train every rank on the whole sequence). Tuple batches get no
            ``position_ids`` (no key can be added; a one-time warning says so).
        label_keys: those of ``sequence_keys`` padded with ``ignore_index`` instead of ``pad_value``.
        position_ids_key: if this key is in ``sequence_keys`` but missing from a Mapping batch, the
            strategy adds this rank's global positions ``[B, S_local]`` (padding clamped to ``N - 1``).
        ignore_index: label value the loss ignores (padding of ``label_keys``).
        pad_value: padding value of the other sequence tensors.
        kernel: local kernel for modules built with ``kernel="auto"``.
        fsdp_shard_modules: with ``"fsdp"``, module classes that get their own ``fully_shard`` unit
            (e.g. the transformer block) before the root; default: the root only.
        checkpoint_attention: selective activation checkpointing (Korthikanti et al. 2022): keep
            no activations inside each ``SequenceParallelAttention`` and recompute it (with its
            communication) in the backward pass; everything else is stored as usual.
        shuffle: ``True`` keeps Lightning's behaviour: the ``DistributedSampler`` it injects shuffles the
            training data (seed ``PL_GLOBAL_SEED``) even if the ``DataLoader`` does not. ``False`` keeps
            the dataset order, so a run compares step for step with a single-device, unshuffled run.
        process_group_timeout: seconds (or ``timedelta``) a collective may wait before the run fails
            with an error naming the rank; keep it short to turn a dead or stalled rank into an error.
        tensor_parallel_size: Megatron tensor + sequence parallelism over the innermost ``tp`` mesh axis
            (``lightning_sp.tensor_parallel``): every ``TensorParallelModule`` of the model keeps its
            slice of the weights, heads divide across TP first, then Ulysses. The mesh is
            ``dp x sp(ring x ulysses) x tp`` (``device_mesh``); DDP / FSDP2 run over ``dp x sp``.
        distributed_checkpoint: save checkpoints as a ``torch.distributed.checkpoint`` directory in which
            every rank writes only the chunks it holds, resumable under other tp / sp / dp degrees and
            DDP <-> FSDP (``lightning_sp.checkpoint``). ``None``: on with FSDP or tensor parallelism,
            otherwise Lightning's single file. Both formats resume under every layout (a directory is
            recognised as sharded when loading); a single file cannot hold a tensor-parallel model.
        **kwargs: passed to ``DDPStrategy`` (``start_method``, ``process_group_backend``,
            ``find_unused_parameters``, ...).
    """

    strategy_name = "sequence_parallel"

    def __init__(
        self,
        sequence_parallel_size: int | None = None,
        *,
        backend: str = "auto",
        ulysses_degree: int | None = None,
        data_parallel: Literal["ddp", "fsdp"] = "ddp",
        sequence_keys: Sequence[str | int] = DEFAULT_SEQUENCE_KEYS,
        label_keys: Sequence[str | int] = ("labels",),
        position_ids_key: str | None = "position_ids",
        ignore_index: int = -100,
        pad_value: int | float = 0,
        kernel: str = "auto",
        fsdp_shard_modules: Iterable[type[nn.Module]] = (),
        checkpoint_attention: bool = False,
        shuffle: bool = True,
        process_group_timeout: float | timedelta = timedelta(minutes=30),
        tensor_parallel_size: int = 1,
        distributed_checkpoint: bool | None = None,
        **kwargs: Any,
    ) -> None:
        if "timeout" in kwargs:
            raise ValueError("pass `process_group_timeout=` instead of `timeout=` to SequenceParallelStrategy")
        if not isinstance(process_group_timeout, timedelta):
            process_group_timeout = timedelta(seconds=float(process_group_timeout))
        if process_group_timeout.total_seconds() <= 0:
            raise ValueError(f"process_group_timeout must be positive, got {process_group_timeout}")
        super().__init__(timeout=process_group_timeout, **kwargs)
        if sequence_parallel_size is not None and (
            not isinstance(sequence_parallel_size, int) or isinstance(sequence_parallel_size, bool) or sequence_parallel_size < 1
        ):
            raise ValueError(f"sequence_parallel_size must be a positive integer or None (all ranks), got {sequence_parallel_size!r}")
        if backend not in BACKENDS:
            raise ValueError(f"backend={backend!r} is not one of {BACKENDS}")
        if ulysses_degree is not None and backend != "usp":
            raise ValueError(
                f"ulysses_degree={ulysses_degree} only applies to backend='usp' (got backend={backend!r}); "
                f"use backend='usp' for a ring x ulysses split, or drop ulysses_degree"
            )
        if ulysses_degree is not None and sequence_parallel_size is not None:
            ParallelDims(world_size=sequence_parallel_size, sequence_parallel_size=sequence_parallel_size,
                         ulysses_degree=ulysses_degree)  # eager check: ulysses_degree divides sp
        if not isinstance(tensor_parallel_size, int) or isinstance(tensor_parallel_size, bool) or tensor_parallel_size < 1:
            raise ValueError(f"tensor_parallel_size must be a positive integer, got {tensor_parallel_size!r}")
        if data_parallel not in DATA_PARALLEL:
            raise ValueError(f"data_parallel={data_parallel!r} is not one of {DATA_PARALLEL}")
        if isinstance(sequence_keys, str):
            raise ValueError(f"sequence_keys must be a sequence of keys, got the string {sequence_keys!r}; use ({sequence_keys!r},)")
        self._sp_size_arg = sequence_parallel_size
        self._tp_size = tensor_parallel_size
        self._mesh: ParallelMesh | None = None
        self._tp_context: TensorParallelContext | None = None
        self._tp_sharded: set[str] = set()
        if tensor_parallel_size > 1 and distributed_checkpoint is False:
            raise ValueError("distributed_checkpoint=False (one file) cannot hold a tensor-parallel model; drop it: "
                             "sharded checkpoints resume under any layout, DDP and FSDP included")
        self._distributed_checkpoint = (tensor_parallel_size > 1 or data_parallel == "fsdp") \
            if distributed_checkpoint is None else bool(distributed_checkpoint)
        self._restored_sharded = False
        self._backend = backend
        self._ulysses_degree_arg = ulysses_degree
        self._data_parallel = data_parallel
        self.sequence_keys = tuple(sequence_keys)
        self.label_keys = tuple(label_keys)
        self.position_ids_key = position_ids_key
        self.ignore_index = ignore_index
        self.pad_value = pad_value
        self._kernel = kernel
        self._fsdp_shard_modules = tuple(fsdp_shard_modules)
        self.checkpoint_attention = checkpoint_attention
        self.shuffle = shuffle
        self._dims: ParallelDims | None = None
        self._context: SequenceParallelContext | None = None
        self._dp_group: dist.ProcessGroup | None = None
        self._owned_groups: list[dist.ProcessGroup] = []
        self._layout: Any = None
        self._warned_tuple_positions = False
        self._padding_reported: set[tuple[int, int]] = set()
        self._announced_auto = False

    # ---------------------------------------------------------------------------------- topology
    @property
    def backend(self) -> str:
        return self._backend

    @property
    def data_parallel(self) -> str:
        return self._data_parallel

    def _world_size_from_config(self) -> int:
        return self.num_nodes * max(self.num_processes, 1)

    def _ranks_per_node(self) -> int | None:
        """Devices per node: all-to-alls (Ulysses) are kept within this many consecutive ranks."""
        return self.num_processes if self.num_processes else None

    def _make_dims(self, world_size: int) -> ParallelDims:
        sp = max(world_size // self._tp_size, 1) if self._sp_size_arg is None else self._sp_size_arg
        if self._backend == "usp":
            u = self._ulysses_degree_arg or default_ulysses_degree(sp, ranks_per_node=self._ranks_per_node())
        elif self._backend == "ulysses":
            u = sp
        else:
            u = 1
        try:
            return ParallelDims(world_size=world_size, sequence_parallel_size=sp, ulysses_degree=u,
                                tensor_parallel_size=self._tp_size)
        except ValueError as err:
            raise ValueError(
                f"SequenceParallelStrategy(sequence_parallel_size={sp}, backend={self._backend!r}, "
                f"ulysses_degree={self._ulysses_degree_arg}, tensor_parallel_size={self._tp_size}) on num_nodes={self.num_nodes} x "
                f"devices={self.num_processes}: {err}"
            ) from None

    @property
    def parallel_dims(self) -> ParallelDims:
        """The mesh degrees; known once the Trainer has set the devices."""
        if self._dims is None:
            if self.parallel_devices is None:
                raise RuntimeError(
                    "SequenceParallelStrategy.parallel_dims is not known yet: pass the strategy to a Trainer "
                    "(it reads num_nodes and devices) before asking for the mesh"
                )
            self._dims = self._make_dims(self._world_size_from_config())
        return self._dims

    @property
    def sequence_parallel_size(self) -> int:
        return self.parallel_dims.sp

    @property
    def data_parallel_size(self) -> int:
        return self.parallel_dims.dp

    @property
    def context(self) -> SequenceParallelContext:
        """This rank's ``SequenceParallelContext`` (groups, backend, comm counters); set in ``setup``."""
        if self._context is None:
            raise RuntimeError(
                "SequenceParallelStrategy.context is created in Trainer setup (after the process group "
                "exists); access it from a LightningModule hook such as `setup`, `training_step` or a callback"
            )
        return self._context

    @property
    def sp_group(self) -> dist.ProcessGroup:
        """This rank's sequence-parallel group (pass it to ``sequence_parallel_cross_entropy``)."""
        return self.context.group

    @property
    def dp_group(self) -> dist.ProcessGroup:
        """This rank's data-parallel group (one rank per sp group, same sp index)."""
        if self._dp_group is None:
            raise RuntimeError("SequenceParallelStrategy.dp_group is created in Trainer setup")
        return self._dp_group

    @property
    def tensor_parallel_size(self) -> int:
        return self._tp_size

    @property
    def device_mesh(self) -> "DeviceMesh":
        """The 4-D ``DeviceMesh`` with axes ``("dp", "ring", "ulysses", "tp")`` (``lightning_sp.mesh``)."""
        if self._mesh is None:
            raise RuntimeError("SequenceParallelStrategy.device_mesh is created in Trainer setup")
        return self._mesh.mesh

    @property
    def tp_group(self) -> dist.ProcessGroup:
        """This rank's tensor-parallel group (the innermost mesh axis)."""
        if self._mesh is None:
            raise RuntimeError("SequenceParallelStrategy.tp_group is created in Trainer setup")
        return self._mesh.group(MeshAxis.TP)

    @property
    def tensor_parallel_context(self) -> TensorParallelContext:
        """What the model's tensor-parallel layers are bound to (group, comm counters); set in ``setup``."""
        if self._tp_context is None:
            raise RuntimeError("SequenceParallelStrategy.tensor_parallel_context is created in Trainer setup")
        return self._tp_context

    @property
    def layout(self):
        """The ``SequenceLayout`` batches are sharded with (that of the bound attention modules)."""
        if self._layout is None:
            raise RuntimeError("SequenceParallelStrategy.layout is known after Trainer setup binds the model")
        return self._layout

    @override
    def _configure_launcher(self) -> None:
        # runs at Trainer construction, before any process is launched: fail bad degrees here
        self._dims = self._make_dims(self._world_size_from_config())
        super()._configure_launcher()

    @property
    @override
    def distributed_sampler_kwargs(self) -> dict[str, Any]:
        # data-parallel axis only: every rank of an sp group reads the same samples
        dims = self.parallel_dims
        return {"num_replicas": dims.dp, "rank": dims.dp_rank(self.global_rank)}

    @override
    def process_dataloader(self, dataloader: Any) -> Any:
        dataloader = super().process_dataloader(dataloader)
        sampler = getattr(dataloader, "sampler", None)
        if not self.shuffle and isinstance(sampler, DistributedSampler):
            sampler.shuffle = False  # read at every __iter__
        return dataloader

    # ---------------------------------------------------------------------------------- groups
    @override
    def setup_environment(self) -> None:
        super().setup_environment()  # init_process_group (or reuse an initialised one)
        self._build_groups()

    def _build_groups(self) -> None:
        world = dist.get_world_size()
        dims = self._make_dims(world)
        if world != self._world_size_from_config():
            raise ValueError(
                f"the process group has {world} ranks but the Trainer was configured with "
                f"num_nodes={self.num_nodes} x devices={self.num_processes}"
            )
        self._dims = dims
        # one DeviceMesh dp x ring x ulysses x tp (collective: every rank, same order)
        self._mesh = build_parallel_mesh(dims, self.root_device.type, timeout=self._timeout)
        self._owned_groups.extend(self._mesh.transient_groups())
        mesh = self._mesh
        log.debug("rank %d: mesh %s", dist.get_rank(), mesh.mesh)
        self._dp_group = mesh.group(MeshAxis.DP)
        usp = self._backend == "usp"
        self._context = SequenceParallelContext(
            group=mesh.group(MeshAxis.SP),
            backend=self._backend,
            ulysses_degree=dims.ulysses if usp else None,
            ulysses_group=mesh.group(MeshAxis.ULYSSES) if usp else None,
            ring_group=mesh.group(MeshAxis.RING) if usp else None,
            kernel=self._kernel,
            ranks_per_node=self._ranks_per_node(),
        )
        backend = self._backend
        if backend == "auto":
            backend = (f"auto (chosen at the first attention call by the cost model from the shapes, sp={dims.sp} "
                       f"and {self._ranks_per_node()} ranks per node, among ulysses, zigzag_ring, allgather_kv "
                       f"and usp on the zigzag layout)")
        rank_zero_info(
            f"SequenceParallelStrategy: world={world} dp={dims.dp} sp={dims.sp} (ring={dims.ring} x "
            f"ulysses={dims.ulysses}) backend={backend} data_parallel={self._data_parallel}"
        )
        self._tp_context = TensorParallelContext(
            group=mesh.group(MeshAxis.TP) if dims.tp > 1 else None, sequence_parallel=True,
            ulysses_degree=dims.ulysses if self._backend in ("ulysses", "usp") else 1,
        )
        if dims.tp > 1:
            rank_zero_info(f"SequenceParallelStrategy: tensor_parallel_size={dims.tp} (Megatron TP+SP, innermost axis); "
                           f"mesh dp x ring x ulysses x tp = {' x '.join(map(str, dims.mesh_shape))}")

    def _bind_model(self, module: nn.Module) -> None:
        from lightning_sp.attention import SequenceParallelAttention, layout_for_backend

        layouts = {}
        for name, m in module.named_modules():
            if isinstance(m, SequenceParallelAttention):
                m.bind(self.context)
                if m.resolved_backend() != "local":  # local modules attend over whatever they are given
                    layouts[name] = m.layout
                if self.checkpoint_attention:
                    _recompute_in_backward(m)
        distinct = set(layouts.values())
        if len(distinct) > 1:
            raise ValueError(
                "the model's SequenceParallelAttention modules need different sequence layouts "
                f"({ {k: str(v) for k, v in layouts.items()} }), but a batch can be sharded only one way: "
                "build them with backend=None (the strategy's backend) or backends of the same layout"
            )
        if self._tp_context is not None and self._tp_context.world > 1:
            self._bind_tensor_parallel(module)
        if distinct:
            self._layout = distinct.pop()
        else:
            self._layout = layout_for_backend(
                self._backend, group_size=self.parallel_dims.sp, ulysses_degree=self.context.ulysses_degree
            )

    def _bind_tensor_parallel(self, module: nn.Module) -> None:
        """Split the model's ``TensorParallelModule`` weights over the ``tp`` axis (Note [Megatron tensor +
        sequence parallelism]); remember which parameters are split (the others are replicated)."""
        self._tp_sharded = set(bind_tensor_parallel(module, self._tp_context))
        if not self._tp_sharded:
            raise ValueError(
                f"tensor_parallel_size={self._tp_size} but the model has no tensor-parallel layers "
                "(lightning_sp.tensor_parallel.ColumnParallelLinear / RowParallelLinear / VocabParallelEmbedding): "
                "build it from them (as lightning_sp.models does), or use tensor_parallel_size=1"
            )

    @override
    def setup(self, trainer: "pl.Trainer") -> None:
        from lightning.pytorch.trainer.states import TrainerFn

        assert self.lightning_module is not None
        self._bind_model(self.lightning_module)
        if trainer.state.fn == TrainerFn.FITTING:
            super().setup(trainer)
            if self._tp_context is not None and self._tp_context.world > 1:
                # Lightning's clip-by-norm takes each rank's local norm; under TP that differs across
                # tp ranks (and from one process): use the global norm instead
                self.precision_plugin.clip_grad_by_norm = self.clip_grad_norm_
            return
        # validate / test / predict. DDPStrategy.setup would broadcast every tensor from global rank 0,
        # which breaks FSDP2-sharded parameters ("Cannot flatten unevenly sharded tensor" when a first
        # dim does not divide the world: trainer.validate() after fit) and tensor-parallel shards.
        # Synchronise over dp x sp only: the ranks that hold the same shard.
        assert self.accelerator is not None and self.model is not None
        self.accelerator.setup(trainer)
        self.precision_plugin.convert_module(self.model)
        self.model_to_device()
        if not self._is_fsdp_root():
            self._broadcast_replicas(self.model)
        self.setup_precision_plugin()

    def _broadcast_replicas(self, module: nn.Module) -> None:
        """Copy every parameter and buffer from the first rank of this rank's ``dp x sp`` group."""
        from torch.distributed.tensor import DTensor

        group = self._mesh.group(MeshAxis.DP_SP)
        if dist.get_world_size(group) == 1:
            return
        src = dist.get_process_group_ranks(group)[0]
        with torch.no_grad():
            for t in [*module.parameters(), *module.buffers()]:
                if isinstance(t, DTensor):
                    continue  # sharded by FSDP: consistent by construction
                dist.broadcast(t.data, src=src, group=group)

    # ---------------------------------------------------------------------------------- batches
    @override
    def batch_to_device(self, batch: Any, device: torch.device | None = None, dataloader_idx: int = 0) -> Any:
        # shard first: only this rank's N/P tokens travel to the device, never the whole sequence. A module
        # whose batches need global work before sharding (HFSequenceParallelModule: label shift, packing)
        # sets `shards_its_own_batches = True` and shards in `on_after_batch_transfer` instead.
        if self._context is not None and not getattr(self.lightning_module, "shards_its_own_batches", False):
            batch = self.shard_batch(batch)
        return super().batch_to_device(batch, device, dataloader_idx)

    def shard_batch(self, batch: Any) -> Any:
        """Shard every tensor under ``sequence_keys`` along dim 1 (``[B, N, ...] -> [B, N_pad/P, ...]``),
        set ``context.global_seq_len = N`` and add global ``position_ids`` if requested and absent."""
        from lightning_sp.layout import sequence_positions, shard_sequence

        group, layout = self.context.group, self.layout
        sharding = self.parallel_dims.sp > 1
        if isinstance(batch, Mapping):
            items = [(k, batch[k]) for k in self.sequence_keys if k in batch and isinstance(batch[k], torch.Tensor)]
        elif isinstance(batch, (list, tuple)):
            items = [(k, batch[k]) for k in self.sequence_keys
                     if isinstance(k, int) and -len(batch) <= k < len(batch) and isinstance(batch[k], torch.Tensor)]
        else:
            items = []
        lengths = {k: t.size(1) for k, t in items if t.dim() >= 2}
        if not lengths:
            if sharding:  # every rank would silently train on the whole sequence
                raise ValueError(self._unsharded_batch_message(batch))
            return batch
        if len(set(lengths.values())) > 1:
            raise ValueError(f"sequence_keys tensors disagree on the sequence length (dim 1): {lengths}")
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
        self._report_padding(seq_len)
        return out

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

    # ---------------------------------------------------------------------------------- model wrapping
    @override
    def _setup_model(self, model: nn.Module) -> nn.Module:
        # DDP / FSDP2 over dp x sp (the world when tp = 1): see Note [Gradient reduction over dp x sp]
        if self._data_parallel == "ddp":
            if self.parallel_dims.tp > 1:  # tp ranks hold different shards: never average across them
                if self._ddp_kwargs.get("process_group") is not None:  # LightningCLI passes None explicitly
                    raise ValueError("SequenceParallelStrategy builds DDP's process group (dp x sp) itself; "
                                     "do not pass process_group=")
                self._ddp_kwargs["process_group"] = self._mesh.group(MeshAxis.DP_SP)
            return super()._setup_model(model)
        from torch.distributed.fsdp import fully_shard

        mesh = self._mesh.dp_sp  # flattened dp x sp mesh, in global rank order
        for m in model.modules():
            if m is not model and isinstance(m, self._fsdp_shard_modules):
                fully_shard(m, mesh=mesh)
        fully_shard(model, mesh=mesh)
        return model

    def _redirect(self, method: str, *args: Any, **kwargs: Any) -> Any:
        # an FSDP2 root only unshards in its forward hooks: route the step through __call__
        return self._forward_redirection(self.model, self.lightning_module, method, *args, **kwargs)

    @override
    def training_step(self, *args: Any, **kwargs: Any) -> Any:
        if self._data_parallel == "fsdp" and self.model is self.lightning_module:
            with self.precision_plugin.train_step_context():
                out = self._redirect("training_step", *args, **kwargs)
        else:
            out = super().training_step(*args, **kwargs)
        self._announce_auto_backend()
        return out

    def _announce_auto_backend(self) -> None:
        """Say once what ``backend="auto"`` resolved to (known after the first attention call)."""
        if self._announced_auto or self._context is None or self._context.resolved_backend is None:
            return
        self._announced_auto = True
        choice = self._context.auto_choice
        rank_zero_info(f"SequenceParallelStrategy: backend='auto' runs "
                       f"{choice.summary() if choice is not None else self._context.resolved_backend}")

    @override
    def validation_step(self, *args: Any, **kwargs: Any) -> Any:
        if self._data_parallel == "fsdp" and self._is_fsdp_root():
            with self.precision_plugin.val_step_context():
                return self._redirect("validation_step", *args, **kwargs)
        return super().validation_step(*args, **kwargs)

    @override
    def optimizer_step(self, optimizer: torch.optim.Optimizer, closure: Any, model: Any = None, **kwargs: Any) -> Any:
        if self._tp_context is None or self._tp_context.world == 1:
            return super().optimizer_step(optimizer, closure, model, **kwargs)

        def closure_then_tp_sum() -> Any:
            result = closure()  # forward + backward of the last micro-batch (DDP/FSDP reduce over dp x sp)
            self.reduce_tensor_parallel_gradients()
            return result

        return super().optimizer_step(optimizer, closure_then_tp_sum, model, **kwargs)

    def reduce_tensor_parallel_gradients(self) -> None:
        """Sum replicated parameters' partial gradients over ``tp`` (``tensor_parallel.grads``); runs once
        per optimizer step. (Manual optimization: call it before ``optimizer.step()``.)"""
        from lightning_sp.tensor_parallel.grads import reduce_replicated_gradients

        reduce_replicated_gradients(self.lightning_module, self._tp_sharded, self._tp_context.group,
                                    self._tp_context.comm)

    def clip_grad_norm_(self, optimizer: torch.optim.Optimizer, clip_val: float) -> torch.Tensor:
        """Clip by the norm of the whole (tp-split, FSDP-sharded) model, as one process would."""
        from lightning_sp.tensor_parallel.grads import clip_grad_norm_

        params = [p for g in optimizer.param_groups for p in g["params"]]
        shard_group = self._mesh.group(MeshAxis.DP_SP) if self._is_fsdp_root() else None
        return clip_grad_norm_(self.lightning_module, params, clip_val, sharded=self._tp_sharded,
                               tp_group=self._tp_context.group, shard_group=shard_group)

    def _is_fsdp_root(self) -> bool:
        from torch.distributed.fsdp import FSDPModule

        return isinstance(self.model, FSDPModule)

    @contextmanager
    @override
    def block_backward_sync(self):
        if self._data_parallel == "fsdp" and self._is_fsdp_root():
            # accumulate unsharded gradients locally, reduce-scatter on the last micro-batch only
            self.model.set_requires_gradient_sync(False)
            try:
                yield None
            finally:
                self.model.set_requires_gradient_sync(True)
        else:
            with super().block_backward_sync():
                yield None

    # ---------------------------------------------------------------------------------- checkpoints
    @property
    @override
    def restore_checkpoint_after_setup(self) -> bool:
        # load into the converted (e.g. float64) and, for FSDP, sharded model: loading before setup
        # would round a float64 checkpoint through the float32 module
        return True

    # Single file (distributed_checkpoint=False; the default for DDP without tensor parallelism):
    # DDP: Lightning's checkpoint (nothing is sharded by sp, so any sp degree can resume).
    # FSDP: the full (unsharded) state dict is gathered on every rank and written once by rank 0.
    # Either resumes under any layout: lightning_sp.checkpoint copies the whole tensors into the chunks
    # each rank holds (load_full_model_state / load_full_optimizer_states). Read weights_only.
    def _fsdp_options(self, **kw):
        from torch.distributed.checkpoint.state_dict import StateDictOptions

        return StateDictOptions(full_state_dict=True, cpu_offload=True, **kw)

    # Sharded (``distributed_checkpoint``): see Note [Checkpoint chunks] in lightning_sp.checkpoint. The
    # model and optimizer state stay chunked until ``save_checkpoint`` hands them to DCP; loading
    # happens in ``load_checkpoint`` (after setup: the model is converted, wrapped and split), so the
    # Lightning restore hooks below have nothing left to do.
    @override
    def save_checkpoint(self, checkpoint: dict[str, Any], filepath: Any, storage_options: Any | None = None) -> None:
        if not self._distributed_checkpoint:
            return super().save_checkpoint(checkpoint, filepath, storage_options=storage_options)
        from lightning_sp.checkpoint import save_lightning_checkpoint

        if storage_options is not None:
            raise TypeError("storage_options is not supported with distributed_checkpoint=True")
        dims = self.parallel_dims
        save_lightning_checkpoint(checkpoint, filepath, dp=dims.dp, sp=dims.sp, tp=dims.tp,
                                  data_parallel=self._data_parallel)

    @override
    def load_checkpoint(self, checkpoint_path: Any, weights_only: bool | None = None) -> dict[str, Any]:
        from lightning_sp.checkpoint import is_sharded_checkpoint, load_lightning_checkpoint, load_single_file

        self._restored_sharded = False
        if not is_sharded_checkpoint(checkpoint_path):
            read = super().load_checkpoint  # weights_only unless the caller passes False for a file they trust
            return load_single_file(checkpoint_path, lambda: read(checkpoint_path, weights_only=weights_only is not False))
        checkpoint = load_lightning_checkpoint(checkpoint_path, self.lightning_module, list(self.optimizers))
        self._restored_sharded = True
        return checkpoint

    @override
    def lightning_module_state_dict(self) -> dict[str, Any]:
        if self._distributed_checkpoint:
            from lightning_sp.checkpoint import model_state

            return model_state(self.lightning_module)
        if self._data_parallel == "fsdp" and self._is_fsdp_root():
            from torch.distributed.checkpoint.state_dict import get_model_state_dict

            return get_model_state_dict(self.model, options=self._fsdp_options())
        return super().lightning_module_state_dict()

    @override
    def optimizer_state(self, optimizer: torch.optim.Optimizer) -> dict[str, Any]:
        if self._distributed_checkpoint:
            from lightning_sp.checkpoint import optimizer_state

            tensors, groups = optimizer_state(self.lightning_module, optimizer)
            return {"tensors": tensors, "param_groups": groups}
        if self._data_parallel == "fsdp" and self._is_fsdp_root():
            from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict

            return get_optimizer_state_dict(self.model, optimizer, options=self._fsdp_options())
        return super().optimizer_state(optimizer)

    @override
    def load_model_state_dict(self, checkpoint: Mapping[str, Any], strict: bool = True) -> None:
        if self._restored_sharded:
            return
        if self._tp_size > 1 or (self._data_parallel == "fsdp" and self._is_fsdp_root()):
            from lightning_sp.checkpoint import load_full_model_state

            load_full_model_state(self.lightning_module, checkpoint["state_dict"], strict=strict)
            return
        super().load_model_state_dict(checkpoint, strict=strict)

    @override
    def load_optimizer_state_dict(self, checkpoint: Mapping[str, Any]) -> None:
        if self._restored_sharded:
            return
        from lightning_sp.checkpoint import is_name_keyed, load_full_optimizer_states

        states = checkpoint["optimizer_states"]
        if self._tp_size > 1 or (self._data_parallel == "fsdp" and self._is_fsdp_root()) or is_name_keyed(states):
            load_full_optimizer_states(self.lightning_module, list(self.optimizers), states)
            return
        super().load_optimizer_state_dict(checkpoint)

    # ---------------------------------------------------------------------------------- faults
    def _global_step_or_none(self) -> int | None:
        module = self.lightning_module
        trainer = getattr(module, "_trainer", None) if module is not None else None
        return trainer.global_step if trainer is not None else None

    @override
    def on_exception(self, exception: BaseException) -> None:
        super().on_exception(exception)
        text = str(exception)
        if re.search(r"timed? ?out|timeout|Connection closed|Connection reset|peer", text, re.IGNORECASE):
            hint = (
                f"\n[lightning_sp] rank {self.global_rank} (dp rank {self.parallel_dims.dp_rank(self.global_rank)}, "
                f"sp rank {self.parallel_dims.sp_rank(self.global_rank)}) failed in a collective: another rank died or "
                f"stalled, or ranks issued collectives in different orders. process_group_timeout="
                f"{self._timeout.total_seconds():.0f}s, global step {self._global_step_or_none()}. Resume from the "
                f"last saved checkpoint with `trainer.fit(..., ckpt_path=...)`."
            )
            try:
                exception.args = (f"{exception.args[0] if exception.args else ''}{hint}",) + tuple(exception.args[1:])
            except Exception:  # noqa: BLE001 - never mask the original error
                pass

    @override
    def teardown(self) -> None:
        super().teardown()
        if dist.is_initialized():
            for group in self._owned_groups:
                try:
                    dist.destroy_process_group(group)
                except Exception:  # noqa: BLE001 - best effort; the world group may already be gone
                    pass
        self._owned_groups.clear()
        self._context = None
        self._dp_group = None
        self._mesh = None
        self._tp_context = None

    # ---------------------------------------------------------------------------------- registry
    @classmethod
    @override
    def register_strategies(cls, strategy_registry: Any) -> None:
        if cls.strategy_name not in strategy_registry:
            strategy_registry.register(
                cls.strategy_name, cls,
                description="Sequence parallelism (ulysses/ring/zigzag/usp) x data parallelism (DDP/FSDP2)",
            )
        if "sequence_parallel_spawn" not in strategy_registry:
            strategy_registry.register(
                "sequence_parallel_spawn", cls,
                description="SequenceParallelStrategy with start_method='spawn'", start_method="spawn",
            )


def register_strategy() -> None:
    """Make ``Trainer(strategy="sequence_parallel")`` work (idempotent)."""
    SequenceParallelStrategy.register_strategies(StrategyRegistry)


register_strategy()
