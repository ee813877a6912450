"""Starting an experiment's processes: gloo ranks on CPU (``run_on_ranks``) and the allocator settings that
make their timings independent of what ran before (``keep_freed_memory``)."""

from __future__ import annotations

import os
import platform
import sys

MALLOC_KEEP_FREED = {"MALLOC_TRIM_THRESHOLD_": str(1 << 40), "MALLOC_MMAP_THRESHOLD_": str(32 << 20)}
"""glibc's malloc settings ``keep_freed_memory`` puts in the environment: never trim freed memory back to the
system, and serve every block up to 32 MiB (glibc's largest allowed threshold) from the heap, not a fresh mmap."""


def keep_freed_memory() -> bool:
    """Make glibc's malloc keep freed memory for reuse, in this process and in every process it starts
    afterwards (``run_on_ranks``' spawned ranks read ``MALLOC_KEEP_FREED`` from the environment at start).
    Returns whether it applied (Linux with glibc; elsewhere nothing changes).

    Why (Note [Fresh pages] in ``experiments/cost_model/NOTES.md``): by default glibc moves its mmap and trim
    thresholds with the history of frees, so whether a buffer of a few MiB lands on pages already touched or
    on fresh ones (a page fault per 4 KiB, ~2 us each on this VM) depends on what ran before. ``colossal``'s
    O(N^2/P) scores made the same call 60-123 ms from one process state to another; the cost model prices
    compute, not the allocator's history. With freed memory kept, a call's buffers are warm from its second
    run on, in the primitives and the measured layers alike; buffers over 32 MiB are still mapped fresh on
    every call, in both."""
    import ctypes
    import ctypes.util

    if sys.platform != "linux" or platform.libc_ver()[0] != "glibc":
        return False
    os.environ.update(MALLOC_KEEP_FREED)
    libc = ctypes.CDLL(ctypes.util.find_library("c"))
    m_trim_threshold, m_mmap_threshold = -1, -3  # <malloc.h>
    # mallopt takes a C int: 1 GiB here stands for the environment's 1 TiB (both: never trim in practice)
    return bool(libc.mallopt(m_trim_threshold, 1 << 30) and libc.mallopt(m_mmap_threshold, 32 << 20))


def run_on_ranks(fn, world_size: int, args: tuple = (), *, timeout_s: float = 600, pg_timeout_s: float = 120):
    """Spawn ``world_size`` gloo ranks on CPU and return what ``fn(rank, world_size, *args)`` returns on
    each: the tests' harness (one spawner for tests and experiments)."""
    from tests.distributed.harness import run_on_ranks as _run

    return _run(fn, world_size=world_size, args=args, timeout_s=timeout_s, pg_timeout_s=pg_timeout_s)
