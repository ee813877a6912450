"""Layouts: every token on exactly one rank, round trips, zigzag balance, padding."""

import random

import pytest
import torch

from lightning_sp.layout import SequenceLayout, padded_length, runs_of, token_indices

LAYOUTS = [SequenceLayout("contiguous"), SequenceLayout("zigzag"), SequenceLayout("zigzag", 2), SequenceLayout("zigzag", 4)]


@pytest.mark.parametrize(
    "layout,world", [(lay, w) for lay in LAYOUTS for w in (1, 2, 4, 8) if w % lay.ulysses_degree == 0], ids=str
)
def test_every_token_on_exactly_one_rank(layout, world):
    rng = random.Random(world)
    for seq_len in [1, 7, 37, 64, rng.randrange(1, 500)]:
        n_pad = padded_length(seq_len, world, layout)
        assert n_pad >= seq_len and n_pad - seq_len < 2 * world
        parts = [token_indices(layout, world, n_pad, r) for r in range(world)]
        assert all(p.numel() == n_pad // world for p in parts)
        assert torch.equal(torch.sort(torch.cat(parts)).values, torch.arange(n_pad))


def test_zigzag_assigns_mirrored_chunks():
    # 4 ranks, 8 chunks of 2: rank r holds chunks r and 7 - r
    assert token_indices("zigzag", 4, 16, 0).tolist() == [0, 1, 14, 15]
    assert token_indices("zigzag", 4, 16, 3).tolist() == [6, 7, 8, 9]


def test_usp_layout_splits_each_ring_rank_contiguously():
    # P=4, U=2 -> R=2 ring ranks, 4 chunks of 4: ring rank 0 holds chunks 0,3 = [0..3, 12..15]
    lay = SequenceLayout("zigzag", ulysses_degree=2)
    assert token_indices(lay, 4, 16, 0).tolist() == [0, 1, 2, 3]
    assert token_indices(lay, 4, 16, 1).tolist() == [12, 13, 14, 15]
    assert token_indices(lay, 4, 16, 2).tolist() == [4, 5, 6, 7]


def test_zigzag_balances_causal_work():
    world, n = 4, 64
    work = []
    for r in range(world):
        pos = token_indices("zigzag", world, n, r)
        work.append(int((pos + 1).sum()))  # keys visible to each query under a causal mask
    assert max(work) == min(work)
    contiguous = [int((token_indices("contiguous", world, n, r) + 1).sum()) for r in range(world)]
    assert max(contiguous) / min(contiguous) > 5  # the imbalance zigzag removes


def test_runs_of_splits_at_gaps():
    assert [tuple(r) for r in runs_of([4, 5, 6, 0, 1, 9])] == [(0, 4, 3), (3, 0, 2), (5, 9, 1)]


def test_bad_layouts_raise():
    with pytest.raises(ValueError, match="contiguous' or 'zigzag"):
        SequenceLayout("striped")
    with pytest.raises(ValueError, match="multiple of its ulysses_degree"):
        padded_length(10, 6, SequenceLayout("zigzag", 4))
    with pytest.raises(ValueError, match="does not split evenly"):
        token_indices("zigzag", 4, 12, 0)


def test_shard_and_gather_without_group_are_identity_with_padding():
    from lightning_sp import gather_sequence, shard_sequence

    x = torch.randn(2, 7, 3)
    assert torch.equal(shard_sequence(x, None), x)
    assert torch.equal(gather_sequence(x, None, seq_len=7), x)
