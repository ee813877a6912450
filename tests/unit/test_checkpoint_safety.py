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
