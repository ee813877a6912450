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
    assert dm.n_train_records == 2100 - 210 and len(dm.dataset.proteins) == 2100
    assert [len(f) for f in dm.dataset.family_ids] == [12, 10]
    specs = list(dm.train_sampler())
    assert [s.kind for s in specs] == ["single", "family", "single", "family"] and specs == list(dm.train_sampler())
    a, b = dm.dataset[specs[0]], dm.dataset[specs[0]]
    for k in a:
        assert torch.equal(a[k], b[k])
    batch = next(iter(dm.train_dataloader()))
    assert batch["input_ids"].shape == batch["labels"].shape == batch["position_ids"].shape == (1, 512)
    cu = batch["cu_seqlens"]
    assert cu.dim() == 1 and cu[0] == 0 and cu[-1] == 512 and (cu.diff() > 0).all()
    fam = dm.dataset[specs[1]]  # family context, one document, global positions
    assert fam["cu_seqlens"].tolist() == [0, 512] and fam["position_ids"].tolist() == list(range(512))
    val = list(dm.val_sampler())
    assert len(val) == 2 and all(r >= dm.n_train_records for s in val for r, _, _ in s.pieces)


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


# --- protein data at scale: indexed FASTA / FASTA.gz, epoch plans, sharding -------------------

import gzip  # noqa: E402
import os  # noqa: E402
import random  # noqa: E402

import numpy as np  # noqa: E402
from torch.utils.data import DistributedSampler  # noqa: E402

from lightning_sp.data import IndexedFasta, PackedContextSampler, permute_positions  # noqa: E402
from lightning_sp.data.fasta import default_index_dir  # noqa: E402
from lightning_sp.data.sampling import contexts_per_replica  # noqa: E402

AMINO = "ACDEFGHIKLMNPQRSTVWY"


def _ragged_fasta(n: int, seed: int, *, max_len: int = 300) -> str:
    """Records with ragged line widths, CRLF, blank and ';' lines, lower case and trailing '*'."""
    rng = random.Random(seed)
    out = []
    for i in range(n):
        seq = "".join(rng.choice(AMINO) for _ in range(rng.randint(1, max_len)))
        out.append(f">rec{i} protein {i}\n")
        if rng.random() < 0.1:
            seq = seq.lower()
        pos = 0
        while pos < len(seq):
            k = rng.randint(1, 90)
            out.append(seq[pos:pos + k] + ("*" if pos + k >= len(seq) and i % 7 == 0 else "") + rng.choice(["\n", "\r\n"]))
            out.append("\n" if rng.random() < 0.05 else ("; note\n" if rng.random() < 0.02 else ""))
            pos += k
    return "".join(out)


def _write(tmp_path, name: str, text: str, *, gz: bool):
    p = tmp_path / name
    if gz:
        with gzip.open(p, "wt") as f:
            f.write(text)
    else:
        p.write_text(text)
    return p


@pytest.mark.parametrize("gz", [False, True])
def test_indexed_fasta_matches_read_fasta_and_reuses_index(tmp_path, gz):
    import pyfastx

    path = _write(tmp_path, "ragged.faa.gz" if gz else "ragged.faa", _ragged_fasta(300, seed=1), gz=gz)
    ref = read_fasta(path)
    f = IndexedFasta(path, index_dir=tmp_path / "idx")
    assert f.built_now and len(f) == len(ref) == 300
    assert f.lengths.tolist() == [len(r.sequence) for r in ref]
    order = list(range(len(ref)))
    random.Random(0).shuffle(order)
    assert all(f.record(i) == ref[i] for i in order)  # by number, in random order
    assert list(f) == ref  # streaming pass
    # negative control: pyfastx's own .seq is wrong on ragged lines, which is why records are parsed from .raw
    native = pyfastx.Fasta(str(f.link_path))
    assert any(native[i].seq.upper().rstrip("*") != ref[i].sequence for i in range(len(ref)))
    # reuse: a second open builds nothing and leaves the index untouched
    stamp = f.fxi_path.stat().st_mtime_ns
    again = IndexedFasta(path, index_dir=tmp_path / "idx")
    assert not again.built_now and again.fxi_path.stat().st_mtime_ns == stamp and again.record(299) == ref[299]
    # stale: the file changes (one record more) -> detected and rebuilt
    _write(tmp_path, path.name, _ragged_fasta(301, seed=1), gz=gz)
    changed = IndexedFasta(path, index_dir=tmp_path / "idx")
    assert changed.built_now and len(changed) == 301 and changed.record(300) == read_fasta(path)[300]
    # damaged index parts are rebuilt, never trusted
    changed.lengths_path.write_bytes(changed.lengths_path.read_bytes()[:-8])
    assert IndexedFasta(path, index_dir=tmp_path / "idx").built_now
    changed.manifest_path.write_text("{not json")
    assert IndexedFasta(path, index_dir=tmp_path / "idx").built_now
    assert not list((tmp_path / "idx").glob("*.tmp-*"))  # temporaries never left behind


