"""The device a process group's collectives take: where every tensor the library makes for one must live.

    t = torch.tensor([value], dtype=torch.int64, device=group_device(group))
    collective(dist.all_reduce, t, group=group)

Note [Collectives on the group's device]
~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
A backend takes tensors of the devices it was registered for: gloo CPU tensors, NCCL CUDA tensors only (a
CPU tensor: "No backend type associated with device type cpu"). On GPUs Lightning makes an NCCL group, so a
tensor built for a collective with the default device (``torch.tensor([value])``: the CPU) fails every GPU
job and passes every CPU test. Tensors that come from the model (attention blocks, the loss) are on the
model's device already; the small ones the library makes itself (agreement rows, save ids, budgets, auto's
timings) are made on ``group_device(group)``:

    group's device types (``group._device_types``)     group_device
    [cpu] / [cpu, cuda] (gloo; "cpu:gloo,cuda:nccl")    cpu   (no copy to the GPU and back)
    [cuda] (nccl)                                       ``prefer`` if it is a CUDA device, else cuda:<current>
    [<other accelerator>]                               the same rule for that device type
    none registered yet                                 cpu, unless the backend is "nccl" (then as [cuda])

"current" is the device module's ``current_device()`` (``torch.cuda.current_device()``: Lightning sets it to
the rank's GPU). Such a tensor costs a host sync when read back (``int(t)``), which these paths do anyway.
tests/distributed/test_group_device.py runs them through a stand-in group that, like NCCL, refuses tensors of
any other device (tests/stand_ins/device_group.py).
"""

from __future__ import annotations

import torch
import torch.distributed as dist

_CPU = torch.device("cpu")


def _device_types(group) -> list[str]:
    group = group if group is not None else dist.group.WORLD
    types = [d.type for d in getattr(group, "_device_types", ())]
    if not types and dist.get_backend(group) == "nccl":
        types = ["cuda"]
    return types


def group_device(group, prefer: torch.device | None = None) -> torch.device:
    """The device whose tensors ``group``'s collectives take (Note [Collectives on the group's device]):
    the CPU where the group takes CPU tensors, else its accelerator: ``prefer`` where it is one of that type
    (a model's device), else that type's current device. ``group=None``: the default group."""
    types = _device_types(group)
    if not types or "cpu" in types:
        return _CPU
    kind = types[0]
    if prefer is not None and prefer.type == kind:
        return prefer if prefer.index is not None else torch.device(kind, _current_index(kind))
    return torch.device(kind, _current_index(kind))


def _current_index(kind: str) -> int:
    return torch._utils._get_device_module(kind).current_device()
