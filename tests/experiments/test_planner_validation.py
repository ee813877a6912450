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



def test_committed_grid_is_the_current_planners_prediction_of_its_measured_rows():
    """Every committed row's prediction is what the planner predicts now (a change to the planner must re-predict:
    ``run.py --repredict --publish``), its error is its figures', the summary is its rows', and the measured peaks
    are positive and distinct per row (no stale row)."""
    from experiments.planner.run import CPU_PROFILE, predict
    from lightning_sp.planner import hardware_profile

    committed = json.loads((ROOT / "experiments/planner/results/planner_validation.json").read_text())
    hw = hardware_profile(CPU_PROFILE)
    errors = []
    for row in committed["rows"]:
        now = predict(row, hw)["peak_bytes"]
        assert row["predicted"]["peak_bytes"] == pytest.approx(now), (row["model"], row["backend"])
        assert row["memory_error"] == pytest.approx(now / row["measured"]["peak_bytes"] - 1)
        errors.append(abs(row["memory_error"]))
    assert committed["summary"]["memory_mean_abs_error"] == pytest.approx(sum(errors) / len(errors))
    assert committed["summary"]["memory_max_abs_error"] == pytest.approx(max(errors))
    assert {row["model"] for row in committed["rows"]} >= {"llama_gqa", "qwen3", "esm", "deepseek_mla"}
    assert {row["data_parallel"] for row in committed["rows"]} == {"ddp", "fsdp"}
    assert {row["world"] for row in committed["rows"]} == {2, 4}


@pytest.mark.parametrize("name", ["planner_time_validation.json", "planner_time_validation_rerun.json",
                                  "planner_time_validation_warm_pages.json",
                                  "planner_time_validation_warm_pages_rerun.json"])
def test_committed_step_times_are_consistent_and_not_calibrated_on_their_rows(name):
    """The committed step-time validations (``run.py --time`` / ``--recommend``; with glibc keeping freed memory, and
    a repeat of its rows): each error is its measured and predicted figures', the summary is its rows', the fixed time per step
    comes from models none of these rows use, and the planner's pick is the candidate it predicts fastest."""
    results = ROOT / "experiments/planner/results"
    data = json.loads((results / name).read_text())
    assert ("allocator" in data) == ("warm_pages" in name)
    overhead = json.loads((results / "cpu_step_overhead.json").read_text())
    assert data["kind"] == overhead["kind"] == "measured"
    calibration = {r["model"] for r in overhead["rows"]}
    timed = {r["model"] for r in data["rows"]} | {k.split()[0] for k in data.get("recommendations", {})}
    assert calibration and not calibration & timed
    from experiments.planner.run import cpu_predict_step_s

    layer = json.loads((results / "cpu_layer_rates.json").read_text())
    assert layer["kind"] == "measured" and "none of the validated training steps" in layer["method"]
    sync = json.loads((results / "cpu_sync_wait.json").read_text())  # Note [Rank skew]
    assert sync["kind"] == "measured" and "None of the validated training steps" in sync["method"]
    assert {w for w, _, _ in sync["sync_wait"]} == {2, 4}
    errors = []
    for r in data["rows"]:
        assert r["predicted_step_s"] == pytest.approx(sum(r["predicted_time"].values()))
        # the current planner's prediction, with the committed calibrations (a change must re-predict)
        assert r["predicted_step_s"] == pytest.approx(cpu_predict_step_s(r, overhead)), (r["model"], r["backend"])
        assert r["error"] == pytest.approx(r["predicted_step_s"] / r["measured_step_s"] - 1)
        assert r["predicted_time"]["fixed_s"] >= 0 and r["predicted_time"]["sync_wait_s"] > 0
        errors.append(abs(r["error"]))
    assert data["summary"]["rows"] == len(errors) >= 12
    assert data["summary"]["mean_abs_error"] == pytest.approx(sum(errors) / len(errors))
    if "rerun" in name:  # a repeat of the rows only
        assert "recommendations" not in data
        return
    assert len(data["recommendations"]) >= 2
    from experiments.planner.run import RECOMMEND_SETUPS, recommend_rows

    for setup in RECOMMEND_SETUPS:
        cands = data["recommendations"][f"{setup[0]} P={setup[1]} N={setup[2]} {setup[3]}"]["candidates"]
        rows = recommend_rows(setup)
        assert [(r["backend"], r["activation_checkpointing"]) for r in rows] == [
            (c["backend"], c["activation_checkpointing"]) for c in cands]
        for row, c in zip(rows, cands):
            assert c["predicted_step_s"] == pytest.approx(cpu_predict_step_s(row, overhead)), setup
    for rec in data["recommendations"].values():
        cands = rec["candidates"]
        picked = min(cands, key=lambda c: c["predicted_step_s"])
        assert rec["planner_pick"] == {k: picked[k] for k in ("backend", "activation_checkpointing")}
        fastest = min(c["measured_step_s"] for c in cands)
        assert rec["pick_over_fastest"] == pytest.approx(picked["measured_step_s"] / fastest - 1)


def test_the_fixed_time_fit_is_never_negative():
    """``fit_overhead``: through two depths' residuals; a residual falling with depth gives no per-layer part and the
    residuals' mean; a negative fixed part is 0 (the plain line through the points, the control, has both)."""
    from experiments.planner.run import fit_overhead

    assert fit_overhead([(1, 0.010), (3, 0.016)]) == pytest.approx((0.007, 0.003))
    assert fit_overhead([(3, 0.004), (1, 0.010)]) == pytest.approx((0.007, 0.0))  # plain line: 0.013 - 0.003 L
    assert fit_overhead([(2, 0.010), (4, -0.020)]) == (0.0, 0.0)  # plain line: 0.040 - 0.015 L, < 0 from L = 3
    assert fit_overhead([(1, 0.001), (3, 0.011)]) == pytest.approx((0.0, 0.005))  # plain line: -0.004 + 0.005 L
    committed = json.loads((ROOT / "experiments/planner/results/cpu_step_overhead.json").read_text())["fits"]
    assert all(fixed >= 0 and per_layer >= 0 for fixed, per_layer in committed.values())
