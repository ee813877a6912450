"""The strategy's rooms work without a Trainer (issue 18): binding the attention modules, batch sharding,
degrees and their errors, fault messages. No process group; ~1 s."""

from __future__ import annotations

from datetime import timedelta
from types import SimpleNamespace

import pytest
import torch
from torch import nn

from lightning_sp import SequenceLayout, SequenceParallelAttention, SequenceParallelContext
from lightning_sp.batch_sharding import BatchSharder
from lightning_sp.binding import auto_backend_message, bind_attention_modules, recompute_in_backward
from lightning_sp.faults import append_hint, as_process_group_timeout, collective_failure_hint
from lightning_sp.mesh import check_strategy_degrees, strategy_dims
from lightning_sp.topology import ParallelDims


class TwoAttentions(nn.Module):
    def __init__(self, first: str | None, second: str | None) -> None:
        super().__init__()
        self.a = SequenceParallelAttention(causal=True, backend=first)
        self.b = SequenceParallelAttention(causal=True, backend=second)


def test_binding_returns_the_layout_batches_are_sharded_with():
    context = SequenceParallelContext(backend="zigzag_ring")
    model = TwoAttentions(None, "local")
    layout = bind_attention_modules(model, context, backend="zigzag_ring", sequence_parallel_size=1)
    assert model.a.context is context and model.b.context is context
    assert layout == model.a.layout  # that of the parallel module; the local one does not constrain it
    only_local = bind_attention_modules(TwoAttentions("local", "local"), context, backend="zigzag_ring",
                                        sequence_parallel_size=2)
    assert only_local == SequenceLayout("zigzag")  # none constrains it: the strategy backend's layout
    # (two parallel modules of different layouts need a group of >= 2 ranks: tests/distributed/test_strategy.py, "conflict_error")


def test_recompute_in_backward_is_idempotent_and_exact():
    torch.manual_seed(0)
    attn = SequenceParallelAttention(causal=True, backend="local")
    q, k, v = (torch.randn(1, 5, 2, 4, dtype=torch.float64, requires_grad=True) for _ in range(3))
    attn(q, k, v).square().sum().backward()
    plain = [t.grad.clone() for t in (q, k, v)]
    for t in (q, k, v):
        t.grad = None
    recompute_in_backward(attn)
    wrapped = attn.forward
    recompute_in_backward(attn)
    assert attn.forward is wrapped  # once only
    attn(q, k, v).square().sum().backward()
    for g, ref in zip((q.grad, k.grad, v.grad), plain):
        assert (g - ref).abs().max() < 1e-14


def test_auto_backend_message_once_resolved():
    context = SequenceParallelContext(backend="auto")
    assert auto_backend_message(None) is None and auto_backend_message(context) is None
    context.resolved_backend = "ulysses"
    assert auto_backend_message(context) == "SequenceParallelStrategy: backend='auto' runs ulysses"


def test_batch_sharder_without_a_trainer():
    context = SequenceParallelContext(backend="zigzag_ring")
    source = SimpleNamespace(context=context, layout=SequenceLayout("zigzag"),
                             parallel_dims=ParallelDims(world_size=1, sequence_parallel_size=1))
    sharder = BatchSharder(source)
    ids = torch.arange(14).view(2, 7)
    out = sharder.shard_batch({"input_ids": ids, "labels": ids, "other": torch.ones(3)})
    # zigzag splits into 2P chunks: 7 tokens are padded to 8 (labels with ignore_index), N = 7 recorded
    assert torch.equal(out["input_ids"], torch.cat([ids, torch.zeros(2, 1, dtype=ids.dtype)], 1))
    assert torch.equal(out["labels"], torch.cat([ids, torch.full((2, 1), -100)], 1))
    assert torch.equal(out["other"], torch.ones(3))  # not a sequence key: untouched
    assert torch.equal(out["position_ids"], torch.arange(8).clamp(max=6).expand(2, 8))  # added, padding clamped
    assert context.global_seq_len == 7
    with pytest.raises(ValueError, match="disagree on the sequence length"):
        sharder.shard_batch({"input_ids": ids, "labels": ids[:, :5]})
    with pytest.raises(ValueError, match="use \\('input_ids',\\)"):
        BatchSharder(source, sequence_keys="input_ids")


def test_degrees_and_their_errors_name_every_argument():
    dims = strategy_dims(8, sequence_parallel_size=None, backend="usp", ulysses_degree=None, tensor_parallel_size=2,
                         ranks_per_node=8, num_nodes=1, devices=8)
    assert (dims.dp, dims.sp, dims.ulysses, dims.ring, dims.tp) == (1, 4, 2, 2, 2)
    with pytest.raises(ValueError, match=r"sequence_parallel_size=3.*num_nodes=2 x devices=2"):
        strategy_dims(4, sequence_parallel_size=3, backend="ring", ulysses_degree=None, tensor_parallel_size=1,
                      ranks_per_node=2, num_nodes=2, devices=2)
    with pytest.raises(ValueError, match="only applies to backend='usp'"):
        check_strategy_degrees(4, backend="ring", ulysses_degree=2, tensor_parallel_size=1)
    with pytest.raises(ValueError, match="is not one of"):
        check_strategy_degrees(4, backend="flash", ulysses_degree=None, tensor_parallel_size=1)
    check_strategy_degrees(4, backend="usp", ulysses_degree=2, tensor_parallel_size=1)  # control: valid


def test_fault_hint_names_the_rank_and_keeps_the_error():
    dims = ParallelDims(world_size=4, sequence_parallel_size=2)
    err = RuntimeError("[gloo] Timed out waiting 5000ms for recv")
    hint = collective_failure_hint(err, rank=3, dims=dims, timeout=timedelta(seconds=5), global_step=7)
    assert "rank 3 (dp rank 1, sp rank 1)" in hint and "process_group_timeout=5s" in hint and "step 7" in hint
    append_hint(err, hint)
    assert str(err).startswith("[gloo] Timed out") and str(err).endswith(hint)
    assert collective_failure_hint(ValueError("shapes differ"), rank=0, dims=dims, timeout=timedelta(seconds=5),
                                   global_step=None) is None  # negative control: not a collective failure
    assert as_process_group_timeout(2.5, {}) == timedelta(seconds=2.5)
    with pytest.raises(ValueError, match="process_group_timeout="):
        as_process_group_timeout(5, {"timeout": 5})
