"""Ring exchange: send to the next rank, receive from the previous, overlapped with compute.

    comm = RingComm(group, stats)
    pending = comm.start((k, v))        # batched isend/irecv, returns at once
    ... compute on (k, v) ...
    k, v = pending.wait()               # the previous rank's blocks

Two buffers are alive at a time (the block being computed on and the one in flight): the
double-buffering that lets transfer overlap compute. ``ring_pass`` and ``ring_pass_with_grads``
are the loops every ring-style backend is built from; ``ring_pass_accumulating`` and
``ring_reduce_scatter`` are their memory-lean versions for gradient partial sums (Note [Gradient
partial sums around the ring]).

Note [Gradient partial sums around the ring]
    In a ring backward each rank adds its contribution to the dK/dV of the block it holds and
    passes the partial sum on, one step behind the block itself. Overlapping that transfer with
    compute (``ring_pass_with_grads``) keeps three block-sized gradient buffers alive during compute:
    the partial being sent, the partial being received, and the new contribution. The
    accumulating form keeps one: it waits until the partial it sent last step has *left* (the send
    alone), runs the kernel while the incoming partial is still in flight, and adds its contribution
    into the received buffer after::

        step t:   wait(send of partial_{t-1})  ->  contribution = kernel(...)  (partial_t arriving meanwhile)
                  ->  wait(partial_t from rank-1)  ->  partial_t[:, rows] += contribution  ->  send to rank+1
        (K/V blocks still travel double-buffered, overlapped with the compute)

    The contribution is the kernel's own result (Note [First write assigns] in ops/ring_attention.py),
    restricted to the key rows the plan touches (half a block on the zigzag ring's off-diagonal steps),
    so it is the transient any in-place add would have had. The receive overlaps compute; the send
    does not (waiting for it frees the buffer: a send completes once the next rank posted its receive,
    at the same point of its loop). Until 2026-11-24 the receive was waited for before the kernel ran.
    With the in-place merge and the prompt release of used blocks, this took the ring's per-rank
    peak at P = 4 (N = 8192, H = 8, D = 64, fp32) from 15.3 to 11.3 local shards (benchmarks/README.md,
    section 4).

Note [The partial sums' transfer overlaps on NCCL]
    A coalescing backend (NCCL) returns one work for a whole ``batch_isend_irecv``: its sends and
    receives run as one NCCL group and complete together, so there is no "the sends alone" to wait for,
    and waiting for that work before the kernel (as ``wait_sent`` did) made step t's kernel wait for the
    partial sum arriving from rank - 1: the dK/dV transfer never overlapped compute. There ``wait_sent``
    now waits for nothing: it drops this object's references to the send buffers, which the backend holds
    until the transfer is done (ProcessGroupNCCL keeps a work's tensors until it completes, and the
    caching allocator reuses their memory only after NCCL's stream has let go), and the kernel runs
    while the partial sum is in flight; ``wait`` (the stream waits for NCCL, not the host) comes
    before the add, as on gloo::

        gloo (a work per op):   wait(send_{t-1})  ->  kernel_t  ->  wait(recv_t)  ->  add  ->  send_t
        NCCL (one work):                              kernel_t  ->  wait(send_{t-1} + recv_t)  ->  add  ->  send_t

    The cost: on NCCL the sent partial's memory is freed when the transfer completes, not before the
    kernel allocates, so one more gradient buffer may be alive during compute than on gloo. Sending
    the two halves as separate batches (sends in one, receives in the next) would deadlock a ring on
    NCCL: each rank's receive would queue on its stream behind its own send, which waits for the next
    rank's receive. Bytes counted are the same (the exchange is unchanged). tests/unit/test_ring_overlap.py
    checks the order with a recording stand-in of ``batch_isend_irecv`` in both modes.
"""

from __future__ import annotations

from typing import Callable, Sequence

import torch
import torch.distributed as dist

from lightning_sp.comm.stats import CommStats


