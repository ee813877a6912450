"""Attention math runs at the precision of its inputs, with autocast off (forward and backward alike).

Under ``torch.autocast`` the matmuls inside a custom ``autograd.Function`` would run in the autocast
dtype in forward but, when ``backward()`` is called outside the autocast region (as Lightning does),
in the input dtype in backward: the gradient of a different function (fp32 inputs under bf16
autocast: output error 2e-1, gradient error 5e-2 against fp64). ``SequenceParallelAttention`` turns
autocast off around its forward, and every attention ``autograd.Function`` wraps its ``backward`` in
``autocast_off`` so the gradient matches the forward whatever region ``backward()`` is called in.
"""

from __future__ import annotations

import functools
from contextlib import ExitStack

import torch

_DEVICE_TYPES = ("cpu", "cuda")


def autocast_off(fn):
    """Run ``fn`` with autocast disabled on every device type where it is enabled."""

    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        with ExitStack() as stack:
            for device_type in _DEVICE_TYPES:
                if torch.is_autocast_enabled(device_type):
                    stack.enter_context(torch.autocast(device_type, enabled=False))
            return fn(*args, **kwargs)

    return wrapper
