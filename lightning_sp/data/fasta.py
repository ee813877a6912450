"""FASTA reading that refuses bad input loudly, naming file and line, for files of any size.

A record is a ``>`` header line followed by one or more sequence lines. Rejected, with
``path:line`` in the message: sequence lines before any header, headers with no identifier, records
with no residues, characters outside the allowed alphabet, and a ``*`` (stop) anywhere but the very
end of a record (a trailing ``*``, as in translated gene predictions, is dropped). Blank lines and
``;`` comment lines are skipped. Plain and gzip-compressed files are read alike (told apart by their
first two bytes, not by the name).

Three ways in:

- ``iter_fasta(path)``: one streaming pass, constant memory;
- ``read_fasta(path)``: all records in a list (small files: families, fixtures);
- ``IndexedFasta(path)``: random access by record number into a file of any size (UniRef, BFD; tens
  of GB gzipped) with bounded memory, for data-parallel sharding. See Note [FASTA index].

Note [FASTA index]
    Built once by one validating pass over the file (so a malformed record fails at build time with
    its file and line, not hours into training), then reused::

        <index_dir>/<name>.lsp-index.json      manifest: the data file's fingerprint; written LAST
        <index_dir>/<name>.lsp-index.lines.npy  int64 [n]  1-based line of each record's header
        <index_dir>/<name>.lsp-index.lengths.npy uint32 [n] residues per record (trailing '*' dropped)
        <index_dir>/<name>.lsp-index.data       a symbolic link to the data file, which pyfastx opens
        <index_dir>/<name>.lsp-index.data.fxi   pyfastx's index: byte offsets, and for .gz the zran
                                                 checkpoints that make random access into gzip possible

    The fingerprint is the file's size, mtime and a CRC of its first and last 64 KiB; any mismatch
    (file replaced or appended to), a missing or unreadable part, a link that no longer leads to the
    data file, or another alphabet rebuilds them all. Every part is written to a temporary name and renamed into place, manifest last, so
    concurrent builders (several ranks) and a build killed half way never leave an index that is
    trusted but wrong. The ``.npy`` arrays are memory-mapped, not loaded.

    Records are fetched through ``pyfastx`` (a maintained C library) by number, as their raw text
    (``Sequence.raw``), and parsed here with the same code as ``iter_fasta``: pyfastx's own
    ``Sequence.seq`` is wrong for files whose lines vary in length (CRLF, ragged wrapping), which
    ``raw`` is not. A record whose parsed length differs from the index raises, naming file and line.
"""

from __future__ import annotations

import gzip
import hashlib
import json
import os
import zlib
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import numpy as np

#: IUPAC amino-acid letters accepted by default (20 standard + X, B, Z, U, O, J).
PROTEIN_ALPHABET = frozenset("ACDEFGHIKLMNPQRSTVWYXBZUOJ")
INDEX_FORMAT = 1
_FINGERPRINT_SPAN = 1 << 16  # bytes hashed at each end of the data file


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


def is_gzip(path: str | os.PathLike) -> bool:
    with open(path, "rb") as f:
        return f.read(2) == b"\x1f\x8b"


def _open_lines(path: Path):
    """Binary line iterator over a plain or gzip file."""
    return gzip.open(path, "rb") if is_gzip(path) else path.open("rb")


