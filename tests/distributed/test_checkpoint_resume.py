"""Checkpoints you can trust, through real Trainers on 4 gloo ranks, float64.

1. The resume matrix: a single file or a ``torch.distributed.checkpoint`` directory, saved under one
   layout (DDP / FSDP2 / tensor parallel) after one epoch, resumed under another (and another sp
   degree) for a second epoch, equals one uninterrupted single-process run.
2. Crash consistency: one rank (or every rank: the whole job) is killed (``os._exit``) at a point of the
   second save; a later run with ``ckpt_path="last"`` resumes to the uninterrupted run's parameters and
   removes the staging the kill left.
3. Through ``trainer.fit(ckpt_path=...)``: a planted payload never runs, and a damaged checkpoint
   fails on every rank within seconds, naming the checkpoint, the file and "incomplete or corrupted".

Spawns: one per kill point (the killed rank ends its spawn), then one that resumes them and runs
(3) and (1). The demo decoder (GQA, AdamW with two parameter groups and a warmup schedule,
length 13) is used throughout: it runs under every layout.
"""

from __future__ import annotations

import os
import pathlib
import shutil
import time

import pytest
import torch

from tests.distributed.harness import run_on_ranks
from tests.distributed.test_strategy_tp import (
    TOL, WORLD, _data, _full_params, _make, _max_diff, _replica_batches, _replica_mean_loss,
)

# ~2 min of 4 ranks on a quiet 2-core machine (far longer under load); the ranks' own timeouts catch hangs
pytestmark = [pytest.mark.distributed, pytest.mark.timeout(1800)]

N_SAMPLES = 4  # with b=1: 2 optimizer steps per epoch at dp=2, 1 at dp=1 (b=2: 1)
KILL_PG_TIMEOUT_S = 15  # survivors of a killed rank fail in their next collective after this


def _layout(name, *, sp=2, tp=1, dp="ddp", dcp=False, b=1):
    return dict(name=name, sp=sp, tp=tp, dp=dp, dcp=dcp, b=b)


# (saved under, resumed under): what each pair attacks
MATRIX = [
    # the KeyError 'state.0.step': a DDP file's numbered optimizer state into FSDP2 shards
    ("file: ddp sp2xdp2 -> fsdp sp2xdp2", _layout("a"), _layout("b", dp="fsdp")),
    # FSDP's name-keyed full optimizer state into DDP (numbered), another sp degree
    ("file: fsdp sp2xdp2 -> ddp sp4", _layout("a", dp="fsdp"), _layout("b", sp=4, b=2)),
    # a whole file into tensor-parallel splits (was refused), another sp degree
    ("file: fsdp sp2xdp2 -> tp2xcp2", _layout("a", dp="fsdp"), _layout("b", tp=2, dcp=True, b=2)),
    # sharded without tensor parallelism, DDP -> tp x dp FSDP (tp -> others: test_strategy_tp.py)
    ("dcp: ddp sp2xdp2 -> tp2xdp2 fsdp", _layout("a", dcp=True), _layout("b", sp=1, tp=2, dp="fsdp", dcp=True)),
]


def _trainer(cfg, *, epochs, callbacks=(), timeout=60):
    import lightning as L

    from lightning_sp.strategy import SequenceParallelStrategy

    os.environ["WORLD_SIZE"] = str(WORLD)
    strategy = SequenceParallelStrategy(
        cfg["sp"], backend="zigzag_ring", data_parallel=cfg["dp"], tensor_parallel_size=cfg["tp"], shuffle=False,
        process_group_timeout=timeout, distributed_checkpoint=cfg["dcp"],
    )
    return L.Trainer(
        accelerator="cpu", devices=WORLD, strategy=strategy, precision="64-true", max_epochs=epochs, logger=False,
        enable_checkpointing=bool(callbacks), callbacks=list(callbacks), enable_progress_bar=False,
        enable_model_summary=False, num_sanity_val_steps=0,
    )