@pytest.mark.parametrize("gz", [False, True])
def test_indexed_fasta_malformed_record_names_file_and_line(tmp_path, gz):
    text = _ragged_fasta(50, seed=2)
    lines = text.splitlines(keepends=True)
    bad_line = next(i for i in range(len(lines) - 1, 0, -1) if lines[i].strip() and lines[i][0] not in ">;")
    col = len(lines[bad_line]) // 2 + 1
    lines[bad_line] = lines[bad_line][:col - 1] + "7" + lines[bad_line][col:]
    path = _write(tmp_path, "bad.faa.gz" if gz else "bad.faa", "".join(lines), gz=gz)
    with pytest.raises(FastaFormatError, match=r"invalid residue '7' at column \d+ in record 'rec\d+'") as err:
        IndexedFasta(path, index_dir=tmp_path / "idx")
    assert err.value.path == str(path) and err.value.line == bad_line + 1
    assert str(err.value).startswith(f"{path}:{bad_line + 1}: ")
    assert not list((tmp_path / "idx").glob("*")), "a failed build must leave no index behind"


def test_indexed_fasta_index_location_errors(tmp_path, monkeypatch):
    path = _write(tmp_path, "x.faa", ">a\nMKV\n", gz=False)
    blocker = tmp_path / "not_a_dir"
    blocker.write_text("")
    with pytest.raises(PermissionError, match=r"cannot write the FASTA index for .*x.faa.*pass index_dir="):
        IndexedFasta(path, index_dir=blocker / "sub")
    with pytest.raises(FileNotFoundError, match="nope.faa"):
        IndexedFasta(tmp_path / "nope.faa")
    assert default_index_dir(path) == tmp_path  # next to the data when writable
    monkeypatch.setattr(os, "access", lambda *a, **k: False)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    assert default_index_dir(path).parent == tmp_path / "cache" / "lightning_sp" / "fasta_index"
    with pytest.raises(IndexError, match="holds 1 records"):
        IndexedFasta(path, index_dir=tmp_path / "i2").record(1)


def test_permute_positions_is_a_seeded_bijection():
    for n in (1, 2, 7, 1000, 65_537):
        full = permute_positions(np.arange(n), n, (3, 0))
        assert sorted(full.tolist()) == list(range(n))
        parts = np.concatenate([permute_positions(np.arange(s, min(n, s + 999)), n, (3, 0)) for s in range(0, n, 999)])
        assert np.array_equal(parts, full)  # chunked evaluation agrees
    a, b = permute_positions(np.arange(1000), 1000, (3, 0)), permute_positions(np.arange(1000), 1000, (3, 1))
    assert not np.array_equal(a, b) and not np.array_equal(a, np.arange(1000))  # negative controls
    with pytest.raises(ValueError, match="empty range"):
        permute_positions(np.arange(0), 0, (0,))


def _plans(lengths, context_len, replicas, epoch=0, **kw):
    out = []
    for r in range(replicas):
        s = PackedContextSampler(lengths, context_len=context_len, num_replicas=replicas, rank=r, seed=5, **kw)
        s.set_epoch(epoch)
        out.append(list(s))
    return out


