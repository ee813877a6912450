"""``StrictDeviceGroup``: a process group that, like NCCL, takes tensors of its own accelerator only, on CPU.

    install()                                    # once per rank process, after the gloo world exists
    group = dist.new_group(backend=BACKEND)      # or init_process_group(BACKEND, store=...)
    x = torch.ones(3, device=DEVICE_TYPE)        # a tensor of the stand-in accelerator (CPU memory)
    dist.all_reduce(x, group=group)              # fine
    dist.all_reduce(torch.ones(3), group=group)  # RuntimeError: No backend type associated with device type cpu

Why: a job on GPUs runs every collective on an NCCL group, and ProcessGroupNCCL refuses a CPU tensor
("No backend type associated with device type cpu"; a CPU tensor in a CUDA op: "Expected all tensors to
be on the same device"). CPU CI runs gloo, which takes CPU tensors, so a collective that builds its tensor
on the CPU (``torch.tensor([value])``) passes every CPU test and fails every GPU job. Under this stand-in
a CPU test fails the same way.

How, and why so (each choice is at least as strict as NCCL where it matters here):

1. **An accelerator that is not the CPU.** Real CUDA tensors cannot exist on a CPU build, so the
   ``PrivateUse1`` device is set up as a Python backend named ``DEVICE_TYPE`` ("standin", through
   ``torch.utils.backend_registration._setup_privateuseone_for_python_backend``, experimental in torch
   2.13). Its tensors have ``device.type == "standin"`` everywhere the library can look; their memory
   is a CPU tensor hung on the tensor's storage object (so ``detach`` aliases, which share the storage,
   find it). Every aten op on them runs as the same op on that CPU memory (a fallback kernel)
   and returns stand-in tensors; factories with ``device="standin"`` make stand-in tensors; ``.cpu()``
   / ``.item()`` / ``.tolist()`` read the memory back. Like a CUDA op, an op that mixes a stand-in
   tensor with a CPU tensor of one or more dimensions raises "Expected all tensors to be on the same
   device" (0-dim CPU tensors pass, as CUDA lets CPU scalars in).
   ``torch.standin`` is the device module (``current_device``, ``set_device``, ``synchronize``...),
   so code that asks ``torch._utils._get_device_module(group_device.type)`` works unchanged.
2. **A group whose device is that accelerator.** ``BACKEND`` ("strictdev") is registered with
   ``devices=["standin"]``; the group registers its gloo transport as the ``standin`` backend, so
   ``group._device_types == [device("standin")]`` (NCCL: ``[device("cuda")]``): PyTorch's own
   device-for-a-group logic (``_get_object_coll_device``: object collectives, DCP, ``barrier``) and the
   library's (``lightning_sp.comm.device.group_device``) both answer "standin", not "cpu".
3. **Every collective checks every tensor** (inputs, outputs, each element of a list) before it runs:
   a tensor whose device is not the stand-in accelerator raises NCCL's message, naming the collective;
   a sparse tensor raises too (ProcessGroupNCCL: "must be dense"; its "Tensors must be contiguous" is
   checked on the tensor's layout, which for a stand-in tensor always is: see Views). Only then does the
   collective run on the tensors' CPU memory through an inner ``ProcessGroupGloo`` over the same ranks
   (exact results, gloo's own checks on sizes and dtypes).

Views: a stand-in tensor's own layout is always contiguous at offset 0 (the Python backend can make no
other), while its memory may be a strided view (a transpose's). Views made of it (``as_strided``, which
transposes, slices and selects come down to; ``view``) are mapped onto that memory exactly and share it
(checked element by element on index tensors); a ``view`` its memory cannot give is a copy, which is what
``.contiguous().view()`` / ``.reshape`` would make on the accelerator (``.contiguous()`` cannot copy: the
tensor says it is contiguous). Collectives send a strided memory as a contiguous copy and write it back.

Limits (where it is *less* strict than NCCL, said so the tests do not claim more): the device index is
not modelled (every stand-in tensor is ``standin:0``; ``current_device()`` is 0 on every rank), so a
tensor on the wrong GPU of the right kind is not caught; streams and asynchrony are not modelled (every
collective has completed when its work is returned); ``batch_isend_irecv`` runs per operation, as on
gloo (a subclass of ``ProcessGroup`` is not offered coalescing), so the ring's NCCL-only behaviour is
tested with a recording stand-in of ``batch_isend_irecv`` instead (tests/unit/test_ring_overlap.py).
A direct ``.view`` of a transposed stand-in tensor copies where the accelerator would raise. Random ops
(``torch.randn(device="standin")``) need a generator the Python backend cannot register, and fail. Autograd
works on stand-in tensors (the fallback runs below it), but the ops are slow: keep shapes small.
"""

