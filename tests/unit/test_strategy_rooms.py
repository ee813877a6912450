"""The strategy's rooms work without a Trainer: binding the attention modules, batch sharding,
degrees and their errors, fault messages, the launch checks, checkpoint IO (which hook reads what),
FSDP's no-sync window and tensor-parallel gradients without TP. No process group; ~6 s on 2 cores."""

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
from lightning_sp.checkpoint import CheckpointError, StrategyCheckpointIO
from lightning_sp.data_parallel import fsdp_gradient_sync_off
from lightning_sp.mesh import check_launch_matches_nodes, check_strategy_degrees, check_world_matches, strategy_dims
from lightning_sp.tensor_parallel import TensorParallelContext
from lightning_sp.tensor_parallel.grads import TensorParallelGradients
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


def test_launch_and_world_checks_without_a_trainer(monkeypatch):
    check_world_matches(4, devices=2, num_nodes=2)  # control
    with pytest.raises(ValueError, match=r"process group has 3 ranks but .* num_nodes=2 x devices=2"):
        check_world_matches(3, devices=2, num_nodes=2)
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")
    check_launch_matches_nodes(devices=4, num_nodes=1)  # not under torchrun: nothing to compare with
    monkeypatch.setenv("TORCHELASTIC_RUN_ID", "t")
    check_launch_matches_nodes(devices=2, num_nodes=2)  # control: torchrun's node size
    with pytest.raises(ValueError, match=r"torchrun started 2 ranks per node.*pass devices=2"):
        check_launch_matches_nodes(devices=4, num_nodes=1)


def _never(*args, **kwargs):
    raise AssertionError("Lightning's hook must not run here")


def test_checkpoint_io_formats_and_defaults():
    def io(**kw):
        return StrategyCheckpointIO(**{"distributed": None, "data_parallel": "ddp", "tensor_parallel_size": 1,
                                       "is_fsdp_root": lambda: False, **kw})

    assert not io().distributed and io(data_parallel="fsdp").distributed and io(tensor_parallel_size=2).distributed
    assert io(distributed=True).distributed and not io(data_parallel="fsdp", distributed=False).distributed
    with pytest.raises(ValueError, match="distributed_checkpoint=False .* cannot hold a tensor-parallel model"):
        io(tensor_parallel_size=2, distributed=False)
    with pytest.raises(TypeError, match="storage_options is not supported"):
        io(distributed=True).save({}, "x", {"a": 1}, dims=None, lightning_save=_never)
    calls = []
    plain = io()  # DDP, one file: every hook is Lightning's own
    # in_place: Lightning's writer gets the final name (a single file is otherwise staged, then renamed)
    plain.save({"k": 1}, "f", None, dims=None, lightning_save=lambda c, p, storage_options: calls.append(("save", p)),
               in_place=True)
    assert plain.model_state(nn.Linear(2, 2), None, lambda: "lightning") == "lightning"
    plain.load_model_state(nn.Linear(2, 2), {"state_dict": {}}, True, lambda c, strict: calls.append(("model", strict)))
    assert calls == [("save", "f"), ("model", True)]


def test_checkpoint_io_single_file_reads_weights_only_and_names_a_bad_file(tmp_path):
    file = tmp_path / "last.ckpt"
    file.write_bytes(b"x")
    seen = []
    io = StrategyCheckpointIO(distributed=False, data_parallel="ddp", tensor_parallel_size=1, is_fsdp_root=lambda: False)
    for asked, read in ((None, True), (True, True), (False, False)):
        assert io.load(file, asked, None, [], lambda p, weights_only: seen.append(weights_only) or {"epoch": 0}) == {"epoch": 0}
        assert seen[-1] is read and not io.restored_sharded
    with pytest.raises(CheckpointError, match="last.ckpt is incomplete or corrupted.*holds a list"):
        io.load(file, None, None, [], lambda p, weights_only: [1])