class _Pending:
    def __init__(self, works, buffers, sent, per_op: bool):
        # per_op: one work per op in (send, recv) pairs (gloo), so the sends can be waited for alone; else one
        # coalesced work for all (NCCL). A gloo work must be waited for once only (a second wait waits for another
        # transfer), so each list is emptied as it is waited for.
        self._coalesced = not per_op
        self._sends, self._works = (works[0::2], works[1::2]) if per_op else ((), works)
        self._buffers = buffers
        self._sent = sent  # keep the send buffers alive until the transfer completes

    def wait_sent(self) -> None:
        """Let go of the send buffers of this exchange, leaving the receives in flight (``wait`` returns them).
        gloo: waits until the sends are complete (their memory is free on return). A coalescing backend (one
        work for sends and receives): waits for nothing; the backend holds the buffers until the transfer is
        done (Note [The partial sums' transfer overlaps on NCCL])."""
        if not self._coalesced:
            for w in self._sends:
                w.wait()
            self._sends = ()
        self._sent = None

    def wait(self) -> tuple[torch.Tensor, ...]:
        for w in (*self._sends, *self._works):
            w.wait()
        # transfer done: drop the send buffers (and the works, which reference them too) so they are
        # freed as soon as the caller lets go of them, not when this object dies
        self._sends, self._works, self._sent = (), (), None
        return self._buffers


class RingComm:
    def __init__(self, group, stats: CommStats | None = None):
        self.group = group
        self.stats = stats
        self.world = dist.get_world_size(group)
        self.rank = dist.get_rank(group)
        ranks = dist.get_process_group_ranks(group) if group is not None else list(range(self.world))
        self._ranks = ranks
        self.next_global = ranks[(self.rank + 1) % self.world]  # isend/irecv take global ranks
        self.prev_global = ranks[(self.rank - 1) % self.world]

    def start(self, tensors: Sequence[torch.Tensor], op: str = "ring_send", heads_major: bool = False) -> _Pending:
        """Send ``tensors`` to the next rank and receive same-shaped ones from the previous. ``heads_major``:
        the ``[B, S, H, D]`` tensors travel as ``[B, H, S, D]`` memory (no copy for one already laid out so)
        and arrive as ``[B, S, H, D]`` views of such memory. Every rank must pass the same ``heads_major``:
        the bytes are read in that layout."""
        return self._exchange(tensors, self.next_global, self.prev_global, op, heads_major)

    def exchange(self, tensors: Sequence[torch.Tensor], offset: int, op: str = "ring_send") -> _Pending:
        """Send ``tensors`` to group rank ``rank + offset`` and receive same-shaped ones from group
        rank ``rank - offset`` (both mod ``world``): every rank calling it with the same ``offset``
        makes one matched permutation (``offset = 1``: ``start``)."""
        return self._exchange(
            tensors, self._ranks[(self.rank + offset) % self.world], self._ranks[(self.rank - offset) % self.world], op
        )

    def _exchange(self, tensors, to_global: int, from_global: int, op: str, heads_major: bool = False) -> _Pending:
        ops, recv, sent = [], [], []
        for t in tensors:
            t = t.transpose(1, 2).contiguous() if heads_major else t.contiguous()  # [B, H, S, D] on the wire
            sent.append(t)
            buf = torch.empty_like(t)
            recv.append(buf.transpose(1, 2) if heads_major else buf)  # [B, S, H, D] (a view when heads_major)
            ops.append(dist.P2POp(dist.isend, t, to_global, self.group))
            ops.append(dist.P2POp(dist.irecv, buf, from_global, self.group))
            if self.stats is not None:
                self.stats.add(op, t.numel() * t.element_size())
        works = dist.batch_isend_irecv(ops)  # gloo: one work per op, in order; a coalescing backend: one in all
        return _Pending(works, tuple(recv), sent, per_op=len(works) == len(ops))


def ring_pass(
    comm: RingComm | None,
    tensors: tuple[torch.Tensor, ...],
    step_fn: Callable[[int, int, tuple[torch.Tensor, ...]], None],
    heads_major: bool = False,
) -> None:
    """Visit every rank's ``tensors``: ``step_fn(step, source_rank, blocks)`` runs while the next
    blocks are in flight. ``world - 1`` transfers; with ``comm=None`` a single local step.
    ``heads_major``: ``RingComm.start``'s. ``tensors`` are not referenced after step 0."""
    if comm is None:
        step_fn(0, 0, tensors)
        return
    blocks, tensors = tensors, None
    for step in range(comm.world):
        pending = comm.start(blocks, heads_major=heads_major) if step < comm.world - 1 else None
        step_fn(step, (comm.rank - step) % comm.world, blocks)
        if pending is not None:
            blocks = pending.wait()  # the blocks just used are freed here (unless they are the inputs)
            pending = None


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


