"""The ring backward's partial-sum transfer overlaps the kernel on a coalescing backend (NCCL), without a GPU.

``dist.batch_isend_irecv`` is replaced by a recording stand-in that answers as gloo does (a work per op) or as
NCCL does (one work for the whole batch), on one rank of a ring in which every rank holds the same blocks
(so what rank - 1 sends at a step is what this rank sends: a receive is the matching send, copied when the
work is waited for). Its receive buffers hold NaN until then, and a send buffer changed before its transfer
completed fails the test: a result read early, or a buffer reused early, shows in the result.

Checked (Note [The partial sums' transfer overlaps on NCCL] in ``comm/ring.py``): on the coalescing stand-in no
partial-sum exchange is waited for before the kernel of the step that receives it has run (on gloo the sends
alone are); results and byte counts are identical in both modes and equal the plain sum; a negative control
(the old ``wait_sent`` that waited for the whole coalesced work) is seen waiting before the kernel.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from lightning_sp.comm import ring
from lightning_sp.comm.stats import CommStats

WORLD = 4


class _Work:
    def __init__(self, log, name, ops):
        self.log, self.name, self.ops, self.done = log, name, ops, False
        self.snapshots = [op.tensor.clone() for op in ops if op.op is dist.isend]

    def wait(self):
        if self.done:
            return True
        self.log.append(("wait", self.name))
        sends = [op.tensor for op in self.ops if op.op is dist.isend]
        for before, now in zip(self.snapshots, sends):
            assert torch.equal(before, now), f"{self.name}: a send buffer changed before its transfer completed"
        recvs = [op.tensor for op in self.ops if op.op is dist.irecv]
        for sent, buf in zip(self.snapshots, recvs):  # every rank holds the same: rank - 1 sent what we sent
            buf.copy_(sent)
        self.done = True
        return True


class _RecordingExchange:
    """Stands in for ``dist.batch_isend_irecv``: ``coalesced`` (NCCL) gives one work per batch, else (gloo) one
    per op, a send's work completing the send and a receive's completing the receive."""

    def __init__(self, coalesced: bool):
        self.coalesced, self.log, self.batches = coalesced, [], 0

    def __call__(self, ops):
        self.batches += 1
        name = f"batch{self.batches}"
        for op in ops:
            if op.op is dist.irecv:
                op.tensor.fill_(float("nan"))  # nothing has arrived before the work is waited for
        self.log.append(("start", name))
        if self.coalesced:
            return [_Work(self.log, name, ops)]
        works = []
        for i in range(0, len(ops), 2):  # (send, recv) pairs: the send's work, then the receive's
            send, recv = ops[i], ops[i + 1]
            send_work = _Work(self.log, f"{name}.send", [send])
            recv_work = _Work(self.log, f"{name}.recv", [])
            recv_work.ops, recv_work.snapshots = [recv], send_work.snapshots  # completes with what was sent
            works += [send_work, recv_work]
        return works


class _FakeComm(ring.RingComm):
    def __init__(self, stats):  # one rank of a WORLD-rank ring, no process group
        self.group, self.stats, self.world, self.rank = None, stats, WORLD, 1
        self._ranks = list(range(WORLD))
        self.next_global, self.prev_global = 2, 0


def _run(monkeypatch, coalesced: bool, old_wait_sent: bool = False):
    exchange = _RecordingExchange(coalesced)
    monkeypatch.setattr(ring.dist, "batch_isend_irecv", exchange)
    monkeypatch.setattr(ring.dist, "P2POp", lambda op, tensor, peer, group: _Op(op, tensor))
    if old_wait_sent:  # the negative control: waiting for the whole coalesced work, as before
        monkeypatch.setattr(ring._Pending, "wait_sent", lambda self: self.wait() and None)
    stats = CommStats()
    g = torch.Generator().manual_seed(0)
    k, v = (torch.randn(1, 6, 2, 3, generator=g, dtype=torch.float64) for _ in range(2))

    def grad_fn(step, source, blocks, complete):
        exchange.log.append(("kernel", step))
        kb, vb = blocks
        rows = slice(None) if complete or step % 2 == 0 else slice(0, 3)  # half a block on odd steps (zigzag-like)
        return rows, ((step + 1) * kb[:, rows].sin(), (step + 2) * vb[:, rows].cos())

    dk, dv = ring.ring_pass_accumulating(_FakeComm(stats), (k, v), grad_fn)
    return exchange, stats, (dk, dv), (k, v)


class _Op:
    def __init__(self, op, tensor):
        self.op, self.tensor = op, tensor


def _expected(k, v):
    dk, dv = torch.zeros_like(k), torch.zeros_like(v)
    for step in range(WORLD):
        rows = slice(None) if step % 2 == 0 else slice(0, 3)
        dk[:, rows] += (step + 1) * k[:, rows].sin()
        dv[:, rows] += (step + 2) * v[:, rows].cos()
    return dk, dv


def _waits_before_kernel(log) -> list[str]:
    """The partial-sum works waited for before the next kernel ran. A step's order is: start(K/V), the
    kernel, the add, start(dK/dV): the first batch started after a kernel is a partial-sum exchange, which
    the next step's kernel should not wait for. The last exchange (returned after the last kernel) is not one."""
    started_after, kernels, after_kernel, waits = {}, 0, False, []
    for event, what in log:
        if event == "kernel":
            kernels, after_kernel = kernels + 1, True
        elif event == "start":
            if after_kernel:
                started_after[what] = kernels
            after_kernel = False
        elif event == "wait" and started_after.get(what.split(".")[0]) == kernels:
            waits.append(what)
    return [w for w in waits if started_after[w.split(".")[0]] < kernels]


@pytest.mark.parametrize("coalesced", [False, True], ids=["gloo_per_op", "nccl_coalesced"])
def test_partial_sums_are_exact_and_bytes_unchanged(monkeypatch, coalesced):
    exchange, stats, (dk, dv), (k, v) = _run(monkeypatch, coalesced)
    ek, ev = _expected(k, v)
    assert torch.equal(dk, ek) and torch.equal(dv, ev)
    _, gloo_stats, _, _ = _run(monkeypatch, False)
    assert dict(stats.bytes_by_op) == dict(gloo_stats.bytes_by_op) and stats.bytes_by_op["ring_send_grad"] > 0


def test_nccl_waits_for_no_partial_sum_before_the_kernel(monkeypatch):
    exchange, *_ = _run(monkeypatch, True)
    waited = _waits_before_kernel(exchange.log)
    assert waited == [], (waited, exchange.log)


def test_gloo_waits_for_the_sends_alone_before_the_kernel(monkeypatch):
    exchange, *_ = _run(monkeypatch, False)
    waited = _waits_before_kernel(exchange.log)
    assert len(waited) == 2 * (WORLD - 1) and all(name.endswith(".send") for name in waited), waited


def test_negative_control_old_wait_sent_blocks_on_nccl(monkeypatch):
    exchange, stats, (dk, dv), (k, v) = _run(monkeypatch, True, old_wait_sent=True)
    assert _waits_before_kernel(exchange.log), exchange.log  # the order the fix removed
    ek, ev = _expected(k, v)
    assert torch.equal(dk, ek) and torch.equal(dv, ev)  # same result: only the order differs
