"""Data pipeline: FASTA errors with file:line, tokenizer, packing, masking, real protein and digit data."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from lightning_sp.data import (
    DigitSequenceDataModule, DigitSequenceDataset, FastaFormatError, MultimodalDataConfig, MultimodalVocab,
    ProteinDataConfig, ProteinDataModule, ResidueTokenizer, greedy_pack, mask_residues, pack_documents, read_fasta,
)
from lightning_sp.data.multimodal import image_to_patch_codes

FIXTURE = Path(__file__).parent / "fixtures" / "tiny.faa"


def test_read_fasta_fixture():
    recs = read_fasta(FIXTURE)
    assert [r.id for r in recs] == ["sp|P00001|TEST1", "sp|P00002|TEST2", "P00003"]
    assert recs[0].sequence == "MKTAYIAKQRQISFVKSHFSRQLEERLGLIEVQ"
    assert recs[0].description == "first test protein"
    assert recs[1].sequence.endswith("FPGG")  # trailing stop removed
    assert [r.line for r in recs] == [1, 4, 7]


@pytest.mark.parametrize(
    "text, line, match",
    [
        ("MKV\n>a\nMKV\n", 1, "before the first '>' header"),
        (">a\nMKV\n>\nMKV\n", 3, "no sequence identifier"),
        (">a\nMKV\n>b\n>c\nMK\n", 3, "'b' has no residues"),
        (">a\nMKV\n>b\nMK1V\n", 4, r"invalid residue '1' at column 3 in record 'b'"),
        (">a\nMK*\nVV\n", 2, r"'\*' \(stop\) inside record 'a'"),
        (">a\nMK*V\n", 2, r"invalid residue '\*'"),
        ("\n\n", 1, "no FASTA records"),
        (">a\n", 1, "'a' has no residues"),
    ],
)
def test_read_fasta_bad_records_name_file_and_line(tmp_path, text, line, match):
    p = tmp_path / "bad.faa"
    p.write_text(text)
    with pytest.raises(FastaFormatError, match=match) as err:
        read_fasta(p)
    assert err.value.line == line and err.value.path == str(p)
    assert str(err.value).startswith(f"{p}:{line}: ")


def test_read_fasta_missing_file(tmp_path):
    with pytest.raises(FileNotFoundError, match="nope.faa"):
        read_fasta(tmp_path / "nope.faa")


def test_tokenizer_roundtrip_and_errors():
    tok = ResidueTokenizer()
    ids = tok.encode("MKVW")
    assert ids.tolist()[0] == tok.cls_id and ids.tolist()[-1] == tok.eos_id and ids.numel() == 6
    assert tok.decode(ids) == "MKVW"
    assert len(set(tok.encode("ACDEFGHIKLMNPQRSTVWY", add_special=False).tolist())) == 20
    with pytest.raises(ValueError, match=r"cannot tokenize '1' at position 2"):
        tok.encode("MK1")
    assert ResidueTokenizer(unknown="map").encode("M1", add_special=False).tolist() == [tok.index["M"], tok.unk_id]
    with pytest.raises(ValueError, match="unknown must be"):
        ResidueTokenizer(unknown="drop")


def test_pack_documents_and_greedy_pack():
    docs = [torch.arange(5), torch.arange(3) + 10, torch.arange(4) + 20]
    out = pack_documents(docs)
    assert out["cu_seqlens"].tolist() == [0, 5, 8, 12] and out["cu_seqlens"].dtype == torch.int32
    assert out["position_ids"].tolist() == [0, 1, 2, 3, 4, 0, 1, 2, 0, 1, 2, 3]
    assert out["input_ids"].tolist() == list(range(5)) + [10, 11, 12] + [20, 21, 22, 23]
    assert pack_documents(docs, restart_positions=False)["position_ids"].tolist() == list(range(12))
    ctxs = greedy_pack(docs, 7)
    # 12 tokens into contexts of 7: one full context; the incomplete tail (5 tokens) is dropped
    assert [[d.tolist() for d in c] for c in ctxs] == [[[0, 1, 2, 3, 4], [10, 11]]]
    with pytest.raises(ValueError, match="non-empty 1-D"):
        pack_documents([torch.zeros(2, 2)])
    with pytest.raises(ValueError, match="at least one"):
        pack_documents([])


def test_mask_residues_only_masks_residues():
    tok = ResidueTokenizer()
    ids = torch.cat([tok.encode("M" * 200), tok.encode("K" * 200)])
    g = torch.Generator().manual_seed(0)
    masked, labels = mask_residues(ids, tok, 0.15, g)
    sel = labels != -100
    assert 0.08 < sel.float().mean() < 0.22
    assert (labels[sel] == ids[sel]).all()
    assert (ids[sel] >= tok.first_residue_id).all()  # specials never selected
    assert (masked[~sel] == ids[~sel]).all()  # unselected tokens unchanged
    assert (masked[sel] == tok.mask_id).float().mean() > 0.6


def test_protein_config_errors():
    with pytest.raises(ValueError, match="context_len"):
        ProteinDataConfig(context_len=4)
    with pytest.raises(ValueError, match="kinds"):
        ProteinDataConfig(kinds=("msa",))
    with pytest.raises(ValueError, match="mask_prob"):
        ProteinDataConfig(mask_prob=1.5)


def test_protein_datamodule_real_data_is_deterministic():
    dm = ProteinDataModule(context_len=512, samples_per_epoch=4, val_samples=2)
    dm.setup("fit")
    # 2,100 real proteins from pyhmmer's genome file, minus the held-out 10%
    assert len(dm.train_set.protein_ids) == 2100 - 210
    assert [len(f) for f in dm.train_set.family_ids] == [12, 10]
    a, b = dm.train_set[0], dm.train_set[0]
    for k in a:
        assert torch.equal(a[k], b[k])
    batch = next(iter(dm.train_dataloader()))
    assert batch["input_ids"].shape == batch["labels"].shape == batch["position_ids"].shape == (1, 512)
    cu = batch["cu_seqlens"]
    assert cu.dim() == 1 and cu[0] == 0 and cu[-1] == 512 and (cu.diff() > 0).all()
    fam = dm.train_set[1]  # odd index: family context, one document, global positions
    assert fam["cu_seqlens"].tolist() == [0, 512] and fam["position_ids"].tolist() == list(range(512))
    assert len(dm.val_set) == 2


def test_protein_datamodule_bad_fasta_path_is_reported(tmp_path):
    bad = tmp_path / "broken.faa"
    bad.write_text(">ok\nMKV\nMK?V\n")
    dm = ProteinDataModule(context_len=64, kinds=("single",), single_fasta=[str(bad)])
    with pytest.raises(FastaFormatError, match=r"broken.faa:3: invalid residue '\?'"):
        dm.setup("fit")


def test_patch_codes():
    img = torch.zeros(8, 8).numpy()
    img[0, 0] = 16  # top-left pixel of the first patch -> level 3, weight 1
    img[7, 7] = 16  # bottom-right pixel of the last patch -> level 3, weight 4**3
    codes = image_to_patch_codes(img)
    assert codes.shape == (16,) and codes[0] == 3 and codes[15] == 3 * 64 and codes[1:15].sum() == 0


def test_digit_sequences_long_range_question():
    cfg = MultimodalDataConfig(n_images=4, samples_per_epoch=3)
    ds = DigitSequenceDataset(cfg, split="train")
    v = MultimodalVocab()
    s = ds[0]
    n = 21 * 4 + 9
    assert s["input_ids"].shape == (n,) == (cfg.seq_len,)
    toks = [v.tokens[i] for i in s["input_ids"].tolist()]
    assert toks[0] == "<bos>" and toks[1] == "<img>" and toks[18] == "</img>" and toks[-2] in "0123456789"
    assert toks[-8:-2] == ["what", "was", "the", "first", "image", "?"]
    # the answer is the caption of the first image, 80+ tokens back
    assert toks[-2] == toks[21]
    assert s["answer_mask"].sum() == 1 and s["labels"][s["answer_mask"]].item() == s["input_ids"][-2].item()
    # patch tokens are inputs, never targets
    tgt = s["labels"][s["labels"] != -100]
    assert (tgt < v.patch0).all()
    assert not torch.equal(ds[0]["input_ids"], ds[1]["input_ids"])
    # truncated baseline: same tail, first image gone
    t = DigitSequenceDataset(MultimodalDataConfig(n_images=4, samples_per_epoch=3, truncate_to=40), split="train")[0]
    assert torch.equal(t["input_ids"], s["input_ids"][-40:]) and t["answer_mask"].sum() == 1
    with pytest.raises(ValueError, match="n_images must be >= 2"):
        MultimodalDataConfig(n_images=1)


def test_digit_datamodule_batches():
    dm = DigitSequenceDataModule(n_images=2, batch_size=4, samples_per_epoch=8, val_samples=4)
    dm.setup("fit")
    b = next(iter(dm.train_dataloader()))
    assert b["input_ids"].shape == (4, 51) and b["answer_mask"].dtype == torch.bool
    assert len(dm.val_set) == 4 and dm.vocab_size == 279


def test_data_modules_split_samples_over_the_data_parallel_axis():
    """Each data-parallel replica reads its own samples (the strategy's ``distributed_sampler_kwargs``);
    together the replicas read what one process reads. Regression: the sampler once looked for
    ``module._trainer``, which a ``LightningDataModule`` does not have, so every replica read the same."""
    from types import SimpleNamespace

    def first_ids(replicas: int, rank: int) -> list[int]:
        dm = DigitSequenceDataModule(n_images=2, batch_size=1, samples_per_epoch=8, val_samples=0)
        dm.trainer = SimpleNamespace(strategy=SimpleNamespace(
            distributed_sampler_kwargs={"num_replicas": replicas, "rank": rank}))
        dm.setup("fit")
        loader = dm.train_dataloader()
        assert (loader.sampler.num_replicas, loader.sampler.rank) == (replicas, rank)
        return list(loader.sampler)

    one = first_ids(1, 0)
    r0, r1 = first_ids(2, 0), first_ids(2, 1)
    assert r0 != r1  # negative control: the replicas differ
    assert sorted(r0 + r1) == sorted(one) and [i for pair in zip(r0, r1) for i in pair] == one
