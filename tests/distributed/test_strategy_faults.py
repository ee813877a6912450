"""A stalled or dead rank ends the run with an error naming the rank, never an endless hang."""

from __future__ import annotations

import os
import time

import pytest
import torch.distributed

from tests.distributed.harness import run_on_ranks
from tests.distributed.test_strategy import WORLD, _c, _dataset, _fit, _make_model

pytestmark = pytest.mark.distributed

PG_TIMEOUT_S = 4
STALL_S = 10  # > PG_TIMEOUT_S: the peers' collectives must time out


def _fault_worker(rank: int, world_size: int, fault: str) -> dict:
    """Rank 3 stalls (``fault="stall"``) or dies (``"die"``) in its second training step."""
    os.environ.update(LOCAL_RANK=str(rank), NODE_RANK="0")
    model = _make_model(causal=True)
    step = type(model).training_step

    def faulty_step(self, batch, batch_idx):
        if rank == 3 and batch_idx == 1:
            if fault == "stall":
                time.sleep(STALL_S)  # a hung data loader, a swapped-out host, ...
            else:
                os._exit(1)  # the process is killed (OOM killer, hardware fault, ...)
        return step(self, batch, batch_idx)

    model.training_step = faulty_step.__get__(model)
    cfg = _c(fault, "ring" if fault == "stall" else "zigzag_ring", 4, timeout=PG_TIMEOUT_S)
    # the timeout also bounds creating the strategy's groups: line the ranks up first (2 busy cores)
    torch.distributed.barrier()
    start = time.monotonic()
    try:
        _fit(cfg, model, _dataset(8), steps=3)
    except Exception as err:  # noqa: BLE001 - the error itself is what is tested
        return {"error": f"{type(err).__name__}: {err}", "elapsed": time.monotonic() - start}
    return {"error": None, "elapsed": time.monotonic() - start}


def test_stalled_rank_fails_fast_with_clear_message():
    results = run_on_ranks(_fault_worker, WORLD, args=("stall",), timeout_s=120, pg_timeout_s=60)
    for rank in range(3):  # the ranks that waited for rank 3
        res = results[rank]
        assert res["error"] is not None, f"rank {rank} finished although rank 3 stalled"
        assert f"[lightning_sp] rank {rank} " in res["error"], res["error"]
        assert f"process_group_timeout={PG_TIMEOUT_S}s" in res["error"], res["error"]
        assert "connectFullMesh" not in res["error"], "failed while creating groups, not on the stall"
        # waited for the strategy's timeout, not the world group's 60 s
        assert PG_TIMEOUT_S - 0.5 < res["elapsed"] < 40, res["elapsed"]


def test_dead_rank_fails_fast_with_clear_message():
    results = run_on_ranks(_fault_worker, WORLD, args=("die",), timeout_s=120, pg_timeout_s=60, may_die=(3,))
    assert results[3] is None  # it really died
    for rank in range(3):
        res = results[rank]
        assert res["error"] is not None, f"rank {rank} finished although rank 3 died"
        assert f"[lightning_sp] rank {rank} " in res["error"], res["error"]
        assert res["elapsed"] < 40, res["elapsed"]
