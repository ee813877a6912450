"""Lightning data modules for the protein and multimodal demos.

Each module is deterministic in ``seed`` and sample index, so every rank of a sequence-parallel
group builds the same global sample before the strategy shards it. The data-parallel split comes
from the strategy's ``distributed_sampler_kwargs`` (the data-parallel axis only). The training loaders
are ``ResumableDataLoader``s: a checkpoint written mid-epoch resumes at the next batch of that epoch
(Note [Resuming mid-epoch]).
"""

from __future__ import annotations

import os
from typing import Sequence

import lightning as L
import numpy as np
from torch.utils.data import DataLoader, Dataset, DistributedSampler
from typing_extensions import override

from lightning_sp.data.multimodal import DigitSequenceDataset, MultimodalDataConfig, MultimodalVocab, collate_stack
from lightning_sp.data.proteins import ProteinContextDataset, ProteinDataConfig, collate_packed, load_protein_records
from lightning_sp.data.sampling import PackedContextSampler, ResumableDataLoader
from lightning_sp.data.tokenizer import ResidueTokenizer


def data_parallel_kwargs(module: L.LightningDataModule) -> dict[str, int]:
    """``num_replicas`` and ``rank`` of the data-parallel axis (1 and 0 without a trainer).

    From the strategy's ``distributed_sampler_kwargs``: the data-parallel axis only for
    ``SequenceParallelStrategy``, so every rank of a sequence-parallel group gets the same samples.
    """
    trainer = getattr(module, "trainer", None)  # LightningDataModule.trainer: set by the Trainer, else None
    kwargs = getattr(trainer.strategy, "distributed_sampler_kwargs", None) if trainer is not None else None
    kwargs = kwargs or {"num_replicas": 1, "rank": 0}
    return {"num_replicas": kwargs["num_replicas"], "rank": kwargs["rank"]}


def data_parallel_sampler(module: L.LightningDataModule, dataset: Dataset, *, shuffle: bool, seed: int) -> DistributedSampler:
    """A seeded sampler over the data-parallel axis, identical with and without a strategy.

    Lightning would otherwise swap in its own ``DistributedSampler(shuffle=True)`` under a
    distributed strategy but a ``RandomSampler`` without one, so the same config would see different
    batches with and without sequence parallelism.
    """
    return DistributedSampler(dataset, **data_parallel_kwargs(module), shuffle=shuffle, seed=seed)


