"""Residue-level protein tokenizer: one token per amino acid plus a few special tokens."""

from __future__ import annotations

import torch

from lightning_sp.data.fasta import PROTEIN_ALPHABET

SPECIAL_TOKENS = ("<pad>", "<cls>", "<eos>", "<unk>", "<mask>")


class ResidueTokenizer:
    """Maps residues to ids: specials ``<pad>=0, <cls>=1, <eos>=2, <unk>=3, <mask>=4``, then letters.

    ``encode`` wraps a sequence as ``<cls> residues <eos>`` (ESM-2 convention). Unknown letters
    raise ``ValueError`` unless ``unknown="map"``, which sends them to ``<unk>``.
    """

    def __init__(self, *, unknown: str = "error") -> None:
        if unknown not in ("error", "map"):
            raise ValueError(f"unknown must be 'error' or 'map', got {unknown!r}")
        self.unknown = unknown
        self.tokens = list(SPECIAL_TOKENS) + sorted(PROTEIN_ALPHABET)
        self.index = {t: i for i, t in enumerate(self.tokens)}
        self.pad_id, self.cls_id, self.eos_id, self.unk_id, self.mask_id = range(len(SPECIAL_TOKENS))
        self.first_residue_id = len(SPECIAL_TOKENS)

    @property
    def vocab_size(self) -> int:
        return len(self.tokens)

    def encode(self, sequence: str, *, add_special: bool = True) -> torch.Tensor:
        """``str`` of length L -> int64 ``[L + 2]`` (or ``[L]`` without specials)."""
        ids = []
        for pos, ch in enumerate(sequence.upper()):
            i = self.index.get(ch) if ch in PROTEIN_ALPHABET else None
            if i is None:
                if self.unknown == "error":
                    raise ValueError(f"cannot tokenize {ch!r} at position {pos}; allowed: {''.join(sorted(PROTEIN_ALPHABET))}")
                i = self.unk_id
            ids.append(i)
        if add_special:
            ids = [self.cls_id, *ids, self.eos_id]
        return torch.tensor(ids, dtype=torch.long)

    def decode(self, ids: torch.Tensor | list[int]) -> str:
        """Ids -> residues; special tokens are dropped."""
        out = []
        for i in torch.as_tensor(ids).tolist():
            if i >= self.first_residue_id:
                out.append(self.tokens[i])
        return "".join(out)
