"""What every experiment shares: where results and runs go, run metadata, result files, run names,
figures in TensorBoard (spawning gloo ranks: ``experiments.common.launch``).

    from experiments.common.results import PAPER_FIGURES, run_metadata, write_results, read_results, run_name

Conventions:

- Reruns never overwrite committed files: an experiment writes to ``runs/<experiment>/`` (ignored by git)
  unless it is given ``--publish`` (``paper_figures/``) or ``--out DIR`` (``add_output_arguments``,
  ``output_dir``); figure scripts draw beside the results file they read.
- A result file is ``<out>/<name>.json`` (``{**metadata, "results": rows}``) plus ``<name>.csv``
  (the rows). Metadata says what produced it: command, UTC date, hardware, torch version, git commit,
  and whether the numbers are ``measured`` or ``model`` output (never both in one file's column).
- Every experiment's TensorBoard runs sit under ``runs/<experiment>/`` with names from
  ``run_name`` that say method, degree and length (``zigzag_ring-P4-N2048``), so
  ``tensorboard --logdir runs/<experiment>`` overlays them.
- Figure scripts read result files and never train; they also log the figure as an image into the
  experiment's log dir (``log_figure``), so TensorBoard shows it beside the curves.
"""

from __future__ import annotations

import csv
import datetime
import json
import os
import platform
import subprocess
import sys
from pathlib import Path
from typing import Any, Iterable

from experiments.common.launch import MALLOC_KEEP_FREED

ROOT = Path(__file__).resolve().parents[2]  # the repository

PAPER_FIGURES = ROOT / "paper_figures"
RUNS = ROOT / "runs"  # TensorBoard root: tensorboard --logdir runs/<experiment>


def add_output_arguments(parser, experiment: str) -> None:
    """``--publish`` / ``--out DIR``: where the result files go (default ``runs/<experiment>/``)."""
    group = parser.add_mutually_exclusive_group()
    group.add_argument("--publish", action="store_true",
                       help=f"write to paper_figures/ (the committed results) instead of runs/{experiment}/")
    group.add_argument("--out", type=Path, default=None, help=f"result directory (default: runs/{experiment}/)")


def output_dir(args, experiment: str) -> Path:
    """The result directory ``add_output_arguments`` chose: ``--out``, ``paper_figures/`` with
    ``--publish``, else ``runs/<experiment>/`` (ignored by git: a rerun leaves the checkout clean)."""
    if getattr(args, "out", None) is not None:
        return Path(args.out)
    return PAPER_FIGURES if getattr(args, "publish", False) else RUNS / experiment


def default_results(args, experiment: str, filename: str) -> Path:
    """For a figure script: the results file it reads when none is named (``output_dir``'s)."""
    return output_dir(args, experiment) / filename


def hardware() -> dict[str, Any]:
    """The machine a measurement ran on, in words a reader can compare."""
    import torch

    model = platform.processor() or "unknown"
    try:
        with open("/proc/cpuinfo") as f:
            model = next((ln.split(":", 1)[1].strip() for ln in f if ln.startswith("model name")), model)
    except OSError:
        pass
    cuda = torch.cuda.get_device_name(0) if torch.cuda.is_available() else None
    return {"device": cuda or f"CPU ({model}, {os.cpu_count()} cores)", "cpu_model": model,
            "cpu_cores": os.cpu_count(), "cuda": cuda, "platform": platform.platform(),
            "python": platform.python_version(), "torch": torch.__version__}


def git_commit() -> str | None:
    try:
        out = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True, timeout=10)
    except (OSError, subprocess.SubprocessError):
        return None
    return out.stdout.strip() or None


def git_dirty() -> bool | None:
    """Whether tracked files differ from ``git_commit`` (the numbers may then not be reproducible from it)."""
    try:
        out = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=ROOT, capture_output=True,
                             text=True, timeout=10)
    except (OSError, subprocess.SubprocessError):
        return None
    return bool(out.stdout.strip()) if out.returncode == 0 else None


def run_metadata(script: str | Path, argv: Iterable[str] | None, *, kind: str = "measured", **extra: Any) -> dict[str, Any]:
    """``kind``: ``"measured"`` (this machine ran it) or ``"model"`` (cost-model output)."""
    if kind not in ("measured", "model"):
        raise ValueError(f"kind must be 'measured' or 'model', got {kind!r}")
    args = list(sys.argv[1:] if argv is None else argv)
    path = Path(script).resolve()
    rel = path.relative_to(ROOT) if path.is_relative_to(ROOT) else path
    # a study's or benchmark's module runs as `python -m experiments.<study>.run`; a script by its path
    entry = ["-m", ".".join(rel.with_suffix("").parts)] if rel.parts[0] in ("experiments", "benchmarks") else [str(rel)]
    return {"command": " ".join([".venv/bin/python", *entry, *args]),
            "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
            "hardware": hardware(), "git_commit": git_commit(), "git_dirty": git_dirty(),
            "kind": kind, **extra,
            **({"malloc": {k: os.environ[k] for k in MALLOC_KEEP_FREED if k in os.environ}}
               if any(k in os.environ for k in MALLOC_KEEP_FREED) else {})}


def write_results(name: str, meta: dict[str, Any], rows: list[dict[str, Any]], out: str | Path = PAPER_FIGURES) -> Path:
    """Write ``<out>/<name>.json`` and ``<out>/<name>.csv``; returns the JSON path."""
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    path = out / f"{name}.json"
    path.write_text(json.dumps({**meta, "results": rows}, indent=2, default=str) + "\n")
    if rows:
        fields = list(dict.fromkeys(k for row in rows for k in row))  # union of keys, first-seen order
        with (out / f"{name}.csv").open("w", newline="") as f:
            w = csv.DictWriter(f, fieldnames=fields)
            w.writeheader()
            w.writerows(rows)
    return path


def read_results(path: str | Path) -> tuple[dict[str, Any], list[dict[str, Any]]]:
    """``(metadata, rows)`` of a file written by ``write_results``."""
    data = json.loads(Path(path).read_text())
    rows = data.pop("results")
    return data, rows


def run_name(method: str, **fields: Any) -> str:
    """``run_name("zigzag_ring", P=4, N=2048)`` -> ``"zigzag_ring-P4-N2048"``: a TensorBoard run name
    that says method, degree and length."""
    return "-".join([method, *(f"{k}{v}" for k, v in fields.items())])


def log_figure(log_dir: str | Path, tag: str, png: str | Path, step: int = 0) -> None:
    """Log a PNG the figure script drew as an image in TensorBoard (``<log_dir>/figures``)."""
    import matplotlib.image as mpimg
    import numpy as np
    from torch.utils.tensorboard import SummaryWriter

    img = mpimg.imread(str(png))  # [H, W, C] floats in [0, 1]
    if img.ndim == 2:
        img = np.stack([img] * 3, axis=-1)
    with SummaryWriter(str(Path(log_dir) / "figures")) as w:
        w.add_image(tag, img[..., :3], step, dataformats="HWC")