def test_checkpoint_io_sharded_round_trip_then_restore_hooks_do_nothing(tmp_path):
    """A sharded save read back into a model with other weights: the model and optimizer come back exactly,
    and Lightning's restore hooks that follow (which would load the empty placeholders) never run."""
    io = StrategyCheckpointIO(distributed=True, data_parallel="ddp", tensor_parallel_size=1, is_fsdp_root=lambda: False)
    dims = ParallelDims(world_size=1, sequence_parallel_size=1)

    def trained(seed):
        torch.manual_seed(seed)
        model = nn.Linear(3, 2).double()
        opt = torch.optim.Adam(model.parameters(), lr=0.1)
        model(torch.randn(4, 3, dtype=torch.float64)).square().sum().backward()
        opt.step()
        return model, opt

    model, opt = trained(0)
    checkpoint = {"epoch": 3, "state_dict": io.model_state(model, model, _never),
                  "optimizer_states": [io.optimizer_state(model, model, opt, _never)]}
    io.save(checkpoint, tmp_path / "c", None, dims=dims, lightning_save=_never)
    other, other_opt = trained(1)
    assert not torch.equal(other.weight, model.weight)  # negative control: different before loading
    restored = io.load(tmp_path / "c", None, other, [other_opt], _never)
    assert io.restored_sharded and restored["epoch"] == 3
    io.load_model_state(other, restored, True, _never)
    io.load_optimizer_states(other, [other_opt], restored, _never)
    for p, q in zip(model.parameters(), other.parameters()):
        assert torch.equal(p, q) and torch.equal(opt.state[p]["exp_avg_sq"], other_opt.state[q]["exp_avg_sq"])


def test_checkpoint_io_copies_a_whole_file_into_an_fsdp_model():
    """Under FSDP (and TP), a single file's whole tensors are copied into this rank's chunks, not loaded by
    Lightning; a name-keyed (FSDP-written) optimizer state is loaded by name whatever the strategy."""
    source, target = nn.Linear(2, 2).double(), nn.Linear(2, 2).double()
    io = StrategyCheckpointIO(distributed=False, data_parallel="fsdp", tensor_parallel_size=1, is_fsdp_root=lambda: True)
    assert not torch.equal(target.weight, source.weight)  # negative control
    io.load_model_state(target, {"state_dict": source.state_dict()}, True, _never)
    assert torch.equal(target.weight, source.weight) and torch.equal(target.bias, source.bias)
    with pytest.raises(ValueError, match="missing.*bias"):
        io.load_model_state(target, {"state_dict": {"weight": source.weight}}, True, _never)
    opt = torch.optim.SGD(target.parameters(), lr=0.5, momentum=0.9)
    saved = {"state": {"weight": {"momentum_buffer": torch.ones(2, 2, dtype=torch.float64)}},
             "param_groups": [{"lr": 0.25, "momentum": 0.9, "params": ["weight", "bias"]}]}
    ddp = StrategyCheckpointIO(distributed=False, data_parallel="ddp", tensor_parallel_size=1, is_fsdp_root=lambda: False)
    ddp.load_optimizer_states(target, [opt], {"optimizer_states": [saved]}, _never)
    assert opt.param_groups[0]["lr"] == 0.25 and torch.equal(opt.state[target.weight]["momentum_buffer"],
                                                             torch.ones(2, 2, dtype=torch.float64))


def test_fsdp_gradient_sync_off_restores_sync_on_error():
    calls = []
    model = SimpleNamespace(set_requires_gradient_sync=calls.append)
    with pytest.raises(KeyError):
        with fsdp_gradient_sync_off(model):
            assert calls == [False]
            raise KeyError("a micro-batch failed")
    assert calls == [False, True]


def test_tensor_parallel_gradients_without_tp_is_a_no_op():
    """With no tp group there is nothing to sum: the gradients stay as they are and no collective runs
    (none can: there is no process group here)."""
    model = nn.Linear(2, 2)
    model(torch.ones(1, 2)).sum().backward()
    before = [p.grad.clone() for p in model.parameters()]
    grads = TensorParallelGradients(model, (), TensorParallelContext(group=None))
    assert not grads.active
    assert grads.reducing_after(lambda: "loss")() == "loss"
    grads.reduce()
    assert all(torch.equal(p.grad, g) for p, g in zip(model.parameters(), before))
