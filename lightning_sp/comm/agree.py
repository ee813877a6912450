"""Cross-rank agreement: every rank joins one small all-gather, then every rank decides the same.

Note [Cross-rank checks are decided together]
~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
A check that some ranks skip deadlocks: the rank whose input changed all-gathers while its peers,
which skipped, enter the next collective (a ring exchange); every rank then waits for the
process-group timeout and fails without naming the cause. So whether a rank calls a collective never
depends on state only that rank has (a cache of shapes it has seen, its local input):

    rank 0: row (S_local=4, dtype=fp32, ...) ──┐
    rank 1: row (S_local=5, dtype=fp32, ...) ──┼── one all-gather of a fixed-size float64 row,
    rank 2: row (S_local=4, dtype=fp32, ...) ──┘   joined by every rank at every check
                         │
              every rank holds every row: each decides the same (all pass, or all raise naming
              the ranks and their values: "S_local: 4 on ranks [0, 2]; 5 on rank [1]")

A rank whose own input is bad still joins (its row carries an error code) before it raises, so its
peers raise too instead of waiting. Rows are numbers (integers below 2**53 are exact in float64);
what cannot be a number travels as ``stable_hash`` (48 bits, the same on every rank, unlike
Python's salted ``hash``).
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence

import torch
import torch.distributed as dist

from lightning_sp.comm.device import group_device
from lightning_sp.comm.release import collective


def stable_hash(*parts) -> int:
    """A 48-bit hash of ``repr(parts)``, identical on every rank and process (exact in float64)."""
    return int.from_bytes(hashlib.blake2b(repr(parts).encode(), digest_size=6).digest(), "big")


def gather_rows(row: Sequence[int | float], group, *, device: torch.device | None = None) -> list[list[int | float]]:
    """Every rank's ``row`` in group-rank order: one all-gather of ``len(row)`` float64 per rank, which
    every rank of ``group`` must call (with rows of the same length). Integral values come back as ``int``.
    ``device``: the preferred device where the group takes accelerator tensors (``group_device``'s ``prefer``:
    else the current one), which costs a host sync per call (the rows are read back); on gloo the CPU."""
    values = torch.tensor([float(x) for x in row], dtype=torch.float64, device=group_device(group, device))  # [F]
    gathered = [torch.empty_like(values) for _ in range(dist.get_world_size(group))]  # P x [F]
    collective(dist.all_gather, gathered, values, group=group)
    return [[int(x) if float(x).is_integer() else float(x) for x in g.tolist()] for g in gathered]


def global_ranks(group) -> list[int]:
    """Global rank of each group rank (what a user finds in the launcher's logs)."""
    return dist.get_process_group_ranks(group)


def describe_disagreement(rows: Sequence[Sequence], names: Sequence[str], ranks: Sequence[int],
                          *, show: dict | None = None) -> str | None:
    """``None`` when every row is equal; else one line per field that differs, each value with the
    (global) ranks that hold it: ``"  S_local: 4 on ranks [0, 2, 3]; 5 on rank [1]"``. ``show`` maps a
    field name to a function turning its number back into words (a dtype code into ``torch.float32``)."""
    if all(list(r) == list(rows[0]) for r in rows):
        return None
    show = show or {}
    lines = []
    for i, name in enumerate(names):
        holders: dict = {}
        for rank, r in zip(ranks, rows):
            holders.setdefault(r[i], []).append(rank)
        if len(holders) > 1:
            fmt = show.get(name, repr)
            parts = [f"{fmt(v)} on rank{'s' if len(rs) > 1 else ''} {rs}" for v, rs in holders.items()]
            lines.append(f"  {name}: " + "; ".join(parts))
    return "\n".join(lines)
