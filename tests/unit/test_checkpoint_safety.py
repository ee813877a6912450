"""Sharded checkpoints never unpickle arbitrary objects, and refuse to write what they could not read."""

from __future__ import annotations

import pytest
import torch

from lightning_sp import checkpoint


class _Evil:
    def __reduce__(self):  # would run on an unrestricted torch.load
        return (print, ("unpickled!",))


def test_meta_is_loaded_weights_only(tmp_path):
    torch.save({"epoch": 1, "x": _Evil()}, tmp_path / checkpoint.META_FILE)
    with pytest.raises(Exception, match="Weights only load failed|Unsupported global"):
        checkpoint.load_meta(tmp_path)
    torch.save({"epoch": 1, "loops": {"a": [1, 2.0, "s", None, (3, 4)]}, "t": torch.ones(2)}, tmp_path / checkpoint.META_FILE)
    assert checkpoint.load_meta(tmp_path)["loops"]["a"][4] == (3, 4)  # control: plain data loads


def test_plain_copies_dict_subclasses():
    class Attr(dict):
        pass

    out = checkpoint._plain({"h": Attr(lr=1.0), "l": [Attr(a=1)]})
    assert type(out["h"]) is dict and type(out["l"][0]) is dict


def test_chunks_of_a_split_fused_weight():
    # qkv rows of tp rank 1 of 2 (segments 4, 2, 2): local rows [q 2:4 | k 1:2 | v 1:2], no FSDP
    split = checkpoint._Split(torch.Size((8, 3)), 0, ((0, 2, 2), (2, 1, 5), (3, 1, 7)))
    local = torch.arange(12.0).view(4, 3)
    ct = checkpoint._chunked(local, split)
    assert [off for off, _ in ct.chunks] == [(2, 0), (5, 0), (7, 0)]
    assert [t.shape[0] for _, t in ct.chunks] == [2, 1, 1]
    assert ct.chunks[1][1].data_ptr() == local[2].data_ptr()  # views: loading writes into the parameter


# --------------------------------------------------------------------------- crash consistency (one process)
# torch.distributed.checkpoint saves in one process without a process group; a ``_Killed`` raised at a
# point of the save leaves the files exactly as a SIGKILL there would (nothing catches a BaseException).
import json  # noqa: E402
import os  # noqa: E402
import pickle  # noqa: E402

import torch.distributed.checkpoint as dcp  # noqa: E402

pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled")


class _Killed(BaseException):
    pass


def _model(seed: int) -> torch.nn.Module:
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.Linear(4, 2)).double()


def _save(path, seed: int) -> dict:
    m = _model(seed)
    checkpoint.save(path, checkpoint.model_state(m), {"seed": seed})
    return {k: v.detach().clone() for k, v in m.state_dict().items()}


def _load(path) -> tuple[dict, dict]:
    m = _model(99)
    checkpoint.load(path, checkpoint.model_state(m))
    return {k: v.detach().clone() for k, v in m.state_dict().items()}, checkpoint.load_meta(path)


def _equal(a: dict, b: dict) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def _kill_at(monkeypatch, point: str) -> None:
    def die(*args, **kwargs):
        raise _Killed(point)

    if point == "before_shards":
        monkeypatch.setattr(dcp.FileSystemWriter, "write_data", die)
    elif point == "before_metadata":  # the shards are written; the coordinator dies before .metadata
        monkeypatch.setattr(dcp.FileSystemWriter, "finish", die)
    elif point == "before_meta":  # shards and .metadata written, meta.pt not
        monkeypatch.setattr(checkpoint, "_write_durably", die)
    elif point == "before_commit_record":  # meta.pt written, commit.json not
        monkeypatch.setattr(checkpoint, "_commit_record", die)
    elif point == "before_rename":  # complete in the staging directory, not in place
        monkeypatch.setattr(checkpoint, "_move_into_place", die)
    elif point == "between_renames":  # no atomic exchange here: the old one moved aside, the new one not in place
        monkeypatch.setattr(checkpoint, "_exchange", lambda a, b: False)
        real_rename = os.rename

        def rename_once(a, b):
            if ".saving-" in str(a) and str(b).endswith("last.ckpt"):  # the second rename of the swap
                raise _Killed(point)
            real_rename(a, b)

        monkeypatch.setattr(checkpoint.os, "rename", rename_once)
    else:
        raise AssertionError(point)


