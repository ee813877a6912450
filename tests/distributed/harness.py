"""Spawn real gloo ranks on CPU, once per test module, and bring back what each rank returns.

    results = run_on_ranks(_worker, world_size=4, args=(cases,))   # list, index = rank

``_worker(rank, world_size, *args)`` must be a module-level function (it is pickled by name). The
process group is initialised before it runs and destroyed after it returns. A rank that raises
fails the whole call with that rank's traceback; a rank that hangs (a deadlock, a mismatched
collective) is killed after ``timeout_s`` and the call fails naming the ranks that did not finish.
Every rank runs with one intra-op thread so 4 ranks fit a 2-core machine.
"""

from __future__ import annotations

import datetime
import os
import socket
import traceback
from typing import Any, Callable

import torch
import torch.distributed as dist
import torch.multiprocessing as mp


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _rank_main(rank, world_size, port, pg_timeout_s, fn, args, queue) -> None:
    # LOCAL_RANK/NODE_RANK: a Lightning Trainer inside a worker sees ranks launched externally (as under
    # torchrun) and never starts its own launcher, which would re-run the parent's command (pytest)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), LOCAL_RANK=str(rank), NODE_RANK="0")
    torch.set_num_threads(1)
    try:
        dist.init_process_group(
            "gloo", rank=rank, world_size=world_size,
            timeout=datetime.timedelta(seconds=pg_timeout_s),
        )
        result = fn(rank, world_size, *args)
        queue.put((rank, True, result))
    except BaseException:  # noqa: BLE001 - every failure goes back to the parent with its traceback
        queue.put((rank, False, traceback.format_exc()))
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def run_on_ranks(
    fn: Callable[..., Any],
    world_size: int,
    args: tuple = (),
    *,
    timeout_s: float = 240.0,
    pg_timeout_s: float = 60.0,
    may_die: tuple[int, ...] = (),
) -> list[Any]:
    """Run ``fn(rank, world_size, *args)`` on ``world_size`` gloo ranks; return results by rank.
    Ranks in ``may_die`` may exit without reporting (fault tests); their result is ``None``."""
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    port = free_port()
    procs = [
        ctx.Process(target=_rank_main, args=(r, world_size, port, pg_timeout_s, fn, args, queue), daemon=True)
        for r in range(world_size)
    ]
    for p in procs:
        p.start()
    results: dict[int, Any] = {}
    failures: dict[int, str] = {}
    import queue as queue_mod
    import time

    deadline = time.monotonic() + timeout_s
    try:
        while len(results) + len(failures) < world_size:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                break
            try:
                rank, ok, payload = queue.get(timeout=min(remaining, 1.0))
            except queue_mod.Empty:
                dead = [r for r, p in enumerate(procs) if not p.is_alive() and r not in results and r not in failures]
                # A rank that died without reporting (segfault, os._exit) cannot answer any more.
                if dead and all(procs[r].exitcode not in (None, 0) for r in dead):
                    for r in dead:
                        if r in may_die:
                            results[r] = None
                        else:
                            failures[r] = f"rank {r} exited with code {procs[r].exitcode} without reporting"
                continue
            (results if ok else failures)[rank] = payload
            if not ok:
                break  # first failure: the other ranks may now be blocked in a collective
    finally:
        for p in procs:
            p.join(timeout=5 if not failures else 0.5)
        for p in procs:
            if p.is_alive():
                p.kill()
                p.join()
    if failures:
        rank = min(failures)
        raise AssertionError(f"rank {rank} failed:\n{failures[rank]}")
    missing = [r for r in range(world_size) if r not in results]
    if missing:
        raise AssertionError(f"ranks {missing} did not finish within {timeout_s:.0f}s (deadlock or hang)")
    return [results[r] for r in range(world_size)]
