"""Peak resident memory of one piece of work in this process, on CPU (Linux): the method the memory
experiments share (``scripts/bench_attention.py``'s memory section, ``experiments/longest_sequence``).

    mmap_large_allocations()          # before torch allocates anything / before ranks are spawned
    with PeakRSS() as peak:           # baseline = VmRSS now; peak counter reset to it
        work()
    peak.increase_bytes               # VmHWM at exit - VmRSS at entry

Method (``METHOD`` below, quoted in result files): glibc is told to serve every allocation of
``MMAP_THRESHOLD_BYTES`` or more by ``mmap`` (``MALLOC_MMAP_THRESHOLD_``, inherited by spawned ranks), so
a freed tensor's pages leave the process at once and the resident set follows the live tensors. Before
the work the heap is trimmed (``malloc_trim(0)``) and the kernel's high-water mark ``VmHWM`` is reset to
the current ``VmRSS`` by writing ``5`` to ``/proc/self/clear_refs``; after it, ``VmHWM - VmRSS(before)`` is
the peak of what the work added: every byte it touched and still held at its peak (tensors, the
allocator's and gloo's own buffers, code pages first faulted in). Granularity: one 4 KiB page, read in KiB.
"""

from __future__ import annotations

import contextlib
import ctypes
import ctypes.util
import gc
import os

MMAP_THRESHOLD_BYTES = 128 * 1024



def method(threshold: int = MMAP_THRESHOLD_BYTES) -> str:
    """The method in one line, for result files."""
    return ("peak RSS: VmHWM after the work minus VmRSS before it, from /proc/self/status; VmHWM reset to VmRSS "
            "through /proc/self/clear_refs (5) after gc.collect() and malloc_trim(0); "
            f"MALLOC_MMAP_THRESHOLD_={threshold} (allocations of {threshold // 1024} KiB or more are mmapped, so freed "
            "memory leaves the process)")


METHOD = method()


def mmap_large_allocations() -> None:
    """Make glibc ``mmap`` every allocation >= ``MMAP_THRESHOLD_BYTES`` in processes started from now on
    (and in this one, if glibc has not read its tunables yet: call it before importing torch)."""
    os.environ.setdefault("MALLOC_MMAP_THRESHOLD_", str(MMAP_THRESHOLD_BYTES))


@contextlib.contextmanager
def mmap_threshold(threshold: int):
    """Processes started inside the block ``mmap`` every allocation >= ``threshold`` bytes; the
    environment is restored after (so other spawns of this process keep their setting)."""
    old = os.environ.get("MALLOC_MMAP_THRESHOLD_")
    os.environ["MALLOC_MMAP_THRESHOLD_"] = str(threshold)
    try:
        yield
    finally:
        if old is None:
            del os.environ["MALLOC_MMAP_THRESHOLD_"]
        else:
            os.environ["MALLOC_MMAP_THRESHOLD_"] = old


def proc_status_kib(field: str) -> int:
    """A ``kB`` field of ``/proc/self/status`` (``VmRSS``, ``VmHWM``, ...)."""
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    raise KeyError(f"{field} is not in /proc/self/status (not Linux?)")


def reset_peak_rss() -> bool:
    """Reset ``VmHWM`` to the current ``VmRSS``; ``False`` where the kernel does not allow it."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return True
    except OSError:
        return False


def trim_heap() -> None:
    """Collect garbage and hand the heap's free pages back to the kernel (glibc ``malloc_trim``)."""
    gc.collect()
    name = ctypes.util.find_library("c")
    if name:
        try:
            ctypes.CDLL(name).malloc_trim(0)
        except (OSError, AttributeError):  # not glibc
            pass


class PeakRSS:
    """``with PeakRSS() as p: ...`` -> ``p.increase_bytes``: peak resident bytes the block added
    (``None`` where ``VmHWM`` cannot be reset). ``p.peak_now()`` reads the peak so far inside the block;
    ``p.restart_peak()`` forgets the transient peak of the set-up done so far."""

    def __init__(self, *, trim: bool = True) -> None:
        self.trim = trim
        self.rss_before_kib: int | None = None
        self.ok = False
        self.increase_bytes: int | None = None

    def __enter__(self) -> "PeakRSS":
        if self.trim:
            trim_heap()
        self.rss_before_kib = proc_status_kib("VmRSS")
        self.ok = reset_peak_rss()
        return self

    def restart_peak(self) -> None:
        """Reset ``VmHWM`` to the current ``VmRSS`` again, keeping the baseline: what was set up in the
        block so far counts as much as it still holds now, not at its transient peak."""
        self.ok = self.ok and reset_peak_rss()

    def peak_now(self) -> int | None:
        return (proc_status_kib("VmHWM") - self.rss_before_kib) * 1024 if self.ok else None

    def __exit__(self, *exc) -> None:
        self.increase_bytes = self.peak_now()
