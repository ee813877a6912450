"""Packing variable-length documents into one sequence described by ``cu_seqlens``.

    docs  [5 tokens][3 tokens][4 tokens]        -> input_ids [12]
    cu_seqlens = [0, 5, 8, 12]  (int32)          -> tokens attend only inside their document
    position_ids = [0 1 2 3 4 0 1 2 0 1 2 3]     -> rotary positions restart per document
"""

from __future__ import annotations

from collections.abc import Sequence

import torch


def pack_documents(docs: Sequence[torch.Tensor], *, restart_positions: bool = True) -> dict[str, torch.Tensor]:
    """Concatenate 1-D token tensors.

    Returns ``input_ids [N]`` (int64), ``cu_seqlens [len(docs) + 1]`` (int32) and
    ``position_ids [N]`` (int64; restarting at 0 in every document unless ``restart_positions=False``).
    """
    if len(docs) == 0:
        raise ValueError("pack_documents needs at least one document")
    lengths = []
    for i, d in enumerate(docs):
        if d.dim() != 1 or d.numel() == 0:
            raise ValueError(f"document {i} must be a non-empty 1-D tensor, got shape {tuple(d.shape)}")
        lengths.append(d.numel())
    input_ids = torch.cat([d.long() for d in docs])  # [N]
    cu = torch.zeros(len(docs) + 1, dtype=torch.int32)
    cu[1:] = torch.cumsum(torch.tensor(lengths), 0)
    if restart_positions:
        position_ids = torch.cat([torch.arange(n) for n in lengths])
    else:
        position_ids = torch.arange(input_ids.numel())
    return {"input_ids": input_ids, "cu_seqlens": cu, "position_ids": position_ids}


def greedy_pack(docs: Sequence[torch.Tensor], context_len: int) -> list[list[torch.Tensor]]:
    """Group documents, in order, into contexts of exactly ``context_len`` tokens.

    A document that does not fit is split: its head ends the current context and its tail starts the
    next. The tail of the last context is dropped if incomplete (reported by the caller's counts).
    """
    if context_len < 2:
        raise ValueError(f"context_len must be >= 2, got {context_len}")
    contexts: list[list[torch.Tensor]] = []
    current: list[torch.Tensor] = []
    room = context_len
    for d in docs:
        while d.numel() > 0:
            take = d[:room]
            current.append(take)
            room -= take.numel()
            d = d[take.numel():]
            if room == 0:
                contexts.append(current)
                current, room = [], context_len
    return contexts
