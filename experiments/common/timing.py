"""Timing several implementations fairly on a busy machine: alternate them rep by rep, barriers around each call."""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import torch.distributed as dist


def median_seconds(fn: Callable[[], object], reps: int, warmup: int = 1) -> float:
    """Median wall time of ``fn()`` over ``reps`` calls after ``warmup`` untimed ones."""
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


@dataclass(kw_only=True)
class Timing:
    """Per-rep times of one implementation on this rank (seconds)."""

    wall_s: list[float] = field(default_factory=list)
    """Between the barriers around each timed call."""
    cpu_s: list[float] = field(default_factory=list)
    """This process's CPU time over the same interval."""

    @property
    def median_s(self) -> float:
        return statistics.median(self.wall_s)


def _barrier(group) -> None:
    if group is not None:
        dist.barrier(group)


def time_alternating(calls: dict[str, Callable[[], object]], *, warmup: int, reps: int, group=None) -> dict[str, Timing]:
    """Time every callable ``warmup + reps`` times, alternating them rep by rep (the order rotates each
    rep), with a barrier over ``group`` before and after each call; returns the timed reps only."""
    if warmup < 0 or reps < 1:
        raise ValueError(f"need warmup >= 0 and reps >= 1, got warmup={warmup}, reps={reps}")
    names = list(calls)
    out = {name: Timing() for name in names}
    for rep in range(warmup + reps):
        k = rep % len(names)
        for name in names[k:] + names[:k]:
            _barrier(group)
            w0, c0 = time.perf_counter(), time.process_time()
            calls[name]()
            _barrier(group)
            w1, c1 = time.perf_counter(), time.process_time()
            if rep >= warmup:
                out[name].wall_s.append(w1 - w0)
                out[name].cpu_s.append(c1 - c0)
    return out
