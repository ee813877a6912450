"""Models without a process group: shapes, rotary, document masking, config errors, loss falls."""

from __future__ import annotations

import lightning as L
import pytest
import torch

from lightning_sp.data import DigitSequenceDataModule, ProteinDataModule
from lightning_sp.models import MultimodalDecoder, ProteinEncoder, TransformerConfig, rotary


def test_rotary_is_relative():
    torch.manual_seed(0)
    q, k = torch.randn(1, 1, 2, 8), torch.randn(1, 1, 2, 8)
    def score(pq, pk):
        return (rotary(q, torch.tensor([[pq]]), 10_000.0) * rotary(k, torch.tensor([[pk]]), 10_000.0)).sum(-1)
    assert torch.allclose(score(3, 1), score(103, 101), atol=1e-5)  # depends on the offset only
    assert not torch.allclose(score(3, 1), score(3, 2), atol=1e-3)  # negative control
    assert torch.equal(rotary(q, torch.zeros(1, 1, dtype=torch.long), 10_000.0), q)


def test_protein_encoder_shapes_and_global_positions():
    torch.manual_seed(0)
    m = ProteinEncoder(d_model=32, n_layers=2, n_heads=4, n_kv_heads=2).eval()
    with torch.no_grad():  # sharpen attention so that positions visibly matter
        for blk in m.net.blocks:
            blk.qkv.weight.mul_(30)
    ids = torch.randint(5, 31, (2, 24))  # [B, S]
    assert m(ids).shape == (2, 24, 31)
    # explicit positions 0..S-1 equal the default; shifting all positions by a constant changes
    # nothing (rotary is relative), but a permutation of positions does
    pos = torch.arange(24).expand(2, 24)
    assert torch.allclose(m(ids, pos), m(ids))
    assert torch.allclose(m(ids, pos + 1000), m(ids), atol=1e-4)
    assert not torch.allclose(m(ids, pos.flip(-1)), m(ids), atol=1e-3)


def test_packed_documents_do_not_see_each_other():
    torch.manual_seed(0)
    m = ProteinEncoder(d_model=32, n_layers=2, n_heads=4).eval()
    a, b = torch.randint(5, 31, (1, 10)), torch.randint(5, 31, (1, 6))
    packed = torch.cat([a, b], 1)  # [1, 16]
    cu = torch.tensor([0, 10, 16], dtype=torch.int32)
    pos = torch.cat([torch.arange(10), torch.arange(6)])[None]
    out = m(packed, pos, cu)  # [1, 16, V]
    assert torch.allclose(out[:, :10], m(a), atol=1e-5) and torch.allclose(out[:, 10:], m(b), atol=1e-5)
    assert not torch.allclose(m(packed, pos)[:, 10:], m(b), atol=1e-3)  # without cu_seqlens they mix


def test_decoder_is_causal():
    torch.manual_seed(0)
    m = MultimodalDecoder(d_model=32, n_layers=2, n_heads=2).eval()
    ids = torch.randint(0, 279, (1, 20))
    ids2 = ids.clone()
    ids2[0, 15:] = (ids2[0, 15:] + 1) % 279
    o1, o2 = m(ids), m(ids2)
    assert torch.allclose(o1[:, :15], o2[:, :15], atol=1e-6) and not torch.allclose(o1[:, 15:], o2[:, 15:])


def test_config_errors():
    with pytest.raises(ValueError, match="divisible by n_heads"):
        TransformerConfig(vocab_size=10, d_model=30, n_heads=4)
    with pytest.raises(ValueError, match="multiple of n_kv_heads=3"):
        TransformerConfig(vocab_size=10, d_model=32, n_heads=4, n_kv_heads=3)
    with pytest.raises(ValueError, match="even for rotary"):
        TransformerConfig(vocab_size=10, d_model=12, n_heads=4)
    with pytest.raises(NotImplementedError, match="dropout"):
        TransformerConfig(vocab_size=10, dropout=0.1)
    with pytest.raises(ValueError, match="lr > 0"):
        ProteinEncoder(lr=0.0)


def _fit(model, dm, steps):
    losses = []

    class Rec(L.Callback):
        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
            losses.append(float(outputs["loss"]))

    L.Trainer(max_steps=steps, accelerator="cpu", logger=False, enable_checkpointing=False, enable_progress_bar=False,
              enable_model_summary=False, limit_val_batches=0, callbacks=[Rec()]).fit(model, dm)
    return losses


def test_protein_masked_residue_loss_falls():
    L.seed_everything(0)
    dm = ProteinDataModule(context_len=1024, samples_per_epoch=60, val_samples=0)
    m = ProteinEncoder(d_model=64, n_layers=2, n_heads=4, lr=1e-2, warmup_steps=5)
    losses = _fit(m, dm, 60)
    assert len(losses) == 60
    assert abs(losses[0] - torch.log(torch.tensor(31.0)).item()) < 0.2  # starts near uniform over the vocab
    start, end = sum(losses[:5]) / 5, sum(losses[-20:]) / 20
    assert end < start - 0.25, (start, end)  # learns at least the residue frequencies (~2.95 nats)


def test_multimodal_loss_falls():
    L.seed_everything(0)
    dm = DigitSequenceDataModule(n_images=3, batch_size=8, samples_per_epoch=8 * 40, val_samples=0)
    m = MultimodalDecoder(d_model=64, n_layers=2, n_heads=4, lr=3e-3, warmup_steps=5)
    losses = _fit(m, dm, 40)
    assert sum(losses[-5:]) / 5 < 0.5 * sum(losses[:5]) / 5


@pytest.mark.parametrize("name, model_cls, vocab", [("protein_demo", ProteinEncoder, 31), ("multimodal_demo", MultimodalDecoder, 279)])
def test_demo_configs_instantiate(name, model_cls, vocab, tmp_path):
    from pathlib import Path

    from lightning_sp.cli import build_cli
    from lightning_sp.strategy import SequenceParallelStrategy

    cfg = Path(__file__).resolve().parents[2] / "experiments" / name / "config.yaml"
    cli = build_cli(["--config", str(cfg), "--trainer.logger.init_args.save_dir", str(tmp_path)], run=False)
    assert isinstance(cli.model, model_cls) and cli.model.config.vocab_size == vocab  # linked from the data module
    assert isinstance(cli.trainer.strategy, SequenceParallelStrategy) and cli.trainer.num_devices == 4


def test_cli_rejects_bad_config(tmp_path, capsys):
    from lightning_sp.cli import build_cli

    bad = tmp_path / "bad.yaml"
    bad.write_text("model:\n  class_path: lightning_sp.models.ProteinEncoder\n  init_args:\n    d_model: 30\n    n_heads: 4\n"
                   "data:\n  class_path: lightning_sp.data.ProteinDataModule\n")
    with pytest.raises(ValueError, match="divisible by n_heads"):
        build_cli(["--config", str(bad), "--trainer.logger", "false"], run=False)
