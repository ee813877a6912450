"""CUDA kernels (SDPA flash op, flash-attn) against dense float64 attention. Skipped without CUDA:
these are not CI coverage; run `make test-gpu` on a GPU machine and record the device."""

import pytest
import torch

from lightning_sp import SequenceParallelAttention
from lightning_sp.ops.kernels import flash_attn_available
from tests.reference import dense_attention

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA (not CI coverage)"),
]

KERNELS = ["sdpa", "torch"] + (["flash_attn"] if flash_attn_available() else [])


@pytest.mark.parametrize("kernel", KERNELS)
@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("docs", [False, True])
def test_cuda_local_attention_matches_dense(kernel, causal, docs):
    torch.manual_seed(0)
    n, dtype = 1000, torch.bfloat16
    q = torch.randn(1, n, 8, 64, device="cuda", dtype=dtype, requires_grad=True)
    k = torch.randn(1, n, 2, 64, device="cuda", dtype=dtype, requires_grad=True)
    v = torch.randn(1, n, 2, 64, device="cuda", dtype=dtype, requires_grad=True)
    cu = torch.tensor([0, 300, 301, 777, n], dtype=torch.int32, device="cuda") if docs else None
    out = SequenceParallelAttention(causal=causal, kernel=kernel)(q, k, v, cu_seqlens=cu)
    dout = torch.randn_like(out)
    grads = torch.autograd.grad(out, (q, k, v), dout)
    qd, kd, vd = (t.detach().double().cpu().requires_grad_() for t in (q, k, v))
    ref = dense_attention(qd, kd, vd, causal=causal, cu_seqlens=None if cu is None else cu.cpu())
    ref_grads = torch.autograd.grad(ref, (qd, kd, vd), dout.double().cpu())
    assert (out.double().cpu() - ref).abs().max() < 2e-2
    for g, r in zip(grads, ref_grads):
        assert (g.double().cpu() - r).abs().max() / r.abs().max() < 2e-2
