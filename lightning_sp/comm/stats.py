"""Byte counters for every collective, so measured traffic can be compared with the analytic volume.

Convention: a call counts the bytes this rank hands to the collective as its send buffer
(all-to-all: the whole local input, the paper's ``M/P``; ring send: the block sent; all-gather:
the local shard once per peer it reaches, i.e. ``(P-1) * shard``; reduce-scatter: ``(P-1)/P`` of
the input). With this convention Ulysses moves exactly ``4*N*h/P`` elements per rank forward and
a ring ``(P-1)/P * 2*N*h_kv``, the formulas in DESIGN.md.
"""

from __future__ import annotations

from collections import defaultdict
from contextlib import contextmanager
from dataclasses import dataclass, field


@dataclass
class CommStats:
    """Bytes sent by this rank, by operation name (``"all_to_all"``, ``"ring_send"``, ...)."""

    bytes_by_op: dict[str, int] = field(default_factory=lambda: defaultdict(int))
    calls_by_op: dict[str, int] = field(default_factory=lambda: defaultdict(int))
    enabled: bool = True

    def add(self, op: str, nbytes: int) -> None:
        if self.enabled:
            self.bytes_by_op[op] += int(nbytes)
            self.calls_by_op[op] += 1

    @property
    def total_bytes(self) -> int:
        return sum(self.bytes_by_op.values())

    def reset(self) -> None:
        self.bytes_by_op.clear()
        self.calls_by_op.clear()

    def snapshot(self) -> dict[str, int]:
        return dict(self.bytes_by_op)

    @contextmanager
    def paused(self):
        """Do not count what happens inside (e.g. validation collectives)."""
        was, self.enabled = self.enabled, False
        try:
            yield
        finally:
            self.enabled = was
