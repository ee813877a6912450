"""``lightning_sp/choices.py`` without a process group: the rules behind ``kv_pieces="auto"`` and the policy
of ``backend="auto"``; argument errors name what to change."""

from __future__ import annotations

import pytest

from lightning_sp import SequenceParallelAttention, choices


def test_no_budget_is_whole_blocks_and_a_budget_the_fewest_pieces_that_fit():
    peak = {1: 900, 2: 600, 4: 450, 8: 380, 16: 340}.__getitem__
    assert choices.fewest_pieces_that_fit(peak, None) == (1, 900)
    assert choices.fewest_pieces_that_fit(peak, 10_000) == (1, 900)
    assert choices.fewest_pieces_that_fit(peak, 600) == (2, 600)
    assert choices.fewest_pieces_that_fit(peak, 400) == (8, 380)


def test_a_budget_nothing_fits_runs_the_most_pieces_and_warns(caplog):
    peak = {1: 900, 2: 600, 4: 450, 8: 380, 16: 340}.__getitem__
    with caplog.at_level("WARNING", logger="lightning_sp.choices"):
        assert choices.fewest_pieces_that_fit(peak, 100) == (16, 340)
    assert "memory budget" in caplog.text and "sequence-parallel degree" in caplog.text


def test_predicted_peak_falls_with_pieces_and_grows_with_the_shard():
    kw = dict(batch=1, num_heads=8, num_kv_heads=2, head_dim=64, element_size=2, world=4)
    for backend in ("ring", "zigzag_ring", "allgather_kv", "ulysses", "usp"):
        by_pieces = [choices.predicted_peak_bytes(backend, shard_len=4096, pieces=p, **kw) for p in choices.PIECE_CHOICES]
        assert by_pieces == sorted(by_pieces, reverse=True), (backend, by_pieces)
        assert choices.predicted_peak_bytes(backend, shard_len=8192, pieces=1, **kw) > by_pieces[0]


def test_ulysses_runs_two_head_groups_where_memory_is_free_and_cheap():
    """Note [Ulysses' head groups by default]: the benchmark's shapes (P = 2, H = 8, D = 64, fp32, N = 4096 and
    8192) on the CPU profile with a kernel that reads head-major gathers get 2 groups; a shard under
    ``GROUPS_MIN_SHARD_TOKENS``, heads the ranks cannot split, and seq-major gathers (CUDA: each group would
    cost a copy) get whole heads."""
    import torch

    from lightning_sp import cost_model

    cpu, h100 = cost_model.default_profile("cpu"), cost_model.PRESETS["h100-80gb"]
    kw = dict(batch=1, num_heads=8, num_kv_heads=8, head_dim=64, element_size=4, world=2, causal=True)
    for n in (4096, 8192):
        assert choices.ulysses_groups_when_memory_is_free(shard_len=n // 2, hardware=cpu, gather_copies=True, **kw) == 2
    assert choices.ulysses_groups_when_memory_is_free(shard_len=choices.GROUPS_MIN_SHARD_TOKENS - 1, hardware=cpu,
                                                      gather_copies=True, **kw) == 1
    for hw in (cpu, h100):  # the control: the same shapes with seq-major gathers
        assert choices.ulysses_groups_when_memory_is_free(shard_len=2048, hardware=hw, gather_copies=False, **kw) == 1
    assert choices.ulysses_groups_when_memory_is_free(shard_len=2048, hardware=cpu, gather_copies=True,
                                                      **{**kw, "num_heads": 6, "world": 4}) == 1
    # what SequenceParallelAttention(kv_pieces="auto") resolves to on CPU without a budget (expanded: no memory)
    q = torch.zeros(()).expand(1, 2048, 8, 64)
    for backend, pieces in (("ulysses", 2), ("ring", 1), ("zigzag_ring", 1), ("usp", 1)):
        assert SequenceParallelAttention(backend=backend)._kv_pieces(backend, q, q, 2, None) == pieces, backend
    assert SequenceParallelAttention(backend="ulysses", kernel="torch")._kv_pieces("ulysses", q, q, 2, None) == 1
    short = torch.zeros(()).expand(1, 1024, 8, 64)
    assert SequenceParallelAttention(backend="ulysses")._kv_pieces("ulysses", short, short, 2, None) == 1
    assert SequenceParallelAttention(backend="ulysses", kv_pieces=1)._kv_pieces("ulysses", q, q, 2, None) == 1


def test_length_bucket_is_the_next_power_of_two():
    assert [choices.length_bucket(n) for n in (1, 2, 3, 1000, 1024, 1025)] == [1, 2, 4, 1024, 1024, 2048]


def test_auto_policy(monkeypatch):
    monkeypatch.delenv("LIGHTNING_SP_AUTO", raising=False)
    assert choices.auto_policy(None, None) == "measure"
    assert choices.auto_policy(None, "cpu-default") == "model"  # a profile given: the user wants the model
    assert choices.auto_policy("measure", "cpu-default") == "measure"
    monkeypatch.setenv("LIGHTNING_SP_AUTO", "model")
    assert choices.auto_policy(None, None) == "model"
    with pytest.raises(ValueError, match="auto_policy must be 'measure' or 'model'"):
        choices.auto_policy("fastest", None)


def test_cache_path_follows_the_environment(monkeypatch, tmp_path):
    monkeypatch.setenv("LIGHTNING_SP_CACHE_DIR", str(tmp_path))
    assert choices.auto_cache_path() == tmp_path / "auto_backend.json"
    choices._write_cache(choices.auto_cache_path(), "k", "ulysses")
    choices._write_cache(choices.auto_cache_path(), "j", "zigzag_ring")  # merged, not replaced
    assert choices._read_cache(choices.auto_cache_path()) == {"k": "ulysses", "j": "zigzag_ring"}
    (tmp_path / "auto_backend.json").write_text("[1, 2")  # damaged: read as empty, never raises
    assert choices._read_cache(choices.auto_cache_path()) == {}


@pytest.mark.parametrize("kw, match", [
    ({"kv_pieces": "many"}, "kv_pieces must be an int >= 1"),
    ({"kv_pieces": 0}, "kv_pieces must be an int >= 1"),
    ({"memory_budget": 0}, "memory_budget must be a positive int"),
    ({"memory_budget": 1.5e9}, "memory_budget must be a positive int"),
])
def test_bad_arguments_name_what_to_change(kw, match):
    with pytest.raises(ValueError, match=match):
        SequenceParallelAttention(**kw)
