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
