"""``SequenceParallelStrategy``: Lightning training over orthogonal sequence- and data-parallel groups.

The strategy only wires Lightning's lifecycle; the machinery lives in rooms of its own, each usable
without a Trainer: degrees and groups in ``lightning_sp.mesh``, binding the attention modules in
``lightning_sp.binding``, batch sharding in ``lightning_sp.batch_sharding``, DDP / FSDP2 in
``lightning_sp.data_parallel``, tensor-parallel binding, gradient sums and clipping in
``lightning_sp.tensor_parallel``, checkpoints in ``lightning_sp.checkpoint``, fault messages in
``lightning_sp.faults``.

Built on Lightning's ``DDPStrategy``, so launching (``popen``/``spawn``, torchrun, SLURM, multi-node),
precision plugins, checkpoint IO and cluster environments are Lightning's own. On top it lays the world
out as one ``dp x ring x ulysses x tp`` mesh, binds every ``SequenceParallelAttention`` (and
tensor-parallel layer) of the model, gives the ``DistributedSampler`` the data-parallel axis only and
shards each batch along the sequence before ``training_step``, wraps the model in DDP / FSDP2 over
``dp x sp`` (Note [Gradient reduction over dp x sp] in ``lightning_sp.data_parallel``), sums replicated
gradients over ``tp`` before each optimizer step, and saves sharded checkpoints when asked.
"""

from __future__ import annotations

import logging
import os
import re
from collections.abc import Iterable, Mapping, Sequence
from contextlib import contextmanager
from datetime import timedelta
from typing import TYPE_CHECKING, Any, Literal

import torch
import torch.distributed as dist
from lightning.pytorch.strategies import DDPStrategy
from lightning.pytorch.utilities.rank_zero import rank_zero_info
from torch import nn
from torch.utils.data import DistributedSampler
from typing_extensions import override

from lightning_sp.batch_sharding import DEFAULT_SEQUENCE_KEYS, BatchSharder
from lightning_sp.binding import auto_backend_message, bind_attention_modules
from lightning_sp.context import SequenceParallelContext
from lightning_sp.dependency_noise import silence_dependency_noise
from lightning_sp.data_parallel import (DATA_PARALLEL, broadcast_replicas, check_data_parallel, ddp_process_group,
                                        fully_shard_model, is_fsdp_root)
from lightning_sp.faults import append_hint, as_process_group_timeout, collective_failure_hint
from lightning_sp.mesh import ParallelMesh, build_strategy_groups, check_strategy_degrees, destroy_groups, strategy_dims
from lightning_sp.tensor_parallel import TensorParallelContext, bind_tensor_parallel_layers
from lightning_sp.tensor_parallel.grads import clip_grad_norm_, reduce_replicated_gradients
from lightning_sp.topology import MeshAxis, ParallelDims

if TYPE_CHECKING:
    import lightning.pytorch as pl
    from torch.distributed.device_mesh import DeviceMesh

    from lightning_sp.cost_model import HardwareProfile

log = logging.getLogger(__name__)

__all__ = ["DATA_PARALLEL", "DEFAULT_SEQUENCE_KEYS", "SequenceParallelStrategy"]


def _set_up(value: Any, name: str) -> Any:
    """``value``, or a clear error if the Trainer has not created it yet."""
    if value is None:
        raise RuntimeError(f"SequenceParallelStrategy.{name} is created in Trainer setup")
    return value


