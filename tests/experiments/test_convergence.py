"""Smoke test of the convergence experiment (``experiments/convergence/run.py --quick``): a sequence-
parallel and a Megatron TP+SP run of the protein encoder on 2 gloo ranks match the one-process run to
the experiment's goal (1e-4 relative, fp32) at every step, the losses in TensorBoard are the ones in
the result file, and the figure script draws from that file."""

from __future__ import annotations

import pytest

import importlib

pytestmark = pytest.mark.distributed


def _script(name: str):
    return importlib.import_module(name)  # the spawned ranks unpickle the worker function by its module name


def test_bad_arguments_say_what_to_change(tmp_path):
    exp = _script("experiments.convergence.run")
    with pytest.raises(ValueError, match="--steps must be >= 2"):
        exp.main(["--steps", "1", "--out", str(tmp_path)])
    with pytest.raises(ValueError, match="P = 1 is the one-process reference"):
        exp.main(["--degrees", "1", "--out", str(tmp_path)])
    with pytest.raises(ValueError, match="unknown method 'dense'"):
        exp.method_strategy("dense", 2)


def test_quick_run_matches_one_process(tmp_path):
    exp = _script("experiments.convergence.run")
    from experiments.common.results import read_results

    path = exp.main(["--quick", "--out", str(tmp_path)])
    assert path == tmp_path / "convergence.json" and (tmp_path / "convergence.csv").is_file()
    meta, rows = read_results(path)
    assert meta["kind"] == "measured" and meta["precision"] == "fp32" and "--quick" in meta["command"]
    steps = meta["steps"]
    assert [r["step"] for r in rows] == list(range(steps)) and {r["model"] for r in rows} == {"protein"}
    columns = {exp.loss_column("zigzag_ring", 2, "ddp"), exp.loss_column("megatron_tp_sp", 2, "ddp")}
    assert {k for k in rows[0] if k.startswith("loss:")} == columns

    meshes = {s["method"]: s["mesh"] for s in meta["summary"]}
    assert meshes["zigzag_ring"]["sp"] == 2 and meshes["zigzag_ring"]["tp"] == 1
    assert meshes["megatron_tp_sp"]["tp"] == 2 and meshes["megatron_tp_sp"]["sp"] == 1
    goal = meta["goal_max_rel_diff"]
    for s in meta["summary"]:
        assert s["max_rel_diff"] < goal, s
        assert s["rank_spread"] == 0.0, s  # every rank reports the same global loss
    # negative control: training moves the loss far more than the tolerance, so a match is not vacuous
    ref = [r["one_process_loss"] for r in rows]
    assert max(abs(x - ref[0]) for x in ref) / ref[0] > 100 * goal, ref
    for r in rows:  # the per-step maxima are those of the loss columns (written to 9 digits: 1e-8 apart at most)
        worst = max(abs(r[c] - r["one_process_loss"]) for c in columns)
        assert r["max_abs_diff"] == pytest.approx(worst, abs=2e-8) and r["max_rel_diff"] < goal

    # TensorBoard: each run under <log_dir>/<run_name>, its Loss/train the losses of the result file
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    name = exp.run_name("zigzag_ring", P=2, mode="ddp", model="protein")
    acc = EventAccumulator(str(tmp_path / "runs" / name))
    acc.Reload()
    logged = [e.value for e in sorted(acc.Scalars("Loss/train"), key=lambda e: e.step)]
    ours = [r[exp.loss_column("zigzag_ring", 2, "ddp")] for r in rows]
    assert logged == pytest.approx(ours, rel=1e-6, abs=0)
    assert len(acc.Scalars("convergence/rel_loss_diff_vs_one_process")) == steps

    png = _script("experiments.convergence.plot").main(["--results", str(path)])
    assert png == tmp_path / "convergence.png" and png.stat().st_size > 10_000
    assert any((tmp_path / "runs" / "figures").iterdir())
