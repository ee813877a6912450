"""Bad SequenceParallelStrategy configurations fail at construction (before any process is launched
or any data is read) with messages that say what to change. No process group is needed."""

from __future__ import annotations

from datetime import timedelta

import lightning as L
import pytest

from lightning_sp.strategy import SequenceParallelStrategy


def _trainer(strategy, devices=4, num_nodes=1):
    return L.Trainer(accelerator="cpu", devices=devices, num_nodes=num_nodes, strategy=strategy, logger=False,
                     enable_progress_bar=False, enable_checkpointing=False, enable_model_summary=False)


def test_sp_must_divide_world_at_trainer_construction():
    with pytest.raises(ValueError, match=r"sequence_parallel_size=3 does not divide world_size=4.*in \[1, 2, 4\]"):
        _trainer(SequenceParallelStrategy(3, backend="ring"))
    with pytest.raises(ValueError, match=r"num_nodes=2 x devices=3.*sequence_parallel_size=4 does not divide world_size=6"):
        _trainer(SequenceParallelStrategy(4, backend="ring"), devices=3, num_nodes=2)


def test_usp_ulysses_degree_must_divide_sp():
    with pytest.raises(ValueError, match=r"ulysses_degree=3 does not divide sequence_parallel_size=4.*in \[1, 2, 4\]"):
        SequenceParallelStrategy(4, backend="usp", ulysses_degree=3)
    # sp = None (all ranks) is checked once the world size is known
    with pytest.raises(ValueError, match=r"ulysses_degree=3 does not divide sequence_parallel_size=4"):
        _trainer(SequenceParallelStrategy(None, backend="usp", ulysses_degree=3))


@pytest.mark.parametrize(
    "kwargs,match",
    [
        (dict(sequence_parallel_size=2, backend="ring", ulysses_degree=2), r"ulysses_degree=2 only applies to backend='usp'.*use backend='usp'"),
        (dict(sequence_parallel_size=2, backend="ringg"), r"backend='ringg' is not one of .*'zigzag_ring'"),
        (dict(sequence_parallel_size=2, data_parallel="zero3"), r"data_parallel='zero3' is not one of \('ddp', 'fsdp'\)"),
        (dict(sequence_parallel_size=0), r"sequence_parallel_size must be a positive integer or None"),
        (dict(sequence_parallel_size=2, sequence_keys="input_ids"), r"sequence_keys must be a sequence of keys.*\('input_ids',\)"),
        (dict(sequence_parallel_size=2, timeout=timedelta(seconds=5)), r"pass `process_group_timeout=`"),
        (dict(sequence_parallel_size=2, process_group_timeout=0), r"process_group_timeout must be positive"),
        (dict(sequence_parallel_size=2, shuffle="yes"), r"shuffle must be None \(follow the training DataLoader\)"),
        (dict(sequence_parallel_size=2, gather_predictions=None), r"gather_predictions True or False"),
    ],
)
def test_bad_arguments(kwargs, match):
    with pytest.raises(ValueError, match=match):
        SequenceParallelStrategy(**kwargs)


def test_properties_before_setup_raise_clearly():
    strategy = SequenceParallelStrategy(2, backend="ring")
    with pytest.raises(RuntimeError, match="pass the strategy to a Trainer"):
        strategy.parallel_dims
    with pytest.raises(RuntimeError, match="created in Trainer setup"):
        strategy.context
    with pytest.raises(RuntimeError, match="known after Trainer setup"):
        strategy.layout
    _trainer(strategy)
    assert (strategy.data_parallel_size, strategy.sequence_parallel_size) == (2, 2)
    with pytest.raises(RuntimeError, match="created in Trainer setup"):
        strategy.sp_group