class ProteinDataModule(L.LightningDataModule):
    """Masked-residue contexts of ``context_len`` tokens from real proteins (see ``data/proteins.py``).

    ``single_fasta``: the user's FASTA / FASTA.gz files (UniRef50/90, BFD, ...; any size): indexed
    once (``prepare_data``, next to the data or in ``index_dir``), then each data-parallel replica
    reads only its own records (``data/sampling.py``). ``samples_per_epoch=None``: one pass over them.
    """

    def __init__(
        self,
        *,
        context_len: int = 1024,
        kinds: Sequence[str] = ("single", "family"),
        single_fasta: list[str] | str | None = None,
        family_fasta: list[str] | None = None,
        index_dir: str | None = None,
        packing: str = "split",
        bucket_records: int = 256,
        mask_prob: float = 0.15,
        samples_per_epoch: int | None = 64,
        val_samples: int = 8,
        val_fraction: float = 0.1,
        seed: int = 0,
        num_workers: int = 0,
    ) -> None:
        super().__init__()
        if isinstance(single_fasta, (str, os.PathLike)):
            single_fasta = [single_fasta]
        self.config = ProteinDataConfig(
            context_len=context_len, kinds=tuple(kinds), single_fasta=[os.fspath(p) for p in single_fasta or []],
            family_fasta=list(family_fasta or []), index_dir=index_dir, packing=packing, bucket_records=bucket_records,
            mask_prob=mask_prob,
            samples_per_epoch=samples_per_epoch, val_fraction=val_fraction, seed=seed,
        )
        if val_samples < 0:
            raise ValueError(f"val_samples must be >= 0, got {val_samples}")
        self.val_samples, self.num_workers = val_samples, num_workers
        self.tokenizer = ResidueTokenizer()

    @property
    def vocab_size(self) -> int:
        return self.tokenizer.vocab_size

    @override
    def prepare_data(self) -> None:
        # One process per node (Lightning) builds or checks the indexes before any rank opens them;
        # builds are atomic, so a rank racing it (no prepare_data, e.g. without Lightning) is safe too.
        load_protein_records(self.config)

    @override
    def setup(self, stage: str | None = None) -> None:
        proteins, families = load_protein_records(self.config)
        n = 0 if proteins is None else len(proteins)
        self.n_val_records = int(n * self.config.val_fraction)
        self.n_train_records = n - self.n_val_records
        self.dataset = ProteinContextDataset(proteins=proteins, families=families, config=self.config, tokenizer=self.tokenizer)
        lengths = proteins.lengths if proteins is not None else np.zeros(0, dtype=np.uint32)
        self.train_lengths, self.val_lengths = lengths[: self.n_train_records], lengths[self.n_train_records:]
        # Validation: held-out proteins only (families are too few to split), the same contexts every epoch.
        # (every replica needs a whole context of held-out tokens; R * (context_len + 1): slack for the split)
        val_tokens = int(np.sum(np.minimum(self.val_lengths.astype(np.int64) + 2, self.config.context_len)))
        replicas = data_parallel_kwargs(self)["num_replicas"]
        self.has_val = bool(self.val_samples) and val_tokens >= replicas * (self.config.context_len + 1) + self.config.context_len

    @property
    def train_set(self) -> ProteinContextDataset:
        return self.dataset

    def train_sampler(self) -> PackedContextSampler:
        kinds = [k for k in self.config.kinds if k in self.dataset.kinds]
        return PackedContextSampler(
            self.train_lengths, context_len=self.config.context_len, **data_parallel_kwargs(self), shuffle=True,
            seed=self.config.seed, kinds=kinds, max_contexts=self.config.samples_per_epoch,
            packing=self.config.packing, bucket_records=self.config.bucket_records,
        )

    def val_sampler(self) -> PackedContextSampler:
        return PackedContextSampler(
            self.val_lengths, context_len=self.config.context_len, **data_parallel_kwargs(self), shuffle=False,
            seed=self.config.seed + 1, kinds=("single",), max_contexts=self.val_samples, record_offset=self.n_train_records,
            packing=self.config.packing, bucket_records=self.config.bucket_records,
        )

    @override
    def train_dataloader(self) -> DataLoader:
        return ResumableDataLoader(self.dataset, batch_size=1, sampler=self.train_sampler(), collate_fn=collate_packed,
                                   num_workers=self.num_workers)

    @override
    def val_dataloader(self) -> DataLoader | list:
        if not self.has_val:
            return []
        return DataLoader(self.dataset, batch_size=1, sampler=self.val_sampler(), collate_fn=collate_packed, num_workers=self.num_workers)


class DigitSequenceDataModule(L.LightningDataModule):
    """Interleaved digit-image / text sequences with a long-range question (see ``data/multimodal.py``)."""

    def __init__(
        self,
        *,
        n_images: int = 16,
        batch_size: int = 8,
        samples_per_epoch: int = 256,
        val_samples: int = 128,
        truncate_to: int | None = None,
        seed: int = 0,
        num_workers: int = 0,
    ) -> None:
        super().__init__()
        if batch_size < 1:
            raise ValueError(f"batch_size must be >= 1, got {batch_size}")
        self.config = MultimodalDataConfig(n_images=n_images, samples_per_epoch=samples_per_epoch, truncate_to=truncate_to, seed=seed)
        self.val_config = MultimodalDataConfig(n_images=n_images, samples_per_epoch=max(val_samples, 1), truncate_to=truncate_to, seed=seed)
        self.batch_size, self.val_samples, self.num_workers = batch_size, val_samples, num_workers

    @property
    def vocab_size(self) -> int:
        return MultimodalVocab().vocab_size

    @override
    def setup(self, stage: str | None = None) -> None:
        self.train_set = DigitSequenceDataset(self.config, split="train")
        self.val_set = DigitSequenceDataset(self.val_config, split="val") if self.val_samples else None

    @override
    def train_dataloader(self) -> DataLoader:
        sampler = data_parallel_sampler(self, self.train_set, shuffle=True, seed=self.config.seed)
        return ResumableDataLoader(self.train_set, batch_size=self.batch_size, sampler=sampler, collate_fn=collate_stack,
                                   num_workers=self.num_workers)

    @override
    def val_dataloader(self) -> DataLoader | list:
        if self.val_set is None:
            return []
        sampler = data_parallel_sampler(self, self.val_set, shuffle=False, seed=self.config.seed)
        return DataLoader(self.val_set, batch_size=self.batch_size, sampler=sampler, collate_fn=collate_stack, num_workers=self.num_workers)
