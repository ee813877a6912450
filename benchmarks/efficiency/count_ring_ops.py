#!/usr/bin/env python
"""Per-rank op counts of one fwd+bwd (torch.profiler, CPU): local kernel calls, zero fills, merges, adds, for
zigzag_ring and ring at P = 2 and 4, N = 1024, H = 8, D = 64, fp32, default settings (benchmarks/README.md,
section 9). Counts, not times: the same on any machine for a given plan.

    .venv/bin/python -m benchmarks.efficiency.count_ring_ops
"""
import os
import sys

from experiments.common.launch import run_on_ranks



def _count_ops(rank: int, world: int, n: int, backend: str) -> dict:
    """One warm-up fwd+bwd, then how many times one profiled fwd+bwd called each counted op on this rank."""
    import torch, torch.distributed as dist
    from lightning_sp import SequenceParallelAttention, shard_sequence
    from torch.profiler import profile, ProfilerActivity
    group = dist.group.WORLD
    g = torch.Generator().manual_seed(0)
    full = [torch.randn(1, n, 8, 64, generator=g) for _ in range(4)]
    m = SequenceParallelAttention(causal=True, backend=backend, group=group)
    sh = [shard_sequence(t, group, layout=m.layout) for t in full]
    def fb():
        q, k, v = (t.detach().clone().requires_grad_() for t in sh[:3])
        m(q, k, v, seq_len=n).backward(sh[3])
    fb()
    with profile(activities=[ProfilerActivity.CPU]) as p:
        fb()
    c = {e.key: e.count for e in p.key_averages()}
    return {k: c.get(k, 0) for k in ("aten::_scaled_dot_product_flash_attention_for_cpu", "aten::_scaled_dot_product_flash_attention_for_cpu_backward", "aten::fill_", "aten::lerp_", "aten::add_")}


if __name__ == "__main__":
    for world in (2, 4):
        for b in ("zigzag_ring", "ring"):
            print(world, b, run_on_ranks(_count_ops, world, (1024, b), timeout_s=600))
