"""What the cost model is validated against, measured on this machine (CPU, gloo): one attention layer
fwd+bwd per backend on ``P`` gloo ranks, the median over repetitions of the time between a barrier
before and after (the slowest rank's time). Calibration (primitives, and backends with their compute stubbed) is
``calibrate.py``."""

from __future__ import annotations

import torch
import torch.distributed as dist

from experiments.common.launch import run_on_ranks
from experiments.cost_model.calibrate import median_seconds, shared_window


def _inputs(seed, n, h, h_kv, d, dtype):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(1, n, h, d, generator=g, dtype=dtype), torch.randn(1, n, h_kv, d, generator=g, dtype=dtype),
            torch.randn(1, n, h_kv, d, generator=g, dtype=dtype), torch.randn(1, n, h, d, generator=g, dtype=dtype))


PROBE_WINDOW_S = 0.2
"""Each round's probe of the machine's speed: every rank calls ``calibrate.SHARING_CALL`` for this long at once."""


def time_backends_worker(rank, world, cases, reps):
    """``cases``: ``(backend, ulysses_degree, N, H, H_kv, D, causal, kv_pieces)``; returns (rank 0) every timed fwd+bwd
    (seconds between barriers, ``reps`` of them) for each case, and each round's probe (``calibrate.shared_window``:
    mean seconds per ``SHARING_CALL`` with every rank calling it, the machine's speed while that round ran). Every
    case is warmed up once, then timed in ``reps`` rounds over all cases, the order rotated by one case per round,
    so a slow spell of the machine spreads over the cases instead of landing on the ones timed during it."""
    from lightning_sp import SequenceParallelAttention, shard_sequence

    torch.set_num_threads(1)
    group = dist.group.WORLD
    steps = []
    for i, (backend, u, n, h, h_kv, d, causal, kv_pieces) in enumerate(cases):
        attn = SequenceParallelAttention(causal=causal, backend=backend, group=group, ulysses_degree=u,
                                         kv_pieces=kv_pieces)
        q, k, v, dout = (shard_sequence(t, group, layout=attn.layout) for t in _inputs(i, n, h, h_kv, d, torch.float32))
        q, k, v = (t.detach().requires_grad_() for t in (q, k, v))

        def step(attn=attn, q=q, k=k, v=v, dout=dout, n=n):
            dist.barrier()
            attn(q, k, v, seq_len=n).backward(dout)
            dist.barrier()

        step()  # warm-up
        steps.append(step)
    times, probes = [[] for _ in cases], []
    for r in range(reps):
        order = list(range(len(cases)))
        order = order[r % len(order):] + order[:r % len(order)]
        probes.append(shared_window(world, PROBE_WINDOW_S)[0])
        for i in order:
            times[i].append(median_seconds(steps[i], 1, warmup=0))
    return (times, probes) if rank == 0 else None


def measure_world(world: int, cases, reps: int) -> tuple[list[list[float]], list[float]]:
    """Every timed fwd+bwd (seconds, ``reps`` per case) per case, and each round's probe (seconds per call),
    measured on ``world`` gloo ranks (one spawn)."""

    return run_on_ranks(time_backends_worker, world, (list(cases), reps), timeout_s=1800, pg_timeout_s=300)[0]
