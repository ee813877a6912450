"""Rank layout of the (dp, sp = ring x ulysses) mesh: pure math, no process group."""

from __future__ import annotations

import itertools

import pytest

from lightning_sp.topology import MeshAxis, ParallelDims


def test_degrees_and_docstring_example():
    dims = ParallelDims(world_size=8, sequence_parallel_size=4, ulysses_degree=2)
    assert (dims.dp, dims.sp, dims.ring, dims.ulysses) == (2, 4, 2, 2)
    assert dims.groups(MeshAxis.SP) == [[0, 1, 2, 3], [4, 5, 6, 7]]
    assert dims.groups("dp") == [[0, 4], [1, 5], [2, 6], [3, 7]]
    assert dims.groups(MeshAxis.ULYSSES) == [[0, 1], [2, 3], [4, 5], [6, 7]]
    assert dims.groups(MeshAxis.RING) == [[0, 2], [1, 3], [4, 6], [5, 7]]
    assert dims.group_of("ring", 5) == [5, 7]
    assert dims.coordinates(6) == {MeshAxis.DP: 1, MeshAxis.SP: 2, MeshAxis.RING: 1, MeshAxis.ULYSSES: 0}


@pytest.mark.parametrize("ws,sp,u", [(1, 1, 1), (4, 4, 1), (4, 4, 4), (4, 4, 2), (4, 2, 2), (12, 6, 3), (16, 8, 2), (6, 1, 1)])
def test_partitions_and_formula(ws, sp, u):
    dims = ParallelDims(world_size=ws, sequence_parallel_size=sp, ulysses_degree=u)
    for axis in MeshAxis:
        groups = dims.groups(axis)
        # every axis partitions the world into groups of the axis degree
        assert sorted(itertools.chain.from_iterable(groups)) == list(range(ws))
        assert all(len(g) == dims.degree(axis) for g in groups)
        assert len(groups) == ws // dims.degree(axis)
    for rank in range(ws):
        c = dims.coordinates(rank)
        assert rank == c[MeshAxis.DP] * sp + c[MeshAxis.RING] * u + c[MeshAxis.ULYSSES]
        assert c[MeshAxis.SP] == c[MeshAxis.RING] * u + c[MeshAxis.ULYSSES]
        sp_group = dims.group_of(MeshAxis.SP, rank)
        # usp contract: group rank r has ulysses index r % u and ring index r // u
        r = sp_group.index(rank)
        assert (r % u, r // u) == (c[MeshAxis.ULYSSES], c[MeshAxis.RING])
        # ulysses and ring groups sit inside the sp group; dp group holds one rank per sp group
        assert set(dims.group_of("ulysses", rank)) <= set(sp_group)
        assert set(dims.group_of("ring", rank)) <= set(sp_group)
        assert [dims.sp_rank(q) for q in dims.group_of("dp", rank)] == [c[MeshAxis.SP]] * dims.dp
        assert dims.dp_rank(rank) == c[MeshAxis.DP]
        # ulysses is innermost: contiguous global ranks
        ug = dims.group_of("ulysses", rank)
        assert ug == list(range(ug[0], ug[0] + u))


def test_negative_control_ring_is_not_ulysses():
    dims = ParallelDims(world_size=4, sequence_parallel_size=4, ulysses_degree=2)
    assert dims.groups("ring") != dims.groups("ulysses")


@pytest.mark.parametrize(
    "kwargs,match",
    [
        (dict(world_size=6, sequence_parallel_size=4), r"sequence_parallel_size=4 does not divide world_size=6.*ulysses_degree=1.*in \[1, 2, 3, 6\]"),
        (dict(world_size=8, sequence_parallel_size=4, ulysses_degree=3), r"ulysses_degree=3 does not divide sequence_parallel_size=4.*world_size=8.*in \[1, 2, 4\]"),
        (dict(world_size=4, sequence_parallel_size=0), r"sequence_parallel_size must be a positive integer, got 0"),
        (dict(world_size=4, sequence_parallel_size=2, ulysses_degree=2.0), r"ulysses_degree must be a positive integer"),
        (dict(world_size=-1, sequence_parallel_size=1), r"world_size must be a positive integer, got -1"),
    ],
)
def test_errors_name_every_degree_and_fix(kwargs, match):
    with pytest.raises(ValueError, match=match):
        ParallelDims(**kwargs)


def test_rank_out_of_range():
    with pytest.raises(ValueError, match=r"rank 4 is outside \[0, 4\)"):
        ParallelDims(world_size=4, sequence_parallel_size=2).coordinates(4)


def test_kw_only():
    with pytest.raises(TypeError):
        ParallelDims(4, 2)  # type: ignore[misc]
