"""Real protein sequences, long protein contexts and the masked-residue objective.

Sources (read at run time from installed packages; nothing large is committed):

- ``pyhmmer`` test data: ``938293.PRJEB85.HG003687.faa``, 2,100 proteins predicted from a real
  bacterial genome (682K residues, longest 4,560): the *single-protein* source.
- homolog families shipped with ``pyhmmer``: ``LuxC.faa`` (12 LuxC reductases) and ``PKSI.faa``
  (10 type-I polyketide synthases, 1.5K-4K residues each): the *family* source. A family context is
  its members in a random order, each ``<cls> seq <eos>``, as **one** document (members attend to
  each other, as in homolog-conditioned protein language models), 10K-30K tokens before cropping.

Contexts:

- ``single``: proteins packed back to back into ``context_len`` tokens, one document each
  (``cu_seqlens``; attention stays inside a protein; positions restart per protein); a protein longer
  than the context contributes a random window of it.
- ``family``: one family context cropped to a random ``context_len`` window (positions global).

Single proteins may come from the user's own FASTA / FASTA.gz files of any size (UniRef50/90, BFD):
they are read through ``IndexedFasta`` (random access, bounded memory) and an epoch is planned from
their lengths alone (``data/sampling.py``, Note [Packed-context plan]): each data-parallel replica
reads only the records of its own contexts. Family files are small and read whole.
"""

from __future__ import annotations

import importlib.util
import os
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch
from torch.utils.data import Dataset

from lightning_sp.data.fasta import FastaRecord, IndexedFasta, read_fasta
from lightning_sp.data.packing import pack_documents
from lightning_sp.data.sampling import PAD_RECORD, ContextSpec
from lightning_sp.data.tokenizer import ResidueTokenizer

IGNORE_INDEX = -100


def pyhmmer_data_dir() -> Path:
    """Folder of the FASTA files shipped in the ``pyhmmer`` wheel (``pip install lightning-sp[data]``)."""
    spec = importlib.util.find_spec("pyhmmer")
    if spec is None or spec.origin is None:
        raise ModuleNotFoundError(
            "protein data comes from the 'pyhmmer' package's test data; install it with "
            "`pip install -e '.[data]'` (or `pip install pyhmmer`)"
        )
    d = Path(spec.origin).parent / "tests" / "data" / "seqs"
    if not d.is_dir():
        raise FileNotFoundError(f"pyhmmer is installed but has no test data folder {d}")
    return d


def default_single_fasta() -> list[Path]:
    return [pyhmmer_data_dir() / "938293.PRJEB85.HG003687.faa"]


def default_family_fastas() -> list[Path]:
    d = pyhmmer_data_dir()
    return [d / "LuxC.faa", d / "PKSI.faa"]


@dataclass(kw_only=True)
class ProteinDataConfig:
    context_len: int = 1024
    """Tokens per training context (the global sequence length that sequence parallelism splits)."""
    kinds: tuple[str, ...] = ("single", "family")
    """Which contexts to draw: ``single`` (packed proteins), ``family`` (concatenated homologs)."""
    single_fasta: list[str] = field(default_factory=list)
    """FASTA / FASTA.gz files of single proteins, any size (indexed once, see ``IndexedFasta``);
    empty: pyhmmer's 2,100-protein genome file."""
    index_dir: str | None = None
    """Where the FASTA indexes go; ``None``: next to each file (the user cache when its folder is
    read-only; always the cache for the pyhmmer defaults)."""
    family_fasta: list[str] = field(default_factory=list)
    """FASTA files, one homolog family each; empty: pyhmmer's LuxC and PKSI families."""
    packing: str = "split"
    """How proteins fill a context: ``"split"`` (in order, a protein that does not fit continues in the next
    context; no padding) or ``"whole"`` (never split: length buckets, first-fit-decreasing, the rest padded)."""
    bucket_records: int = 256
    """Proteins per length bucket for ``packing="whole"``."""
    mask_prob: float = 0.15
    """Fraction of residues selected for the masked-residue objective (80% <mask>, 10% random, 10% kept)."""
    samples_per_epoch: int | None = 64
    """Cap on contexts per epoch, all data-parallel replicas together; ``None``: one pass over the
    training proteins (kinds alternate, so with ``family`` too an epoch is twice that)."""
    val_fraction: float = 0.1
    """Fraction of single proteins held out for validation (the last ones in file order)."""
    seed: int = 0
    """Seeds the epoch's shuffle, crops, masking and family windows: a context is the same tensor on
    every rank of a sequence-parallel group."""

    def __post_init__(self) -> None:
        self.kinds = tuple(self.kinds)
        if self.context_len < 16:
            raise ValueError(f"context_len must be >= 16, got {self.context_len}")
        bad = [k for k in self.kinds if k not in ("single", "family")]
        if not self.kinds or bad:
            raise ValueError(f"kinds must be a non-empty subset of ('single', 'family'), got {self.kinds}")
        if self.packing not in ("split", "whole"):
            raise ValueError(f"packing must be 'split' or 'whole', got {self.packing!r}")
        if self.bucket_records < 1:
            raise ValueError(f"bucket_records must be >= 1, got {self.bucket_records}")
        if not 0.0 < self.mask_prob < 1.0:
            raise ValueError(f"mask_prob must be in (0, 1), got {self.mask_prob}")
        if self.samples_per_epoch is not None and self.samples_per_epoch < 1:
            raise ValueError(f"samples_per_epoch must be >= 1 or None (one pass over the data), got {self.samples_per_epoch}")
        if not 0.0 <= self.val_fraction < 1.0:
            raise ValueError(f"val_fraction must be in [0, 1), got {self.val_fraction}")


