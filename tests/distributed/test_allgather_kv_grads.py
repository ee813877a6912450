"""``allgather_kv`` backward sums dK/dV over ranks in the accumulation dtype (fp32 for bf16 inputs)
and casts after, instead of summing bf16 partials. Checked on 4 gloo ranks (one spawn): by the bytes
the backward's reduce-scatter moves (fp32 = 4 bytes per element; a bf16 sum would move 2), and by the
gradients against dense fp64 attention with a bf16 tolerance and a negative control."""

from __future__ import annotations

import pytest
import torch

from lightning_sp import SequenceParallelAttention, gather_sequence, shard_sequence
from tests.distributed.harness import run_on_ranks
from tests.reference import dense_attention

pytestmark = pytest.mark.distributed

WORLD, N, D = 4, 64, 16
HEADS = {"mha": (4, 4), "gqa": (4, 2)}
TOL_BF16 = 3e-2


def _worker(rank, world):
    import torch.distributed as dist

    group = dist.group.WORLD
    results = {}
    for i, (name, (h, h_kv)) in enumerate(HEADS.items()):
        g = torch.Generator().manual_seed(i)
        q, k, v, dout = (torch.randn(1, N, hh, D, generator=g, dtype=torch.float64) for hh in (h, h_kv, h_kv, h))
        attn = SequenceParallelAttention(causal=True, backend="allgather_kv", group=group)
        local = [shard_sequence(t.bfloat16(), group, layout=attn.layout).requires_grad_(j < 3)
                 for j, t in enumerate((q, k, v, dout))]
        out = attn(*local[:3])
        attn.comm_stats.reset()
        out.backward(local[3])
        bwd_bytes = dict(attn.comm_stats.snapshot())
        grads = [gather_sequence(t.grad, group, layout=attn.layout) for t in local[:3]]
        qd, kd, vd = (t.requires_grad_() for t in (q, k, v))
        ref = torch.autograd.grad(dense_attention(qd, kd, vd, causal=True), (qd, kd, vd), dout)
        control = torch.autograd.grad(dense_attention(qd, kd, vd, causal=False), (qd, kd, vd), dout)
        errors = [float((a.double() - b).abs().max()) for a, b in zip(grads, ref)]
        control_errors = [float((a.double() - b).abs().max()) for a, b in zip(grads, control)]
        results[name] = {"bwd_bytes": bwd_bytes, "kv_shard_numel": local[1].numel(),
                         "grad_dtypes": [str(t.grad.dtype) for t in local[:3]],
                         "errors": errors, "control_errors": control_errors}
    return results


@pytest.fixture(scope="module")
def per_rank():
    return run_on_ranks(_worker, WORLD, timeout_s=180)


def test_dkv_reduce_scatter_runs_in_fp32(per_rank):
    for rank, res in enumerate(per_rank):
        for name, r in res.items():
            fp32_bytes = (WORLD - 1) * 2 * r["kv_shard_numel"] * 4  # (P-1) chunks of dK and of dV, 4 bytes each
            got = r["bwd_bytes"].get("reduce_scatter")
            assert got == fp32_bytes, (
                f"rank {rank} {name}: the dK/dV reduce-scatter moved {got} bytes; fp32 sums move {fp32_bytes}, "
                f"bf16 sums {fp32_bytes // 2}"
            )
            assert r["grad_dtypes"] == ["torch.bfloat16"] * 3  # cast back after the sum


def test_bf16_grads_match_dense_fp64(per_rank):
    for name, r in per_rank[0].items():
        assert max(r["errors"]) < TOL_BF16, (name, r["errors"])
        assert min(r["control_errors"][1:]) > 10 * TOL_BF16, (name, r["control_errors"])  # dk, dv control
