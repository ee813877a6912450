"""Ring exchange: send to the next rank, receive from the previous, overlapped with compute.

    comm = RingComm(group, stats)
    pending = comm.start((k, v))        # batched isend/irecv, returns at once
    ... compute on (k, v) ...
    k, v = pending.wait()               # the previous rank's blocks

Two buffers are alive at a time (the block being computed on and the one in flight): the
double-buffering that lets transfer overlap compute. ``ring_pass`` and ``ring_pass_with_grads``
are the two loops every ring-style backend is built from.
"""

from __future__ import annotations

from typing import Callable, Sequence

import torch
import torch.distributed as dist

from lightning_sp.comm.stats import CommStats


class _Pending:
    def __init__(self, works, buffers, sent):
        self._works, self._buffers = works, buffers
        self._sent = sent  # keep the send buffers alive until the transfer completes

    def wait(self) -> tuple[torch.Tensor, ...]:
        for w in self._works:
            w.wait()
        return self._buffers


class RingComm:
    def __init__(self, group, stats: CommStats | None = None):
        self.group = group
        self.stats = stats
        self.world = dist.get_world_size(group)
        self.rank = dist.get_rank(group)
        ranks = dist.get_process_group_ranks(group) if group is not None else list(range(self.world))
        self.next_global = ranks[(self.rank + 1) % self.world]  # isend/irecv take global ranks
        self.prev_global = ranks[(self.rank - 1) % self.world]

    def start(self, tensors: Sequence[torch.Tensor], op: str = "ring_send") -> _Pending:
        """Send ``tensors`` to the next rank and receive same-shaped ones from the previous."""
        ops, recv, sent = [], [], []
        for t in tensors:
            t = t.contiguous()
            sent.append(t)
            buf = torch.empty_like(t)
            recv.append(buf)
            ops.append(dist.P2POp(dist.isend, t, self.next_global, self.group))
            ops.append(dist.P2POp(dist.irecv, buf, self.prev_global, self.group))
            if self.stats is not None:
                self.stats.add(op, t.numel() * t.element_size())
        return _Pending(dist.batch_isend_irecv(ops), tuple(recv), sent)


def ring_pass(
    comm: RingComm | None,
    tensors: tuple[torch.Tensor, ...],
    step_fn: Callable[[int, int, tuple[torch.Tensor, ...]], None],
) -> None:
    """Visit every rank's ``tensors``: ``step_fn(step, source_rank, blocks)`` runs while the next
    blocks are in flight. ``world - 1`` transfers; with ``comm=None`` a single local step."""
    if comm is None:
        step_fn(0, 0, tensors)
        return
    blocks = tensors
    for step in range(comm.world):
        pending = comm.start(blocks) if step < comm.world - 1 else None
        step_fn(step, (comm.rank - step) % comm.world, blocks)
        if pending is not None:
            blocks = pending.wait()


def ring_pass_with_grads(
    comm: RingComm | None,
    tensors: tuple[torch.Tensor, ...],
    grad_fn: Callable[[int, int, tuple[torch.Tensor, ...]], tuple[torch.Tensor, ...]],
) -> tuple[torch.Tensor, ...]:
    """Like ``ring_pass``, but ``grad_fn`` returns gradient contributions for the blocks it was given;
    these travel with the blocks (one step behind, overlapped with the next step's compute) and
    return to their owner after a full circle. Returns the complete gradients of this rank's
    ``tensors`` (summed over every rank's contribution)."""
    if comm is None:
        return grad_fn(0, 0, tensors)
    blocks = tensors
    grads_in_flight: _Pending | None = None
    for step in range(comm.world):
        pending = comm.start(blocks) if step < comm.world - 1 else None
        contribution = grad_fn(step, (comm.rank - step) % comm.world, blocks)
        if grads_in_flight is not None:
            # the partial sums for this step's blocks, from the ranks that saw them before us
            contribution = tuple(c + g for c, g in zip(contribution, grads_in_flight.wait()))
        grads_in_flight = comm.start(contribution, op="ring_send_grad")
        if pending is not None:
            blocks = pending.wait()
    return grads_in_flight.wait()
