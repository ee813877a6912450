"""``backend="auto"`` chooses from the cost model, and every choice it can make is exact on the zigzag
layout ``auto`` shards for (4 gloo ranks, fp64 vs dense attention): Ulysses, zigzag ring, all-gather
KV is never the model's fastest here (its transfers are never overlapped) and is tested exact on the
zigzag layout in ``test_attention.py``) and ``usp(ulysses=2)``, each forced by a hardware profile that makes it the model's fastest."""

from __future__ import annotations

import logging
from dataclasses import replace

import pytest
import torch
import torch.distributed as dist

from lightning_sp import cost_model
from tests.distributed.harness import run_on_ranks
from tests.reference import dense_attention

pytestmark = pytest.mark.distributed

_BASE = cost_model.preset("cpu-default")
# profiles under which the model prefers one backend for the test shapes (checked in the worker)
PROFILES = {
    # fast all-to-all, no per-step latency budget for the ring: Ulysses
    "ulysses": replace(_BASE, name="fast-links", intra_bandwidth=1e12, intra_latency=1e-9, inter_bandwidth=1e12,
                       inter_latency=1e-9, attention_curve=((16, 1e6), (128, 1e9))),
    # one rank per node, slow links, compute slow enough to hide the ring's transfers: zigzag ring
    "zigzag_ring": replace(_BASE, name="slow-links", ranks_per_node=1, inter_bandwidth=1e8, inter_latency=1e-3,
                           attention_curve=((16, 1e6), (128, 1e6))),
    # 2 ranks per node, fast inside, slow across: usp(2) keeps its all-to-all in the node
    "usp(ulysses=2)": replace(_BASE, name="two-per-node", ranks_per_node=2, intra_bandwidth=1e12, intra_latency=1e-9,
                              inter_bandwidth=1e7, inter_latency=1e-3, attention_curve=((16, 1e6), (128, 1e6))),
}
CASES = [(label, True, 4, 2) for label in PROFILES] + [("usp(ulysses=2)", False, 4, 4)]


def _worker(rank, world, cases):
    from lightning_sp import SequenceParallelAttention, shard_sequence

    logger = logging.getLogger("lightning_sp.attention")
    records: list[str] = []

    class _Keep(logging.Handler):
        def emit(self, record):
            records.append(record.getMessage())

    logger.addHandler(_Keep())
    logger.setLevel(logging.INFO)
    out = []
    for i, (label, causal, h, h_kv) in enumerate(cases):
        n, d = 37, 8  # no degree divides 37: padding too
        g = torch.Generator().manual_seed(i)  # the same on every rank
        q = torch.randn(1, n, h, d, generator=g, dtype=torch.float64)
        k = torch.randn(1, n, h_kv, d, generator=g, dtype=torch.float64)
        v = torch.randn(1, n, h_kv, d, generator=g, dtype=torch.float64)
        dout = torch.randn(1, n, h, d, generator=g, dtype=torch.float64)
        qr, kr, vr = (t.clone().requires_grad_() for t in (q, k, v))
        ref = dense_attention(qr, kr, vr, causal=causal)
        ref.backward(dout)
        attn = SequenceParallelAttention(causal=causal, backend="auto", group=dist.group.WORLD, kernel="torch")
        attn.context.hardware = PROFILES[label]
        attn.context.ranks_per_node = PROFILES[label].ranks_per_node
        ql, kl, vl, dl = (shard_sequence(t, dist.group.WORLD, layout=attn.layout) for t in (q, k, v, dout))
        ql, kl, vl = (t.detach().requires_grad_() for t in (ql, kl, vl))
        o = attn(ql, kl, vl, seq_len=n)
        o.backward(dl)
        errs = []
        for mine, full in ((o, ref), (ql.grad, qr.grad), (kl.grad, kr.grad), (vl.grad, vr.grad)):
            want = shard_sequence(full.detach(), dist.group.WORLD, layout=attn.layout)
            errs.append((mine.detach() - want).abs().max().item())
        # negative control: the same comparison against the wrong (contiguous) shard must fail
        wrong = shard_sequence(ref.detach(), dist.group.WORLD, layout="contiguous")
        control = (o.detach() - wrong).abs().max().item()
        out.append({"case": (label, causal, h, h_kv), "chosen": attn.context.resolved_backend,
                    "layout": str(attn.layout), "errs": errs, "control": control})
    return {"cases": out, "log": records}


def test_auto_choices_are_the_models_and_exact():
    results = run_on_ranks(_worker, world_size=4, args=(CASES,), timeout_s=400, pg_timeout_s=120)
    for res in results:
        for row in res["cases"]:
            label = row["case"][0]
            assert row["chosen"] == label, row
            assert row["layout"] == "zigzag", row  # auto never changes the layout it shards for
            assert max(row["errs"]) < 1e-10, row
            assert row["control"] > 1e-3, row  # the tolerance is not vacuous
        text = "\n".join(res["log"])
        for label in PROFILES:  # the decision and the alternatives' predicted times are logged
            assert f"backend='auto' runs {label} (cost model on" in text, text
        assert "predicted fwd+bwd per layer: " in text and "allgather_kv " in text