def test_sampler_uses_data_parallel_axis_only():
    strategy = SequenceParallelStrategy(2, backend="zigzag_ring")
    _trainer(strategy, devices=8)
    ranks = []
    for global_rank in range(8):
        strategy.cluster_environment.set_global_rank(global_rank)
        ranks.append(strategy.distributed_sampler_kwargs)
    # ranks 2k and 2k+1 share a sequence, hence a sample; 4 replicas, not 8
    assert ranks == [{"num_replicas": 4, "rank": r // 2} for r in range(8)]


def test_registered_by_name():
    trainer = _trainer("sequence_parallel")
    assert isinstance(trainer.strategy, SequenceParallelStrategy)
    assert trainer.strategy.sequence_parallel_size == 4  # default: the whole world
    trainer = _trainer("sequence_parallel_spawn", devices=2)
    assert isinstance(trainer.strategy, SequenceParallelStrategy) and trainer.strategy._start_method == "spawn"


def test_megatron_flops_formula():
    from lightning_sp.callbacks import megatron_flops_per_iteration

    # 72 B L s h^2 (1 + s/(6h) + V/(12hL)) with B=1, L=1, s=6, h=1, V=12: 72 * 6 * (1 + 1 + 1)
    assert megatron_flops_per_iteration(batch=1, seq_len=6, num_layers=1, hidden=1, vocab=12) == 1296.0
    # linear in batch
    args = dict(seq_len=4096, num_layers=32, hidden=4096, vocab=32000)
    assert megatron_flops_per_iteration(batch=4, **args) == 4 * megatron_flops_per_iteration(batch=1, **args)


def test_monitor_does_not_invent_peak_flops_on_cpu():
    import torch

    from lightning_sp.callbacks import SequenceParallelMonitor

    assert SequenceParallelMonitor()._peak(torch.device("cpu")) is None
    assert SequenceParallelMonitor(peak_flops=5.0)._peak(torch.device("cpu")) == 5.0
    with pytest.raises(ValueError, match="log_every_n_steps must be >= 1"):
        SequenceParallelMonitor(log_every_n_steps=0)


TORCHRUN_2X2 = {"TORCHELASTIC_RUN_ID": "t", "RANK": "0", "LOCAL_RANK": "0", "GROUP_RANK": "0", "WORLD_SIZE": "4",
                "LOCAL_WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "29400"}


def test_devices_must_be_torchruns_ranks_per_node(monkeypatch):
    """Under torchrun (2 nodes x 2 ranks), devices=4 x num_nodes=1 has the right product (Lightning accepts
    it) but the wrong node size, which would place Ulysses all-to-alls across nodes: refused, saying what
    to pass. The right split constructs (negative control)."""
    for key, value in TORCHRUN_2X2.items():
        monkeypatch.setenv(key, value)
    with pytest.raises(ValueError, match=r"torchrun started 2 ranks per node.*devices=4, num_nodes=1: pass devices=2"):
        _trainer(SequenceParallelStrategy(2, backend="usp"), devices=4, num_nodes=1)
    trainer = _trainer(SequenceParallelStrategy(4, backend="usp"), devices=2, num_nodes=2)
    assert trainer.strategy.parallel_dims.ulysses == 2  # the inner axis capped at the node size


def test_unknown_hardware_preset_lists_the_presets():
    with pytest.raises(ValueError, match=r"unknown hardware preset 'h1000'.*h100-80gb"):
        SequenceParallelStrategy(2, hardware="h1000")


def test_shuffle_following_is_installed_until_teardown_and_said_when_impossible():
    """Note [The training sampler follows the loader]: the wrap sits on this trainer's data connector only while the
    strategy is set up; a Lightning without the hook gets a warning, not a silent shuffle."""
    import types

    strategy = SequenceParallelStrategy(2, backend="ring")
    trainer = _trainer(strategy)
    strategy._follow_loader_shuffling(trainer)
    assert "_prepare_dataloader" in vars(trainer._data_connector)
    strategy._undo_shuffle_following()
    assert "_prepare_dataloader" not in vars(trainer._data_connector)
    with pytest.warns(UserWarning, match=r"shuffle=None\) cannot see the training DataLoader's shuffling"):
        SequenceParallelStrategy(2, backend="ring")._follow_loader_shuffling(types.SimpleNamespace())
