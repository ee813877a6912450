"""Faults: the process-group timeout that turns a dead or stalled rank into an error, and what a rank
says when a collective fails (``SequenceParallelStrategy.on_exception``)."""

from __future__ import annotations

import re
from datetime import timedelta

from lightning_sp.topology import ParallelDims

_COLLECTIVE_FAILURE = re.compile(r"timed? ?out|timeout|Connection closed|Connection reset|peer", re.IGNORECASE)


def as_process_group_timeout(value: float | timedelta, strategy_kwargs: dict) -> timedelta:
    """``process_group_timeout`` (seconds or ``timedelta``) as a positive ``timedelta``; rejects
    ``timeout=`` among the strategy's other keyword arguments (it has its own name here)."""
    if "timeout" in strategy_kwargs:
        raise ValueError("pass `process_group_timeout=` instead of `timeout=` to SequenceParallelStrategy")
    if not isinstance(value, timedelta):
        value = timedelta(seconds=float(value))
    if value.total_seconds() <= 0:
        raise ValueError(f"process_group_timeout must be positive, got {value}")
    return value


def collective_failure_hint(exception: BaseException, *, rank: int, dims: ParallelDims, timeout: timedelta,
                            global_step: int | None) -> str | None:
    """The hint to append to ``exception`` if it looks like a failed collective (a timeout or a lost peer),
    naming this rank's place in the mesh, the timeout and the step; ``None`` otherwise."""
    if not _COLLECTIVE_FAILURE.search(str(exception)):
        return None
    return (
        f"\n[lightning_sp] rank {rank} (dp rank {dims.dp_rank(rank)}, "
        f"sp rank {dims.sp_rank(rank)}) failed in a collective: another rank died or "
        f"stalled, or ranks issued collectives in different orders. process_group_timeout="
        f"{timeout.total_seconds():.0f}s, global step {global_step}. Resume from the "
        f"last saved checkpoint with `trainer.fit(..., ckpt_path=...)`."
    )


def append_hint(exception: BaseException, hint: str) -> None:
    """Append ``hint`` to ``exception``'s message in place (never masks the original error)."""
    try:
        exception.args = (f"{exception.args[0] if exception.args else ''}{hint}",) + tuple(exception.args[1:])
    except Exception:  # noqa: BLE001 - never mask the original error
        pass
