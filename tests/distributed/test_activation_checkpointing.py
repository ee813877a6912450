"""Full activation checkpointing (``activation_checkpointing=True``) under sequence parallelism: each
block's forward, collectives included, runs again in backward on every rank in the same order, and the
loss and parameter gradients equal the one-process model's (fp64, 2 gloo ranks, zigzag ring and Ulysses,
a length the group does not divide). The attention's forward traffic is paid twice (counted)."""

from __future__ import annotations

import pytest
import torch

from tests.distributed.harness import run_on_ranks

pytestmark = pytest.mark.distributed

N = 37
CASES = [(b, r) for b in ("zigzag_ring", "ulysses") for r in (False, True)] + [("local", True)]
"""(backend, activation_checkpointing); "local": each rank attends over its own tokens only (negative
control)."""


def _loss_and_grads(model, ids, labels, position_ids=None):
    model.zero_grad()
    logits = model(ids, position_ids)  # [B, S, V]
    loss = model.net.cross_entropy(logits, labels)
    loss.backward()
    return loss.detach(), {n: p.grad.detach().clone() for n, p in model.named_parameters()}


def _worker(rank, world):
    import torch.distributed as dist

    from lightning_sp import shard_sequence
    from lightning_sp.context import SequenceParallelContext
    from lightning_sp.models import ProteinEncoder
    from lightning_sp.models._attention import SequenceParallelAttention

    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, 31, (1, N), generator=g)
    labels = torch.where(torch.rand(1, N, generator=g) < 0.3, ids, torch.full_like(ids, -100))
    kw = dict(d_model=32, n_layers=2, n_heads=4, n_kv_heads=2)
    torch.manual_seed(1)
    reference = ProteinEncoder(**kw).double()
    ref_loss, ref_grads = _loss_and_grads(reference, ids, labels)  # one process, whole sequence
    results = {}
    for backend, recompute in CASES:
        torch.manual_seed(1)
        model = ProteinEncoder(**kw, activation_checkpointing=recompute).double()
        ctx = SequenceParallelContext(group=dist.group.WORLD, backend=backend, global_seq_len=N)
        for m in model.modules():
            if isinstance(m, SequenceParallelAttention):
                m.bind(ctx)
        layout = "contiguous" if backend == "local" else next(
            m for m in model.modules() if isinstance(m, SequenceParallelAttention)).layout
        local = [shard_sequence(t, dist.group.WORLD, layout=layout, pad_value=pad)
                 for t, pad in ((ids, 0), (labels, -100), (torch.arange(N)[None], N - 1))]
        loss, grads = _loss_and_grads(model, *local[:2], local[2])
        for gr in grads.values():  # average over the group, as DDP does (the loss is the same on every rank)
            dist.all_reduce(gr)
            gr /= world
        loss_err = abs(float(loss - ref_loss))
        grad_err = max(float((grads[n] - ref_grads[n]).abs().max()) for n in ref_grads)
        results[(backend, recompute)] = (loss_err, grad_err, ctx.comm.calls_by_op.get("all_to_all", 0)
                                         + ctx.comm.calls_by_op.get("ring_send", 0))
    return results


@pytest.fixture(scope="module")
def results():
    return run_on_ranks(_worker, 2, timeout_s=180, pg_timeout_s=60)


def test_checkpointed_model_equals_one_process(results):
    for per_rank in results:
        for key, (loss_err, grad_err, _) in per_rank.items():
            if key[0] == "local":  # negative control: attention that does not span the ranks
                assert grad_err > 1e-6, (key, grad_err)
            else:
                assert loss_err < 1e-12 and grad_err < 1e-10, (key, loss_err, grad_err)


def test_checkpointing_runs_the_attention_collectives_again(results):
    for backend in ("zigzag_ring", "ulysses"):
        plain, recomputed = results[0][(backend, False)][2], results[0][(backend, True)][2]
        assert recomputed > plain > 0, (backend, plain, recomputed)
