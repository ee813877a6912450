"""``group_device`` (Note [Collectives on the group's device]): the device each kind of group takes, without a
process group or a GPU (a group is anything with ``_device_types``; the device module is replaced)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from lightning_sp.comm import device as group_device_module
from lightning_sp.comm.device import group_device


def _group(*types):
    return SimpleNamespace(_device_types=[torch.device(t) for t in types])


@pytest.fixture
def current_cuda_is_3(monkeypatch):
    monkeypatch.setattr(group_device_module, "_current_index", lambda kind: {"cuda": 3}[kind])


def test_a_group_that_takes_cpu_tensors_gets_the_cpu(current_cuda_is_3):
    for group in (_group("cpu"), _group("cpu", "cuda"), _group("cuda", "cpu")):  # gloo; "cpu:gloo,cuda:nccl"
        assert group_device(group) == torch.device("cpu")
        assert group_device(group, torch.device("cuda", 1)) == torch.device("cpu")


def test_an_nccl_group_gets_the_models_gpu_or_the_current_one(current_cuda_is_3):
    nccl = _group("cuda")
    assert group_device(nccl) == torch.device("cuda", 3)
    assert group_device(nccl, torch.device("cuda", 1)) == torch.device("cuda", 1)  # the model's device
    assert group_device(nccl, torch.device("cuda")) == torch.device("cuda", 3)  # no index: the current one
    assert group_device(nccl, torch.device("cpu")) == torch.device("cuda", 3)  # a CPU model: still the GPU


def test_a_group_without_registered_devices_goes_by_its_backend(current_cuda_is_3, monkeypatch):
    monkeypatch.setattr(group_device_module.dist, "get_backend", lambda group: group.backend)
    assert group_device(SimpleNamespace(_device_types=[], backend="nccl")) == torch.device("cuda", 3)
    assert group_device(SimpleNamespace(_device_types=[], backend="gloo")) == torch.device("cpu")