def mask_residues(
    input_ids: torch.Tensor, tok: ResidueTokenizer, mask_prob: float, generator: torch.Generator
) -> tuple[torch.Tensor, torch.Tensor]:
    """BERT/ESM masking of residues only (specials never masked).

    ``input_ids [N] -> (masked_ids [N], labels [N])``; ``labels`` is the original id at selected
    positions and ``-100`` elsewhere. At least one residue is always selected.
    """
    is_residue = input_ids >= tok.first_residue_id  # [N]
    select = (torch.rand(input_ids.shape, generator=generator) < mask_prob) & is_residue
    if not select.any() and is_residue.any():
        select[is_residue.nonzero()[0]] = True
    labels = torch.where(select, input_ids, torch.full_like(input_ids, IGNORE_INDEX))
    roll = torch.rand(input_ids.shape, generator=generator)
    masked = input_ids.clone()
    masked[select & (roll < 0.8)] = tok.mask_id
    rand_ids = torch.randint(tok.first_residue_id, tok.vocab_size, input_ids.shape, generator=generator)
    swap = select & (roll >= 0.8) & (roll < 0.9)
    masked[swap] = rand_ids[swap]
    return masked, labels


class ProteinRecords:
    """Single proteins of one or more FASTA files behind one record numbering (file order).

    ``lengths`` uint32 ``[n]`` residues per record (memory-mapped for one file); ``record(i)``.
    """

    def __init__(self, files: Sequence[IndexedFasta]) -> None:
        if not files:
            raise ValueError("ProteinRecords needs at least one FASTA file")
        self.files = list(files)
        self.starts = np.cumsum([0] + [len(f) for f in self.files])  # [n_files + 1]
        self.lengths = self.files[0].lengths if len(self.files) == 1 else np.concatenate([f.lengths for f in self.files])

    def __len__(self) -> int:
        return int(self.starts[-1])

    def record(self, i: int) -> FastaRecord:
        f = int(np.searchsorted(self.starts, i, side="right")) - 1
        return self.files[f].record(i - int(self.starts[f]))