class _RecordParser:
    """Line-by-line FASTA state machine shared by the streaming pass and the indexed reader.

    ``feed(lineno, raw_line)`` returns a finished record ``(id, description, line, residues)`` when
    a header closes the previous one; ``finish()`` closes the last. ``residues`` is ``None`` when
    ``keep_sequence=False`` (the index pass needs only lengths: ``self.last_length``).
    """

    def __init__(self, path: Path, alphabet: frozenset[str] | None, *, keep_sequence: bool = True) -> None:
        self.path, self.keep = path, keep_sequence
        self.allowed = None if alphabet is None else bytes(sorted(ord(c) for c in alphabet))
        self.header: tuple[str, str, int] | None = None  # (id, description, line)
        self.chunks: list[bytes] = []
        self.length = 0
        self.stopped_at: int | None = None  # line of a '*' seen in the current record
        self.last_length = 0

    def _close(self) -> tuple[str, str, int, str | None] | None:
        if self.header is None:
            return None
        if self.length == 0:
            raise FastaFormatError(self.path, self.header[2], f"record {self.header[0]!r} has no residues")
        self.last_length = self.length
        seq = b"".join(self.chunks).decode("latin-1") if self.keep else None
        return (*self.header, seq)

    def feed(self, lineno: int, raw: bytes) -> tuple[str, str, int, str | None] | None:
        line = raw.strip()
        if not line or line.startswith(b";"):
            return None
        if line.startswith(b">"):
            done = self._close()
            try:
                text = line[1:].decode("utf-8")
            except UnicodeDecodeError as e:
                raise FastaFormatError(self.path, lineno, f"header is not valid UTF-8 ({e.reason} at byte {e.start + 1})") from None
            parts = text.strip().split(maxsplit=1)
            if not parts:
                raise FastaFormatError(self.path, lineno, "header '>' has no sequence identifier")
            self.header = (parts[0], parts[1] if len(parts) > 1 else "", lineno)
            self.chunks, self.length, self.stopped_at = [], 0, None
            return done
        if self.header is None:
            raise FastaFormatError(self.path, lineno, "sequence data before the first '>' header")
        if self.stopped_at is not None:
            raise FastaFormatError(
                self.path, self.stopped_at, f"'*' (stop) inside record {self.header[0]!r}; only a final '*' is allowed"
            )
        seq = b"".join(line.split()).upper()
        if seq.endswith(b"*"):
            seq, self.stopped_at = seq[:-1], lineno
        if self.allowed is not None:
            bad = seq.translate(None, self.allowed)  # the invalid bytes, in order
            if bad:
                col = seq.index(bad[:1]) + 1
                raise FastaFormatError(
                    self.path, lineno, f"invalid residue {chr(bad[0])!r} at column {col} in record {self.header[0]!r}"
                )
        self.length += len(seq)
        if self.keep:
            self.chunks.append(seq)
        return None

    def finish(self) -> tuple[str, str, int, str | None] | None:
        done = self._close()
        self.header = None
        return done


def iter_fasta(path: str | os.PathLike, *, alphabet: frozenset[str] | None = PROTEIN_ALPHABET) -> Iterator[FastaRecord]:
    """Records of a plain or gzipped FASTA file, one at a time (memory: one record).

    Raises ``FileNotFoundError`` for a missing file and ``FastaFormatError`` for a malformed one.
    """
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"FASTA file not found: {path}")
    parser = _RecordParser(path, alphabet)
    n = 0
    with _open_lines(path) as f:
        for lineno, raw in enumerate(f, start=1):
            done = parser.feed(lineno, raw)
            if done is not None:
                n += 1
                yield FastaRecord(id=done[0], description=done[1], line=done[2], sequence=done[3], path=str(path))
    done = parser.finish()
    if done is not None:
        n += 1
        yield FastaRecord(id=done[0], description=done[1], line=done[2], sequence=done[3], path=str(path))
    if n == 0:
        raise FastaFormatError(path, 1, "no FASTA records found (expected lines starting with '>')")


def read_fasta(path: str | os.PathLike, *, alphabet: frozenset[str] | None = PROTEIN_ALPHABET) -> list[FastaRecord]:
    """All records of a FASTA file (plain or gzipped); ``alphabet=None`` accepts any letters.

    Raises ``FileNotFoundError`` for a missing file and ``FastaFormatError`` for a malformed one.
    Holds the whole file in memory: for large files use ``IndexedFasta`` or ``iter_fasta``.
    """
    return list(iter_fasta(path, alphabet=alphabet))


def _fingerprint(path: Path, alphabet: frozenset[str] | None) -> dict:
    st = path.stat()
    with path.open("rb") as f:
        head = f.read(_FINGERPRINT_SPAN)
        f.seek(max(0, st.st_size - _FINGERPRINT_SPAN))
        tail = f.read(_FINGERPRINT_SPAN)
    return {
        "format": INDEX_FORMAT, "size": st.st_size, "mtime_ns": st.st_mtime_ns,
        "crc_head": zlib.crc32(head), "crc_tail": zlib.crc32(tail),
        "alphabet": None if alphabet is None else "".join(sorted(alphabet)),
    }


def _pyfastx():
    try:
        import pyfastx
    except ModuleNotFoundError as e:
        raise ModuleNotFoundError(
            "indexed FASTA reading needs pyfastx: `pip install -e '.[data]'` (or `pip install pyfastx`)"
        ) from e
    return pyfastx


