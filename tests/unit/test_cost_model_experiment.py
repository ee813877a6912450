"""``scripts/cost_model_experiment.py`` without ranks: how many reps each validation grid's medians are of."""

from __future__ import annotations

from pathlib import Path

from tests.script_import import load_script

ROOT = Path(__file__).resolve().parents[2]


def _experiment():
    return load_script("cost_model_experiment")


def test_grid_reps_default_per_grid_and_yield_to_the_flags(tmp_path):
    """Grid 1's short rows get 15 reps and grid 2's 5 (as the experiment README says); ``--reps`` overrides both,
    ``--quick`` takes 2."""
    exp = _experiment()
    args = exp.parse_args(["--out", str(tmp_path)])
    assert (exp.grid_reps(args, "grid1"), exp.grid_reps(args, "grid2")) == (15, 5)
    args = exp.parse_args(["--out", str(tmp_path), "--reps", "7"])
    assert (exp.grid_reps(args, "grid1"), exp.grid_reps(args, "grid2")) == (7, 7)
    args = exp.parse_args(["--out", str(tmp_path), "--quick"])
    assert (exp.grid_reps(args, "grid1"), exp.grid_reps(args, "grid2")) == (2, 2)
    readme = (ROOT / "experiments" / "cost_model" / "README.md").read_text()
    assert "15 rounds for grid 1, 5 for grid 2" in readme


RESULTS = ROOT / "experiments" / "cost_model" / "results"


def _grid(name: str) -> dict:
    import json

    return json.loads((RESULTS / f"cost_model_validation_{name}.json").read_text())


def test_quoted_errors_are_the_committed_results():
    """The main README's cost-model row and the experiment README quote grid 1's and grid 2's mean / max |error| and
    row counts as the committed results files hold them, and the experiment README embeds the committed table
    (`results/cost_model_validation.md`) unchanged: a re-run copied in without the READMEs (or the reverse) fails."""
    import re

    grids = {g: _grid(g) for g in ("grid1", "grid2")}
    main = (ROOT / "README.md").read_text()
    row = next(line for line in main.splitlines() if line.startswith("| [cost_model]"))
    latest = re.search(r"mean &#124;error&#124; ([\d.]+)%, max ([\d.]+)% in the committed run", row)
    unseen = re.search(r"second grid of unseen shapes \(([\d.]+)%, ([\d.]+)%", row)
    assert latest and unseen, "the README's cost-model row no longer says where its figures are"
    for found, grid in ((latest, grids["grid1"]), (unseen, grids["grid2"])):
        assert (float(found.group(1)), float(found.group(2))) == (grid["mean_abs_error_pct"], grid["max_abs_error_pct"])
    readme = (ROOT / "experiments" / "cost_model" / "README.md").read_text()
    for name, grid in grids.items():
        quoted = re.search(rf"^- {name}: (\d+) rows, \*\*mean \|error\| ([\d.]+)%, max ([\d.]+)%\*\*", readme, re.M)
        assert quoted, f"the experiment README's committed-run paragraph no longer quotes {name}"
        assert (int(quoted.group(1)), float(quoted.group(2)), float(quoted.group(3))) == (
            len(grid["results"]), grid["mean_abs_error_pct"], grid["max_abs_error_pct"])
    table = (RESULTS / "cost_model_validation.md").read_text().split("\n", 2)[2].strip()  # without its heading
    assert table in readme, "the experiment README's embedded table is not results/cost_model_validation.md's"


def test_committed_model_columns_are_this_codes_predictions():
    """Every committed row's model column is what the model in this tree predicts from the committed calibration
    (with the stretch measured at its grid's start, and the two barriers): a change to the model or to the
    calibration without re-running ``scripts/cost_model_validate.sh`` fails here. Control: the same rows without
    the calibrated layer latency differ, so the check sees the term the results claim to include."""
    from dataclasses import replace

    from experiments.cost_model.calibrate import load_profile
    from lightning_sp.cost_model import AttentionShape, predict_attention

    hw, _ = load_profile(RESULTS)
    assert hw.layer_latency_s, "the committed calibration has no layer latency"
    moved = 0
    for name in ("grid1", "grid2"):
        grid = _grid(name)
        now = replace(hw, compute_sharing=tuple(sorted((int(w), float(x)) for w, x in grid["sharing_now"].items()
                                                       if str(w).isdigit())))
        for r in grid["results"]:
            backend, u = r["backend"], None
            if backend.startswith("usp"):
                backend, u = "usp", int(backend.split("=")[1].rstrip(")"))
            shape = AttentionShape(seq_len=r["N"], num_heads=r["heads"], num_kv_heads=r["kv_heads"],
                                   head_dim=r["head_dim"], causal=r["causal"], batch=1, dtype_bytes=4)
            for profile, same in ((now, True), (replace(now, layer_latency_s=()), False)):
                ms = predict_attention(backend, shape, r["P"], profile, ulysses_degree=u,
                                       kv_pieces=r["kv_pieces"]).total_s * 1e3 + r["model_barriers_ms"]
                if same:
                    assert abs(ms - r["model_predicted_ms"]) < 0.01, (
                        f"{name} {r['backend']} P={r['P']} N={r['N']}: the model now predicts {ms:.3f} ms, the file "
                        f"{r['model_predicted_ms']} ms; re-run scripts/cost_model_validate.sh")
                else:
                    moved += abs(ms - r["model_predicted_ms"]) > 0.01
    assert moved >= 10  # the control: the layer latency is in the committed predictions


def test_load_profile_without_a_calibration_says_what_to_run(tmp_path):
    import pytest

    from experiments.cost_model.calibrate import load_profile

    with pytest.raises(FileNotFoundError, match="run --part calibrate"):
        load_profile(tmp_path)
