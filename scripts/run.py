#!/usr/bin/env python
"""Run a study or a benchmark by name, from anywhere:

    python scripts/run.py --list                        # every study and benchmark, and its modules
    python scripts/run.py longest_sequence --quick      # experiments/longest_sequence/run.py
    python scripts/run.py longest_sequence.plot         # its figure
    python scripts/run.py peers.cell --pair ulysses     # benchmarks/peers/cell.py

``NAME[.MODULE]`` names ``experiments/NAME/MODULE.py`` or ``benchmarks/NAME/MODULE.py`` (``MODULE`` defaults to
``run``); the rest of the command line goes to it. It runs as ``python -m experiments.NAME.MODULE`` with the
repository on ``PYTHONPATH``, so relative paths in the arguments keep meaning what they mean where you are.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("experiments", "benchmarks")


def entry_points() -> dict[str, list[str]]:
    """``{name: [module, ...]}`` of every study and benchmark folder that has a ``run.py`` or ``plot.py``."""
    found = {}
    for package in PACKAGES:
        for folder in sorted(p for p in (ROOT / package).iterdir() if (p / "__init__.py").is_file()):
            modules = sorted(p.stem for p in folder.glob("*.py") if p.stem != "__init__" and _is_entry(p))
            if modules:
                found[folder.name] = [f"{package}.{folder.name}.{m}" for m in modules]
    return found


def _is_entry(path: Path) -> bool:
    return 'if __name__ == "__main__"' in path.read_text()


def resolve(name: str) -> str:
    """The module ``NAME[.MODULE]`` names; a clear error listing the choices otherwise."""
    folder, _, module = name.partition(".")
    modules = entry_points()
    if folder not in modules:
        raise SystemExit(f"no study or benchmark named {folder!r}; choose one of: {', '.join(sorted(modules))}")
    wanted = [m for m in modules[folder] if m.rsplit(".", 1)[1] == (module or "run")]
    if not wanted:
        raise SystemExit(f"{folder} has no module {module or 'run'!r}; choose one of: "
                         f"{', '.join(m.rsplit('.', 1)[1] for m in modules[folder])}")
    return wanted[0]


def main(argv: list[str]) -> None:
    if not argv or argv[0] in ("-h", "--help"):
        print(__doc__)
        raise SystemExit(0 if argv else 2)
    if argv[0] == "--list":
        for name, modules in entry_points().items():
            print(f"{name:20s} {' '.join(m.rsplit('.', 1)[1] for m in modules)}")
        return
    module = resolve(argv[0])
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))}
    os.execve(sys.executable, [sys.executable, "-m", module, *argv[1:]], env)


if __name__ == "__main__":
    main(sys.argv[1:])
