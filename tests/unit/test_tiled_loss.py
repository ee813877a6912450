"""The tiled logits + cross-entropy (Note [Tiled logits and cross-entropy]): exact against ``F.linear`` then
the loss, forward and backward, and never a tensor as large as the logits."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch.utils._python_dispatch import TorchDispatchMode

from lightning_sp.loss import linear_cross_entropy_sum, sequence_parallel_cross_entropy


def _inputs(tokens=29, hidden=7, vocab=13, *, bias=True, dtype=torch.float64, seed=0):
    g = torch.Generator().manual_seed(seed)
    h = torch.randn(2, tokens, hidden, dtype=dtype, generator=g, requires_grad=True)
    w = torch.randn(vocab, hidden, dtype=dtype, generator=g, requires_grad=True)
    b = torch.randn(vocab, dtype=dtype, generator=g, requires_grad=True) if bias else None
    labels = torch.randint(0, vocab, (2, tokens), generator=g)
    labels[0, :5] = -100
    labels[1, -3:] = -100
    return h, w, b, labels


def _grads(loss, tensors):
    return torch.autograd.grad(loss, [t for t in tensors if t is not None])


@pytest.mark.parametrize("bias", [True, False])
@pytest.mark.parametrize("chunk_elements", [1, 13 * 4, 13 * 29, 1 << 20])  # 1 row, 4 rows, a ragged tile, all
def test_tiled_loss_equals_linear_then_cross_entropy_fp64(bias, chunk_elements):
    h, w, b, labels = _inputs(bias=bias)
    got = linear_cross_entropy_sum(h, w, labels, bias=b, chunk_elements=chunk_elements)
    ref = F.cross_entropy(F.linear(h, w, b).reshape(-1, w.size(0)), labels.reshape(-1), reduction="sum")
    assert abs(float(got - ref)) < 1e-12
    for g_got, g_ref in zip(_grads(1.7 * got, (h, w, b)), _grads(1.7 * ref, (h, w, b))):
        assert float((g_got - g_ref).abs().max()) < 1e-12
    # negative controls: the ignored tokens counted, or the bias dropped, change the value
    unmasked = F.cross_entropy(F.linear(h, w, b).reshape(-1, w.size(0)), labels.clamp_min(0).reshape(-1),
                               reduction="sum")
    assert abs(float(got - unmasked)) > 1e-3
    if bias:
        assert abs(float(got - linear_cross_entropy_sum(h, w, labels, chunk_elements=chunk_elements))) > 1e-3


def test_sequence_parallel_cross_entropy_takes_the_hidden_states_and_the_projection():
    h, w, b, labels = _inputs()
    got = sequence_parallel_cross_entropy(h, labels, weight=w, bias=b)
    ref = sequence_parallel_cross_entropy(F.linear(h, w, b), labels)
    assert abs(float(got - ref)) < 1e-14
    for g_got, g_ref in zip(_grads(got, (h, w, b)), _grads(ref, (h, w, b))):
        assert float((g_got - g_ref).abs().max()) < 1e-14


def test_tiled_loss_bad_shapes_say_what_to_pass():
    h, w, b, labels = _inputs()
    with pytest.raises(ValueError, match=r"output projection \[V, C\]"):
        linear_cross_entropy_sum(h, w.T, labels)
    with pytest.raises(ValueError, match="disagree on the leading dims"):
        linear_cross_entropy_sum(h, w, labels[:, 1:])
    with pytest.raises(ValueError, match=r"bias .* must be \[V\]"):
        linear_cross_entropy_sum(h, w, labels, bias=b[1:])
    with pytest.raises(ValueError, match="bias without weight"):
        sequence_parallel_cross_entropy(F.linear(h, w), labels, bias=b)


class _LargeTensors(TorchDispatchMode):
    """Records every tensor of at least ``numel`` elements an op produces."""

    def __init__(self, numel):
        super().__init__()
        self.numel, self.seen = numel, []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in out if isinstance(out, (tuple, list)) else (out,):
            if isinstance(t, torch.Tensor) and t.numel() >= self.numel:
                self.seen.append((str(func), tuple(t.shape)))
        return out


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_tiled_loss_never_holds_the_logits_whole(dtype):
    tokens, hidden, vocab = 512, 16, 1000
    h = torch.randn(1, tokens, hidden, dtype=dtype, requires_grad=True)
    w = torch.randn(vocab, hidden, dtype=dtype, requires_grad=True)
    labels = torch.randint(0, vocab, (1, tokens))
    with _LargeTensors(tokens * vocab // 4) as mode:
        linear_cross_entropy_sum(h, w, labels, chunk_elements=tokens * vocab // 8).backward()
    assert mode.seen == [], mode.seen
    assert h.grad.dtype == dtype and w.grad.dtype == dtype
    with _LargeTensors(tokens * vocab // 4) as control:  # the untiled loss does hold the logits [T, V]
        sequence_parallel_cross_entropy(F.linear(h, w), labels).backward()
    assert control.seen
