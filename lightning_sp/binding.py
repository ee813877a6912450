"""Binding a model's ``SequenceParallelAttention`` modules to a ``SequenceParallelContext``: the one
sequence layout every batch is then sharded with, selective activation checkpointing of the attention,
and what ``backend="auto"`` resolved to. Used by ``SequenceParallelStrategy.setup``; runs without a Trainer.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.utils.checkpoint
from torch import nn

from lightning_sp.attention import SequenceParallelAttention, layout_for_backend
from lightning_sp.context import SequenceParallelContext
from lightning_sp.layout import SequenceLayout


def recompute_in_backward(module: nn.Module) -> None:
    """Make ``module``'s forward non-reentrant-checkpointed (idempotent). The recomputation repeats the
    module's collectives during backward, in the same order on every rank."""
    if getattr(module, "_lightning_sp_checkpointed", False):
        return
    forward = module.forward

    def checkpointed_forward(*args: Any, **kwargs: Any) -> Any:
        return torch.utils.checkpoint.checkpoint(forward, *args, use_reentrant=False, **kwargs)

    module.forward = checkpointed_forward
    module._lightning_sp_checkpointed = True


def bind_attention_modules(module: nn.Module, context: SequenceParallelContext, *, backend: str,
                           sequence_parallel_size: int, checkpoint_attention: bool = False) -> SequenceLayout:
    """Bind every ``SequenceParallelAttention`` of ``module`` to ``context`` (``checkpoint_attention``:
    recompute each in backward) and return the layout batches must be sharded with: that of the bound
    parallel modules (``backend="local"`` ones attend over whatever they are given), else ``backend``'s.
    Raises if the modules need different layouts: a batch can be sharded only one way."""
    layouts = {}
    for name, m in module.named_modules():
        if isinstance(m, SequenceParallelAttention):
            m.bind(context)
            if m.resolved_backend() != "local":  # local modules attend over whatever they are given
                layouts[name] = m.layout
            if checkpoint_attention:
                recompute_in_backward(m)
    distinct = set(layouts.values())
    if len(distinct) > 1:
        raise ValueError(
            "the model's SequenceParallelAttention modules need different sequence layouts "
            f"({ {k: str(v) for k, v in layouts.items()} }), but a batch can be sharded only one way: "
            "build them with backend=None (the strategy's backend) or backends of the same layout"
        )
    if distinct:
        return distinct.pop()
    return layout_for_backend(backend, group_size=sequence_parallel_size, ulysses_degree=context.ulysses_degree)


def auto_backend_message(context: SequenceParallelContext | None) -> str | None:
    """What ``backend="auto"`` resolved to, once the first attention call has resolved it (else ``None``)."""
    if context is None or context.resolved_backend is None:
        return None
    choice = context.auto_choice
    return (f"SequenceParallelStrategy: backend='auto' runs "
            f"{choice.summary() if choice is not None else context.resolved_backend}")
