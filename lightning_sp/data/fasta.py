"""FASTA reading that refuses bad input loudly, naming file and line.

A record is a ``>`` header line followed by one or more sequence lines. Rejected, with
``path:line`` in the message: sequence lines before any header, headers with no identifier, records
with no residues, characters outside the allowed alphabet, and a ``*`` (stop) anywhere but the very
end of a record (a trailing ``*``, as in translated gene predictions, is dropped).
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

#: IUPAC amino-acid letters accepted by default (20 standard + X, B, Z, U, O, J).
PROTEIN_ALPHABET = frozenset("ACDEFGHIKLMNPQRSTVWYXBZUOJ")


class FastaFormatError(ValueError):
    """A malformed FASTA record; ``path`` and ``line`` (1-based) point at it."""

    def __init__(self, path: str | os.PathLike, line: int, message: str) -> None:
        self.path = str(path)
        self.line = line
        super().__init__(f"{self.path}:{line}: {message}")


@dataclass(frozen=True, kw_only=True)
class FastaRecord:
    id: str
    """First whitespace-separated word of the header."""
    description: str
    """Rest of the header (may be empty)."""
    sequence: str
    """Residues, upper case, no whitespace, trailing ``*`` removed."""
    path: str
    """File the record came from."""
    line: int
    """1-based line of the header."""


def read_fasta(path: str | os.PathLike, *, alphabet: frozenset[str] | None = PROTEIN_ALPHABET) -> list[FastaRecord]:
    """All records of a FASTA file; ``alphabet=None`` accepts any letters.

    Raises ``FileNotFoundError`` for a missing file and ``FastaFormatError`` for a malformed one.
    """
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"FASTA file not found: {path}")
    records: list[FastaRecord] = []
    header: tuple[str, str, int] | None = None  # (id, description, line)
    chunks: list[str] = []
    stopped_at: int | None = None  # line of a '*' seen in the current record

    def finish() -> None:
        if header is None:
            return
        seq = "".join(chunks)
        if not seq:
            raise FastaFormatError(path, header[2], f"record {header[0]!r} has no residues")
        records.append(FastaRecord(id=header[0], description=header[1], sequence=seq, path=str(path), line=header[2]))

    with path.open("r", encoding="utf-8", errors="strict") as f:
        for lineno, raw in enumerate(f, start=1):
            line = raw.strip()
            if not line or line.startswith(";"):
                continue
            if line.startswith(">"):
                finish()
                parts = line[1:].strip().split(maxsplit=1)
                if not parts:
                    raise FastaFormatError(path, lineno, "header '>' has no sequence identifier")
                header = (parts[0], parts[1] if len(parts) > 1 else "", lineno)
                chunks, stopped_at = [], None
                continue
            if header is None:
                raise FastaFormatError(path, lineno, "sequence data before the first '>' header")
            if stopped_at is not None:
                raise FastaFormatError(path, stopped_at, f"'*' (stop) inside record {header[0]!r}; only a final '*' is allowed")
            seq = "".join(line.split()).upper()
            if seq.endswith("*"):
                seq, stopped_at = seq[:-1], lineno
            if alphabet is not None:
                for col, ch in enumerate(seq, start=1):
                    if ch not in alphabet:
                        raise FastaFormatError(
                            path, lineno, f"invalid residue {ch!r} at column {col} in record {header[0]!r}"
                        )
            chunks.append(seq)
    finish()
    if not records:
        raise FastaFormatError(path, 1, "no FASTA records found (expected lines starting with '>')")
    return records
