"""``lightning_sp.comm.volume`` forward and backward formulas against hand-computed element counts
(the measured side is ``tests/experiments/test_comm_volume.py`` and ``tests/distributed/test_attention.py``)."""

from __future__ import annotations

import pytest

from lightning_sp.comm.volume import (
    backward_elements,
    forward_elements,
    tensor_parallel_backward_elements,
    tensor_parallel_elements,
)

N, D = 64, 16
KW = dict(seq_len=N, head_dim=D)


def test_ulysses_backward_moves_what_the_forward_moves():
    # MHA, P=4: 4 all-to-alls of the local [N/P, H*D] input = 4 * 64 * 128 / 4
    assert forward_elements("ulysses", world=4, num_heads=8, num_kv_heads=8, **KW) == 4 * N * 8 * D / 4
    assert backward_elements("ulysses", world=4, num_heads=8, num_kv_heads=8, **KW) == 4 * N * 8 * D / 4
    # GQA H_kv=2 at P=4: K/V heads replicated to lcm(2, 4) = 4
    assert backward_elements("ulysses", world=4, num_heads=8, num_kv_heads=2, **KW) == (16 + 8) * D * N / 4


@pytest.mark.parametrize("backend", ["ring", "zigzag_ring", "colossal"])
def test_ring_backward_sends_blocks_and_a_full_circle_of_grads(backend):
    h_kv = 2 * D
    fwd = forward_elements(backend, world=4, num_heads=8, num_kv_heads=2, **KW)
    bwd = backward_elements(backend, world=4, num_heads=8, num_kv_heads=2, **KW)
    assert fwd == 3 * 2 * (N // 4) * h_kv  # 3 sends of a K and a V block [N/4, h_kv]
    assert bwd == fwd + 4 * 2 * (N // 4) * h_kv  # + 4 sends of the dK/dV partial sums
    assert bwd != fwd  # negative control


def test_allgather_kv_backward_regathers_and_reduce_scatters():
    fwd = forward_elements("allgather_kv", world=4, num_heads=8, num_kv_heads=8, **KW)
    assert fwd == 3 / 4 * 2 * N * 8 * D
    assert backward_elements("allgather_kv", world=4, num_heads=8, num_kv_heads=8, **KW) == 2 * fwd


def test_usp_is_ulysses_plus_a_ring_on_the_split_heads():
    # P=8, U=2, R=4: a2a over 8 ranks' shards + ring of 4 on H_kv/U heads
    a2a = (16 + 16) * D * N / 8
    ring_fwd = 3 / 4 * 2 * N * 8 * D / 2
    assert forward_elements("usp", world=8, num_heads=8, num_kv_heads=8, ulysses_degree=2, **KW) == a2a + ring_fwd
    assert backward_elements("usp", world=8, num_heads=8, num_kv_heads=8, ulysses_degree=2, **KW) == \
        a2a + ring_fwd + 2 * N * 8 * D / 2
    # U = P: no ring, exactly Ulysses
    assert backward_elements("usp", world=4, num_heads=8, num_kv_heads=8, ulysses_degree=4, **KW) == \
        backward_elements("ulysses", world=4, num_heads=8, num_kv_heads=8, **KW)
    with pytest.raises(ValueError, match="ulysses_degree dividing"):
        backward_elements("usp", world=8, num_heads=8, num_kv_heads=8, ulysses_degree=3, **KW)


def test_megatron_tp_sp_layer():
    assert tensor_parallel_elements(tokens=N, hidden=128, world=4) == 4 * 3 / 4 * N * 128
    assert tensor_parallel_backward_elements(tokens=N, hidden=128, world=4) == 6 * 3 / 4 * N * 128
    assert tensor_parallel_backward_elements(tokens=N, hidden=128, world=4, sequence_parallel=False) == 4 * 3 / 4 * N * 128
    assert tensor_parallel_backward_elements(tokens=N, hidden=128, world=1) == 0


def test_unknown_backend_raises():
    with pytest.raises(ValueError, match="no analytic volume"):
        backward_elements("nccl_magic", world=4, num_heads=8, num_kv_heads=8, **KW)


def test_kv_pieces_send_grads_straight_to_their_owner():
    # Note [K/V in pieces]: K/V bytes are the ring's; dK/dV contributions go to their owners directly,
    # (P-1)/P * 2 N h_kv instead of the circle's 2 N h_kv; colossal has no pieces
    kw = dict(world=4, num_heads=8, num_kv_heads=2, **KW)
    blocks = 3 / 4 * 2 * N * 2 * D
    for backend in ("ring", "zigzag_ring"):
        assert backward_elements(backend, kv_pieces=1, **kw) == blocks + 2 * N * 2 * D
        assert backward_elements(backend, kv_pieces=4, **kw) == 2 * blocks
        assert forward_elements(backend, **kw) == blocks
    assert backward_elements("colossal", kv_pieces=4, **kw) == backward_elements("colossal", **kw)
    usp_kw = dict(world=8, num_heads=8, num_kv_heads=8, ulysses_degree=2, **KW)
    ring_part = 3 / 4 * 2 * N * 8 * D / 2  # ring of 4 on H/2 heads
    assert backward_elements("usp", kv_pieces=2, **usp_kw) - backward_elements("usp", **usp_kw) == ring_part - 2 * N * 8 * D / 2
    with pytest.raises(ValueError, match="kv_pieces"):
        backward_elements("ring", kv_pieces=0, **kw)