class ProteinContextDataset(Dataset):
    """``dataset[spec]`` for a ``ContextSpec`` from ``PackedContextSampler``: dict ``input_ids, labels,
    position_ids [context_len]``, ``cu_seqlens [n_docs + 1]``.

    Deterministic in the spec, so every rank of a sequence-parallel group builds the same sample;
    a ``single`` spec reads only the records it names.
    """

    def __init__(
        self,
        *,
        proteins: ProteinRecords | None,
        families: list[list[FastaRecord]],
        config: ProteinDataConfig,
        tokenizer: ResidueTokenizer,
    ) -> None:
        self.cfg, self.tok, self.proteins = config, tokenizer, proteins
        self.kinds = tuple(k for k in config.kinds if (k == "single" and proteins is not None and len(proteins)) or (k == "family" and families))
        if not self.kinds:
            n = 0 if proteins is None else len(proteins)
            raise ValueError(f"no data for kinds {config.kinds}: {n} proteins, {len(families)} families")
        self.family_ids = [[tokenizer.encode(r.sequence) for r in fam] for fam in families]
        if "single" in self.kinds:
            total = int(np.sum(proteins.lengths, dtype=np.int64)) + 2 * len(proteins)
            if total < config.context_len:
                raise ValueError(f"single proteins hold {total} tokens, fewer than context_len={config.context_len}")

    def __len__(self) -> int:
        return 0 if self.proteins is None else len(self.proteins)  # records; the sampler decides the epoch

    def _single(self, pieces: tuple[tuple[int, int, int], ...]) -> dict[str, torch.Tensor]:
        # Each piece is tokens [start, stop) of <cls> residues <eos>: a crop window or a split part.
        docs = [
            torch.full((stop - start,), self.tok.pad_id) if rec == PAD_RECORD  # "whole" packing's padding segment
            else self.tok.encode(self.proteins.record(rec).sequence)[start:stop]
            for rec, start, stop in pieces
        ]
        if sum(d.numel() for d in docs) != self.cfg.context_len:
            raise ValueError(f"pieces {pieces} do not fill context_len={self.cfg.context_len}: the FASTA index is stale")
        return pack_documents(docs)

    def _family(self, g: torch.Generator) -> dict[str, torch.Tensor]:
        fam = self.family_ids[int(torch.randint(len(self.family_ids), (1,), generator=g))]
        order = torch.randperm(len(fam), generator=g).tolist()
        ids = torch.cat([fam[j] for j in order])  # one document: homologs see each other
        if ids.numel() < self.cfg.context_len:  # short family: repeat it in another order
            reps = -(-self.cfg.context_len // ids.numel())
            ids = torch.cat([ids] + [torch.cat([fam[j] for j in torch.randperm(len(fam), generator=g).tolist()]) for _ in range(reps - 1)])
        start = int(torch.randint(ids.numel() - self.cfg.context_len + 1, (1,), generator=g))
        return pack_documents([ids[start:start + self.cfg.context_len]], restart_positions=False)

    def __getitem__(self, spec: ContextSpec) -> dict[str, torch.Tensor]:
        if not isinstance(spec, ContextSpec):
            raise TypeError(f"ProteinContextDataset is indexed by the ContextSpecs of PackedContextSampler, got {spec!r}")
        if spec.kind not in self.kinds:
            raise ValueError(f"no data for a {spec.kind!r} context (this dataset has {self.kinds})")
        g = torch.Generator().manual_seed(spec.sample_seed)
        sample = self._single(spec.pieces) if spec.kind == "single" else self._family(g)
        masked, labels = mask_residues(sample["input_ids"], self.tok, self.cfg.mask_prob, g)
        return {**sample, "input_ids": masked, "labels": labels}


def collate_packed(samples: list[dict[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
    """Batch of one packed context: ``[S] -> [1, S]``; ``cu_seqlens`` stays 1-D ``[n_docs + 1]``."""
    if len(samples) != 1:
        raise ValueError(f"packed contexts use batch_size=1 (documents are packed instead), got {len(samples)}")
    s = samples[0]
    return {k: (v if k == "cu_seqlens" else v.unsqueeze(0)) for k, v in s.items()}


def load_protein_records(config: ProteinDataConfig) -> tuple[ProteinRecords | None, list[list[FastaRecord]]]:
    """Indexed single proteins (built or reused) and the family files, read whole."""
    proteins = None
    if "single" in config.kinds:
        if config.single_fasta:
            files = [IndexedFasta(p, index_dir=config.index_dir) for p in config.single_fasta]
        else:  # never write into site-packages
            files = [IndexedFasta(p, index_dir=config.index_dir or default_cache_index_dir()) for p in default_single_fasta()]
        proteins = ProteinRecords(files)
    families = [read_fasta(os.fspath(p)) for p in (config.family_fasta or default_family_fastas())] if "family" in config.kinds else []
    return proteins, families


def default_cache_index_dir() -> Path:
    cache = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache")
    return cache / "lightning_sp" / "fasta_index" / "pyhmmer"
