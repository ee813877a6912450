"""A run stopped mid-epoch and resumed from its last checkpoint reads the same samples in the same order as
one that never stopped (Note [Resuming mid-epoch]): the project's data modules, in one process, through
Lightning's own fit loop and ``ModelCheckpoint``. Stops in the middle of an epoch, at an epoch's end, in a
later epoch, with a worker process; the negative control is the same resume through a plain ``DataLoader``
(Lightning restarts the epoch from its first sample)."""

from __future__ import annotations

import warnings
from pathlib import Path

import lightning as L
import pytest
import torch
from lightning.pytorch.callbacks import ModelCheckpoint
from torch.utils.data import DataLoader, DistributedSampler, IterableDataset

from lightning_sp.data import DigitSequenceDataModule, ProteinDataModule, ResumableDataLoader



class Crash(RuntimeError):
    """Raised in place of a killed process."""


class Recorder(L.LightningModule):
    """Records every training batch's samples (their token ids) and takes an SGD step on a loss that reads
    them, so the parameter is a function of the whole sample order."""

    def __init__(self, crash_at_step: int | None = None) -> None:
        super().__init__()
        self.weight = torch.nn.Parameter(torch.zeros((), dtype=torch.float64))
        self.crash_at_step = crash_at_step
        self.seen: list[tuple[int, tuple]] = []  # (global step, the batch's token ids)

    def training_step(self, batch, batch_idx):
        if self.global_step == self.crash_at_step:
            raise Crash(f"killed at step {self.global_step}")
        ids = batch["input_ids"]
        self.seen.append((self.global_step, tuple(map(tuple, ids.tolist()))))
        return (self.weight - ids.to(torch.float64).mean() / 10) ** 2

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)


def _trainer(tmp: Path, steps: int, every: int) -> L.Trainer:
    return L.Trainer(accelerator="cpu", devices=1, max_steps=steps, logger=False, enable_progress_bar=False,
                     enable_model_summary=False, limit_val_batches=0, default_root_dir=tmp,
                     callbacks=[ModelCheckpoint(dirpath=tmp / "ckpt", every_n_train_steps=every, save_top_k=0,
                                                save_last=True, enable_version_counter=False)])


def _digits(num_workers: int = 0) -> DigitSequenceDataModule:
    # 3 batches of 2 per epoch
    return DigitSequenceDataModule(n_images=2, batch_size=2, samples_per_epoch=6, val_samples=0, seed=3,
                                   num_workers=num_workers)


def _proteins(fasta: Path) -> ProteinDataModule:
    # 3 packed contexts per epoch (of about 25 the records fill), one per batch
    return ProteinDataModule(context_len=64, kinds=("single",), single_fasta=[str(fasta)], index_dir=str(fasta.parent),
                             samples_per_epoch=3, val_samples=0, seed=5)


@pytest.fixture(scope="module")
def fasta(tmp_path_factory) -> Path:
    """40 proteins of 20-60 random residues."""
    gen = torch.Generator().manual_seed(7)
    residues = "ACDEFGHIKLMNPQRSTVWY"
    path = tmp_path_factory.mktemp("fasta") / "proteins.faa"
    records = []
    for i in range(40):
        n = int(torch.randint(20, 61, (), generator=gen))
        records.append(f">p{i}\n" + "".join(residues[j] for j in torch.randint(0, 20, (n,), generator=gen).tolist()))
    path.write_text("\n".join(records) + "\n")
    return path


def _plain(module: L.LightningDataModule) -> L.LightningDataModule:
    """The same module, its training loader a plain ``DataLoader`` over the same sampler (the control)."""
    resumable = module.train_dataloader

    def train_dataloader():
        loader = resumable()
        return DataLoader(loader.dataset, batch_size=loader.batch_size, sampler=loader.sampler,
                          collate_fn=loader.collate_fn, num_workers=loader.num_workers)

    module.train_dataloader = train_dataloader
    return module


def _run(make_data, tmp: Path, *, steps: int, stop_after: int | None, plain: bool = False) -> tuple[list, float]:
    """Train ``steps`` steps, checkpointing every ``stop_after`` (>= 2) steps; with ``stop_after``, crash one step
    after the first checkpoint and resume a fresh trainer, model and data module from ``ckpt_path="last"``. Returns
    the (step, samples) of every step trained, in order, and the final parameter."""
    wrap = _plain if plain else (lambda m: m)
    if stop_after is None:
        model = Recorder()
        _trainer(tmp, steps, every=steps).fit(model, wrap(make_data()))
        return model.seen, model.weight.item()
    first = Recorder(crash_at_step=stop_after + 1)
    with pytest.raises(Crash):
        _trainer(tmp, steps, every=stop_after).fit(first, wrap(make_data()))
    assert (tmp / "ckpt" / "last.ckpt").is_file()
    second = Recorder()
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*not resumable.*")  # the control's warning
        _trainer(tmp, steps, every=stop_after).fit(second, wrap(make_data()), ckpt_path="last")
    # the crash came one step after the checkpoint: that step is trained again after the resume
    return [s for s in first.seen if s[0] < stop_after] + second.seen, second.weight.item()


