"""What the cost model is validated against, measured on this machine (CPU, gloo): one attention layer
fwd+bwd per backend on ``P`` gloo ranks, the median over repetitions of the time between a barrier
before and after (the slowest rank's time). Calibration (primitives only) is ``calibrate.py``."""

from __future__ import annotations

import torch
import torch.distributed as dist

from experiments.cost_model.calibrate import median_seconds


def _inputs(seed, n, h, h_kv, d, dtype):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(1, n, h, d, generator=g, dtype=dtype), torch.randn(1, n, h_kv, d, generator=g, dtype=dtype),
            torch.randn(1, n, h_kv, d, generator=g, dtype=dtype), torch.randn(1, n, h, d, generator=g, dtype=dtype))


def time_backends_worker(rank, world, cases, reps):
    """``cases``: ``(backend, ulysses_degree, N, H, H_kv, D, causal, kv_pieces)``; returns the median
    fwd+bwd seconds between barriers for each (rank 0)."""
    from lightning_sp import SequenceParallelAttention, shard_sequence

    torch.set_num_threads(1)
    group = dist.group.WORLD
    out = []
    for i, (backend, u, n, h, h_kv, d, causal, kv_pieces) in enumerate(cases):
        attn = SequenceParallelAttention(causal=causal, backend=backend, group=group, ulysses_degree=u,
                                         kv_pieces=kv_pieces)
        q, k, v, dout = (shard_sequence(t, group, layout=attn.layout) for t in _inputs(i, n, h, h_kv, d, torch.float32))
        q, k, v = (t.detach().requires_grad_() for t in (q, k, v))

        def step():
            dist.barrier()
            attn(q, k, v, seq_len=n).backward(dout)
            dist.barrier()

        out.append(median_seconds(step, reps))
    return out if rank == 0 else None


def measure_world(world: int, cases, reps: int) -> list[float]:
    """Median fwd+bwd seconds per case, measured on ``world`` gloo ranks (one spawn)."""
    from experiments.common import run_on_ranks

    return run_on_ranks(time_backends_worker, world, (list(cases), reps), timeout_s=1800, pg_timeout_s=300)[0]
