"""Differentiable collectives against single-process references, the SP loss, and bad input that
must fail with a message (never a hang) on real gloo ranks."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from lightning_sp import SequenceParallelAttention, gather_sequence, sequence_parallel_cross_entropy, shard_sequence
from lightning_sp.comm.collectives import (
    all_gather_along,
    head_groups_to_seq,
    head_to_seq,
    seq_to_head,
    seq_to_head_all_to_all,
    seq_to_head_groups,
)
from tests.distributed.harness import run_on_ranks

pytestmark = pytest.mark.distributed
WORLD = 4


def _global(seed, *shape):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed), dtype=torch.float64)


def _expect_error(fn, exc_type, match):
    try:
        fn()
    except exc_type as e:
        import re

        return bool(re.search(match, str(e))), str(e)
    return False, "no error raised"


def _head_groups(rank, world, group) -> dict[str, bool]:
    """Note [Heads in groups]: ``seq_to_head_groups`` hands this rank's ``H/P`` heads out in groups of consecutive
    heads, each in memory of its own, with and without a token order, head-major or not (B = 2); backward and
    ``head_groups_to_seq`` invert it. Control: the groups' memory is distinct, which slices of one tensor's
    would not be."""
    from lightning_sp.layout import SequenceLayout
    from lightning_sp.ops.backends import _token_order

    x, w = _global(10, 2, 8, 16, 3), _global(11, 2, 8, 16, 3)  # [B, N, H, D]: 4 heads per rank, 2 groups of 2
    heads = [slice(rank * 4 + 2 * c, rank * 4 + 2 * c + 2) for c in range(2)]
    zigzag = _token_order(SequenceLayout("zigzag"), world, 8, tuple(range(world)), torch.device("cpu"))
    ok = {}
    for layout, order in (("contiguous", None), ("zigzag", zigzag)):
        for head_major in (False, True):
            name = f"{layout}{'_head_major' if head_major else ''}"
            xl = shard_sequence(x, group, layout=layout).requires_grad_()
            parts = seq_to_head_groups(xl, group, order=order, head_major=head_major, groups=2)
            ok[f"groups_fwd_{name}"] = all(torch.equal(p, x[:, :, h]) for p, h in zip(parts, heads))
            ok[f"groups_own_memory_{name}"] = parts[0].untyped_storage().data_ptr() != parts[1].untyped_storage().data_ptr()
            ok[f"groups_layout_{name}"] = all(p.transpose(1, 2).is_contiguous() == head_major for p in parts)
            sum((p * w[:, :, h]).sum() for p, h in zip(parts, heads)).backward()
            ok[f"groups_bwd_{name}"] = torch.equal(xl.grad, shard_sequence(w, group, layout=layout))
            leaves = [p.detach().requires_grad_() for p in parts]
            back = head_groups_to_seq(leaves, group, order=order)  # [B, N/P, H, D]
            ok[f"groups_roundtrip_{name}"] = torch.equal(back, xl.detach())
            (back * shard_sequence(w, group, layout=layout)).sum().backward()
            ok[f"groups_roundtrip_bwd_{name}"] = all(torch.equal(p.grad, w[:, :, h]) for p, h in zip(leaves, heads))
    return ok


def _worker(rank, world):
    group = dist.group.WORLD
    res = {}
    # all-to-all seq -> heads: forward is a transpose of the global tensor, backward its inverse
    x = _global(0, 2, 8, 8, 3)  # [B, N, H, D]
    w = _global(1, 2, 8, 8, 3)  # a weight so every element's gradient is distinct
    xl = shard_sequence(x, group).requires_grad_()
    y = seq_to_head(xl, group, head_major=True)  # [B, N, H/P, D]
    res["a2a_fwd"] = torch.equal(y, x[:, :, rank * 2 : rank * 2 + 2])
    (y * w[:, :, rank * 2 : rank * 2 + 2]).sum().backward()
    res["a2a_bwd"] = torch.equal(xl.grad, shard_sequence(w, group))
    back = head_to_seq(y.detach(), group)
    res["a2a_roundtrip"] = torch.equal(back, xl.detach())
    # Note [Head-major gather]: the [B, N, H/P, D] result's memory is [B, H/P, N, D] (B = H/P = 2 here, so the
    # two layouts differ); control: the default (head_major=False) gives the same values in [B, N, H/P, D] memory
    seq_major = seq_to_head_all_to_all(xl.detach(), group)
    res["a2a_head_major"] = y.transpose(1, 2).is_contiguous() and not y.is_contiguous()
    res["a2a_head_major_control"] = torch.equal(seq_major, y) and not seq_major.transpose(1, 2).is_contiguous()
    # with a TokenOrder (Note [Sorting while gathering]): zigzag shards come out in global order, and back
    from lightning_sp.layout import SequenceLayout
    from lightning_sp.ops.backends import _token_order

    order = _token_order(SequenceLayout("zigzag"), world, 8, tuple(range(world)), torch.device("cpu"))
    zl = shard_sequence(x, group, layout="zigzag").requires_grad_()
    yz = seq_to_head(zl, group, order=order, head_major=True)  # [B, N, H/P, D], global order
    res["a2a_sorted_fwd"] = torch.equal(yz, x[:, :, rank * 2 : rank * 2 + 2])
    sorted_seq_major = seq_to_head_all_to_all(zl.detach(), group, order=order)
    res["a2a_sorted_head_major"] = yz.transpose(1, 2).is_contiguous() and torch.equal(sorted_seq_major, yz)
    res["a2a_sorted_head_major_control"] = not sorted_seq_major.transpose(1, 2).is_contiguous()
    res["a2a_sorted_control"] = not torch.equal(seq_to_head(zl.detach(), group), x[:, :, rank * 2 : rank * 2 + 2])
    (yz * w[:, :, rank * 2 : rank * 2 + 2]).sum().backward()
    res["a2a_sorted_bwd"] = torch.equal(zl.grad, shard_sequence(w, group, layout="zigzag"))
    yh = yz.detach().requires_grad_()
    back = head_to_seq(yh, group, order=order, head_major=True)  # [B, N/P, H, D] zigzag shard again
    res["a2a_sorted_roundtrip"] = torch.equal(back, zl.detach())
    (back * shard_sequence(w, group, layout="zigzag")).sum().backward()
    res["a2a_sorted_roundtrip_bwd"] = torch.equal(yh.grad, w[:, :, rank * 2 : rank * 2 + 2])
    res["a2a_sorted_roundtrip_bwd_head_major"] = yh.grad.transpose(1, 2).is_contiguous()  # the kernels' dout
    res.update(_head_groups(rank, world, group))
    # all-gather: each rank's loss differs; the gradient of a shard is the SUM over ranks
    zl = shard_sequence(x, group, layout="zigzag").requires_grad_()
    full = gather_sequence(zl, group, layout="zigzag", seq_len=7)
    res["gather_inverse"] = torch.equal(full, x[:, :7])
    ((rank + 1) * full * w[:, :7]).sum().backward()
    coeff = sum(r + 1 for r in range(world))
    expected = shard_sequence(coeff * w[:, :7], group, layout="zigzag")
    res["gather_bwd"] = torch.allclose(zl.grad, expected, atol=1e-12)
    # SP cross-entropy equals the unsharded mean; gradient of the global mean * P (all-reduce backward)
    logits = _global(2, 1, 11, 5).requires_grad_()
    labels = torch.randint(0, 5, (1, 11), generator=torch.Generator().manual_seed(3))
    labels[0, 4] = -100
    ref = torch.nn.functional.cross_entropy(logits[0], labels[0], ignore_index=-100)
    ref_grad = torch.autograd.grad(ref, logits)[0]
    ll = shard_sequence(logits.detach(), group).requires_grad_()
    lab = shard_sequence(labels, group, pad_value=-100)
    loss = sequence_parallel_cross_entropy(ll, lab, group=group)
    loss.backward()
    res["loss_value"] = float((loss - ref).abs())
    res["loss_grad"] = float((ll.grad - world * shard_sequence(ref_grad, group)).abs().max())
    # bad input: fails with a message on every rank, never hangs
    q = torch.randn(1, 4 + (rank == 1), 4, 8)  # rank 1 has a different local length
    attn = SequenceParallelAttention(backend="ring", group=group)
    res["mismatch"] = _expect_error(lambda: attn(q, q, q), ValueError, r"different inputs.*\n  S_local: 4 on ranks \[0, 2, 3\]; 5 on rank \[1\]")
    qd = torch.randn(1, 4, 4, 8, dtype=torch.float64 if rank == 2 else torch.float32)
    res["dtype_mismatch"] = _expect_error(lambda: attn(qd, qd, qd), ValueError, "different inputs")
    q6 = torch.randn(1, 4, 6, 8)
    uly = SequenceParallelAttention(backend="ulysses", group=group)
    res["heads"] = _expect_error(lambda: uly(q6, q6, q6), ValueError, "usp.*ring")
    usp = SequenceParallelAttention(backend="usp", group=group, ulysses_degree=3)
    res["usp_degree"] = _expect_error(lambda: usp.layout, ValueError, "must divide")
    return res


@pytest.fixture(scope="module")
def results():
    return run_on_ranks(_worker, WORLD, timeout_s=120, pg_timeout_s=30)


@pytest.mark.parametrize("key", ["a2a_fwd", "a2a_bwd", "a2a_roundtrip", "a2a_head_major", "a2a_head_major_control",
                                 "a2a_sorted_fwd", "a2a_sorted_head_major", "a2a_sorted_head_major_control",
                                 "a2a_sorted_roundtrip_bwd_head_major", "a2a_sorted_control", "a2a_sorted_bwd",
                                 "a2a_sorted_roundtrip", "a2a_sorted_roundtrip_bwd", "gather_inverse", "gather_bwd",
                                 *(f"groups_{what}_{name}" for what in ("fwd", "own_memory", "layout", "bwd", "roundtrip",
                                                                        "roundtrip_bwd")
                                   for name in ("contiguous", "contiguous_head_major", "zigzag", "zigzag_head_major"))])
def test_collective_matches_single_process(results, key):
    assert all(r[key] for r in results), [r[key] for r in results]


def test_sequence_parallel_cross_entropy_equals_unsharded(results):
    for r in results:
        assert r["loss_value"] < 1e-13
        assert r["loss_grad"] < 1e-13


@pytest.mark.parametrize("key", ["mismatch", "dtype_mismatch", "heads", "usp_degree"])
def test_bad_input_fails_with_a_message_on_every_rank(results, key):
    for rank, r in enumerate(results):
        ok, message = r[key]
        assert ok, f"rank {rank}: {message}"


def test_hang_is_reported_not_waited_forever():
    with pytest.raises(AssertionError, match="did not finish|failed"):
        run_on_ranks(_deadlock, 2, timeout_s=20, pg_timeout_s=5)


def _deadlock(rank, world):
    if rank == 0:  # rank 1 never joins this collective
        dist.all_reduce(torch.ones(1))
    return rank