def _replace_atomically(tmp: Path, final: Path) -> None:
    os.replace(tmp, final)  # atomic on POSIX within one file system


class IndexedFasta:
    """Random access by record number into a plain or gzipped FASTA file of any size.

    ``len(f)`` records; ``f.lengths`` (uint32 ``[n]``, memory-mapped) residues per record, read
    without touching the data; ``f.record(i)`` / ``f.sequence(i)`` fetch one record; iterating
    streams all records in file order. The index (Note [FASTA index]) is built on first use and
    reused; ``index_dir=None`` keeps it next to the data file, or, when that folder is not writable,
    in ``$XDG_CACHE_HOME/lightning_sp/fasta_index`` (``~/.cache`` by default).

    Raises ``FileNotFoundError`` for a missing file and ``FastaFormatError`` (file and line) for a
    malformed record, when the index is built.
    """

    def __init__(
        self,
        path: str | os.PathLike,
        *,
        index_dir: str | os.PathLike | None = None,
        alphabet: frozenset[str] | None = PROTEIN_ALPHABET,
    ) -> None:
        self.path = Path(path)
        if not self.path.is_file():
            raise FileNotFoundError(f"FASTA file not found: {self.path}")
        self.alphabet = alphabet
        self.index_dir = Path(index_dir) if index_dir is not None else default_index_dir(self.path)
        base = self.index_dir / f"{self.path.name}.lsp-index"
        self.manifest_path = Path(f"{base}.json")
        self.lines_path, self.lengths_path = Path(f"{base}.lines.npy"), Path(f"{base}.lengths.npy")
        # pyfastx names its index "<data path>.fxi"; a link to the data in index_dir puts it there.
        # (Its index_file= argument writes one byte past a heap buffer in pyfastx 2.3.1: not used.)
        self.link_path = Path(f"{base}.data")
        self.fxi_path = Path(f"{base}.data.fxi")
        self.built_now = False
        """True when this object built the index (False: an existing one was reused)."""
        fingerprint = _fingerprint(self.path, alphabet)
        if not self._load(fingerprint):
            self._build(fingerprint)
            if not self._load(fingerprint):
                raise RuntimeError(f"the FASTA index for {self.path} in {self.index_dir} was written but does not load")
            self.built_now = True
        self._handle = None
        self._handle_pid = None

    # --- index --------------------------------------------------------------------------------
    def _load(self, fingerprint: dict) -> bool:
        try:
            manifest = json.loads(self.manifest_path.read_text())
            if manifest.get("fingerprint") != fingerprint or not self.fxi_path.is_file():
                return False
            if not os.path.samefile(self.link_path, self.path):  # data moved, or a foreign link
                return False
            lines = np.load(self.lines_path, mmap_mode="r")
            lengths = np.load(self.lengths_path, mmap_mode="r")
        except (OSError, ValueError):  # missing, truncated or foreign files: rebuild
            return False
        n = manifest.get("records")
        if lines.shape != (n,) or lengths.shape != (n,) or lines.dtype != np.int64 or lengths.dtype != np.uint32:
            return False
        self.lines, self.lengths = lines, lengths
        return True

    def _build(self, fingerprint: dict) -> None:
        try:
            self.index_dir.mkdir(parents=True, exist_ok=True)
            probe = self.index_dir / f".lsp-write-probe-{os.getpid()}"
            probe.touch()
            probe.unlink()
        except OSError as e:
            raise PermissionError(
                f"cannot write the FASTA index for {self.path} in {self.index_dir} ({e.strerror}); "
                "pass index_dir= a writable folder"
            ) from None
        tag = f".tmp-{os.getpid()}-{id(self)}"
        # 1. validating pass: header lines and residue counts, in bounded memory (arrays grow in chunks).
        lines = _GrowableArray(np.int64)
        lengths = _GrowableArray(np.uint32)
        parser = _RecordParser(self.path, self.alphabet, keep_sequence=False)
        with _open_lines(self.path) as f:
            for lineno, raw in enumerate(f, start=1):
                done = parser.feed(lineno, raw)
                if done is not None:
                    lines.append(done[2])
                    lengths.append(parser.last_length)
        done = parser.finish()
        if done is not None:
            lines.append(done[2])
            lengths.append(parser.last_length)
        if len(lines) == 0:
            raise FastaFormatError(self.path, 1, "no FASTA records found (expected lines starting with '>')")
        if int(lengths.array().max()) >= 2**32 - 2:
            raise FastaFormatError(self.path, 1, "a record holds 2^32 residues or more; not a protein file")
        parts = (self.lines_path, self.lengths_path, self.link_path, self.fxi_path, self.manifest_path)
        tmp = {p: Path(f"{p}{tag}") for p in parts}
        tmp[self.fxi_path] = Path(f"{tmp[self.link_path]}.fxi")  # where pyfastx writes for the temporary link
        try:
            for final, arr in ((self.lines_path, lines.array()), (self.lengths_path, lengths.array())):
                with open(tmp[final], "wb") as out:
                    np.save(out, arr)
            # 2. pyfastx's offset (and gzip checkpoint) index, through a temporary link to the data.
            os.symlink(self.path.resolve(), tmp[self.link_path])
            fasta = _pyfastx().Fasta(str(tmp[self.link_path]))
            if len(fasta) != len(lines):
                raise FastaFormatError(
                    self.path, 1,
                    f"pyfastx finds {len(fasta)} records, the validating reader {len(lines)}: a '>' inside a line? "
                    "check the file with `grep -c '^>'`",
                )
            del fasta
            tmp[self.manifest_path].write_text(json.dumps({"fingerprint": fingerprint, "records": len(lines)}))
            for final in parts:  # manifest last
                _replace_atomically(tmp[final], final)
        finally:  # (a build killed outright leaves these behind: harmless, never read)
            for t in (*tmp.values(), Path(f"{tmp[self.fxi_path]}-journal")):
                t.unlink(missing_ok=True)

    # --- records ------------------------------------------------------------------------------
    def __len__(self) -> int:
        return int(self.lengths.shape[0])

    def _fasta(self):
        if self._handle is None or self._handle_pid != os.getpid():  # one handle per process (DataLoader workers)
            self._handle = _pyfastx().Fasta(str(self.link_path))  # reads the index at link_path + ".fxi"
            self._handle_pid = os.getpid()
        return self._handle

    def record(self, i: int) -> FastaRecord:
        """Record ``i`` (0-based, file order), parsed and validated like ``iter_fasta``."""
        n = len(self)
        if not -n <= i < n:
            raise IndexError(f"record {i} out of range: {self.path} holds {n} records")
        i = i % n
        first_line = int(self.lines[i])
        raw = self._fasta()[i].raw.encode("utf-8")  # header + sequence lines, as in the file
        parser = _RecordParser(self.path, self.alphabet)
        done = None
        for offset, text in enumerate(raw.splitlines()):
            got = parser.feed(first_line + offset, text)
            if got is not None:  # a second header inside one record's raw text
                done = got
                break
        done = done or parser.finish()
        if done is None or done[2] != first_line or len(done[3]) != int(self.lengths[i]):
            raise FastaFormatError(
                self.path, first_line,
                f"record {i} does not match the index ({int(self.lengths[i])} residues expected): the file "
                f"changed while open, or the index in {self.index_dir} is damaged; delete {self.manifest_path} to rebuild",
            )
        return FastaRecord(id=done[0], description=done[1], sequence=done[3], path=str(self.path), line=first_line)

    def sequence(self, i: int) -> str:
        return self.record(i).sequence

    def __iter__(self) -> Iterator[FastaRecord]:
        return iter_fasta(self.path, alphabet=self.alphabet)

    def __getstate__(self) -> dict:
        state = dict(self.__dict__)
        state["_handle"] = state["_handle_pid"] = None  # a pyfastx handle is per process
        return state


class _GrowableArray:
    """Append-only numpy buffer, doubling: O(n) memory of the final size, no Python int list."""

    def __init__(self, dtype) -> None:
        self.buf, self.n = np.empty(1 << 16, dtype=dtype), 0

    def append(self, value: int) -> None:
        if self.n == self.buf.shape[0]:
            self.buf = np.concatenate([self.buf, np.empty_like(self.buf)])
        self.buf[self.n] = value
        self.n += 1

    def __len__(self) -> int:
        return self.n

    def array(self) -> np.ndarray:
        return self.buf[: self.n]


def default_index_dir(path: Path) -> Path:
    """Next to the data when that folder is writable, else the user cache (one folder per data path)."""
    if os.access(path.parent, os.W_OK):
        return path.parent
    cache = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache")
    key = hashlib.sha1(str(path.resolve()).encode()).hexdigest()[:16]
    return cache / "lightning_sp" / "fasta_index" / key
