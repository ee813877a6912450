"""``benchmarks/gpu/run.py --smoke``: every section of the GPU benchmark runs end to end on CPU with
tiny shapes (simulated ranks through the fake process group, the Trainer + monitor for MFU) and writes a
results file that labels simulated rows, which ``benchmarks/gpu/plot.py`` draws; the GPU numbers themselves
need a GPU."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_smoke_runs_every_section_and_labels_simulated_rows(tmp_path):
    cmd = [sys.executable, "-m", "benchmarks.gpu.run", "--smoke", "--out", str(tmp_path), "--name", "smoke"]
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=300,
                          env={**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)})
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    data = json.loads((tmp_path / "smoke.json").read_text())
    meta, rows = data["meta"], data["results"]
    assert {"date_utc", "command", "torch", "device_name", "simulated_ranks"} <= meta.keys()
    assert set(rows) == {"kernels", "schedule", "longest", "mfu"}
    schedule = rows["schedule"]
    assert {r["backend"] for r in schedule} == {"zigzag_ring", "allgather_kv", "usp", "ulysses", "ring"}
    assert {r["causal"] for r in schedule} == {True, False}
    for r in schedule:
        assert "error" not in r, r
        assert r["simulated_ranks"] is True and r["rank_s"] > 0 and r["efficiency"] > 0
    assert {(r["world"], r["simulated_ranks"]) for r in rows["longest"]} == {(1, False), (4, True)}
    assert all(r["peak_bytes"] is None for r in rows["longest"])  # no CUDA: the step runs, nothing is measured
    (mfu,) = rows["mfu"]
    assert mfu["mfu"] > 0 and mfu["tflops"] > 0
    assert (tmp_path / "smoke.csv").stat().st_size > 0
    assert list((tmp_path / "tensorboard").rglob("events.out.tfevents*")), "the monitor logged nothing"
    plot = subprocess.run([sys.executable, "-m", "benchmarks.gpu.plot", str(tmp_path / "smoke.json"),
                           "--png", str(tmp_path / "smoke.png"), "--log-dir", str(tmp_path / "figures")],
                          cwd=ROOT, capture_output=True, text=True, timeout=120, env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert plot.returncode == 0, plot.stdout[-2000:] + plot.stderr[-2000:]
    assert (tmp_path / "smoke.png").stat().st_size > 10_000