def _sharder_attribute(name: str) -> property:
    """A strategy attribute kept on its ``BatchSharder`` (read and set through the strategy)."""
    return property(lambda self: getattr(self._sharder, name), lambda self, value: setattr(self._sharder, name, value))


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
        hardware: the cost-model profile ``backend="auto"`` prices the backends with (a
            ``lightning_sp.cost_model`` preset name such as ``"h100-80gb"``, or a calibrated
            ``HardwareProfile``); its ranks per node are replaced by the launch's (``devices``).
            ``None``: ``cost_model.default_profile`` for the device. A profile makes ``auto`` choose by the
            model's prediction unless ``auto_policy="measure"``.
        memory_budget: bytes one attention fwd+bwd may peak at per rank; attention modules with
            ``kv_pieces="auto"`` (the default) split K/V into the fewest pieces that fit it (whole blocks
            when ``None`` on CPU; a share of the free memory on CUDA). See ``SequenceParallelContext``.
        auto_policy: ``backend="auto"``: ``"measure"`` (time the candidates once per shape on this machine,
            cached) or ``"model"`` (the cost model); ``None``: see ``SequenceParallelContext.auto_policy``.
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
        hardware: "HardwareProfile | str | None" = None,
        memory_budget: int | None = None,
        auto_policy: str | None = None,
        **kwargs: Any,
    ) -> None:
        process_group_timeout = as_process_group_timeout(process_group_timeout, kwargs)
        super().__init__(timeout=process_group_timeout, **kwargs)
        silence_dependency_noise()  # Lightning's per-rank LeafSpec deprecation and its product tips
        check_strategy_degrees(sequence_parallel_size, backend=backend, ulysses_degree=ulysses_degree,
                               tensor_parallel_size=tensor_parallel_size)
        check_data_parallel(data_parallel)
        if isinstance(hardware, str):
            from lightning_sp.cost_model import preset

            preset(hardware)  # eager check: an unknown name lists the presets
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
        self._sharder = BatchSharder(self, sequence_keys=sequence_keys, label_keys=label_keys,
                                     position_ids_key=position_ids_key, ignore_index=ignore_index, pad_value=pad_value)
        self._kernel = kernel
        self._hardware = hardware
        self._memory_budget = memory_budget
        self._auto_policy = auto_policy
        self._fsdp_shard_modules = tuple(fsdp_shard_modules)
        self.checkpoint_attention = checkpoint_attention
        self.shuffle = shuffle
        self._dims: ParallelDims | None = None
        self._context: SequenceParallelContext | None = None
        self._dp_group: dist.ProcessGroup | None = None
        self._owned_groups: list[dist.ProcessGroup] = []
        self._layout: Any = None
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

    def _check_launch_matches_nodes(self) -> None:
        """Under torchrun, ``devices`` must be the ranks it started per node (``LOCAL_WORLD_SIZE``): Lightning
        checks only ``num_nodes * devices == WORLD_SIZE``, and a wrong split would place Ulysses
        all-to-alls (``ulysses``, ``usp``'s inner axis, ``auto``'s pricing) across nodes without a word."""
        local_world = os.environ.get("LOCAL_WORLD_SIZE")
        if "TORCHELASTIC_RUN_ID" not in os.environ or not (local_world or "").isdigit():
            return
        if int(local_world) != self.num_processes:
            world = os.environ.get("WORLD_SIZE", "?")
            raise ValueError(
                f"torchrun started {local_world} ranks per node (LOCAL_WORLD_SIZE={local_world}, WORLD_SIZE={world}) "
                f"but the Trainer has devices={self.num_processes}, num_nodes={self.num_nodes}: pass "
                f"devices={local_world}, num_nodes=WORLD_SIZE // LOCAL_WORLD_SIZE (torchrun's --nnodes), so the "
                "strategy knows which ranks share a node"
            )

    def _make_dims(self, world_size: int) -> ParallelDims:
        return strategy_dims(world_size, sequence_parallel_size=self._sp_size_arg, backend=self._backend,
                             ulysses_degree=self._ulysses_degree_arg, tensor_parallel_size=self._tp_size,
                             ranks_per_node=self._ranks_per_node(), num_nodes=self.num_nodes, devices=self.num_processes)

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
        return _set_up(self._dp_group, "dp_group")

    @property
    def tensor_parallel_size(self) -> int:
        return self._tp_size

    @property
    def device_mesh(self) -> "DeviceMesh":
        """The 4-D ``DeviceMesh`` with axes ``("dp", "ring", "ulysses", "tp")`` (``lightning_sp.mesh``)."""
        return _set_up(self._mesh, "device_mesh").mesh

    @property
    def tp_group(self) -> dist.ProcessGroup:
        """This rank's tensor-parallel group (the innermost mesh axis)."""
        return _set_up(self._mesh, "tp_group").group(MeshAxis.TP)

    @property
    def tensor_parallel_context(self) -> TensorParallelContext:
        """What the model's tensor-parallel layers are bound to (group, comm counters); set in ``setup``."""
        return _set_up(self._tp_context, "tensor_parallel_context")

    @property
    def layout(self):
        """The ``SequenceLayout`` batches are sharded with (that of the bound attention modules)."""
        if self._layout is None:
            raise RuntimeError("SequenceParallelStrategy.layout is known after Trainer setup binds the model")
        return self._layout

    # batch keys: held by the BatchSharder, read and set here as before
    sequence_keys = _sharder_attribute("sequence_keys")
    label_keys = _sharder_attribute("label_keys")
    position_ids_key = _sharder_attribute("position_ids_key")
    ignore_index = _sharder_attribute("ignore_index")
    pad_value = _sharder_attribute("pad_value")

    @override
    def _configure_launcher(self) -> None:
        # runs at Trainer construction, before any process is launched: fail bad degrees here
        self._check_launch_matches_nodes()
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
        groups = build_strategy_groups(dims, self.root_device.type, backend=self._backend, kernel=self._kernel,
                                       data_parallel=self._data_parallel, ranks_per_node=self._ranks_per_node(),
                                       timeout=self._timeout, hardware=self._hardware,
                                       memory_budget=self._memory_budget, auto_policy=self._auto_policy)
        self._mesh, self._context, self._tp_context, self._dp_group = (
            groups.mesh, groups.context, groups.tensor_parallel, groups.dp_group)
        self._owned_groups.extend(groups.mesh.transient_groups())
        log.debug("rank %d: mesh %s", dist.get_rank(), groups.mesh.mesh)
        for line in groups.summary:
            rank_zero_info(line)

    def _bind_model(self, module: nn.Module) -> None:
        # attention modules (and the layout batches are sharded with), then tensor-parallel layers
        layout = bind_attention_modules(module, self.context, backend=self._backend,
                                        sequence_parallel_size=self.parallel_dims.sp,
                                        checkpoint_attention=self.checkpoint_attention)
        if self._tp_context is not None and self._tp_context.world > 1:
            self._tp_sharded = bind_tensor_parallel_layers(module, self._tp_context, tensor_parallel_size=self._tp_size)
        self._layout = layout

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
            broadcast_replicas(self.model, self._mesh)
        self.setup_precision_plugin()

    # ---------------------------------------------------------------------------------- batches
    @override
    def batch_to_device(self, batch: Any, device: torch.device | None = None, dataloader_idx: int = 0) -> Any:
        # shard first: only this rank's N/P tokens travel to the device, never the whole sequence. A module
        # whose batches need global work before sharding (HFSequenceParallelModule: label shift, packing)
        # sets `shards_its_own_batches = True` and shards in `on_after_batch_transfer` instead.
        if self._context is not None:
            if getattr(self.lightning_module, "shards_its_own_batches", False):
                items, lengths, _ = self._sharder.sequence_tensors(batch)  # its shard_inputs judges the batch: agree only
                self._sharder.agree_on_batch(batch, items, lengths, None)
            else:
                batch = self.shard_batch(batch)
        return super().batch_to_device(batch, device, dataloader_idx)

    def shard_batch(self, batch: Any) -> Any:
        """Shard every tensor under ``sequence_keys`` along dim 1 (``[B, N, ...] -> [B, N_pad/P, ...]``),
        set ``context.global_seq_len = N`` and add global ``position_ids`` if requested and absent
        (``lightning_sp.batch_sharding``)."""
        return self._sharder.shard_batch(batch)

    # ---------------------------------------------------------------------------------- model wrapping
    @override
    def _setup_model(self, model: nn.Module) -> nn.Module:
        # DDP / FSDP2 over dp x sp (the world when tp = 1): see Note [Gradient reduction over dp x sp]
        if self._data_parallel == "fsdp":
            return fully_shard_model(model, self._mesh, self._fsdp_shard_modules)
        if self.parallel_dims.tp > 1:
            ddp_process_group(self._ddp_kwargs, self._mesh)
        return super()._setup_model(model)

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
        message = None if self._announced_auto else auto_backend_message(self._context)
        if message is not None:
            self._announced_auto = True
            rank_zero_info(message)

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
        reduce_replicated_gradients(self.lightning_module, self._tp_sharded, self._tp_context.group,
                                    self._tp_context.comm)

    def clip_grad_norm_(self, optimizer: torch.optim.Optimizer, clip_val: float) -> torch.Tensor:
        """Clip by the norm of the whole (tp-split, FSDP-sharded) model, as one process would."""
        params = [p for g in optimizer.param_groups for p in g["params"]]
        shard_group = self._mesh.group(MeshAxis.DP_SP) if self._is_fsdp_root() else None
        return clip_grad_norm_(self.lightning_module, params, clip_val, sharded=self._tp_sharded,
                               tp_group=self._tp_context.group, shard_group=shard_group)

    def _is_fsdp_root(self) -> bool:
        return is_fsdp_root(self.model)

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
        hint = collective_failure_hint(exception, rank=self.global_rank, dims=self.parallel_dims,
                                       timeout=self._timeout, global_step=self._global_step_or_none())
        if hint is not None:
            append_hint(exception, hint)

    @override
    def teardown(self) -> None:
        super().teardown()
        destroy_groups(self._owned_groups)
        self._owned_groups.clear()
        self._context = None
        self._dp_group = None
        self._mesh = None
        self._tp_context = None

    # ---------------------------------------------------------------------------------- registry
    @classmethod
    @override
    def register_strategies(cls, strategy_registry: Any) -> None:
        # "sequence_parallel" is registered by lightning_sp._registry when Lightning loads (Note [A light
        # import]); not DDPStrategy's names ("ddp", ...), which this subclass must not take over
        return None