def ring_pass_accumulating(
    comm: RingComm | None,
    tensors: tuple[torch.Tensor, ...],
    grad_fn: Callable[[int, int, tuple[torch.Tensor, ...], bool], "tuple[slice | None, tuple[torch.Tensor, ...]]"],
    heads_major: bool = False,
) -> tuple[torch.Tensor, ...]:
    """Like ``ring_pass_with_grads`` (same result, same traffic), with one gradient buffer alive
    during compute: ``grad_fn(step, source_rank, blocks, complete)`` returns ``(rows, contributions)``, this
    rank's gradient contributions for rows ``rows`` (dim 1) of ``blocks`` (``rows = None``: none at all);
    ``complete=True`` (step 0, or no ring) asks for whole blocks (``rows = slice(None)``). The partial sum of
    the ranks before arrives while ``grad_fn`` computes and is added into after. See Note [Gradient partial
    sums around the ring]. ``heads_major``: ``RingComm.start``'s, for the blocks only (the partial sums
    travel in the layout they have: ``[B, S, H, D]``, as the CPU kernel returns dK/dV whatever K's layout).
    ``tensors`` are not referenced after step 0."""
    if comm is None or comm.world == 1:  # no ring: nothing to send (a one-rank ring would send to itself)
        return grad_fn(0, 0, tensors, True)[1]
    blocks, tensors = tensors, None
    grads_in_flight: _Pending | None = None
    for step in range(comm.world):
        pending = comm.start(blocks, heads_major=heads_major) if step < comm.world - 1 else None  # K/V: overlapped
        if grads_in_flight is not None:
            grads_in_flight.wait_sent()  # the partial sent last step has left (gloo: freed before the kernel runs)
        rows, contribution = grad_fn(step, (comm.rank - step) % comm.world, blocks, grads_in_flight is None)
        if pending is None:
            blocks = None  # the last blocks: free them before the partial sums' buffers arrive
        if grads_in_flight is not None:  # the ranks before: their partial sum for these blocks, received meanwhile
            partial = grads_in_flight.wait()
            grads_in_flight = None
            if rows is not None:
                for p, c in zip(partial, contribution):
                    p[:, rows] += c
            contribution = partial
            del partial
        grads_in_flight = comm.start(contribution, op="ring_send_grad")
        contribution = None
        if pending is not None:
            blocks = pending.wait()  # drop the used blocks before the next step allocates receive buffers
            pending = None
    return grads_in_flight.wait()


def ring_reduce_scatter(
    comm: RingComm,
    contribute: Callable[[int, "tuple[torch.Tensor, ...] | None"], tuple[torch.Tensor, ...]],
    op: str = "reduce_scatter",
) -> tuple[torch.Tensor, ...]:
    """Reduce-scatter whose inputs are produced chunk by chunk: ``contribute(chunk, partial)`` adds
    this rank's contribution to chunk ``chunk`` (the gradient of rank ``chunk``'s shard) into
    ``partial`` in place (``None``: allocate) and returns it. Returns the sum over all ranks of
    chunk ``rank``. Only one chunk-sized partial is alive during compute (never a whole ``[N]``
    input), and the sum is taken in whatever dtype ``contribute`` returns (fp32 for bf16 inputs).

    Ring schedule: at step ``t`` rank ``r`` completes its share of chunk ``(r - t - 1) mod P``,
    received from rank ``r - 1``, and sends it to rank ``r + 1``; after ``P - 1`` sends chunk ``r``
    is back at its owner, summed over every rank. Bytes counted under ``op``: ``(P-1)`` chunks,
    the same as a reduce-scatter collective."""
    world, rank = comm.world, comm.rank
    partial = None
    for step in range(world):
        chunk = (rank - step - 1) % world
        partial = contribute(chunk, partial)
        if step < world - 1:
            partial = comm.start(partial, op=op).wait()  # frees the sent partial on return
    return partial
