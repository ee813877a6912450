"""Numbers generated, not typed: every table or number the READMEs and docs quote from a results file is a
block rendered from that file.

    python -m experiments.common.generated            # rewrite every block from its results file
    python -m experiments.common.generated --check    # change nothing; exit 1 and print a diff if a block differs

A block, in any scanned Markdown file (``SCANNED``: README.md, docs/**/*.md, experiments/**/README.md,
benchmarks/**/README.md, paper_figures/README.md)::

    <!-- generated: MODULE:FUNCTION path/to/results.json [key=value ...] -->
    ... (the body: whatever FUNCTION returned last time; never edit it by hand) ...
    <!-- end generated -->

``MODULE:FUNCTION`` is any importable function (``benchmarks.peers.render:table``); the path is relative to the
repository root, and the file is parsed by its suffix (``.json``: ``json.load``; ``.csv``: a list of
``csv.DictReader`` rows, values as strings; anything else: its text). The body becomes
``FUNCTION(data, path, **kwargs)`` (``path`` a ``pathlib.Path`` relative to the root, ``kwargs`` the
``key=value`` words as strings; quote a value with spaces: ``label="grid 1"``), stripped of surrounding blank lines. The path may be omitted when the function
reads what it needs itself (then it gets ``data=None, path=None``). Blocks do not nest.
"""

from __future__ import annotations

import argparse
import csv
import difflib
import importlib
import json
import re
import shlex
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]  # the repository

SCANNED = ("README.md", "docs/**/*.md", "experiments/**/README.md", "benchmarks/**/README.md",
           "paper_figures/README.md")
"""Globs (relative to the root) of the Markdown files whose blocks are generated."""

BLOCK = re.compile(r"(?P<open><!-- generated: (?P<spec>[^\n]*?) -->\n)(?P<body>.*?)(?P<close><!-- end generated -->)",
                   re.DOTALL)


class GeneratedBlockError(ValueError):
    """A block's marker names something that cannot be rendered (bad spec, unknown function, missing file)."""


@dataclass(frozen=True)
class Block:
    file: Path  # the Markdown file, relative to the root
    line: int  # 1-based line of the opening marker
    function: str  # MODULE:FUNCTION
    path: Path | None  # the results file, relative to the root
    kwargs: dict[str, str]


def scanned_files(root: Path = ROOT) -> list[Path]:
    """Every existing Markdown file ``SCANNED`` matches, relative to ``root``, sorted, without duplicates."""
    found = {p.relative_to(root) for pattern in SCANNED for p in root.glob(pattern) if p.is_file()}
    return sorted(p for p in found if ".venv" not in p.parts and "node_modules" not in p.parts)


def parse_spec(spec: str, *, file: Path, line: int) -> Block:
    try:
        words = shlex.split(spec)
    except ValueError as e:
        raise GeneratedBlockError(f"{file}:{line}: cannot read the marker {spec!r}: {e}") from e
    if not words or words[0].count(":") != 1:
        raise GeneratedBlockError(f"{file}:{line}: the marker needs 'MODULE:FUNCTION [path] [key=value ...]', "
                                  f"got {spec!r}")
    paths = [w for w in words[1:] if "=" not in w]
    if len(paths) > 1:
        raise GeneratedBlockError(f"{file}:{line}: one results path per block, got {paths}")
    kwargs = dict(w.split("=", 1) for w in words[1:] if "=" in w)
    return Block(file=file, line=line, function=words[0], path=Path(paths[0]) if paths else None, kwargs=kwargs)


def blocks(text: str, file: Path) -> Iterator[tuple[re.Match, Block]]:
    for match in BLOCK.finditer(text):
        line = text.count("\n", 0, match.start()) + 1
        if "<!-- generated:" in match.group("body"):
            raise GeneratedBlockError(f"{file}:{line}: a block opens before the previous one closed")
        yield match, parse_spec(match.group("spec"), file=file, line=line)


def load_data(path: Path, root: Path = ROOT) -> Any:
    """The parsed results file: JSON, CSV rows (dicts of strings), or text."""
    full = root / path
    if not full.is_file():
        raise GeneratedBlockError(f"results file {path} does not exist (paths are relative to the repository root)")
    if path.suffix == ".json":
        return json.loads(full.read_text())
    if path.suffix == ".csv":
        with full.open(newline="") as f:
            return list(csv.DictReader(f))
    return full.read_text()


def render(block: Block, root: Path = ROOT) -> str:
    """The block's body: what its function returns, with one newline at the end."""
    module_name, function_name = block.function.split(":")
    try:
        function = getattr(importlib.import_module(module_name), function_name)
    except (ImportError, AttributeError) as e:
        raise GeneratedBlockError(f"{block.file}:{block.line}: cannot import {block.function}: {e}") from e
    data = load_data(block.path, root) if block.path is not None else None
    out = function(data, block.path, **block.kwargs)
    if not isinstance(out, str):
        raise GeneratedBlockError(f"{block.file}:{block.line}: {block.function} returned {type(out).__name__}, "
                                  "not a Markdown string")
    return out.strip("\n") + "\n"


def regenerate(text: str, file: Path, root: Path = ROOT) -> str:
    """``text`` with the body of every block replaced by its rendering."""
    pieces, last = [], 0
    for match, block in blocks(text, file):
        pieces += [text[last:match.end("open")], render(block, root), match.group("close")]
        last = match.end()
    return "".join(pieces) + text[last:]


def markdown_tables(text: str) -> list[str]:
    """The Markdown tables of ``text`` (runs of lines starting with ``|``), in order."""
    tables, current = [], []
    for line in text.splitlines() + [""]:
        if line.startswith("|"):
            current.append(line)
        elif current:
            tables.append("\n".join(current))
            current = []
    return tables


def table(text: str, path: Path, index: str = "0") -> str:
    """A render function for any block: table number ``index`` (0-based) of a Markdown file a figure script wrote
    (``paper_figures/<study>.md``), so a README quotes the table the results file was drawn into."""
    tables = markdown_tables(text)
    if not -len(tables) <= int(index) < len(tables):
        raise GeneratedBlockError(f"{path} has {len(tables)} table(s); there is no table {index}")
    return tables[int(index)]


def main(argv: list[str] | None = None, root: Path = ROOT) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--check", action="store_true",
                        help="change nothing; exit 1 and print a diff where a block differs from its rendering")
    parser.add_argument("files", nargs="*", type=Path, help="Markdown files (default: every scanned file)")
    args = parser.parse_args(argv)
    stale = count = 0
    for file in args.files or scanned_files(root):
        text = (root / file).read_text()
        new = regenerate(text, file, root)
        count += len(BLOCK.findall(text))
        if new == text:
            continue
        stale += 1
        if args.check:
            sys.stdout.writelines(difflib.unified_diff(text.splitlines(keepends=True), new.splitlines(keepends=True),
                                                       f"{file} (committed)", f"{file} (generated)"))
        else:
            (root / file).write_text(new)
            print(f"rewrote {file}")
    if args.check and stale:
        print(f"\n{stale} file(s) have generated blocks that differ from their results files; "
              "run `python -m experiments.common.generated` and commit the result.", file=sys.stderr)
        return 1
    print(f"{count} generated block(s) in {len(args.files or scanned_files(root))} file(s): "
          f"{'all current' if not stale else f'{stale} file(s) ' + ('stale' if args.check else 'rewritten')}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
