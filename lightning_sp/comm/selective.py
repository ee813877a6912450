"""Point-to-point exchanges where each rank sends to at most one peer and receives from at most one, each side
possibly nothing: what a ring that follows an attention mask needs (``ops/ring_attention.py``, Note [Traffic
follows the mask]). Both sides of every message decide it from the same global inputs, so the sends and the
receives match without a message about them.

    pending = exchange_rows(group, stats, send_to=dst, send=(k_rows, v_rows), recv_from=src, recv_shapes=shapes,
                            like=k, op="ring_send", tag=1)
    k_got, v_got = pending.wait()        # () when nothing was received

``send_to``/``recv_from`` are ranks *of the group* (``None``: nothing that way). ``tag`` separates message kinds
between the same two ranks (K/V blocks, gradient contributions), so they cannot be matched out of order.
"""

from __future__ import annotations

from typing import Sequence

import torch
import torch.distributed as dist

from lightning_sp.comm.stats import CommStats


class SelectivePending:
    def __init__(self, works, received: tuple[torch.Tensor, ...], sent):
        self._works, self._received, self._sent = works, received, sent

    def wait(self) -> tuple[torch.Tensor, ...]:
        for w in self._works:
            w.wait()
        self._works, self._sent = (), None
        return self._received


def exchange_rows(group, stats: CommStats | None, *, send_to: int | None, send: Sequence[torch.Tensor] = (),
                  recv_from: int | None, recv_shapes: Sequence[tuple[int, ...]] = (), like: torch.Tensor,
                  op: str = "ring_send", tag: int = 0, dtype: torch.dtype | None = None) -> SelectivePending:
    """Send ``send`` to group rank ``send_to`` and receive tensors of ``recv_shapes`` (``like``'s device,
    ``dtype`` or ``like``'s dtype) from group rank ``recv_from``; either may be ``None`` (nothing that way)."""
    ranks = dist.get_process_group_ranks(group) if group is not None else list(range(dist.get_world_size()))
    ops, sent, received = [], [], []
    if send_to is not None:
        for t in send:
            t = t.contiguous()
            sent.append(t)
            ops.append(dist.P2POp(dist.isend, t, ranks[send_to], group, tag))
            if stats is not None:
                stats.add(op, t.numel() * t.element_size())
    if recv_from is not None:
        for shape in recv_shapes:
            buf = torch.empty(shape, dtype=dtype or like.dtype, device=like.device)
            received.append(buf)
            ops.append(dist.P2POp(dist.irecv, buf, ranks[recv_from], group, tag))
    works = dist.batch_isend_irecv(ops) if ops else []
    return SelectivePending(works, tuple(received), sent)
