#!/usr/bin/env python
"""Redraw every published figure in ``paper_figures/`` from the committed results beside it (never trains):

    python scripts/figures.py              # every study (what `make figures` runs)
    python scripts/figures.py throughput   # one study

Each study's ``plot`` module runs with ``--publish`` (it reads ``paper_figures/<study>.json`` or ``.csv`` and
writes the PNG, and any table it renders, next to it); then the README blocks generated from results files are
rewritten (``python -m experiments.common.generated``). The demos' loss curves are drawn from a demo run's
TensorBoard logs instead: ``python -m experiments.common.demo_loss runs/protein_demo/version_0 --publish``.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
STUDIES = ("activation_memory", "comm_volume", "context_matters", "convergence", "cost_model", "longest_sequence",
           "throughput")


def main(argv: list[str]) -> int:
    unknown = sorted(set(argv) - set(STUDIES))
    if unknown:
        print(f"no published figure for {', '.join(unknown)}; choose from: {', '.join(STUDIES)}", file=sys.stderr)
        return 2
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))}
    commands = [[sys.executable, "-m", f"experiments.{study}.plot", "--publish"] for study in argv or STUDIES]
    commands.append([sys.executable, "-m", "experiments.common.generated"])
    for command in commands:
        print("+", " ".join(command[1:]), flush=True)
        if subprocess.run(command, cwd=ROOT, env=env).returncode:
            return 1
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
