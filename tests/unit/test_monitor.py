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


def test_measured_peak_uses_the_trained_dtype(monkeypatch):
    """``peak_flops="measure"`` times matmuls in the dtype (and on the device) the model trains in: measured
    once the precision plugin has converted the module (bf16-true here), not before."""
    import lightning as L
    from torch.utils.data import DataLoader

    seen = []
    monkeypatch.setattr(SequenceParallelMonitor, "measure_matmul_flops",
                        staticmethod(lambda device, dtype=torch.float32, **kw: seen.append((device.type, dtype)) or 1e12))

    class Tiny(L.LightningModule):
        def __init__(self):
            super().__init__()
            self.lin = torch.nn.Linear(4, 4)

        def training_step(self, batch, batch_idx):
            return self.lin(batch.to(self.lin.weight.dtype)).float().sum()

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=0.1)

    trainer = L.Trainer(accelerator="cpu", devices=1, precision="bf16-true", max_steps=1, logger=False,
                        callbacks=[SequenceParallelMonitor(peak_flops="measure")], enable_progress_bar=False,
                        enable_checkpointing=False, enable_model_summary=False)
    trainer.fit(Tiny(), DataLoader(torch.randn(4, 4), batch_size=2))
    assert seen == [("cpu", torch.bfloat16)], seen
