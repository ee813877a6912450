"""What the cost model is calibrated and validated with, measured on this machine (CPU, gloo).

- ``calibrate_compute``: attention fwd+bwd FLOP/s of the local kernel (``kernel="auto"``: SDPA's CPU op,
  the one every backend calls) vs block size, and a dense matmul rate; one process, one thread.
- ``links_worker`` / ``fit_links``: gloo ping-pong between ranks 0 and 1 (one-way time vs message
  size, least-squares ``t = latency + bytes / bandwidth``) and an all-to-all at the same sizes.
- ``time_backends_worker``: one attention layer fwd+bwd per backend on ``P`` gloo ranks: median over
  repetitions of the time between a barrier before and after (the slowest rank's time).
- ``measure_world``: both of the above in one spawn of ``P`` ranks.
"""

from __future__ import annotations

import statistics
import time

import torch
import torch.distributed as dist

from lightning_sp.cost_model import FWD_BWD_FACTOR


def _median_time(fn, reps: int) -> float:
    fn()  # warm-up
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def calibrate_compute(blocks, *, heads: int, head_dim: int, reps: int, dtype=torch.float32) -> dict:
    """``{"attention_curve": [(block, FLOP/s)], "matmul_flops": FLOP/s}``: non-causal attention fwd+bwd
    on ``[1, block, heads, head_dim]`` through ``SequenceParallelAttention(backend="local")``."""
    from lightning_sp import SequenceParallelAttention

    torch.set_num_threads(1)
    attn = SequenceParallelAttention(causal=False, backend="local")
    curve = []
    for c in blocks:
        g = torch.Generator().manual_seed(c)
        q, k, v = (torch.randn(1, c, heads, head_dim, generator=g, dtype=dtype, requires_grad=True) for _ in range(3))
        dout = torch.randn(1, c, heads, head_dim, generator=g, dtype=dtype)

        def step():
            attn(q, k, v).backward(dout)

        t = _median_time(step, reps)
        curve.append((int(c), 4.0 * c * c * heads * head_dim * FWD_BWD_FACTOR / t))
    a = torch.randn(512, 512, dtype=dtype)
    b = torch.randn(512, 512, dtype=dtype)
    t = _median_time(lambda: a @ b, reps * 4)
    return {"attention_curve": curve, "matmul_flops": 2.0 * 512 ** 3 / t}


def fit_latency_bandwidth(sizes, times) -> tuple[float, float]:
    """Least squares ``t = lat + bytes / bw``: ``(lat, bw)``. Noise can make the fitted slope or
    intercept non-physical: then ``lat`` is the smallest message's time and ``bw`` the largest
    message's bytes over its time minus ``lat``."""
    n = len(sizes)
    mx, my = sum(sizes) / n, sum(times) / n
    sxx = sum((x - mx) ** 2 for x in sizes)
    slope = sum((x - mx) * (y - my) for x, y in zip(sizes, times)) / sxx
    lat = my - slope * mx
    if slope <= 0 or lat < 0:
        i_min, i_max = sizes.index(min(sizes)), sizes.index(max(sizes))
        lat = times[i_min]
        slope = max(times[i_max] - lat, 1e-9) / sizes[i_max]
    return lat, 1.0 / slope


def links_worker(rank, world, sizes, reps):
    """Ping-pong between ranks 0 and 1 (others idle) and an all-to-all over all ranks, per size."""
    torch.set_num_threads(1)
    rows = []
    for nbytes in sizes:
        buf = torch.zeros(nbytes // 4, dtype=torch.float32)
        times = []
        for i in range(reps + 1):
            dist.barrier()
            t0 = time.perf_counter()
            if rank == 0:
                dist.send(buf, 1)
                dist.recv(buf, 1)
            elif rank == 1:
                dist.recv(buf, 0)
                dist.send(buf, 0)
            if i:
                times.append((time.perf_counter() - t0) / 2)  # one way
        chunks = torch.zeros(world * max(nbytes // 4 // world, 1), dtype=torch.float32)
        out = torch.empty_like(chunks)
        a2a = []
        for i in range(reps + 1):
            dist.barrier()
            t0 = time.perf_counter()
            dist.all_to_all_single(out, chunks)
            if i:
                a2a.append(time.perf_counter() - t0)
        rows.append({"bytes": nbytes, "one_way_s": statistics.median(times), "all_to_all_s": statistics.median(a2a)})
    return rows if rank == 0 else None


def fit_links(points) -> dict:
    """``{"latency", "bandwidth", "points"}`` from ``links_worker``'s rows (one-way ping-pong times)."""
    lat, bw = fit_latency_bandwidth([r["bytes"] for r in points], [r["one_way_s"] for r in points])
    return {"latency": lat, "bandwidth": bw, "points": points}


def _inputs(seed, n, h, h_kv, d, dtype):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(1, n, h, d, generator=g, dtype=dtype), torch.randn(1, n, h_kv, d, generator=g, dtype=dtype),
            torch.randn(1, n, h_kv, d, generator=g, dtype=dtype), torch.randn(1, n, h, d, generator=g, dtype=dtype))


def time_backends_worker(rank, world, cases, reps):
    """``cases``: ``(backend, ulysses_degree, N, H, H_kv, D, causal)``; returns the median fwd+bwd
    seconds between barriers for each (rank 0)."""
    from lightning_sp import SequenceParallelAttention, shard_sequence

    torch.set_num_threads(1)
    group = dist.group.WORLD
    out = []
    for i, (backend, u, n, h, h_kv, d, causal) in enumerate(cases):
        attn = SequenceParallelAttention(causal=causal, backend=backend, group=group, ulysses_degree=u,
                                         kv_pieces=8)  # as the committed validation was measured (then the default)
        q, k, v, dout = (shard_sequence(t, group, layout=attn.layout) for t in _inputs(i, n, h, h_kv, d, torch.float32))
        q, k, v = (t.detach().requires_grad_() for t in (q, k, v))

        def step():
            dist.barrier()
            attn(q, k, v, seq_len=n).backward(dout)
            dist.barrier()

        out.append(_median_time(step, reps))
    return out if rank == 0 else None


def world_worker(rank, world, sizes, link_reps, cases, reps):
    """One spawn per world size: the link ping-pong/all-to-all, then the backends' timings."""
    links = links_worker(rank, world, sizes, link_reps)
    times = time_backends_worker(rank, world, cases, reps)
    return {"links": links, "times": times} if rank == 0 else None


def measure_world(world: int, sizes, link_reps: int, cases, reps: int) -> dict:
    """``{"links": [...], "times": [...]}`` measured on ``world`` gloo ranks (one spawn)."""
    from experiments.common import run_on_ranks

    return run_on_ranks(world_worker, world, (list(sizes), link_reps, list(cases), reps), timeout_s=1800, pg_timeout_s=300)[0]
