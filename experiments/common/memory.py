"""Peak resident memory of one piece of work in this process, on CPU (Linux): the method the memory
experiments share (``benchmarks/attention/run.py``'s memory section, ``experiments/longest_sequence``).

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

``AllocatorPeak`` is the deterministic alternative for tests: the peak of PyTorch's CPU allocator events
(``torch.profiler``), without page, malloc or gloo effects; ``grad_seed`` starts a backward without the
caller holding the output.
"""

from __future__ import annotations

import contextlib
import ctypes
import ctypes.util
import gc
import os

import torch
from torch.profiler import ProfilerActivity, profile

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


# ----------------------------------------------------------------------------------------------
# The PyTorch allocator's peak (deterministic; what the profiler sees, not gloo's own buffers)
# ----------------------------------------------------------------------------------------------


def grad_seed(out, dout):
    """A scalar whose ``.backward()`` runs ``out``'s backward with gradient ``dout``, so that the caller
    can drop ``out`` first (``seed = grad_seed(out, dout); del out; seed.backward()``): as in a model,
    where the next layer's backward has released the output before attention's backward runs
    (``out.backward(dout)`` would keep it alive throughout)."""
    return _SeedGrad.apply(out, dout)


def attention_peak_bytes(attn, q, k, v, dout, *, seq_len: int, group=None) -> tuple[int, int]:
    """``(allocator peak of one fwd+bwd, bytes of q, k, v, dout)`` of ``attn`` on these leaf inputs (``q, k, v``
    with ``requires_grad``): one warm-up call first (usp sub-groups, plans), ranks aligned by a barrier over
    ``group``, the backward seeded without holding the output (``grad_seed``); gradients cleared after."""
    attn(q, k, v, seq_len=seq_len).backward(dout)
    q.grad = k.grad = v.grad = None
    if group is not None:
        torch.distributed.barrier(group)
    with AllocatorPeak() as peak:
        out = attn(q, k, v, seq_len=seq_len)
        seed = grad_seed(out, dout)
        del out
        seed.backward()
    q.grad = k.grad = v.grad = None
    return peak.peak_bytes, sum(t.numel() * t.element_size() for t in (q, k, v, dout))


class _SeedGrad(torch.autograd.Function):
    """A scalar whose backward hands ``dout`` to ``x``."""

    @staticmethod
    def forward(ctx, x, dout):
        ctx.dout = dout
        return x.new_zeros(())

    @staticmethod
    def backward(ctx, _grad):
        return ctx.dout, None


class AllocatorPeak:
    """``with AllocatorPeak() as p: work()`` -> ``p.peak_bytes``: the peak, over the block, of the CPU
    tensor bytes allocated in it minus those freed (``torch.profiler`` with ``profile_memory=True``), and
    ``p.live_at_peak(top)``: the tensors alive at that moment as ``[(aten op, autograd node, MiB,
    count)]``, largest first. Deterministic (no page or allocator-cache effects); sees only PyTorch's
    allocator, not a collective library's own buffers, which ``PeakRSS`` counts."""

    def __init__(self) -> None:
        self.peak_bytes: int | None = None
        self._trace: dict | None = None

    def __enter__(self) -> "AllocatorPeak":
        self._prof = profile(activities=[ProfilerActivity.CPU], profile_memory=True)
        self._prof.__enter__()
        return self

    def __exit__(self, *exc) -> None:
        import json
        import tempfile

        self._prof.__exit__(*exc)
        with tempfile.NamedTemporaryFile(suffix=".json") as f:
            self._prof.export_chrome_trace(f.name)
            with open(f.name) as g:
                self._trace = json.load(g)
        del self._prof
        self.peak_bytes, self._live = _peak_of(self._trace["traceEvents"])

    def live_at_peak(self, top: int = 12) -> list[tuple[str, str, float, int]]:
        """Tensors alive at the peak, grouped by the aten op that allocated them (the innermost one
        other than a bare ``empty``/``empty_strided``, which name no purpose; "?" = outside any aten op,
        e.g. a C++ collective), its autograd node and the allocation size."""
        import bisect
        import collections

        events = self._trace["traceEvents"]
        ops = sorted((e for e in events if e.get("ph") == "X" and e.get("cat") == "cpu_op"), key=lambda e: e["ts"])
        starts = [o["ts"] for o in ops]
        alloc_only = {"aten::empty", "aten::empty_strided", "aten::resize_"}

        def owner(ts):
            aten, node = "?", "forward"
            for o in reversed(ops[: bisect.bisect_right(starts, ts)]):
                if o["ts"] <= ts <= o["ts"] + o["dur"]:
                    if aten == "?" and o["name"].startswith("aten::") and o["name"] not in alloc_only:
                        aten = o["name"]
                    if o["name"].startswith("autograd::engine::evaluate_function"):
                        node = o["name"].split(": ", 1)[-1]
                        break
            return aten, node

        groups, counts = collections.Counter(), collections.Counter()
        for nbytes, ts in self._live.values():
            key = (*owner(ts), nbytes)
            groups[key] += nbytes
            counts[key] += 1
        return [(a, n, b / 2**20, counts[(a, n, each)]) for (a, n, each), b in groups.most_common(top)]


def _peak_of(events) -> tuple[int, dict]:
    """Peak of the running sum of CPU allocator events, and ``{address: (bytes, time)}`` alive then.
    Frees of memory allocated before the profile lower the running sum (the peak is net of them)."""
    mem = sorted((e for e in events if e.get("name") == "[memory]" and e["args"].get("Device Type", 0) == 0),
                 key=lambda e: e["ts"])
    live, running, peak, peak_live = {}, 0, 0, {}
    for e in mem:
        nbytes, addr = e["args"]["Bytes"], e["args"]["Addr"]
        running += nbytes
        if nbytes > 0:
            live[addr] = (nbytes, e["ts"])
        else:
            live.pop(addr, None)
        if running > peak:
            peak, peak_live = running, dict(live)
    return peak, peak_live
