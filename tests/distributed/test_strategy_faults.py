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


# --------------------------------------------------------------------------- full and read-only filesystems
# A small tmpfs fills during the first checkpoint; a read-only one refuses the probe at setup. Without root
# (no mount) the same failures are injected into the writers.
import errno  # noqa: E402
import subprocess  # noqa: E402

SAVE_CASES = {"file": dict(dp="ddp", dcp=False), "dcp": dict(dp="fsdp", dcp=True)}


def _mount(path: str, options: str) -> bool:
    os.makedirs(path, exist_ok=True)
    if os.geteuid() != 0:
        return False
    return subprocess.run(["mount", "-t", "tmpfs", "-o", options, "tmpfs", path], capture_output=True).returncode == 0


def _inject(kind: str, directory: str) -> None:
    """Without a tmpfs: fail as a full disk (after half a write) or a read-only directory would."""
    from torch.distributed.checkpoint import FileSystemWriter

    from lightning_sp import checkpoint

    if kind == "read-only":
        real = checkpoint._write_durably

        def read_only(path, data):
            if str(path).startswith(directory):
                raise OSError(errno.EROFS, "Read-only file system", str(path))
            return real(path, data)

        checkpoint._write_durably = read_only
        return
    from lightning.fabric.plugins.io import torch_io

    save, write = torch_io._atomic_save, FileSystemWriter.write_data

    def full_save(checkpoint, path):  # Lightning's single-file writer
        if str(path).startswith(directory):
            open(path, "wb").write(b"half")
            raise OSError(errno.ENOSPC, "No space left on device", str(path))
        return save(checkpoint, path)

    def full_write(self, plan, planner):
        if str(self.path).startswith(directory):
            raise OSError(errno.ENOSPC, "No space left on device", str(self.path))
        return write(self, plan, planner)

    torch_io._atomic_save, FileSystemWriter.write_data = full_save, full_write


def _disk_worker(rank: int, world_size: int, dirs: dict, injected: bool) -> dict:
    from lightning.pytorch.callbacks import ModelCheckpoint

    from tests.distributed.test_checkpoint_resume import DATA, _layout, _loader, _make, _trainer

    out = {}
    for name, (directory, kind) in dirs.items():
        case = SAVE_CASES[name.split("/")[1]]
        cfg = _layout(name, **case)
        if injected:
            _inject(kind, directory)
        if name.startswith("control"):  # the save before: Lightning's writer on rank 0, nothing agreed
            from lightning_sp.checkpoint import StrategyCheckpointIO

            StrategyCheckpointIO.save = lambda self, ckpt, path, opts, *, dims, lightning_save, in_place=False: (
                lightning_save(ckpt, path, storage_options=opts))
        trainer = _trainer(cfg, epochs=2, callbacks=[ModelCheckpoint(dirpath=directory)], timeout=PG_TIMEOUT_S * 3)
        start = time.monotonic()
        try:
            trainer.fit(_make("decoder"), _loader(cfg, DATA))
            error = None
        except Exception as err:  # noqa: BLE001 - the error is what is tested
            error = f"{type(err).__name__}: {err}"
        out[name] = dict(error=error, elapsed=time.monotonic() - start, step=trainer.global_step,
                         listing=sorted(os.listdir(directory)) if kind == "full" else None)
    return out


def test_full_or_read_only_checkpoint_directory_fails_on_every_rank(tmp_path):
    dirs, mounted = {}, []
    for fmt in SAVE_CASES:
        full, read_only = str(tmp_path / f"full-{fmt}"), str(tmp_path / f"ro-{fmt}")
        mounted += [d for d, opts in ((full, "size=128k"), (read_only, "ro,size=64k")) if _mount(d, opts)]
        dirs[f"full/{fmt}"], dirs[f"read-only/{fmt}"] = (full, "full"), (read_only, "read-only")
    control = str(tmp_path / "full-control")  # last: its ranks leave the save at different moments
    mounted += [control] if _mount(control, "size=128k") else []
    dirs["control/file"] = (control, "full")
    injected = len(mounted) < len(dirs)
    try:
        results = run_on_ranks(_disk_worker, WORLD, args=(dirs, injected), timeout_s=300)
    finally:
        for d in mounted:
            subprocess.run(["umount", d], capture_output=True)
    # negative control: the save before names the cause on rank 0 only (the others: a lost peer or a timeout)
    control = [res["control/file"]["error"] or "" for res in results]
    assert sum("CheckpointSaveError" in e and dirs["control/file"][0] in e for e in control) < WORLD, control
    for name, (directory, kind) in dirs.items():
        if name.startswith("control"):
            continue
        for rank, res in enumerate(results):
            r = res[name]
            assert r["error"] is not None, (name, rank)
            assert "CheckpointSaveError" in r["error"] and directory in r["error"], (name, rank, r["error"])
            assert "Connection closed" not in r["error"] and "another rank died" not in r["error"], (name, rank, r["error"])
            if kind == "full":  # the OS's words, or torch's zip writer finding its write cut short by the full disk
                assert ("No space left on device" in r["error"] or "unexpected pos" in r["error"]) and (
                    f"Free space in {directory}" in r["error"]), (name, rank, r["error"])
                assert r["listing"] == [], (name, rank, r["listing"])  # nothing under a final name, no staging
                assert r["step"] == 2, (name, rank, r["step"])  # the first epoch's save (2 steps) failed
            else:  # found at setup: no training time spent
                assert "not writable on rank(s) [0, 1, 2, 3]" in r["error"] and "Read-only" in r["error"], r["error"]
                assert r["step"] == 0, (name, rank, r["step"])
