"""``experiments/planner/run.py --smoke``: two rows of the planner's validation, measured and predicted, written
with their metadata (the committed grid is ``--publish``)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.distributed

ROOT = Path(__file__).resolve().parents[2]


def test_smoke_run_writes_measured_and_predicted_rows(tmp_path):
    out = tmp_path / "v.json"
    cmd = [sys.executable, "-m", "experiments.planner.run", "--smoke", "--memory-only", "--out", str(out)]
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=600,
                          env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert proc.returncode == 0, proc.stderr[-4000:]
    data = json.loads(out.read_text())
    assert data["kind"] == "measured" and "AllocatorPeak" in data["method"]
    assert data["summary"]["rows"] == len(data["rows"]) == 2
    for row in data["rows"]:
        measured, predicted = row["measured"]["peak_bytes"], row["predicted"]["peak_bytes"]
        assert measured > 0 and predicted == pytest.approx(sum(row["predicted"]["memory"].values()))
        assert row["memory_error"] == pytest.approx(predicted / measured - 1)
    # the committed run renders into the planning guide (a generated block), and is a full grid
    committed = json.loads((ROOT / "experiments/planner/results/planner_validation.json").read_text())
    assert committed["summary"]["rows"] == 48

