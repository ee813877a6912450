"""``SequenceParallelStrategy``: Lightning training over one ``dp x ring x ulysses x tp`` mesh.

Built on Lightning's ``DDPStrategy`` (launching, precision plugins, checkpoint IO and cluster environments
are Lightning's own), it only wires Lightning's lifecycle hooks to rooms of their own, each usable without
a Trainer: degrees, mesh and groups in ``lightning_sp.mesh``; binding the attention modules in
``lightning_sp.binding``; sharding each batch along the sequence in ``lightning_sp.batch_sharding``; DDP /
FSDP2 over ``dp x sp`` in ``lightning_sp.data_parallel`` (Note [Gradient reduction over dp x sp]);
tensor-parallel binding, gradient sums and clipping in ``lightning_sp.tensor_parallel``; checkpoints in
``lightning_sp.checkpoint``; fault messages in ``lightning_sp.faults``; saving together on a preemption signal
in ``lightning_sp.preemption``.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable, Mapping, Sequence
from contextlib import contextmanager
from datetime import timedelta
from typing import TYPE_CHECKING, Any, Literal

import torch
import torch.distributed as dist
from lightning.pytorch.strategies import DDPStrategy
from lightning.pytorch.utilities.rank_zero import rank_zero_info, rank_zero_warn
from torch import nn
from torch.utils.data import DistributedSampler
from typing_extensions import override

from lightning_sp.batch_sharding import DEFAULT_SEQUENCE_KEYS, BatchSharder
from lightning_sp.binding import auto_backend_message, bind_attention_modules
from lightning_sp.checkpoint import StrategyCheckpointIO, probe_directories
from lightning_sp.context import SequenceParallelContext
from lightning_sp.dependency_noise import silence_dependency_noise
from lightning_sp.data_parallel import (DATA_PARALLEL, broadcast_replicas, check_data_parallel, ddp_process_group,
                                        fsdp_gradient_sync_off, fully_shard_model, is_fsdp_root)
from lightning_sp.faults import append_hint, as_process_group_timeout, collective_failure_hint
from lightning_sp.mesh import (ParallelMesh, build_strategy_groups, check_launch_matches_nodes, check_strategy_degrees,
                               check_world_matches, strategy_dims)
from lightning_sp.preemption import Preemption, checkpoint_directories, preemption_callback
from lightning_sp.tensor_parallel import TensorParallelContext, bind_tensor_parallel_layers
from lightning_sp.tensor_parallel.grads import TensorParallelGradients
from lightning_sp.topology import MeshAxis, ParallelDims

if TYPE_CHECKING:
    import lightning.pytorch as pl

    from lightning_sp.cost_model import HardwareProfile

log = logging.getLogger(__name__)

__all__ = ["DATA_PARALLEL", "DEFAULT_SEQUENCE_KEYS", "SequenceParallelStrategy"]


def _set_up(value: Any, name: str, when: str = "is created in Trainer setup") -> Any:
    """``value``, or a clear error saying when the Trainer creates it."""
    if value is None:
        raise RuntimeError(f"SequenceParallelStrategy.{name} {when}")
    return value


def _sharder_attribute(name: str) -> property:
    """A strategy attribute kept on its ``BatchSharder`` (read and set through the strategy)."""
    return property(lambda self: getattr(self._sharder, name), lambda self, value: setattr(self._sharder, name, value))


class SequenceParallelStrategy(DDPStrategy):
    """Sequence (context) parallelism x data parallelism (and tensor parallelism) for a Lightning ``Trainer``.

    ``sequence_parallel_size`` ranks share one sequence and the rest of the world trains data parallel
    (``dp = world / (sp * tp)``). Before ``training_step`` sees a batch, each tensor under ``sequence_keys`` is
    sharded along dim 1 with the backend's layout (``[B, N, ...] -> [B, N_pad / sp, ...]``), padded at the end
    when ``sp`` does not divide ``N``; every ``SequenceParallelAttention`` built with ``backend=None`` is bound to
    this rank's groups and runs ``backend``. Gradients equal single-device training on the same global batch
    when the loss is ``sequence_parallel_cross_entropy(..., group=strategy.sp_group)``. Registered with
    Lightning as ``"sequence_parallel"`` (``Trainer(strategy="sequence_parallel")``: sp = every rank).

    After setup, ``context`` (groups, backend, byte counters), ``sp_group``, ``dp_group``, ``layout`` and
    ``parallel_dims`` are available; before setup they raise an error saying when they become available.

    Args:
        sequence_parallel_size: Ranks that share one sequence; must divide ``num_nodes * devices`` (with
            ``tensor_parallel_size``: ``sp * tp`` must). ``None``: every rank a tensor-parallel group leaves.
        backend: Attention backend for modules built with ``backend=None``: ``"ulysses"``, ``"ring"``,
            ``"zigzag_ring"``, ``"allgather_kv"``, ``"usp"``, ``"colossal"``, ``"local"`` or ``"auto"`` (the
            fastest exact backend, measured once per shape on this machine and cached, or priced by the cost
            model; see ``auto_policy``).
        ulysses_degree: ``backend="usp"`` only: the inner Ulysses degree, a divisor of ``sp``. ``None``: the
            largest divisor that leaves a ring of at least 2 (at most the ranks per node).
        data_parallel: ``"ddp"`` (replicated parameters, ``DistributedDataParallel`` over the world) or
            ``"fsdp"`` (FSDP2 ``fully_shard`` over all ``dp x sp`` ranks: parameters, gradients and optimizer
            state sharded).
        sequence_keys: Keys of a dict batch (or integer positions of a tuple batch) sharded along dim 1. With
            ``sp > 1`` a batch holding none of them raises (every rank would train on the whole sequence).
            Tuple batches get no ``position_ids`` (a one-time warning says so).
        label_keys: Sequence keys padded with ``ignore_index`` instead of ``pad_value``.
        position_ids_key: Key under which this rank's global positions ``[B, S_local]`` are added to a dict
            batch when the key is among ``sequence_keys`` but absent from the batch; ``None`` disables it.
        ignore_index: Label padding value; must match the loss's ``ignore_index``.
        pad_value: Padding value of the other sequence tensors.
        kernel: Local attention kernel for modules built with ``kernel="auto"``: ``"auto"``, ``"sdpa"``,
            ``"efficient"``, ``"cudnn"``, ``"flash_attn"`` or ``"torch"``.
        fsdp_shard_modules: With ``data_parallel="fsdp"``: module classes (e.g. your transformer block) that
            each get their own ``fully_shard`` unit.
        checkpoint_attention: Selective activation checkpointing: recompute only the attention (and its
            communication) in backward. For full checkpointing of the project's models pass
            ``activation_checkpointing=True`` to the model instead.
        shuffle: ``None`` (the default): the training sampler shuffles exactly when your ``DataLoader`` does
            (a custom sampler keeps its own order), so a run compares step for step with one process;
            ``True``: always shuffle (seed ``PL_GLOBAL_SEED``; the same order on the ranks of one
            sequence-parallel group, different across data-parallel replicas); ``False``: dataset order.
        gather_predictions: ``True``: ``trainer.predict`` returns whole sequences ``[B, N, ...]`` in their
            original order, padding removed, on every rank (outputs whose dim 1 is the shard are gathered with
            the layout); ``False``: each rank's shard, for outputs too large to hold whole.
        preemption: A ``lightning_sp.preemption.Preemption`` (``enabled``, ``signal``, ``requeue``): a signal
            only sets a flag; at the next step boundary the ranks agree (one all-reduce), save together and
            rank 0 requeues the job. ``None``: on under ``SLURMEnvironment(auto_requeue=True)`` with SLURM's
            requeue signal, off otherwise.
        process_group_timeout: Seconds (or a ``timedelta``) a collective or a group creation may wait before
            the run fails with an error naming the rank, its coordinates and the step. Keep it short to turn a
            dead or stalled rank into an error.
        tensor_parallel_size: Megatron tensor + sequence parallelism over the innermost ``tp`` mesh axis (the
            model's ``lightning_sp.tensor_parallel`` layers); ``dp = world / (sp * tp)``.
        distributed_checkpoint: ``True``: a sharded ``torch.distributed.checkpoint`` directory (each rank
            writes only the chunks it holds); ``False``: Lightning's single file; ``None``: sharded with FSDP or
            ``tensor_parallel_size > 1``, else a single file. Both resume under any layout; a single file cannot
            hold a tensor-parallel model (``False`` with ``tensor_parallel_size > 1`` raises).
        hardware: The cost-model profile ``backend="auto"`` prices the backends with: a preset name of
            ``lightning_sp.cost_model`` (e.g. ``"h100-80gb"``; an unknown name lists them) or a calibrated
            ``HardwareProfile``. ``None``: the default profile for the device. A profile makes ``auto`` choose
            by the model's prediction unless ``auto_policy="measure"``.
        memory_budget: Bytes one attention forward + backward may peak at per rank: modules with
            ``kv_pieces="auto"`` (the default) split K/V into the fewest pieces that fit it. ``None``: whole
            blocks on CPU, a quarter of the free memory on CUDA.
        auto_policy: For ``backend="auto"``: ``"measure"`` (time the candidates once per shape on this
            machine, cached) or ``"model"`` (the cost model's prediction). ``None``: ``$LIGHTNING_SP_AUTO``,
            else ``"model"`` when ``hardware`` is set, else ``"measure"``.
        **kwargs: Passed to Lightning's ``DDPStrategy`` (``start_method``, ``process_group_backend``,
            ``find_unused_parameters``, ``static_graph``, ...).
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
        shuffle: bool | None = None,
        gather_predictions: bool = True,
        process_group_timeout: float | timedelta = timedelta(minutes=30),
        tensor_parallel_size: int = 1,
        distributed_checkpoint: bool | None = None,
        hardware: "HardwareProfile | str | None" = None,
        memory_budget: int | None = None,
        auto_policy: str | None = None,
        preemption: Preemption | None = None,
        **kwargs: Any,
    ) -> None:
        process_group_timeout = as_process_group_timeout(process_group_timeout, kwargs)
        super().__init__(timeout=process_group_timeout, **kwargs)
        silence_dependency_noise()  # Lightning's per-rank LeafSpec deprecation and its product tips
        check_strategy_degrees(sequence_parallel_size, backend=backend, ulysses_degree=ulysses_degree,
                               tensor_parallel_size=tensor_parallel_size)
        check_data_parallel(data_parallel)
        if shuffle not in (None, True, False) or gather_predictions not in (True, False):
            raise ValueError(f"shuffle must be None (follow the training DataLoader), True or False, and "
                             f"gather_predictions True or False; got shuffle={shuffle!r}, "
                             f"gather_predictions={gather_predictions!r}")
        if isinstance(hardware, str):
            from lightning_sp.cost_model import preset

            preset(hardware)  # eager check: an unknown name lists the presets
        if preemption is not None and not isinstance(preemption, Preemption):
            raise TypeError(f"preemption= takes lightning_sp.preemption.Preemption(...), got {type(preemption).__name__}")
        self._preemption = preemption
        self._sp_size_arg = sequence_parallel_size
        self._tp_size = tensor_parallel_size
        self._checkpoints = StrategyCheckpointIO(distributed=distributed_checkpoint, data_parallel=data_parallel,
                                                 tensor_parallel_size=tensor_parallel_size,
                                                 is_fsdp_root=self._is_fsdp_root)
        self._backend = backend
        self._ulysses_degree_arg = ulysses_degree
        self._data_parallel = data_parallel
        self._sharder = BatchSharder(self, sequence_keys=sequence_keys, label_keys=label_keys,
                                     position_ids_key=position_ids_key, ignore_index=ignore_index, pad_value=pad_value)
        self._kernel = kernel
        self._context_options = dict(hardware=hardware, memory_budget=memory_budget, auto_policy=auto_policy)
        self._fsdp_shard_modules = tuple(fsdp_shard_modules)
        self.checkpoint_attention, self.shuffle = checkpoint_attention, shuffle
        self.gather_predictions = gather_predictions
        self._undo_shuffle_following: Any = None
        # set in Trainer setup (`_build_groups`, `_bind_model`), cleared in teardown
        self._dims: ParallelDims | None = None
        self._mesh: ParallelMesh | None = None
        self._context: SequenceParallelContext | None = None
        self._tp_context: TensorParallelContext | None = None
        self._tp_grads: TensorParallelGradients | None = None
        self._dp_group: dist.ProcessGroup | None = None
        self._layout: Any = None
        self._announced_auto = False

    # ---------------------------------------------------------------------------------- topology
    backend = property(lambda self: self._backend)
    data_parallel = property(lambda self: self._data_parallel)
    tensor_parallel_size = property(lambda self: self._tp_size)
    sequence_parallel_size = property(lambda self: self.parallel_dims.sp)
    data_parallel_size = property(lambda self: self.parallel_dims.dp)
    sp_group = property(lambda self: self.context.group,
                        doc="This rank's sequence-parallel group (pass it to ``sequence_parallel_cross_entropy``).")
    dp_group = property(lambda self: _set_up(self._dp_group, "dp_group"),
                        doc="This rank's data-parallel group (one rank per sp group, same sp index).")
    tp_group = property(lambda self: _set_up(self._mesh, "tp_group").group(MeshAxis.TP),
                        doc="This rank's tensor-parallel group (the innermost mesh axis).")
    device_mesh = property(lambda self: _set_up(self._mesh, "device_mesh").mesh,
                           doc='The 4-D ``DeviceMesh`` with axes ``("dp", "ring", "ulysses", "tp")`` (``lightning_sp.mesh``).')
    tensor_parallel_context = property(
        lambda self: _set_up(self._tp_context, "tensor_parallel_context"),
        doc="What the model's tensor-parallel layers are bound to (group, comm counters); set in ``setup``.")

    @property
    def parallel_dims(self) -> ParallelDims:
        """The mesh degrees; known once the Trainer has set the devices."""
        if self._dims is None:
            if self.parallel_devices is None:
                raise RuntimeError(
                    "SequenceParallelStrategy.parallel_dims is not known yet: pass the strategy to a Trainer "
                    "(it reads num_nodes and devices) before asking for the mesh"
                )
            self._dims = self._make_dims(self.num_nodes * max(self.num_processes, 1))
        return self._dims

    context = property(
        lambda self: _set_up(self._context, "context", "is created in Trainer setup (after the process group exists); "
                             "access it from a LightningModule hook such as `setup`, `training_step` or a callback"),
        doc="This rank's ``SequenceParallelContext`` (groups, backend, comm counters); set in ``setup``.")
    layout = property(lambda self: _set_up(self._layout, "layout", "is known after Trainer setup binds the model"),
                      doc="The ``SequenceLayout`` batches are sharded with (that of the bound attention modules).")

    # batch keys: held by the BatchSharder, read and set here as before
    sequence_keys = _sharder_attribute("sequence_keys")
    label_keys = _sharder_attribute("label_keys")
    position_ids_key = _sharder_attribute("position_ids_key")
    ignore_index = _sharder_attribute("ignore_index")
    pad_value = _sharder_attribute("pad_value")

    def _make_dims(self, world_size: int) -> ParallelDims:
        # ranks per node = devices: all-to-alls (Ulysses) are kept within this many consecutive ranks
        return strategy_dims(world_size, sequence_parallel_size=self._sp_size_arg, backend=self._backend,
                             ulysses_degree=self._ulysses_degree_arg, tensor_parallel_size=self._tp_size,
                             ranks_per_node=self.num_processes or None, num_nodes=self.num_nodes,
                             devices=self.num_processes)

    @override
    def _configure_launcher(self) -> None:
        # runs at Trainer construction, before any process is launched: fail bad degrees here
        check_launch_matches_nodes(devices=self.num_processes, num_nodes=self.num_nodes)
        self._dims = self._make_dims(self.num_nodes * max(self.num_processes, 1))
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
        if self.shuffle is False and isinstance(sampler, DistributedSampler):
            sampler.shuffle = False  # read at every __iter__
        return dataloader

    def _follow_loader_shuffling(self, trainer: "pl.Trainer") -> None:
        """Note [The training sampler follows the loader]: Lightning gives every distributed training loader a
        ``DistributedSampler(shuffle=True)``, also a ``DataLoader(shuffle=False)``'s, so a run over ranks would read
        the samples in another order than the same loader in one process. With ``shuffle=None`` the sampler it
        injects shuffles exactly when the user's loader does (Lightning's ``_is_dataloader_shuffled``: a
        ``RandomSampler``; a custom sampler keeps its own order); ``True``/``False`` decide instead. Lightning
        decides in its data connector's ``_prepare_dataloader``, the one place that still sees the user's loader:
        this wraps it on this trainer until teardown."""
        connector = getattr(trainer, "_data_connector", None)
        prepare = getattr(type(connector), "_prepare_dataloader", None)
        if self._undo_shuffle_following is not None:
            return
        if prepare is None:  # a Lightning without the hook: say so rather than shuffle unasked
            if self.shuffle is None:
                rank_zero_warn("SequenceParallelStrategy(shuffle=None) cannot see the training DataLoader's "
                               "shuffling in this Lightning version: its distributed sampler shuffles; pass "
                               "shuffle=False to read the data in the loader's order")
            return
        from lightning.pytorch.trainer.states import RunningStage
        from lightning.pytorch.utilities.data import _is_dataloader_shuffled

        def prepare_following(dataloader: object, shuffle: bool, mode: Any) -> object:
            if mode == RunningStage.TRAINING:
                shuffle = _is_dataloader_shuffled(dataloader) if self.shuffle is None else bool(self.shuffle)
            return prepare(connector, dataloader, shuffle, mode)

        connector._prepare_dataloader = prepare_following
        self._undo_shuffle_following = lambda: connector.__dict__.pop("_prepare_dataloader", None)

    # ---------------------------------------------------------------------------------- groups
    @override
    def setup_environment(self) -> None:
        super().setup_environment()  # init_process_group (or reuse an initialised one)
        self._build_groups()

    def _build_groups(self) -> None:
        world = dist.get_world_size()
        self._dims = dims = self._make_dims(world)
        check_world_matches(world, devices=self.num_processes, num_nodes=self.num_nodes)
        groups = build_strategy_groups(dims, self.root_device.type, backend=self._backend, kernel=self._kernel,
                                       data_parallel=self._data_parallel, ranks_per_node=self.num_processes or None,
                                       timeout=self._timeout, **self._context_options)
        self._mesh, self._context, self._tp_context, self._dp_group = (
            groups.mesh, groups.context, groups.tensor_parallel, groups.dp_group)
        log.debug("rank %d: mesh %s", dist.get_rank(), groups.mesh.mesh)
        for line in groups.summary:
            rank_zero_info(line)

    def _bind_model(self, module: nn.Module) -> None:
        # attention modules (and the layout batches are sharded with), then tensor-parallel layers
        self._layout = bind_attention_modules(module, self.context, backend=self._backend,
                                              sequence_parallel_size=self.parallel_dims.sp,
                                              checkpoint_attention=self.checkpoint_attention)
        tp = self._tp_context.world if self._tp_context is not None else 1
        sharded = bind_tensor_parallel_layers(module, self._tp_context, tensor_parallel_size=self._tp_size) if tp > 1 else ()
        self._tp_grads = TensorParallelGradients(module, sharded, self._tp_context or TensorParallelContext())

    @override
    def setup(self, trainer: "pl.Trainer") -> None:
        from lightning.pytorch.trainer.states import TrainerFn

        assert self.lightning_module is not None
        self._follow_loader_shuffling(trainer)  # before any loader is built (configure_optimizers may build one)
        self._bind_model(self.lightning_module)
        if trainer.state.fn == TrainerFn.FITTING:
            self._prepare_for_saves(trainer)
            super().setup(trainer)
            if self._tp_grads.active:
                # Lightning's clip-by-norm takes each rank's local norm; under TP that differs across
                # tp ranks (and from one process): use the global norm instead
                self.precision_plugin.clip_grad_by_norm = self.clip_grad_norm_
            return
        # validate / test / predict. DDPStrategy.setup would broadcast every tensor from global rank 0, which
        # breaks FSDP2-sharded parameters ("Cannot flatten unevenly sharded tensor" when a first dim does not
        # divide the world: validate() after fit) and TP shards: sync over dp x sp, the ranks of one shard.
        assert self.accelerator is not None and self.model is not None
        self.accelerator.setup(trainer)
        self.precision_plugin.convert_module(self.model)
        self.model_to_device()
        if not self._is_fsdp_root():
            broadcast_replicas(self.model, self._mesh)
        self.setup_precision_plugin()

    def _prepare_for_saves(self, trainer: "pl.Trainer") -> None:
        # preemption (lightning_sp.preemption): a signal sets a flag, the ranks save together at a step
        # boundary; every checkpoint directory is probed on every rank before any training time is spent
        callback = preemption_callback(self._preemption, self.cluster_environment, self.root_device)
        if callback is not None:
            callback.attach(trainer)
        probe_directories(checkpoint_directories(trainer, callback))

    # ---------------------------------------------------------------------------------- batches
    @override
    def batch_to_device(self, batch: Any, device: torch.device | None = None, dataloader_idx: int = 0) -> Any:
        # shard first: only this rank's N/P tokens travel to the device, never the whole sequence. A module
        # whose batches need global work before sharding (HFSequenceParallelModule: label shift, packing)
        # sets `shards_its_own_batches = True` and shards in `on_after_batch_transfer` instead.
        if self._context is not None and getattr(self.lightning_module, "shards_its_own_batches", False):
            self._sharder.agree_only(batch)
        elif self._context is not None:
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

    @override
    def training_step(self, *args: Any, **kwargs: Any) -> Any:
        # an FSDP2 root only unshards in its forward hooks: route its steps through __call__
        if self._data_parallel == "fsdp" and self.model is self.lightning_module:
            with self.precision_plugin.train_step_context():
                out = self._forward_redirection(self.model, self.lightning_module, "training_step", *args, **kwargs)
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
                return self._forward_redirection(self.model, self.lightning_module, "validation_step", *args, **kwargs)
        return super().validation_step(*args, **kwargs)

    @override
    def predict_step(self, *args: Any, **kwargs: Any) -> Any:
        # whole sequences in their original order, as one process predicts (``gather_predictions``)
        if self._data_parallel == "fsdp" and self._is_fsdp_root():
            with self.precision_plugin.predict_step_context():
                out = self._forward_redirection(self.model, self.lightning_module, "predict_step", *args, **kwargs)
        else:
            out = super().predict_step(*args, **kwargs)
        return self._sharder.gather_outputs(out) if self.gather_predictions else out

    @override
    def optimizer_step(self, optimizer: torch.optim.Optimizer, closure: Any, model: Any = None, **kwargs: Any) -> Any:
        if self._tp_grads is not None and self._tp_grads.active:  # after DDP/FSDP's dp x sp reduction: sum over tp
            closure = self._tp_grads.reducing_after(closure)
        return super().optimizer_step(optimizer, closure, model, **kwargs)

    def reduce_tensor_parallel_gradients(self) -> None:
        """Sum replicated parameters' partial gradients over ``tp`` (``tensor_parallel.grads``); runs once
        per optimizer step (manual optimization: call it before ``optimizer.step()``). No-op without TP."""
        if self._tp_grads is not None:
            self._tp_grads.reduce()

    def clip_grad_norm_(self, optimizer: torch.optim.Optimizer, clip_val: float) -> torch.Tensor:
        """Clip by the norm of the whole (tp-split, FSDP-sharded) model, as one process would."""
        shard_group = self._mesh.group(MeshAxis.DP_SP) if self._is_fsdp_root() else None
        return self._tp_grads.clip(optimizer, clip_val, shard_group=shard_group)

    def _is_fsdp_root(self) -> bool:
        return is_fsdp_root(self.model)

    @contextmanager
    @override
    def block_backward_sync(self):
        fsdp = self._data_parallel == "fsdp" and self._is_fsdp_root()
        with fsdp_gradient_sync_off(self.model) if fsdp else super().block_backward_sync():
            yield None

    # ---------------------------------------------------------------------------------- checkpoints
    # each hook hands over to lightning_sp.checkpoint.StrategyCheckpointIO (single files and sharded directories)
    @property
    @override
    def restore_checkpoint_after_setup(self) -> bool:
        # load into the converted (e.g. float64) and, for FSDP, sharded model: loading before setup
        # would round a float64 checkpoint through the float32 module
        return True

    @override
    def save_checkpoint(self, checkpoint: dict[str, Any], filepath: Any, storage_options: Any | None = None) -> None:
        from lightning.fabric.plugins import TorchCheckpointIO

        self._checkpoints.save(checkpoint, filepath, storage_options, dims=self.parallel_dims,
                               lightning_save=super().save_checkpoint,
                               in_place=type(self.checkpoint_io) is not TorchCheckpointIO)

    @override
    def load_checkpoint(self, checkpoint_path: Any, weights_only: bool | None = None) -> dict[str, Any]:
        return self._checkpoints.load(checkpoint_path, weights_only, self.lightning_module, list(self.optimizers),
                                      lightning_load=super().load_checkpoint)

    @override
    def lightning_module_state_dict(self) -> dict[str, Any]:
        return self._checkpoints.model_state(self.lightning_module, self.model, super().lightning_module_state_dict)

    @override
    def optimizer_state(self, optimizer: torch.optim.Optimizer) -> dict[str, Any]:
        return self._checkpoints.optimizer_state(self.lightning_module, self.model, optimizer, super().optimizer_state)

    @override
    def load_model_state_dict(self, checkpoint: Mapping[str, Any], strict: bool = True) -> None:
        self._checkpoints.load_model_state(self.lightning_module, checkpoint, strict, super().load_model_state_dict)

    @override
    def load_optimizer_state_dict(self, checkpoint: Mapping[str, Any]) -> None:
        self._checkpoints.load_optimizer_states(self.lightning_module, list(self.optimizers), checkpoint,
                                                super().load_optimizer_state_dict)

    # ---------------------------------------------------------------------------------- faults
    @override
    def on_exception(self, exception: BaseException) -> None:
        super().on_exception(exception)
        step = getattr(getattr(self.lightning_module, "_trainer", None), "global_step", None)
        hint = collective_failure_hint(exception, rank=self.global_rank, dims=self.parallel_dims,
                                       timeout=self._timeout, global_step=step)
        if hint is not None:
            append_hint(exception, hint)

    @override
    def teardown(self) -> None:
        super().teardown()
        if self._undo_shuffle_following is not None:
            self._undo_shuffle_following()
            self._undo_shuffle_following = None
        self._context = self._dp_group = self._mesh = self._tp_context = self._tp_grads = None

    # ---------------------------------------------------------------------------------- registry
    @classmethod
    @override
    def register_strategies(cls, strategy_registry: Any) -> None:
        # "sequence_parallel" is registered by lightning_sp._registry when Lightning loads (Note [A light
        # import]); not DDPStrategy's names ("ddp", ...), which this subclass must not take over
        return None
