"""Cross-attention without a process group (``kv_layout="replicated"`` on an unbound module): exact against
dense float64, and the errors that name it. The distributed cases are in tests/distributed/test_attention.py."""

from __future__ import annotations

import pytest
import torch

from lightning_sp import SequenceParallelAttention


def _dense_cross_attention(q, k, v):
    rep = q.size(2) // k.size(2)
    k, v = k.repeat_interleave(rep, dim=2), v.repeat_interleave(rep, dim=2)
    scores = torch.einsum("bqhd,bkhd->bhqk", q, k) / q.size(-1) ** 0.5
    return torch.einsum("bhqk,bkhd->bqhd", torch.softmax(scores, dim=-1), v)


@pytest.mark.parametrize("kernel", ["auto", "torch"])
@pytest.mark.parametrize("memory_len", [5, 11, 23])
def test_replicated_memory_matches_dense_fp64(kernel, memory_len):
    g = torch.Generator().manual_seed(memory_len)
    q, dout = (torch.randn(2, 11, 4, 8, generator=g, dtype=torch.float64) for _ in range(2))
    k, v = (torch.randn(2, memory_len, 2, 8, generator=g, dtype=torch.float64) for _ in range(2))
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    out = SequenceParallelAttention(kernel=kernel)(*leaves, kv_layout="replicated")
    grads = torch.autograd.grad(out, leaves, dout)
    ref_leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    ref = _dense_cross_attention(*ref_leaves)
    ref_grads = torch.autograd.grad(ref, ref_leaves, dout)
    for got, want in zip((out, *grads), (ref, *ref_grads)):
        assert (got - want).abs().max() < 1e-12
    # negative control: the same comparison against attention over a memory one token shorter fails
    assert (out - _dense_cross_attention(q, k[:, 1:], v[:, 1:])).abs().max() > 1e-3


def test_errors_name_cross_attention_and_the_mode():
    q = torch.randn(1, 6, 2, 4)
    memory = torch.randn(1, 9, 2, 4)
    with pytest.raises(ValueError, match=r"k and v hold 9 positions but q holds 6.*pass kv_layout='replicated'"):
        SequenceParallelAttention()(q, memory, memory)
    with pytest.raises(ValueError, match=r"kv_layout='replicated' .*does not take causal=True.*causal=False"):
        SequenceParallelAttention(causal=True)(q, memory, memory, kv_layout="replicated")
    with pytest.raises(ValueError, match=r"does not take cu_seqlens"):
        SequenceParallelAttention()(q, memory, memory, kv_layout="replicated",
                                    cu_seqlens=torch.tensor([0, 6], dtype=torch.int32))
    with pytest.raises(ValueError, match=r"kv_layout must be one of \('sharded', 'replicated'\), got 'whole'"):
        SequenceParallelAttention()(q, memory, memory, kv_layout="whole")
    with pytest.raises(ValueError, match=r"differ in batch or head dim"):
        SequenceParallelAttention()(q, torch.randn(2, 9, 2, 4), torch.randn(2, 9, 2, 4), kv_layout="replicated")
