"""Lightning data modules for the protein and multimodal demos.

Each module is deterministic in ``seed`` and sample index, so every rank of a sequence-parallel
group builds the same global sample before the strategy shards it. The data-parallel split is left
to Lightning's distributed sampler (the strategy sets it from the data-parallel axis only).
"""

from __future__ import annotations

from typing import Sequence

import lightning as L
from torch.utils.data import DataLoader, Dataset, DistributedSampler
from typing_extensions import override

from lightning_sp.data.multimodal import DigitSequenceDataset, MultimodalDataConfig, MultimodalVocab, collate_stack
from lightning_sp.data.proteins import ProteinContextDataset, ProteinDataConfig, collate_packed, load_protein_records
from lightning_sp.data.tokenizer import ResidueTokenizer


def data_parallel_sampler(module: L.LightningDataModule, dataset: Dataset, *, shuffle: bool, seed: int) -> DistributedSampler:
    """A seeded sampler over the data-parallel axis, identical with and without a strategy.

    Lightning would otherwise swap in its own ``DistributedSampler(shuffle=True)`` under a
    distributed strategy but a ``RandomSampler`` without one, so the same config would see different
    batches with and without sequence parallelism. Replicas/rank come from the strategy's
    ``distributed_sampler_kwargs`` (the data-parallel axis only, for ``SequenceParallelStrategy``).
    """
    trainer = getattr(module, "trainer", None)  # LightningDataModule.trainer: set by the Trainer, else None
    kwargs = getattr(trainer.strategy, "distributed_sampler_kwargs", None) if trainer is not None else None
    kwargs = kwargs or {"num_replicas": 1, "rank": 0}
    return DistributedSampler(dataset, num_replicas=kwargs["num_replicas"], rank=kwargs["rank"], shuffle=shuffle, seed=seed)


class ProteinDataModule(L.LightningDataModule):
    """Masked-residue contexts of ``context_len`` tokens from real proteins (see ``data/proteins.py``)."""

    def __init__(
        self,
        *,
        context_len: int = 1024,
        kinds: Sequence[str] = ("single", "family"),
        single_fasta: list[str] | None = None,
        family_fasta: list[str] | None = None,
        mask_prob: float = 0.15,
        samples_per_epoch: int = 64,
        val_samples: int = 8,
        val_fraction: float = 0.1,
        seed: int = 0,
        num_workers: int = 0,
    ) -> None:
        super().__init__()
        self.config = ProteinDataConfig(
            context_len=context_len, kinds=tuple(kinds), single_fasta=list(single_fasta or []),
            family_fasta=list(family_fasta or []), mask_prob=mask_prob, samples_per_epoch=samples_per_epoch,
            val_fraction=val_fraction, seed=seed,
        )
        if val_samples < 0:
            raise ValueError(f"val_samples must be >= 0, got {val_samples}")
        self.val_samples, self.num_workers = val_samples, num_workers
        self.tokenizer = ResidueTokenizer()

    @property
    def vocab_size(self) -> int:
        return self.tokenizer.vocab_size

    @override
    def setup(self, stage: str | None = None) -> None:
        proteins, families = load_protein_records(self.config)
        n_val = int(len(proteins) * self.config.val_fraction)
        train_p, val_p = proteins[: len(proteins) - n_val], proteins[len(proteins) - n_val:]
        self.train_set = ProteinContextDataset(
            proteins=train_p, families=families, config=self.config, tokenizer=self.tokenizer,
            length=self.config.samples_per_epoch,
        )
        # Validation: held-out proteins only (families are too few to split).
        self.val_set = None
        if self.val_samples and val_p and sum(len(r.sequence) + 2 for r in val_p) >= self.config.context_len:
            from dataclasses import replace

            vcfg = replace(self.config, kinds=("single",), seed=self.config.seed + 1)
            self.val_set = ProteinContextDataset(proteins=val_p, families=[], config=vcfg, tokenizer=self.tokenizer, length=self.val_samples)

    @override
    def train_dataloader(self) -> DataLoader:
        sampler = data_parallel_sampler(self, self.train_set, shuffle=True, seed=self.config.seed)
        return DataLoader(self.train_set, batch_size=1, sampler=sampler, collate_fn=collate_packed, num_workers=self.num_workers)

    @override
    def val_dataloader(self) -> DataLoader | list:
        if self.val_set is None:
            return []
        sampler = data_parallel_sampler(self, self.val_set, shuffle=False, seed=self.config.seed)
        return DataLoader(self.val_set, batch_size=1, sampler=sampler, collate_fn=collate_packed, num_workers=self.num_workers)


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
        return DataLoader(self.train_set, batch_size=self.batch_size, sampler=sampler, collate_fn=collate_stack, num_workers=self.num_workers)

    @override
    def val_dataloader(self) -> DataLoader | list:
        if self.val_set is None:
            return []
        sampler = data_parallel_sampler(self, self.val_set, shuffle=False, seed=self.config.seed)
        return DataLoader(self.val_set, batch_size=self.batch_size, sampler=sampler, collate_fn=collate_stack, num_workers=self.num_workers)