def test_packed_context_sampler_shards_crops_and_equalises():
    rng = np.random.default_rng(0)
    lengths = rng.integers(5, 400, size=500).astype(np.uint32)
    C, R = 256, 3
    plans = _plans(lengths, C, R)
    counts = contexts_per_replica(lengths, C, replicas=R, shuffle=True, seed=5, epoch=0)
    assert len(set(counts)) > 1, "negative control: replicas' token totals differ, so equalising is needed"
    assert [len(p) for p in plans] == [min(counts)] * R  # every replica the same number of contexts
    taken = np.zeros(len(lengths), dtype=np.int64)
    owner = {}
    for r, plan in enumerate(plans):
        for spec in plan:
            assert spec.kind == "single" and sum(stop - start for _, start, stop in spec.pieces) == C
            for rec, start, stop in spec.pieces:
                assert 0 <= start < stop <= int(lengths[rec]) + 2
                assert owner.setdefault(rec, r) == r, f"record {rec} read by two replicas"
                taken[rec] += stop - start
    doc = np.minimum(lengths.astype(np.int64) + 2, C)
    assert (taken <= doc).all()  # no record repeated within an epoch; long ones cropped to one window
    assert taken.sum() > 0.9 * doc.sum()  # and the epoch covers the data (only each replica's tail is dropped)
    assert _plans(lengths, C, R) == plans  # deterministic: every SP rank of a replica builds the same plan
    later = _plans(lengths, C, R, epoch=1)
    assert later != plans and _plans(lengths, C, R, epoch=1) == later
    # crops: a seeded window, re-drawn per epoch
    long = [i for i in range(len(lengths)) if lengths[i] + 2 > C]

    def windows(plans_):
        return {rec: start for plan in plans_ for spec in plan for rec, start, _ in spec.pieces if rec in long}

    assert windows(plans) != windows(later)
    # unshuffled (validation): file order, the same every epoch
    val = _plans(lengths, C, 1, epoch=3, shuffle=False)[0]
    assert val == _plans(lengths, C, 1, epoch=0, shuffle=False)[0] and val[0].pieces[0][0] == 0
    s = PackedContextSampler(lengths, context_len=C, kinds=("single", "family"), max_contexts=7, num_replicas=2, rank=1)
    assert isinstance(s, DistributedSampler)  # so Lightning does not wrap it in a second split
    assert [x.kind for x in s] == ["single", "family", "single", "family"] and len(s) == 4
    with pytest.raises(ValueError, match="kinds=\\('family',\\) only, set samples_per_epoch"):
        PackedContextSampler(lengths, context_len=C, kinds=("family",))
    with pytest.raises(ValueError, match="rank=2, num_replicas=2"):
        PackedContextSampler(lengths, context_len=C, num_replicas=2, rank=2)


class _Strategy:
    def __init__(self, dp_size, dp_rank):
        self.distributed_sampler_kwargs = {"num_replicas": dp_size, "rank": dp_rank}


class _Trainer:
    def __init__(self, dp_size, dp_rank):
        self.strategy = _Strategy(dp_size, dp_rank)


def test_protein_datamodule_reads_user_gz_only_own_records_and_exact_tokens(tmp_path):
    path = _write(tmp_path, "user.faa.gz", _ragged_fasta(120, seed=3, max_len=120), gz=True)
    ref = read_fasta(path)
    tok = ResidueTokenizer()

    def module(dp_size, dp_rank):
        dm = ProteinDataModule(context_len=64, kinds=("single",), single_fasta=str(path), index_dir=str(tmp_path / "idx"),
                               samples_per_epoch=None, val_samples=2, seed=1)
        dm.trainer = _Trainer(dp_size, dp_rank)  # what SequenceParallelStrategy hands over: the dp axis only
        dm.prepare_data()
        dm.setup("fit")
        return dm

    read_by = {}
    batches = {}
    for rank in (0, 1):
        dm = module(2, rank)
        seen = []
        original = dm.dataset.proteins.record
        dm.dataset.proteins.record = lambda i, _o=original, _s=seen: (_s.append(i), _o(i))[1]
        batches[rank] = list(dm.train_dataloader())
        read_by[rank] = set(seen)
        specs = list(dm.train_sampler())
        assert read_by[rank] == {r for s in specs for r, _, _ in s.pieces}  # only its own records
        for spec, batch in zip(specs, batches[rank]):
            expect = torch.cat([tok.encode(ref[r].sequence)[a:b] for r, a, b in spec.pieces])  # [64]
            ids, labels = batch["input_ids"][0], batch["labels"][0]
            assert batch["cu_seqlens"].tolist() == [0, *np.cumsum([b - a for _, a, b in spec.pieces]).tolist()]
            kept = labels == -100
            assert torch.equal(ids[kept], expect[kept]) and torch.equal(labels[~kept], expect[~kept])
            assert not torch.equal(expect, torch.roll(expect, 1))  # negative control: the comparison can fail
    assert not read_by[0] & read_by[1] and len(batches[0]) == len(batches[1]) > 0
    assert max(read_by[0] | read_by[1]) < dm.n_train_records  # validation proteins stay out of training
    # another rank of dp replica 0's sequence-parallel group: the same batches, tensor for tensor
    twin = list(module(2, 0).train_dataloader())
    assert all(torch.equal(x[k], y[k]) for x, y in zip(twin, batches[0]) for k in x)
    assert not all(torch.equal(x["input_ids"], y["input_ids"]) for x, y in zip(batches[0], batches[1]))