from __future__ import annotations

import contextlib
import datetime

import torch
import torch.distributed as dist
from torch.utils._pytree import tree_map

DEVICE_TYPE = "standin"
BACKEND = "strictdev"

_library: torch.library.Library | None = None


# ---- the stand-in accelerator -------------------------------------------------------------------------


class _Stream:
    """One stream that is always idle (the stand-in runs every op at once)."""

    def synchronize(self) -> None:
        pass

    def wait_stream(self, other) -> None:
        pass


_STREAM = _Stream()


class _DeviceModule:
    """``torch.standin``: what PyTorch and the library ask a device module (as of ``torch.cuda``; DCP's writer
    asks for streams)."""

    @staticmethod
    def current_stream(device=None) -> _Stream:
        return _STREAM

    @staticmethod
    def stream(stream):
        return contextlib.nullcontext()

    @staticmethod
    def is_available() -> bool:
        return True

    @staticmethod
    def device_count() -> int:
        return 1

    @staticmethod
    def current_device() -> int:
        return 0

    @staticmethod
    def set_device(device) -> None:
        pass

    @staticmethod
    def synchronize(device=None) -> None:
        pass

    @staticmethod
    def _is_in_bad_fork() -> bool:
        return False

    @staticmethod
    def manual_seed_all(seed: int) -> None:
        pass

    @staticmethod
    def get_amp_supported_dtype() -> list[torch.dtype]:
        return [torch.float16, torch.bfloat16]

    @staticmethod
    def get_device_name(device=None) -> str:
        return "stand-in accelerator (CPU memory)"


_OWNER = "lightning_sp_standin_memory"  # the attribute of a storage object holding (layout, CPU tensor)


def _memory(t: torch.Tensor) -> torch.Tensor:
    """The CPU tensor holding stand-in tensor ``t``'s elements (a view of the memory its storage owns)."""
    held = getattr(t.untyped_storage(), _OWNER, None)
    if held is None:
        raise RuntimeError(f"a {DEVICE_TYPE} tensor {tuple(t.shape)} has no memory (made by an op the stand-in "
                           "does not know)")
    layout, cpu = held
    if (tuple(t.shape), t.stride(), t.storage_offset(), t.dtype) == layout:
        return cpu
    return _view_of(cpu, layout, t.shape, t.stride(), t.storage_offset(), t.dtype)  # an alias made without the fallback


