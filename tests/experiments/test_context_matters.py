"""Smoke test of the context experiment (``experiments/context_matters/run.py --quick``): both arms train and
are evaluated, the result file carries its provenance, progress is printed, the figure is drawn beside
the results, and a rerun gives the same numbers bit for bit (seeded, deterministic). Also: no experiment
or figure script writes into ``paper_figures/`` unless told to (``--publish``)."""

from __future__ import annotations

import argparse
import ast
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.distributed

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ["-m", "experiments.context_matters.run"]
METRICS = ("val_answer_acc", "val_loss", "train_loss_last")


def _run(out: Path, *extra: str) -> tuple[dict, str]:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT), "PYTHONWARNINGS": "ignore"}
    proc = subprocess.run([sys.executable, *SCRIPT, "--quick", "--out", str(out), *extra], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return json.loads((out / "context_matters.json").read_text()), proc.stdout


@pytest.mark.timeout(900)  # three Lightning start-ups; far less on a quiet machine (see the report)
def test_quick_run_has_provenance_progress_and_reruns_bit_for_bit(tmp_path):
    # one full-context arm, with bidirectional images (the causal one runs the same code with no mask)
    meta, stdout = _run(tmp_path / "a", "--image-attention", "bidirectional")
    for key in ("command", "date", "hardware", "git_commit", "git_dirty", "kind"):
        assert key in meta, key
    assert meta["kind"] == "measured" and meta["quick"] is True and "--quick" in meta["command"]
    rows = {r["arm"]: r for r in meta["results"]}
    assert set(rows) == {"full_sp2_bidir", "trunc48"}
    assert rows["full_sp2_bidir"]["sequence_parallel"] and rows["full_sp2_bidir"]["context_tokens"] == 177
    assert rows["full_sp2_bidir"]["image_attention"] == "bidirectional" and rows["trunc48"]["image_attention"] == "causal"
    assert (tmp_path / "a" / "context_matters.csv").is_file() and (tmp_path / "a" / "context_matters.png").is_file()
    for line in ("[1/2] full_sp2_bidir seed 0: training 4 steps", "[2/2] trunc48 seed 0: val answer accuracy"):
        assert line in stdout, stdout
    # a rerun (truncated arm only) reproduces the first run's numbers exactly
    again, _ = _run(tmp_path / "b", "--skip-full")
    (rerun,) = again["results"]
    assert {m: rerun[m] for m in METRICS} == {m: rows["trunc48"][m] for m in METRICS}
    # negative control: the metrics are not constants (the full-context arm's differ)
    assert rows["full_sp2_bidir"]["val_loss"] != rows["trunc48"]["val_loss"]


def test_output_dir_defaults_to_runs():
    from experiments.common.results import PAPER_FIGURES, RUNS, output_dir

    assert output_dir(argparse.Namespace(out=None, publish=False), "x") == RUNS / "x"
    assert output_dir(argparse.Namespace(out=None, publish=True), "x") == PAPER_FIGURES
    assert output_dir(argparse.Namespace(out=Path("/tmp/y"), publish=False), "x") == Path("/tmp/y")


WRITERS = sorted([*ROOT.glob("experiments/*/run.py"), *ROOT.glob("experiments/*/plot.py"),
                  *ROOT.glob("experiments/*/measure.py")])
assert len(WRITERS) >= 14, WRITERS  # every study's run and plot


@pytest.mark.parametrize("script", WRITERS, ids=lambda p: str(p.relative_to(ROOT)))
def test_no_argument_defaults_to_paper_figures(script):
    """An ``add_argument(..., default=...)`` whose default names ``paper_figures`` / ``PAPER_FIGURES`` would
    make a plain rerun overwrite committed files; every script must say ``--publish`` for that."""
    offending = []
    for node in ast.walk(ast.parse(script.read_text())):
        if isinstance(node, ast.Call) and getattr(node.func, "attr", None) == "add_argument":
            for kw in node.keywords:
                if kw.arg == "default" and "paper_figures" in ast.unparse(kw.value).lower():
                    offending.append(ast.unparse(node))
    assert not offending, offending
    text = script.read_text()
    if "add_argument" in text:  # a command-line script (not a helper module): it offers --publish
        assert "--publish" in text or "add_output_arguments" in text, script
