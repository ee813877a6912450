"""The dp x sp(ring x ulysses) x tp rank layout, TP innermost: pure math, including the 8-rank
tp x cp x dp layouts the 2-core test machine cannot spawn."""

from __future__ import annotations

import itertools

import pytest

from lightning_sp.topology import MeshAxis, ParallelDims


def test_tp_cp_dp_eight_ranks():
    dims = ParallelDims(world_size=8, sequence_parallel_size=2, tensor_parallel_size=2)
    assert (dims.dp, dims.sp, dims.tp, dims.dp_sp, dims.mesh_shape) == (2, 2, 2, 4, (2, 2, 1, 2))
    assert dims.groups(MeshAxis.TP) == [[0, 1], [2, 3], [4, 5], [6, 7]]  # innermost: neighbours
    assert dims.groups(MeshAxis.SP) == [[0, 2], [1, 3], [4, 6], [5, 7]]
    assert dims.groups(MeshAxis.DP) == [[0, 4], [1, 5], [2, 6], [3, 7]]
    assert dims.groups(MeshAxis.DP_SP) == [[0, 2, 4, 6], [1, 3, 5, 7]]
    assert dims.coordinates(7) == {MeshAxis.DP: 1, MeshAxis.SP: 1, MeshAxis.RING: 1, MeshAxis.ULYSSES: 0}
    assert dims.tp_rank(7) == 1


@pytest.mark.parametrize("ws,sp,u,tp", [(8, 2, 1, 2), (8, 4, 2, 2), (16, 4, 2, 2), (8, 1, 1, 8), (12, 3, 1, 2),
                                        (16, 2, 2, 4), (4, 2, 1, 2), (8, 2, 2, 1)])
def test_every_axis_partitions_the_world(ws, sp, u, tp):
    dims = ParallelDims(world_size=ws, sequence_parallel_size=sp, ulysses_degree=u, tensor_parallel_size=tp)
    for axis in MeshAxis:
        groups = dims.groups(axis)
        assert sorted(itertools.chain.from_iterable(groups)) == list(range(ws))
        assert all(len(g) == dims.degree(axis) for g in groups)
    for rank in range(ws):
        c = dims.coordinates(rank)
        # Note [Mesh axis order]: rank = ((dp * sp) + ring * u + ulysses) * tp + tp_idx
        assert rank == (c[MeshAxis.DP] * sp + c[MeshAxis.RING] * u + c[MeshAxis.ULYSSES]) * tp + dims.tp_rank(rank)
        sp_group = dims.group_of(MeshAxis.SP, rank)
        r = sp_group.index(rank)  # usp contract inside the sp group
        assert (r % u, r // u) == (c[MeshAxis.ULYSSES], c[MeshAxis.RING])
        # ranks of one sp / dp / dp_sp group share a tp index; a tp group shares everything else
        for axis in (MeshAxis.SP, MeshAxis.DP, MeshAxis.DP_SP, MeshAxis.RING, MeshAxis.ULYSSES):
            assert {dims.tp_rank(x) for x in dims.group_of(axis, rank)} == {dims.tp_rank(rank)}
        assert {dims.coordinates(x)[MeshAxis.SP] for x in dims.group_of(MeshAxis.TP, rank)} == {c[MeshAxis.SP]}


def test_tp_errors_say_what_works():
    with pytest.raises(ValueError, match=r"tensor_parallel_size=3 does not divide world_size=8.*in \[1, 2, 4, 8\]"):
        ParallelDims(world_size=8, sequence_parallel_size=1, tensor_parallel_size=3)
    with pytest.raises(ValueError, match=r"sequence_parallel_size=3 does not divide world_size / tensor_parallel_size = 4"
                                         r".*in \[1, 2, 4\]"):
        ParallelDims(world_size=8, sequence_parallel_size=3, tensor_parallel_size=2)
    with pytest.raises(ValueError, match="tensor_parallel_size must be a positive integer"):
        ParallelDims(world_size=8, sequence_parallel_size=1, tensor_parallel_size=0)