def _view_of(cpu: torch.Tensor, layout: tuple, size, stride, offset: int, dtype: torch.dtype) -> torch.Tensor:
    """The elements that ``as_strided(size, stride, offset)`` picks from the storage of a stand-in tensor of layout
    ``layout`` whose memory is ``cpu``, as a view of ``cpu``'s memory (writes go through).

    A stand-in tensor's own layout is always contiguous at offset 0 (``create_empty_tensor`` makes no other), so
    storage index ``i`` is element ``i`` of ``cpu`` in row-major order, whatever ``cpu``'s strides (a transpose's
    memory is a transposed CPU view). Each requested dim must step along one dim of that shape (``stride`` a
    multiple of its row-major stride, staying inside it); the mapping is then checked element by element on
    index tensors. What is not such a view is refused, never answered with the wrong elements."""
    shape = layout[0]
    refuse = RuntimeError(f"the stand-in cannot place a {tuple(size)} view (strides {tuple(stride)}, offset {offset}) "
                          f"of a {shape} tensor held in memory of strides {cpu.stride()}")
    if cpu.dtype != dtype or layout[2] != 0:
        raise refuse
    if cpu.is_contiguous():
        return cpu.as_strided(size, stride, cpu.storage_offset() + offset)
    row_major = [1] * len(shape)
    for d in range(len(shape) - 2, -1, -1):
        row_major[d] = row_major[d + 1] * shape[d + 1]
    digits, rest = [], offset
    for c in row_major:
        digits.append(rest // c)
        rest %= c
    memory_stride = []
    for n, st in zip(size, stride):
        if n == 1 or st == 0:
            memory_stride.append(0 if st == 0 else 1)
            continue
        dim = next((d for d, c in enumerate(row_major) if st % c == 0 and digits[d] + st // c * (n - 1) < shape[d]), None)
        if dim is not None:  # steps along one dim
            memory_stride.append(st // row_major[dim] * cpu.stride(dim))
            continue
        # spans dims first..last whole (a view that merges them): their memory must merge too
        last = next((d for d, c in enumerate(row_major) if c == st), None)
        first, span = last, shape[last] if last is not None else 0
        while last is not None and span < n and first > 0:
            first -= 1
            span *= shape[first]
        if last is None or span != n or any(digits[d] for d in range(first, last + 1)) or any(
                cpu.stride(d) != cpu.stride(d + 1) * shape[d + 1] for d in range(first, last)):
            raise refuse
        memory_stride.append(cpu.stride(last))
    memory_offset = sum(dg * cpu.stride(d) for d, dg in enumerate(digits))
    index = torch.empty_strided(cpu.shape, cpu.stride(), dtype=torch.int64)
    index.copy_(torch.arange(index.numel()).view(cpu.shape))  # each memory element's storage index
    span = index.as_strided(size, memory_stride, memory_offset)
    if not torch.equal(span, torch.arange(max(index.numel(), 1)).as_strided(size, stride, offset)):
        raise refuse
    return cpu.as_strided(size, memory_stride, cpu.storage_offset() + memory_offset)


def _wrap(cpu: torch.Tensor, fresh: bool = False) -> torch.Tensor:
    """A stand-in tensor whose elements are ``cpu``'s (shared memory: a write to one is seen in the other).
    ``fresh``: ``cpu`` is a new result that aliases nothing, so a strided one may be made contiguous (a view's
    memory never is: writes must reach its base; inside a kernel views carry no ``_base`` to tell them apart)."""
    t = torch._C._acc.create_empty_tensor(list(cpu.shape), cpu.dtype)
    if fresh and not cpu.is_contiguous():
        cpu = cpu.contiguous()
    setattr(t.untyped_storage(), _OWNER, ((tuple(t.shape), t.stride(), t.storage_offset(), t.dtype), cpu))
    return t


def _is_standin(x) -> bool:
    return isinstance(x, torch.Tensor) and x.device.type == DEVICE_TYPE


def _unwrap(x):
    return _memory(x) if _is_standin(x) else x


def _check_same_device(op, args, kwargs) -> None:
    found = []
    tree_map(lambda x: found.append(x) if isinstance(x, torch.Tensor) else None, (args, kwargs))
    stray = [t for t in found if t.device.type != DEVICE_TYPE and t.dim() > 0]
    if stray and len(stray) < len(found):
        raise RuntimeError(f"Expected all tensors to be on the same device, but found at least two devices, "
                           f"{DEVICE_TYPE}:0 and {stray[0].device}! ({op.name()} on the stand-in accelerator)")


def _fallback(op, *args, **kwargs):
    """Every aten op on stand-in tensors: the same op on their CPU memory, results wrapped back."""
    if op is torch.ops.aten._copy_from.default:  # src.to(other device) / dst.copy_(src) across devices
        src, dst = args[0], args[1]
        (_memory(dst) if _is_standin(dst) else dst).copy_(_unwrap(src))
        return dst
    if op is not torch.ops.aten._to_copy.default:
        _check_same_device(op, args, kwargs)
    target = kwargs.get("device")
    onto_standin = target is None or torch.device(target).type == DEVICE_TYPE
    if target is not None and onto_standin:
        kwargs = dict(kwargs, device=torch.device("cpu"))
    if op is torch.ops.aten.as_strided.default:  # strides in the call:
        t, size, stride = args[:3]  # the views that composite ops (transpose, select, reshape...) make
        offset = args[3] if len(args) > 3 else kwargs.get("storage_offset") or 0
        held = getattr(t.untyped_storage(), _OWNER)
        return _wrap(_view_of(held[1], held[0], size, stride, t.storage_offset() + offset, t.dtype))
    if op in (torch.ops.aten.view.default, torch.ops.aten._unsafe_view.default,
              torch.ops.aten._reshape_alias.default):  # of a tensor whose layout is
        t, size = args[:2]  # contiguous (every stand-in tensor's): the row-major strides of the new shape
        size = list(torch.empty(t.shape, device="meta").view(size).shape)  # a -1 resolved
        stride = torch.empty(size, device="meta").stride()
        held = getattr(t.untyped_storage(), _OWNER)
        try:
            return _wrap(_view_of(held[1], held[0], size, stride, t.storage_offset(), t.dtype))
        except RuntimeError:  # memory a transpose's: on the accelerator ``.contiguous()`` / ``.reshape`` copied
            return _wrap(_memory(t).reshape(size), fresh=True)  # first, which a stand-in tensor cannot tell
    cpu_args, cpu_kwargs = tree_map(_unwrap, args), tree_map(_unwrap, kwargs)
    out = op(*cpu_args, **cpu_kwargs)
    returns = op._schema.returns
    if returns and returns[0].alias_info is not None and returns[0].alias_info.is_write:  # in place / out=
        written, memory = (kwargs["out"], cpu_kwargs["out"]) if "out" in kwargs else (args[0], cpu_args[0])
        if _is_standin(written) and (written.shape, written.stride()) != (memory.shape, memory.stride()):
            written.data = _wrap(memory)  # resized (an out= factory, resize_): the tensor takes the new layout
        return written
    if not onto_standin:
        return out
    fresh = not (returns and returns[0].alias_info is not None)  # a view op's result shares its input's memory
    return tree_map(lambda t: _wrap(t, fresh) if isinstance(t, torch.Tensor) else t, out)


def install() -> None:
    """Set up the stand-in accelerator and register ``BACKEND`` in this process (idempotent). The PrivateUse1
    device can be set up once per process: call it in spawned ranks, not in the test runner."""
    global _library
    if _library is not None:
        return
    from torch.utils.backend_registration import _setup_privateuseone_for_python_backend

    _setup_privateuseone_for_python_backend(DEVICE_TYPE, backend_module=_DeviceModule())
    _library = torch.library.Library("_", "IMPL")
    _library.fallback(lambda op, *args, **kwargs: _fallback(op, *args, **kwargs), dispatch_key="PrivateUse1")
    dist.Backend.register_backend(BACKEND, _create, devices=[DEVICE_TYPE])


def to_standin(x: torch.Tensor) -> torch.Tensor:
    """``x`` copied to the stand-in accelerator (as ``x.to(DEVICE_TYPE)``)."""
    return x.to(DEVICE_TYPE)


# ---- the group -------------------------------------------------------------------------------------


class StrictDeviceGroup(dist.ProcessGroup):
    """Runs each collective through an inner gloo group on the tensors' CPU memory, after checking every
    tensor is a dense, contiguous tensor of the stand-in accelerator (module docstring)."""

    def __init__(self, store, rank: int, size: int, timeout: datetime.timedelta):
        super().__init__(rank, size)
        self._gloo = dist.ProcessGroupGloo(store, rank, size, timeout)
        self._write_back: list[tuple[torch.Tensor, torch.Tensor]] = []
        self.refused: list[str] = []  # every refusal, for tests that want to see what was caught

    def getBackendName(self) -> str:
        return BACKEND

    def _checked(self, name: str, *tensors_or_lists):
        """The CPU memory of each argument (tensors and lists of them), after the device checks. A stand-in
        tensor always *says* it is contiguous (its layout is), while its memory may be a strided CPU view (a
        ``movedim``'s): such memory travels as a contiguous copy, written back by ``_done``."""
        def check(t):
            if not isinstance(t, torch.Tensor):
                return t
            if t.device.type != DEVICE_TYPE:
                self.refused.append(f"{name}: {t.device}")
                raise RuntimeError(f"No backend type associated with device type {t.device.type} "
                                   f"({name} on a {BACKEND} group: its collectives take {DEVICE_TYPE} tensors only, "
                                   f"as NCCL's take CUDA tensors)")
            if t.layout != torch.strided:
                raise RuntimeError(f"{name}: Tensors must be dense ({BACKEND}, as NCCL)")
            if not t.is_contiguous():
                raise RuntimeError(f"{name}: Tensors must be contiguous ({BACKEND}, as NCCL)")
            memory = _memory(t)
            if memory.is_contiguous():
                return memory
            copy = memory.contiguous()
            self._write_back.append((memory, copy))
            return copy

        self._write_back = []
        return tree_map(check, list(tensors_or_lists))

    def _done(self, work):
        work.wait()  # complete when returned (the stand-in does not model asynchrony)
        for memory, copy in self._write_back:
            memory.copy_(copy)
        self._write_back = []
        return work

    # one method per entry point torch.distributed calls on a Python ProcessGroup
    def allreduce(self, tensors, opts=None):
        (tensors,) = self._checked("all_reduce", tensors)
        return self._done(self._gloo.allreduce(tensors, opts or dist.AllreduceOptions()))

    def allreduce_coalesced(self, tensors, opts=None):
        (tensors,) = self._checked("all_reduce_coalesced", tensors)
        return self._done(self._gloo.allreduce_coalesced(tensors, opts or dist.AllreduceCoalescedOptions()))

    def allgather(self, outputs, inputs, opts=None):
        outputs, inputs = self._checked("all_gather", outputs, inputs)
        return self._done(self._gloo.allgather(outputs, inputs, opts or dist.AllgatherOptions()))

    def all_gather_single(self, output, input, opts=None):
        output, input = self._checked("all_gather_into_tensor", output, input)
        return self._done(self._gloo._allgather_base(output, input, opts or dist.AllgatherOptions()))

    _allgather_base = all_gather_single

    def reduce_scatter(self, outputs, inputs, opts=None):
        outputs, inputs = self._checked("reduce_scatter", outputs, inputs)
        return self._done(self._gloo.reduce_scatter(outputs, inputs, opts or dist.ReduceScatterOptions()))

    def reduce_scatter_single(self, output, input, opts=None):
        output, input = self._checked("reduce_scatter_tensor", output, input)
        return self._done(self._gloo._reduce_scatter_base(output, input, opts or dist.ReduceScatterOptions()))

    _reduce_scatter_base = reduce_scatter_single

    def broadcast(self, tensors, opts=None):
        (tensors,) = self._checked("broadcast", tensors)
        return self._done(self._gloo.broadcast(tensors, opts or dist.BroadcastOptions()))

    def reduce(self, tensors, opts=None):
        (tensors,) = self._checked("reduce", tensors)
        return self._done(self._gloo.reduce(tensors, opts or dist.ReduceOptions()))

    def gather(self, outputs, inputs, opts=None):
        outputs, inputs = self._checked("gather", outputs, inputs)
        return self._done(self._gloo.gather(outputs, inputs, opts or dist.GatherOptions()))

    def scatter(self, outputs, inputs, opts=None):
        outputs, inputs = self._checked("scatter", outputs, inputs)
        return self._done(self._gloo.scatter(outputs, inputs, opts or dist.ScatterOptions()))

    def alltoall_base(self, output, input, output_split_sizes, input_split_sizes, opts=None):
        output, input = self._checked("all_to_all_single", output, input)
        return self._done(self._gloo.alltoall_base(output, input, output_split_sizes, input_split_sizes,
                                                   opts or dist.AllToAllOptions()))

    def all_to_all_single(self, output, input, output_split_sizes, input_split_sizes, opts=None):
        return self.alltoall_base(output, input, output_split_sizes or [], input_split_sizes or [], opts)

    def alltoall(self, outputs, inputs, opts=None):
        outputs, inputs = self._checked("all_to_all", outputs, inputs)
        return self._done(self._gloo.alltoall(outputs, inputs, opts or dist.AllToAllOptions()))

    def send(self, tensors, dst: int, tag: int = 0):
        (tensors,) = self._checked("send", tensors)  # a strided memory's copy is the send buffer
        return self._gloo.send(tensors, dst, tag)  # point-to-point stays asynchronous (a ring's send and receive)

    def recv(self, tensors, src: int, tag: int = 0):
        (tensors,) = self._checked("recv", tensors)
        if self._write_back:
            raise RuntimeError("the stand-in receives into contiguous memory only (a fresh empty_like buffer)")
        return self._gloo.recv(tensors, src, tag)

    def barrier(self, opts=None):
        return self._done(self._gloo.barrier(opts or dist.BarrierOptions()))


def _create(store, rank: int, size: int, timeout: datetime.timedelta) -> StrictDeviceGroup:
    group = StrictDeviceGroup(store, rank, size, timeout)
    # the device this group answers for (``_device_types``): its gloo transport, registered as the stand-in's
    group._register_backend(torch.device(DEVICE_TYPE), dist.ProcessGroup.BackendType.CUSTOM, group._gloo)
    return group
