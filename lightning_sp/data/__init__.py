"""Real data for the demos: FASTA proteins, residue tokenizer, packing, digit/text sequences."""

from lightning_sp.data.fasta import FastaFormatError, FastaRecord, read_fasta
from lightning_sp.data.modules import DigitSequenceDataModule, ProteinDataModule
from lightning_sp.data.multimodal import DigitSequenceDataset, MultimodalDataConfig, MultimodalVocab
from lightning_sp.data.packing import greedy_pack, pack_documents
from lightning_sp.data.proteins import ProteinContextDataset, ProteinDataConfig, mask_residues
from lightning_sp.data.tokenizer import ResidueTokenizer

__all__ = [
    "DigitSequenceDataModule", "DigitSequenceDataset", "FastaFormatError", "FastaRecord", "MultimodalDataConfig",
    "MultimodalVocab", "ProteinContextDataset", "ProteinDataConfig", "ProteinDataModule", "ResidueTokenizer",
    "greedy_pack", "mask_residues", "pack_documents", "read_fasta",
]
