"""The DeviceMesh of ``lightning_sp.mesh`` for 8-rank layouts (tp x cp x dp, usp x tp, ...) that the
2-core test machine cannot spawn: built on every rank of a *fake* 8-rank process group (no data
moves; group membership is real), in a subprocess. ``build_parallel_mesh`` itself checks every
axis against ``ParallelDims``; here the mesh's own answers are compared with hand-written groups."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = r'''
import json
import torch.distributed as dist
from torch.testing._internal.distributed.fake_pg import FakeStore
from lightning_sp.mesh import build_parallel_mesh
from lightning_sp.topology import MeshAxis, ParallelDims
out = {}
for rank in range(8):
    for sp, u, tp in [(2, 1, 2), (4, 2, 2), (1, 1, 8)]:
        dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=8)
        pm = build_parallel_mesh(ParallelDims(world_size=8, sequence_parallel_size=sp, ulysses_degree=u,
                                              tensor_parallel_size=tp), "cpu")
        mine = {a.value: dist.get_process_group_ranks(pm.group(a)) for a in MeshAxis}
        mine["names"] = list(pm.mesh.mesh_dim_names)
        out[f"{rank}/{sp}/{u}/{tp}"] = mine
        dist.destroy_process_group()
print(json.dumps(out))
'''


@pytest.fixture(scope="module")
def meshes():
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}
    proc = subprocess.run([sys.executable, "-c", SCRIPT], env=env, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-4000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


def test_tp_cp_dp(meshes):
    # dp 2 x cp 2 x tp 2: TP innermost (neighbours), cp next, dp outermost
    m = meshes["5/2/1/2"]
    assert m["names"] == ["dp", "ring", "ulysses", "tp"]
    assert (m["tp"], m["sp"], m["dp"], m["dp_sp"]) == ([4, 5], [5, 7], [1, 5], [1, 3, 5, 7])


def test_usp_inside_tp(meshes):
    # cp 4 = ring 2 x ulysses 2, tp 2: Ulysses inside the sp group, which skips the tp partner
    m = meshes["3/4/2/2"]
    assert (m["tp"], m["ulysses"], m["ring"], m["sp"]) == ([2, 3], [1, 3], [3, 7], [1, 3, 5, 7])


def test_tp_only(meshes):
    for rank in range(8):
        m = meshes[f"{rank}/1/1/8"]
        assert m["tp"] == list(range(8)) and m["sp"] == m["dp"] == m["dp_sp"] == [rank]