def _loader(cfg, data):
    from torch.utils.data import DataLoader

    return DataLoader(data, batch_size=cfg["b"], shuffle=False)


def _perturbed():
    model = _make("decoder")
    with torch.no_grad():  # a different start: only the checkpoint can make it right
        for p in model.parameters():
            p.add_(1.0)
    return model


def _reference(schedule) -> dict[str, torch.Tensor]:
    """One process, whole sequences: one AdamW step (and scheduler step) per entry of ``schedule``."""
    from lightning_sp.models.base import make_optimizer

    model = _make("decoder").double()
    h = model.hparams
    conf = make_optimizer(model, h.lr, h.weight_decay, h.warmup_steps)
    opt, sched = conf["optimizer"], conf["lr_scheduler"]["scheduler"]
    for replicas in schedule:
        loss = _replica_mean_loss(model, DATA, replicas)
        opt.zero_grad()
        loss.backward()
        opt.step()
        sched.step()
    return {n: p.detach() for n, p in model.named_parameters()}


DATA = _data(279, N_SAMPLES, 9)


def _params(trainer, cfg, rank) -> dict[str, torch.Tensor]:
    import torch.distributed as dist

    from lightning_sp.topology import ParallelDims

    dims = ParallelDims(world_size=WORLD, sequence_parallel_size=cfg["sp"], tensor_parallel_size=cfg["tp"])
    groups = [dist.new_group(r) for r in dims.groups("tp")]
    try:
        return _full_params(trainer.lightning_module, cfg["tp"], groups[rank // cfg["tp"]])
    finally:
        for g in groups:
            dist.destroy_process_group(g)


# --------------------------------------------------------------------------- 1. the resume matrix
def _matrix_worker(rank: int, world_size: int, tmpdir: str) -> dict:
    out: dict = {"diff": {}}
    moved = None
    for name, first, second in MATRIX:
        path = os.path.join(tmpdir, name.replace(" ", "_").replace(":", "").replace(">", ""))
        trainer = _trainer(first, epochs=1)
        trainer.fit(_make("decoder"), _loader(first, DATA))
        trainer.save_checkpoint(path)
        out.setdefault("is_dir", {})[name] = os.path.isdir(path)
        trainer = _trainer(second, epochs=2)
        trainer.fit(_perturbed(), _loader(second, DATA), ckpt_path=path)
        ref = _reference(_replica_batches(first, N_SAMPLES) + _replica_batches(second, N_SAMPLES))
        out["diff"][name] = _max_diff(_params(trainer, second, rank), ref)
        if moved is None:
            moved = _max_diff(ref, {n: p.detach().double() for n, p in _make("decoder").named_parameters()})
    out["moved"] = moved
    return out


@pytest.fixture(scope="module")
def matrix(resumed):
    return [r["matrix"] for r in resumed]


@pytest.mark.parametrize("name", [m[0] for m in MATRIX])
def test_every_format_resumes_under_every_layout(matrix, name):
    first = next(m[1] for m in MATRIX if m[0] == name)
    for rank, res in enumerate(matrix):
        assert res["is_dir"][name] == first["dcp"], "the case did not save the format it names"
        assert res["diff"][name] < TOL, f"rank {rank} {name}: max |param - uninterrupted| = {res['diff'][name]:.3e}"
    assert matrix[0]["moved"] > 1e-3  # two epochs move the parameters: the comparison is not vacuous


def test_single_file_cannot_be_asked_for_under_tensor_parallelism():
    from lightning_sp.strategy import SequenceParallelStrategy

    with pytest.raises(ValueError, match="distributed_checkpoint=False .* cannot hold a tensor-parallel model"):
        SequenceParallelStrategy(1, tensor_parallel_size=2, distributed_checkpoint=False)


# --------------------------------------------------------------------------- 2. killed during a save
KILLED = _layout("fsdp sp2xdp2 dcp", dp="fsdp", dcp=True)  # the layout
KILL_CASES = {  # point -> (layout, rank that dies)
    "dcp/between_shards": (KILLED, 1),  # rank 1's new shard is written, the other ranks' are not all
    "file/before_rename": (_layout("ddp sp2xdp2 file"), 0),  # Lightning's temp file written, not moved
    # the whole job killed (a node lost, SLURM's SIGKILL) while every rank writes its shard: staging is left
    "dcp/every_rank_in_the_write": (KILLED, None),
}
KILL_EPOCHS = 3  # 2 steps each; at each epoch's end ModelCheckpoint saves epoch=E-step=S.ckpt, then last.ckpt
KILLED_SAVE = 4  # the rewrite of last.ckpt at the end of epoch 1 (other kill points: tests/unit/test_checkpoint_safety.py)


def _checkpoint_callback(dirpath):
    from lightning.pytorch.callbacks import ModelCheckpoint

    return ModelCheckpoint(dirpath=dirpath, save_last=True)  # (save_top_k=0 would skip last.ckpt until the end)


def _arm_kill(point: str, rank: int, victim: int) -> None:
    """Make ``victim`` (``None``: every rank) exit (as if SIGKILLed) at ``point`` of save number ``KILLED_SAVE``."""
    if victim is not None and rank != victim:
        return
    saves = {"n": 0}

    def die():
        os._exit(1)

    if point.startswith("dcp/"):
        from torch.distributed.checkpoint import FileSystemWriter

        write = FileSystemWriter.write_data

        def write_then_die(self, plan, planner):
            result = write(self, plan, planner)
            saves["n"] += 1
            if saves["n"] == KILLED_SAVE:
                result.wait()
                die()
            return result

        FileSystemWriter.write_data = write_then_die
    else:
        from fsspec.implementations.local import LocalFileOpener

        commit = LocalFileOpener.commit

        def die_before_commit(self):
            saves["n"] += 1
            if saves["n"] == KILLED_SAVE:
                die()
            return commit(self)

        LocalFileOpener.commit = die_before_commit


def _kill_worker(rank: int, world_size: int, point: str, dirpath: str) -> dict:
    import torch.distributed as dist

    cfg, victim = KILL_CASES[point]
    _arm_kill(point, rank, victim)
    from datetime import timedelta

    from torch.distributed.distributed_c10d import _set_pg_timeout

    dist.barrier()  # line the ranks up (60 s: a loaded machine starts them slowly), then the short timeout
    _set_pg_timeout(timedelta(seconds=KILL_PG_TIMEOUT_S))  # the world group's, used by torch.distributed.checkpoint
    trainer = _trainer(cfg, epochs=KILL_EPOCHS, callbacks=[_checkpoint_callback(dirpath)], timeout=KILL_PG_TIMEOUT_S)
    save, started = trainer.save_checkpoint, []

    def timed_save(*args, **kwargs):  # when did the (last) save begin on this rank?
        started.append(time.monotonic())
        return save(*args, **kwargs)

    trainer.save_checkpoint = timed_save
    try:
        trainer.fit(_make("decoder"), _loader(cfg, DATA))
    except Exception as err:  # noqa: BLE001 - the error is what is tested
        return {"error": f"{type(err).__name__}: {err}", "saves": len(started), "since_save": time.monotonic() - started[-1] if started else None}
    return {"error": None, "saves": len(started), "since_save": None}


@pytest.fixture(scope="module")
def killed(tmp_path_factory):
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    out = {}
    for point, (_, victim) in KILL_CASES.items():
        dirpath = str(tmp_path_factory.mktemp(point.replace("/", "_")))
        out[point] = (dirpath, run_on_ranks(_kill_worker, WORLD, args=(point, dirpath), timeout_s=600,
                                            may_die=tuple(range(WORLD)) if victim is None else (victim,)))
    return out


def test_killed_save_fails_the_other_ranks(killed):
    for point, (_, results) in killed.items():
        victim = KILL_CASES[point][1]
        if victim is None:
            assert results == [None] * WORLD, f"{point}: a rank survived"
            continue
        assert results[victim] is None, f"{point}: rank {victim} did not die"
        for rank, res in enumerate(results):
            if rank != victim:
                assert res["error"] is not None, f"{point}: rank {rank} finished although rank {victim} died"
                assert res["saves"] == KILLED_SAVE, (point, res)  # it failed in the killed save, not elsewhere
                # within the process-group timeout of the kill, not the world's 60 s or a hang
                assert res["since_save"] < 6 * KILL_PG_TIMEOUT_S, (point, res)


# --------------------------------------------------------------------------- 3. resume; payloads; damage
class _Payload:
    """Unpickling this creates the marker directory: proof that code from the file ran."""

    def __init__(self, marker):
        self.marker = str(marker)

    def __reduce__(self):
        return (os.mkdir, (self.marker,))


def _craft(kind: str, src_dir: str, src_file: str, dst: str, marker: str) -> str:
    """Rank 0: a crafted or damaged copy of a good checkpoint; returns the file it touched."""
    import json
    import pickle

    from lightning_sp import checkpoint

    def recommit(path):
        record = json.loads(open(os.path.join(path, "commit.json")).read())
        record["files"] = {f: os.path.getsize(os.path.join(path, f)) for f in record["files"]}
        open(os.path.join(path, "commit.json"), "w").write(json.dumps(record))

    if kind.startswith("file"):
        shutil.copyfile(src_file, dst)
        if kind == "file/payload":  # in the optimizer state, where a tensor belongs
            ckpt = torch.load(dst, weights_only=True)
            ckpt["optimizer_states"][0]["state"][0]["exp_avg"] = _Payload(marker)
            torch.save(ckpt, dst)
        else:  # truncated
            data = open(dst, "rb").read()
            open(dst, "wb").write(data[: len(data) // 2])
        return os.path.basename(dst)
    shutil.copytree(src_dir, dst)
    if kind == "dcp/payload-metadata":
        md = checkpoint._read_dcp_metadata(pathlib.Path(dst))
        md.planner_data = {"x": _Payload(marker)}
        open(os.path.join(dst, ".metadata"), "wb").write(pickle.dumps(md))
        recommit(dst)
        return ".metadata"
    if kind == "dcp/payload-meta":
        meta = torch.load(os.path.join(dst, "meta.pt"), weights_only=True)
        meta["hyper_parameters"] = _Payload(marker)
        torch.save(meta, os.path.join(dst, "meta.pt"))
        recommit(dst)
        return "meta.pt"
    if kind == "dcp/truncated-shard":
        name = max((f for f in os.listdir(dst) if f.endswith(".distcp")), key=lambda f: os.path.getsize(os.path.join(dst, f)))
        data = open(os.path.join(dst, name), "rb").read()
        open(os.path.join(dst, name), "wb").write(data[: len(data) // 2])
        return name
    if kind == "dcp/no-meta":
        os.remove(os.path.join(dst, "meta.pt"))
        return "meta.pt"
    raise AssertionError(kind)


ATTACKS = ["file/payload", "file/truncated", "dcp/payload-metadata", "dcp/payload-meta", "dcp/truncated-shard", "dcp/no-meta"]


def _resume_worker(rank: int, world_size: int, killed_dirs: dict, tmpdir: str) -> dict:
    import torch.distributed as dist

    out: dict = {"diff": {}, "resumed_step": {}, "attacks": {}, "staged_before": {}, "staged_after": {}}
    for point, dirpath in killed_dirs.items():
        cfg = KILL_CASES[point][0]
        last = os.path.join(dirpath, "last.ckpt")
        staging = os.path.join(dirpath, ".lightning_sp-staging")
        out["staged_before"][point] = sorted(os.listdir(staging)) if os.path.isdir(staging) else []
        dist.barrier()  # every rank has looked before the restart cleans it
        from lightning_sp.checkpoint import load_meta

        meta = load_meta(last) if os.path.isdir(last) else torch.load(last, weights_only=True)
        out["resumed_step"][point] = meta["global_step"]
        trainer = _trainer(cfg, epochs=KILL_EPOCHS, callbacks=[_checkpoint_callback(dirpath)])
        trainer.fit(_perturbed(), _loader(cfg, DATA), ckpt_path="last")
        out["diff"][point] = _max_diff(_params(trainer, cfg, rank), _reference(_replica_batches(cfg, N_SAMPLES) * KILL_EPOCHS))
        out["staged_after"][point] = os.path.exists(staging)

    good_dir = os.path.join(killed_dirs["dcp/between_shards"], "last.ckpt")
    good_file = os.path.join(killed_dirs["file/before_rename"], "last.ckpt")
    marker = os.path.join(tmpdir, "pwned")
    for kind in ATTACKS:
        dst = os.path.join(tmpdir, kind.replace("/", "_") + ".ckpt")
        touched = _craft(kind, good_dir, good_file, dst, marker) if rank == 0 else None
        objs = [touched]
        dist.broadcast_object_list(objs, src=0)  # test plumbing only (the library never unpickles)
        cfg = KILL_CASES["dcp/between_shards" if kind.startswith("dcp") else "file/before_rename"][0]
        start = time.monotonic()
        try:
            _trainer(cfg, epochs=KILL_EPOCHS).fit(_perturbed(), _loader(cfg, DATA), ckpt_path=dst)
            error = None
        except Exception as err:  # noqa: BLE001 - the error is what is tested
            error = f"{type(err).__name__}: {err}"
        out["attacks"][kind] = {"error": error, "elapsed": time.monotonic() - start, "file": objs[0], "path": dst,
                                "ran": os.path.exists(marker)}
    out["matrix"] = _matrix_worker(rank, world_size, tmpdir)
    return out


@pytest.fixture(scope="module")
def resumed(killed, tmp_path_factory):
    dirs = {point: dirpath for point, (dirpath, _) in killed.items()}
    return run_on_ranks(_resume_worker, WORLD, args=(dirs, str(tmp_path_factory.mktemp("attacks"))), timeout_s=1500)


@pytest.mark.parametrize("point", list(KILL_CASES))
def test_resume_last_after_a_killed_save_equals_uninterrupted(resumed, point):
    for rank, res in enumerate(resumed):
        # last.ckpt of epoch 0 (step 2): the killed rewrite at the end of epoch 1 never replaced it
        assert res["resumed_step"][point] == 2, (point, res["resumed_step"][point])
        assert res["diff"][point] < TOL, f"rank {rank} {point}: {res['diff'][point]:.3e}"
        if point == "dcp/every_rank_in_the_write":  # the kill left its staging; the restart removed it
            assert [n.startswith("last.ckpt.saving-") for n in res["staged_before"][point]] == [True], res["staged_before"]
        assert not res["staged_after"][point], (rank, point)


@pytest.mark.parametrize("kind", ATTACKS)
def test_crafted_or_damaged_checkpoint_fails_on_every_rank(resumed, kind):
    for rank, res in enumerate(resumed):
        a = res["attacks"][kind]
        assert not a["ran"], f"rank {rank}: the payload in {kind} ran"
        assert a["error"] is not None, f"rank {rank} resumed from {kind}"
        assert "CheckpointError" in a["error"], (rank, a["error"])
        assert a["path"] in a["error"] or os.path.dirname(a["path"]) in a["error"], (rank, a["error"])
        assert a["file"] in a["error"], (rank, a["error"])
        if "payload" in kind:
            assert "refuses to unpickle" in a["error"], (rank, a["error"])
        else:
            assert "incomplete or corrupted" in a["error"], (rank, a["error"])
        assert a["elapsed"] < 30, (rank, kind, a["elapsed"])