KILL_POINTS = ["before_shards", "before_metadata", "before_meta", "before_commit_record", "before_rename"]


@pytest.mark.parametrize("point", KILL_POINTS)
def test_killed_save_leaves_previous_checkpoint(tmp_path, monkeypatch, point):
    path = tmp_path / "last.ckpt"
    first = _save(path, 1)
    with monkeypatch.context() as patch:
        _kill_at(patch, point)
        with pytest.raises(BaseException, match=point):  # DCP wraps what its steps raise
            _save(path, 2)
    staged = list((tmp_path / checkpoint.STAGING_DIR).iterdir())
    assert [p.name.startswith("last.ckpt.saving-") for p in staged] == [True]  # the kill left a staging dir
    got, meta = _load(path)
    assert _equal(got, first) and meta == {"seed": 1}  # exactly the previous checkpoint
    third = _save(path, 3)  # the next save completes and removes the killed one's staging directory
    got, meta = _load(path)
    assert _equal(got, third) and not _equal(got, first) and meta == {"seed": 3}  # control: the load is not stuck on 1
    assert [p.name for p in tmp_path.iterdir()] == ["last.ckpt"]


def test_killed_between_renames_fails_naming_the_complete_copy(tmp_path, monkeypatch):
    path = tmp_path / "last.ckpt"
    _save(path, 1)
    with monkeypatch.context() as patch:
        _kill_at(patch, "between_renames")
        with pytest.raises(_Killed):
            _save(path, 2)
    with pytest.raises(checkpoint.CheckpointError, match=r"does not exist; a complete copy .* rename .*saving-"):
        _load(path)


def test_first_save_and_overwrite_without_exchange(tmp_path, monkeypatch):
    monkeypatch.setattr(checkpoint, "_exchange", lambda a, b: False)  # e.g. NFS: two renames
    path = tmp_path / "c"
    _save(path, 1)
    second = _save(path, 2)
    assert _equal(_load(path)[0], second) and sorted(p.name for p in tmp_path.iterdir()) == ["c"]


# --------------------------------------------------------------------------- damaged checkpoints
def _rewrite_commit(path, **files):
    record = json.loads((path / checkpoint.COMMIT_FILE).read_text())
    record["files"].update({k: (path / k).stat().st_size for k in files})
    (path / checkpoint.COMMIT_FILE).write_text(json.dumps(record))


def _shard(path) -> str:
    return next(p.name for p in path.iterdir() if p.suffix == ".distcp")


@pytest.mark.parametrize("damage", ["truncated_shard", "truncated_metadata", "no_meta", "no_commit", "garbled_metadata",
                                    "garbled_shard_same_size", "meta_from_other_save", "metadata_from_other_save"])