CASES = [  # (data, steps, stop after step): 3 batches per epoch
    ("digits", 7, 2),  # mid-epoch 0
    ("digits", 7, 3),  # at the end of epoch 0
    ("digits", 7, 5),  # mid-epoch 1 (the sampler's second permutation)
    ("digits-worker", 5, 2),  # a worker process draws the indices
    ("proteins", 5, 2),  # packed contexts (PackedContextSampler), mid-epoch 0
    ("proteins", 6, 4),  # mid-epoch 1
]


def _maker(data: str, fasta: Path):
    return {"digits": _digits, "digits-worker": lambda: _digits(num_workers=1), "proteins": lambda: _proteins(fasta)}[data]


@pytest.mark.parametrize("data,steps,stop_after", CASES)
def test_resume_mid_epoch_reads_the_uninterrupted_order(tmp_path, fasta, data, steps, stop_after):
    make = _maker(data, fasta)
    L.seed_everything(0, verbose=False)
    reference, ref_weight = _run(make, tmp_path / "reference", steps=steps, stop_after=None)
    resumed, weight = _run(make, tmp_path / "resumed", steps=steps, stop_after=stop_after)
    assert [s for s, _ in reference] == list(range(steps))
    assert resumed == reference, f"resumed after step {stop_after}: the steps read other samples"
    assert weight == ref_weight  # same samples, same order, same float64 arithmetic: bit-equal


@pytest.mark.parametrize("data,steps,stop_after", [("digits", 7, 5), ("proteins", 5, 2)])
def test_control_a_plain_dataloader_restarts_the_epoch(tmp_path, fasta, data, steps, stop_after):
    """Negative control: without the loader's state the resumed epoch starts again from its first batch,
    so the run reads other samples than the uninterrupted one (Lightning only warns)."""
    make = _maker(data, fasta)
    reference, _ = _run(make, tmp_path / "reference", steps=steps, stop_after=None, plain=True)
    resumed, _ = _run(make, tmp_path / "resumed", steps=steps, stop_after=stop_after, plain=True)
    assert [s for s, _ in resumed] == list(range(steps))
    assert resumed != reference


def test_loader_state_roundtrip_and_bad_state():
    """The state is plain ints; a loaded position applies to its own epoch only, once; junk is refused."""
    data = list(range(12))
    sampler = DistributedSampler(data, num_replicas=2, rank=1, shuffle=True, seed=0)
    loader = ResumableDataLoader(data, batch_size=2, sampler=sampler)
    sampler.set_epoch(1)
    whole = [b.tolist() for b in loader]
    it = iter(loader)
    next(it), next(it)
    assert loader.state_dict() == {"epoch": 1, "batches": 2}
    fresh = ResumableDataLoader(data, batch_size=2, sampler=DistributedSampler(data, num_replicas=2, rank=1, seed=0))
    fresh.load_state_dict(loader.state_dict())
    fresh.sampler.set_epoch(1)
    assert len(fresh) == len(whole) == 3  # the epoch's length is unchanged by a resume
    assert [b.tolist() for b in fresh] == whole[2:]
    assert fresh.state_dict() == {"epoch": 1, "batches": 3}
    assert [b.tolist() for b in fresh] == whole  # the position was used once
    other = ResumableDataLoader(data, batch_size=2, sampler=DistributedSampler(data, num_replicas=2, rank=1, seed=0))
    other.load_state_dict({"epoch": 0, "batches": 2})
    other.sampler.set_epoch(1)  # another epoch than the saved one: it starts at its beginning
    assert [b.tolist() for b in other] == whole
    for bad in ({"batches": -1, "epoch": 0}, {"epoch": 0}, {"batches": 1, "epoch": "1"}):
        with pytest.raises(ValueError, match="ResumableDataLoader state"):
            other.load_state_dict(bad)


def test_an_iterable_dataset_is_refused():
    """Skipping the sampler's first batches would not move an ``IterableDataset``: refused, naming the way out."""

    class Stream(IterableDataset):
        def __iter__(self):
            return iter(range(4))

    with pytest.raises(TypeError, match="IterableDataset.*state_dict"):
        ResumableDataLoader(Stream(), batch_size=2)


def test_lightning_sampler_injection_keeps_the_loader_resumable():
    """Lightning re-creates a loader to inject its ``DistributedSampler`` (a strategy's
    ``distributed_sampler_kwargs``); the re-created loader is still a ``ResumableDataLoader``."""
    from lightning.pytorch.utilities.data import _update_dataloader

    data = list(range(8))
    loader = ResumableDataLoader(data, batch_size=2, shuffle=True)
    swapped = _update_dataloader(loader, DistributedSampler(data, num_replicas=2, rank=0, seed=0))
    assert isinstance(swapped, ResumableDataLoader) and isinstance(swapped.sampler, DistributedSampler)
    assert swapped.batch_size == 2
