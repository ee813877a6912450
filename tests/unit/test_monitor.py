import pytest
import torch

from lightning_sp.callbacks import SequenceParallelMonitor, megatron_flops_per_iteration


def test_measured_peak_is_a_positive_rate_and_bad_values_raise():
    rate = SequenceParallelMonitor.measure_matmul_flops(torch.device("cpu"), size=128, seconds=0.05)
    assert 1e6 < rate < 1e15
    with pytest.raises(ValueError, match="'measure'"):
        SequenceParallelMonitor(peak_flops="vendor")


def test_megatron_formula_by_hand():
    # 72*B*L*s*h^2*(1 + s/(6h) + V/(12hL)) with B=2, L=3, s=64, h=32, V=96
    expected = 72 * 2 * 3 * 64 * 32**2 * (1 + 64 / (6 * 32) + 96 / (12 * 32 * 3))
    assert megatron_flops_per_iteration(batch=2, seq_len=64, num_layers=3, hidden=32, vocab=96) == pytest.approx(expected)