def test_damaged_sharded_checkpoint_names_the_file(tmp_path, damage):
    path = tmp_path / "last.ckpt"
    _save(path, 1)
    other = tmp_path / "other"
    saved_other = _save(other, 2)
    shard = _shard(path)
    if damage == "truncated_shard":
        data = (path / shard).read_bytes()
        (path / shard).write_bytes(data[: len(data) // 2])
        expect = shard
    elif damage == "truncated_metadata":
        data = (path / ".metadata").read_bytes()
        (path / ".metadata").write_bytes(data[:-10])
        expect = ".metadata"
    elif damage == "no_meta":
        (path / "meta.pt").unlink()
        expect = "meta.pt"
    elif damage == "no_commit":
        (path / "commit.json").unlink()
        expect = "commit.json"
    elif damage == "garbled_metadata":  # same size, so only parsing can tell
        data = bytearray((path / ".metadata").read_bytes())
        data[len(data) // 2: len(data) // 2 + 8] = b"\xff" * 8
        (path / ".metadata").write_bytes(bytes(data))
        expect = ".metadata"
    elif damage == "garbled_shard_same_size":
        data = (path / shard).read_bytes()
        (path / shard).write_bytes(b"\0" * len(data))
        expect = "distcp"
    elif damage == "meta_from_other_save":  # the mix: a meta.pt of one save beside shards of another
        (path / "meta.pt").write_bytes((other / "meta.pt").read_bytes())
        _rewrite_commit(path, **{"meta.pt": 1})
        expect = "meta.pt"
    else:
        (path / ".metadata").write_bytes((other / ".metadata").read_bytes())
        _rewrite_commit(path, **{".metadata": 1})
        expect = ".metadata"
    with pytest.raises(checkpoint.CheckpointError, match="incomplete or corrupted") as info:
        _load(path)
    assert str(path) in str(info.value) and expect in str(info.value), str(info.value)
    assert _equal(_load(other)[0], saved_other)  # control: an undamaged checkpoint loads


def test_damaged_single_file_names_the_file(tmp_path):
    file = tmp_path / "last.ckpt"
    torch.save({"state_dict": {"w": torch.ones(100)}}, file)
    data = file.read_bytes()
    file.write_bytes(data[: len(data) // 2])
    with pytest.raises(checkpoint.CheckpointError, match=r"last.ckpt: .*incomplete or corrupted|incomplete or corrupted: last.ckpt"):
        checkpoint.load_single_file(file, lambda: torch.load(file, weights_only=True))
    torch.save({"state_dict": {"w": torch.ones(100)}}, file)  # control
    assert checkpoint.load_single_file(file, lambda: torch.load(file, weights_only=True))["state_dict"]["w"].sum() == 100


# --------------------------------------------------------------------------- no code from any file
class _Payload:
    """Unpickling this creates the marker directory: proof that code ran."""

    def __init__(self, marker):
        self.marker = str(marker)

    def __reduce__(self):
        return (os.mkdir, (self.marker,))


def _plant(path, file: str, marker) -> None:
    """Replace ``file`` of the sharded checkpoint ``path`` by a crafted one that still passes the commit record."""
    if file == ".metadata":  # DCP's own metadata, with a payload among its plain fields
        md = checkpoint._read_dcp_metadata(path)
        md.planner_data = {"x": _Payload(marker)}
        (path / ".metadata").write_bytes(pickle.dumps(md))
    elif file == "meta.pt":
        meta = torch.load(path / "meta.pt", weights_only=True)
        meta["x"] = _Payload(marker)
        torch.save(meta, path / "meta.pt")
    else:  # a shard: its tensor item replaced by a pickle that runs the payload (DCP must read it weights_only)
        md = checkpoint._read_dcp_metadata(path)
        blob = io.BytesIO()
        torch.save(_Payload(marker), blob)
        shard = _shard(path)
        (path / shard).write_bytes(blob.getvalue())
        for info in md.storage_data.values():
            info.relative_path, info.offset, info.length = shard, 0, len(blob.getvalue())
        (path / ".metadata").write_bytes(pickle.dumps(md))
        _rewrite_commit(path, **{shard: 1})
    _rewrite_commit(path, **{file if file != "shard" else ".metadata": 1})


import io  # noqa: E402


@pytest.mark.parametrize("file", [".metadata", "meta.pt", "shard"])
def test_planted_payload_never_runs(tmp_path, file):
    path = tmp_path / "c"
    _save(path, 1)
    marker = tmp_path / "pwned"
    _plant(path, file, marker)
    loaders = {
        "load": lambda: _load(path),
        "load_lightning_checkpoint": lambda: checkpoint.load_lightning_checkpoint(path, _model(5), []),
        "verify": lambda: checkpoint.verify(path),
        "load_meta": lambda: checkpoint.load_meta(path),
    }
    raised = {}
    for name, fn in loaders.items():
        try:
            fn()
            raised[name] = None
        except Exception as err:  # noqa: BLE001 - recorded and checked below
            raised[name] = err
        assert not marker.exists(), f"{name} ran the payload planted in {file}"
    readers = {".metadata": ("load", "load_lightning_checkpoint", "verify"), "shard": ("load", "load_lightning_checkpoint"),
               "meta.pt": tuple(loaders)}[file]
    for name, err in raised.items():
        if name in readers:
            assert isinstance(err, checkpoint.CheckpointError), (name, err)
            assert str(path) in str(err), (name, err)
    # negative control: an unrestricted unpickler does run it
    if file == ".metadata":
        with open(path / ".metadata", "rb") as f:
            pickle.load(f)
        assert marker.exists()


def test_single_file_payload_never_runs(tmp_path):
    file, marker = tmp_path / "x.ckpt", tmp_path / "pwned"
    torch.save({"state_dict": {}, "optimizer_states": [{"state": {0: {"m": _Payload(marker)}}}]}, file)
    with pytest.raises(checkpoint.CheckpointError, match="refuses to unpickle"):
        checkpoint.load_single_file(file, lambda: torch.load(file, weights_only=True))
    assert not marker.exists()


# --------------------------------------------------------------------------- single files into any layout
def _trained(seed: int):
    model = _model(seed)
    decay = [p for p in model.parameters() if p.dim() >= 2]
    rest = [p for p in model.parameters() if p.dim() < 2]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": 0.1}, {"params": rest, "weight_decay": 0.0}], lr=0.1)
    for _ in range(2):
        model(torch.randn(5, 3, dtype=torch.float64)).square().sum().backward()
        opt.step()
    opt.param_groups[0]["lr"] = 0.05  # a scheduler moved it: restored from the file
    return model, opt


@pytest.mark.parametrize("keyed", ["numbered", "by_name"])
def test_full_optimizer_state_loads_from_either_format(keyed):
    model, opt = _trained(1)
    saved = opt.state_dict()
    if keyed == "by_name":  # what get_optimizer_state_dict(full_state_dict=True) writes under FSDP
        names = [n for n, _ in model.named_parameters()]
        order = [n for g in checkpoint._param_names(model, opt) for n in g]
        number_to_name = dict(zip(range(len(order)), order))
        saved = {"state": {number_to_name[k]: v for k, v in saved["state"].items()},
                 "param_groups": [g | {"params": [number_to_name[i] for i in g["params"]]} for g in saved["param_groups"]]}
        assert set(saved["state"]) <= set(names)
    assert checkpoint.is_name_keyed([saved]) == (keyed == "by_name")
    fresh, fresh_opt = _model(2), None
    decay = [p for p in fresh.parameters() if p.dim() >= 2]
    rest = [p for p in fresh.parameters() if p.dim() < 2]
    fresh_opt = torch.optim.AdamW([{"params": decay, "weight_decay": 0.1}, {"params": rest, "weight_decay": 0.0}], lr=0.1)
    checkpoint.load_full_model_state(fresh, model.state_dict())
    checkpoint.load_full_optimizer_states(fresh, [fresh_opt], [saved])
    got, want = fresh_opt.state_dict(), opt.state_dict()
    assert got["param_groups"] == want["param_groups"]  # lr 0.05 included
    for i, state in want["state"].items():
        for k, v in state.items():
            assert torch.equal(got["state"][i][k], v), (i, k)
    assert _equal(fresh.state_dict(), model.state_dict())
    # negative control: another optimizer layout is refused by name, not loaded into the wrong parameters
    other = torch.optim.AdamW(fresh.parameters(), lr=0.1)
    with pytest.raises(ValueError, match="parameter groups of sizes"):
        checkpoint.load_full_optimizer_states(fresh, [other], [saved])
    with pytest.raises(ValueError, match="missing .*unexpected"):
        checkpoint.load_full_model_state(fresh, {"0.weight": torch.zeros(4, 3)})


# --------------------------------------------------------------------------- staging names, cleanup, failed saves
def _lightning_max_hpc(directory) -> int | None:
    """The number Lightning's ``ckpt_path="hpc"`` (a SLURM requeue) resumes from in ``directory``."""
    from lightning.pytorch.trainer.connectors.checkpoint_connector import _CheckpointConnector

    return _CheckpointConnector._CheckpointConnector__max_ckpt_version_in_folder(directory, "hpc_ckpt_")


def _killed_hpc_save(tmp_path, monkeypatch) -> None:
    """A complete hpc_ckpt_1.ckpt, and hpc_ckpt_2.ckpt's save killed once its shards are written."""
    _save(tmp_path / "hpc_ckpt_1.ckpt", 1)
    with monkeypatch.context() as patch:
        _kill_at(patch, "before_meta")
        with pytest.raises(_Killed):
            _save(tmp_path / "hpc_ckpt_2.ckpt", 2)


def test_killed_save_is_never_taken_for_a_checkpoint(tmp_path, monkeypatch):
    _killed_hpc_save(tmp_path, monkeypatch)
    assert _lightning_max_hpc(tmp_path) == 1  # the requeued job resumes from the complete checkpoint
    assert not [p for p in os.listdir(tmp_path) if "last" in p]  # ckpt_path="last" matches "last" in a name
    got, meta = _load(tmp_path / "hpc_ckpt_1.ckpt")
    assert meta == {"seed": 1}


def test_negative_control_staging_beside_the_checkpoint_is_parsed_by_lightning(tmp_path, monkeypatch):
    # the layout before: ``.<name>.saving-<hex>`` beside the checkpoint; Lightning reads its digits
    monkeypatch.setattr(checkpoint, "_staging_path", lambda path, save_id, kind="saving": path.parent / f".{path.name}.{kind}-{save_id}")
    _killed_hpc_save(tmp_path, monkeypatch)
    assert _lightning_max_hpc(tmp_path) not in (None, 1)  # e.g. hpc_ckpt_2203160492.ckpt: every restart fails


def test_stale_staging_is_cleaned_but_never_a_complete_orphan(tmp_path, monkeypatch):
    _killed_hpc_save(tmp_path, monkeypatch)
    legacy = tmp_path / ".hpc_ckpt_3.ckpt.saving-0a1b2c3d4e5f6071"  # left by an older version
    legacy.mkdir()
    writing = tmp_path / checkpoint.STAGING_DIR / "epoch=2-step=6.ckpt.writing-0a1b2c3d4e5f6071"
    writing.write_bytes(b"partial")
    removed = checkpoint.clean_stale_staging(tmp_path)
    assert len(removed) == 3 and sorted(os.listdir(tmp_path)) == ["hpc_ckpt_1.ckpt"]
    assert _load(tmp_path / "hpc_ckpt_1.ckpt")[1] == {"seed": 1}  # the complete checkpoint is untouched
    # a complete copy whose checkpoint a kill between two renames left missing: kept (loading names it)
    path = tmp_path / "last.ckpt"
    _save(path, 1)
    with monkeypatch.context() as patch:
        _kill_at(patch, "between_renames")
        with pytest.raises(_Killed):
            _save(path, 2)
    checkpoint.clean_stale_staging(tmp_path)
    with pytest.raises(checkpoint.CheckpointError, match=r"rename .*saving-"):
        _load(path)


def _full_disk_writer(monkeypatch):
    """Writes half of each DCP shard, then fails as a full disk does."""
    import errno

    def write_half_then_fail(self, plan, planner):
        os.makedirs(self.path, exist_ok=True)
        with open(os.path.join(self.path, "__0_0.distcp"), "wb") as f:
            f.write(b"x" * 100)
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(dcp.FileSystemWriter, "write_data", write_half_then_fail)


def test_failed_sharded_save_names_path_and_cause_and_leaves_nothing(tmp_path, monkeypatch):
    path = tmp_path / "last.ckpt"
    _save(path, 1)
    with monkeypatch.context() as patch:
        _full_disk_writer(patch)
        with pytest.raises(checkpoint.CheckpointSaveError, match=rf"{path}.*No space left on device"):
            _save(path, 2)
    assert sorted(os.listdir(tmp_path)) == ["last.ckpt"]  # no staging left, nothing under a final name
    assert _load(path)[1] == {"seed": 1}


def test_failed_single_file_save_names_path_and_cause_and_leaves_nothing(tmp_path):
    import errno

    path = tmp_path / "epoch=2-step=6.ckpt"

    def write_half(target):
        with open(target, "wb") as f:
            f.write(b"half a checkpoint")
        raise OSError(errno.ENOSPC, "No space left on device", target)

    with pytest.raises(checkpoint.CheckpointSaveError, match=rf"{path}.*No space left on device.*Nothing was written"):
        checkpoint.save_single_file(path, write_half)
    assert os.listdir(tmp_path) == []  # no partial file under the final name, no staging
    checkpoint.save_single_file(path, lambda target: torch.save({"ok": 1}, target))  # control: a good write lands
    assert os.listdir(tmp_path) == [path.name] and torch.load(path, weights_only=True) == {"ok": 1}


def test_probe_refuses_an_unwritable_directory(tmp_path, monkeypatch):
    import errno

    target = tmp_path / "ckpts"
    real_write = checkpoint._write_durably

    def read_only(path, data):
        if str(path).startswith(str(target)):
            raise OSError(errno.EROFS, "Read-only file system", str(path))
        real_write(path, data)

    monkeypatch.setattr(checkpoint, "_write_durably", read_only)
    with pytest.raises(checkpoint.CheckpointSaveError, match=rf"{target} is not writable on rank\(s\) \[0\].*Read-only"):
        checkpoint.probe_directories([target])
    checkpoint.probe_directories([tmp_path / "fine"])  # control: a writable directory passes, no probe file left
    assert os.listdir(tmp_path / "fine") == []
