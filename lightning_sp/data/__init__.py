"""Real data for the demos: FASTA proteins, residue tokenizer, packing, digit/text sequences."""

from lightning_sp.data.fasta import FastaFormatError, FastaRecord, IndexedFasta, iter_fasta, read_fasta
from lightning_sp.data.modules import DigitSequenceDataModule, ProteinDataModule
from lightning_sp.data.multimodal import DigitSequenceDataset, MultimodalDataConfig, MultimodalVocab
from lightning_sp.data.packing import greedy_pack, pack_documents
from lightning_sp.data.proteins import ProteinContextDataset, ProteinDataConfig, ProteinRecords, mask_residues
from lightning_sp.data.sampling import ContextSpec, PackedContextSampler, ResumableDataLoader, permute_positions
from lightning_sp.data.tokenizer import ResidueTokenizer

__all__ = [
    "ContextSpec", "DigitSequenceDataModule", "DigitSequenceDataset", "FastaFormatError", "FastaRecord", "IndexedFasta",
    "MultimodalDataConfig", "MultimodalVocab", "PackedContextSampler", "ProteinContextDataset", "ProteinDataConfig",
    "ProteinDataModule", "ProteinRecords", "ResidueTokenizer", "ResumableDataLoader", "greedy_pack", "iter_fasta", "mask_residues",
    "pack_documents", "permute_positions", "read_fasta",
]