def test_indexed_fasta_concurrent_builders_agree(tmp_path):
    # Several ranks opening a new file at once (no prepare_data): every build is atomic, all agree.
    import multiprocessing as mp

    path = _write(tmp_path, "shared.faa.gz", _ragged_fasta(200, seed=4), gz=True)
    ctx = mp.get_context("fork")
    procs = [ctx.Process(target=IndexedFasta, args=(path,), kwargs={"index_dir": tmp_path / "idx"}) for _ in range(3)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(120)
    assert [p.exitcode for p in procs] == [0, 0, 0]
    f = IndexedFasta(path, index_dir=tmp_path / "idx")
    assert not f.built_now and [f.record(i) for i in range(len(f))] == read_fasta(path)
    assert not list((tmp_path / "idx").glob("*.tmp-*"))


def test_sampler_refuses_a_replica_without_a_context():
    with pytest.raises(ValueError, match="fewer than context_len=512 tokens .* fewer data-parallel replicas"):
        len(PackedContextSampler(np.full(10, 100, dtype=np.uint32), context_len=512, num_replicas=4, rank=0))


def test_whole_packing_length_buckets_never_split_and_pad_to_the_budget(tmp_path):
    from lightning_sp.data.sampling import PAD_RECORD

    rng = np.random.default_rng(1)
    lengths = rng.integers(5, 300, size=600).astype(np.uint32)
    C, R = 256, 2
    split = _plans(lengths, C, R)
    whole = _plans(lengths, C, R, packing="whole", bucket_records=64)
    assert [len(p) for p in whole] == [len(p) for p in split]  # the same equalising rule holds
    docs = np.minimum(lengths.astype(np.int64) + 2, C)
    pad = 0
    seen = set()
    for plan in whole:
        for spec in plan:
            assert sum(b - a for _, a, b in spec.pieces) == C
            for rec, a, b in spec.pieces:
                if rec == PAD_RECORD:
                    pad += b - a
                    continue
                assert b - a == docs[rec] and rec not in seen  # whole (or the cropped window), once
                seen.add(rec)
    assert any(r == PAD_RECORD for s in whole[0] for r, _, _ in s.pieces)  # negative control: padding exists
    assert pad < 0.05 * len(whole[0]) * C * R  # length buckets keep padding small
    # through the dataset: padding is <pad>, never a target, and its own cu_seqlens segment
    path = _write(tmp_path, "w.faa", _ragged_fasta(80, seed=5, max_len=60), gz=False)
    dm = ProteinDataModule(context_len=128, kinds=("single",), single_fasta=[str(path)], index_dir=str(tmp_path / "i"),
                           samples_per_epoch=None, val_samples=0, packing="whole", bucket_records=16)
    dm.setup("fit")
    tok = ResidueTokenizer()
    for spec in dm.train_sampler():
        s = dm.dataset[spec]
        ends = np.cumsum([b - a for _, a, b in spec.pieces]).tolist()
        assert s["cu_seqlens"].tolist() == [0, *ends]
        if spec.pieces[-1][0] == PAD_RECORD:
            tail = slice(ends[-2] if len(ends) > 1 else 0, ends[-1])
            assert (s["input_ids"][tail] == tok.pad_id).all() and (s["labels"][tail] == -100).all()
    with pytest.raises(ValueError, match="packing must be 'split' or 'whole'"):
        ProteinDataModule(packing="bucket")

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
