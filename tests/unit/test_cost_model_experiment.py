"""``scripts/cost_model_experiment.py`` without ranks: how many reps each validation grid's medians are of."""

from __future__ import annotations

from pathlib import Path

import pytest

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


NEW_MACHINE = RESULTS / "new_machine"
"""Session 28's complete run of main's model on the workplace's new VM (2026-11-28), kept beside the committed run."""


def _grid(name: str, results: Path = RESULTS) -> dict:
    import json

    return json.loads((results / f"cost_model_validation_{name}.json").read_text())


def test_paper_figures_cost_model_files_are_the_committed_run():
    """``paper_figures/``'s cost-model data files are byte copies of the committed run's, its drawn table is
    ``results/cost_model_validation.md``'s, and its README row quotes that run's grid 1 and grid 2 figures: a new
    committed run without the copy (or a figure left from an older one) fails."""
    import re

    papers = ROOT / "paper_figures"
    for name in ("cost_model_validation", "cost_model_cpu_profile", "cost_model_predictions"):
        for ext in ("json", "csv"):
            assert (papers / f"{name}.{ext}").read_bytes() == (RESULTS / f"{name}.{ext}").read_bytes(), \
                f"paper_figures/{name}.{ext} is not the committed run's: copy it from {RESULTS.relative_to(ROOT)}"
    drawn = (papers / "cost_model_validation.md").read_text().split("## Predictions")[0]
    assert drawn == (RESULTS / "cost_model_validation.md").read_text().split("## Predictions")[0], \
        "paper_figures/cost_model_validation.md was not redrawn (scripts/plot_cost_model.py --publish)"
    row = next(line for line in (papers / "README.md").read_text().splitlines()
               if line.startswith("| **Cost-model validation**"))
    found = re.search(r"N = 1024, 2048\) \*\*mean \\\|error\\\| ([\d.]+)%, max ([\d.]+)%\*\*; 24 unseen shapes .*?"
                      r"\*\*([\d.]+)%, ([\d.]+)%\*\*", row)
    assert found, "paper_figures/README.md's cost-model row no longer says where its figures are"
    g1, g2 = _grid("grid1"), _grid("grid2")
    assert tuple(float(x) for x in found.groups()) == (g1["mean_abs_error_pct"], g1["max_abs_error_pct"],
                                                        g2["mean_abs_error_pct"], g2["max_abs_error_pct"])
    assert len(g2["results"]) == 24


@pytest.mark.parametrize("results", [RESULTS, NEW_MACHINE], ids=["committed", "new_machine"])
def test_committed_model_columns_are_this_codes_predictions(results):
    """Every committed row's model column is what the model in this tree predicts from the run's own calibration
    (with the stretch against the calibration's table and the delay per synchronisation measured at its grid's
    start, and the two barriers): a change to the model or to the calibration without re-running
    ``scripts/cost_model_validate.sh`` fails here. The committed colossal table is the median over its rounds.
    Controls: the same rows without the calibrated layer latency, without the delay, or priced by the stretch at the
    grid's start differ, so the check sees the terms the results claim to include."""
    import json
    import statistics
    from dataclasses import replace

    from experiments.cost_model.ablation import predict_row, stretch_against_table, stretch_at_start
    from experiments.cost_model.calibrate import colossal_table, load_profile, with_sync_delay

    hw, _ = load_profile(results)
    assert hw.layer_latency_s and hw.sync_delay_s, "the committed calibration lacks the layer latency or the delay"
    rounds = json.loads((results / "cost_model_calibration.json").read_text())["local"]["colossal"]["rounds"]
    medians = colossal_table([(n, d) for n, d, _ in rounds], [statistics.median(t) for _, _, t in rounds])
    assert [list(row) for row in hw.colossal_table] == medians and all(len(t) == 5 for _, _, t in rounds)
    moved = {"latency": 0, "delay": 0, "stretch at start": 0}
    for name in ("grid1", "grid2"):
        grid = _grid(name, results)
        now = with_sync_delay(replace(hw, compute_sharing=stretch_against_table(grid)), grid["sync_delay_now"])
        for r in grid["results"]:
            for profile, left_out in ((now, None), (replace(now, layer_latency_s=()), "latency"),
                                      (replace(now, sync_delay_s=()), "delay"),
                                      (replace(now, compute_sharing=stretch_at_start(grid)), "stretch at start")):
                ms = predict_row(r, profile, barrier_s=r["model_barriers_ms"] / 2e3)
                if left_out is None:
                    assert abs(ms - r["model_predicted_ms"]) < 0.01, (
                        f"{name} {r['backend']} P={r['P']} N={r['N']}: the model now predicts {ms:.3f} ms, the file "
                        f"{r['model_predicted_ms']} ms; re-run scripts/cost_model_validate.sh")
                else:
                    moved[left_out] += abs(ms - r["model_predicted_ms"]) > 0.01
    rows = len(_grid("grid1", results)["results"]) + len(_grid("grid2", results)["results"])
    assert moved["latency"] >= 10  # the controls: the layer latency is in the committed predictions,
    assert moved["delay"] == rows  # the delay in every row,
    assert moved["stretch at start"] >= rows // 2  # and the stretch against the table (rows that wait on messages
    # more than on compute do not move with it)


def test_load_profile_without_a_calibration_says_what_to_run(tmp_path):
    import pytest

    from experiments.cost_model.calibrate import load_profile

    with pytest.raises(FileNotFoundError, match="run --part calibrate"):
        load_profile(tmp_path)


def _kept_runs() -> list[dict]:
    import json

    from experiments.cost_model.reproducibility import RUNS_FILE

    return json.loads(RUNS_FILE.read_text())["runs"]


def test_reproducibility_results_and_readme_are_recomputed_from_the_kept_runs():
    """`results/cost_model_reproducibility.json` is what `reproducibility.summarise` makes of `results/grid1_runs.json`
    now, and the experiment README's table and floor figures are that summary's: editing the runs, the code or a
    quoted figure without the others fails here."""
    import json
    import re

    from experiments.cost_model.reproducibility import OUT_FILE, summarise, table

    summary = summarise(_kept_runs())
    assert json.loads(OUT_FILE.read_text()) == json.loads(json.dumps(summary)), (
        "re-run `python -m experiments.cost_model.reproducibility --write`")
    readme = (ROOT / "experiments" / "cost_model" / "README.md").read_text()
    assert table(summary) in readme, "the README's reproducibility table is not the summary's"
    near = summary["near_pairs"]
    found = re.search(r"The (\d+) ordered pairs of runs at most (\d+) minutes apart .*? replay each other with ([\d.]+)% "
                      r"mean \|error\| \(median; ([\d.]+)-([\d.]+)%\)\. (\d+) of the \d+ meet\s+issue 17's 15% mean, (\d+) "
                      r"meet both", readme, re.S)
    assert found, "the README's floor sentence moved"
    assert [float(x) for x in found.groups()] == [
        near["pairs"], summary["near_minutes"], round(near["median_of_means_pct"], 1),
        *(round(x, 1) for x in near["range_of_means_pct"]), near["meeting_mean"], near["meeting_both"]]
    shape = [r["model_level_removed_mean_abs_pct"] for r in summary["per_run"]]
    assert f"the model's error is {min(shape):.1f}-{max(shape):.1f}% mean per run" in readme
    levels = [r["model_mean_signed_pct"] for r in summary["per_run"]]
    under = [x for x in levels if x < 0]
    assert f"below zero in {len(under)} of the {len(levels)} runs ({max(under):.1f}% to {min(under):.1f}%)" in readme


def test_the_committed_grid1_run_is_one_of_the_kept_runs():
    """The committed grid-1 results are kept in `grid1_runs.json` row for row (measured and model), so the floor is
    computed over the run the READMEs quote."""
    from experiments.cost_model.reproducibility import run_from_grid

    committed = run_from_grid(_grid("grid1"), "committed")
    kept = [r for r in _kept_runs() if r["date"] == committed["date"]]
    assert len(kept) == 1
    for field in ("measured_ms", "model_predicted_ms", "git_commit", "reps_per_case"):
        assert kept[0][field] == committed[field], field


def test_replay_error_is_scored_as_the_model_is():
    """Controls on the replay arithmetic: a run replays itself with 0 error; every row 1.2x is +20% everywhere and 0
    with the level removed; one row 1.5x is a 50% max; a run of another grid is refused by name; runs timed with
    different reps are not paired."""
    import re

    import pytest

    from experiments.cost_model.reproducibility import errors_pct, replay_pairs, summarise

    base = _kept_runs()[0]
    rows = base["measured_ms"]

    def run(label, measured, reps=15):
        return {**base, "label": label, "measured_ms": measured, "reps_per_case": reps}

    scaled = {k: 1.2 * v for k, v in rows.items()}
    one = dict(rows)
    key = sorted(one)[3]
    one[key] *= 1.5
    pairs = {(p["predictor"], p["judged"]): p for p in replay_pairs(
        [run("a", rows), run("a again", dict(rows)), run("scaled", scaled), run("one", one), run("other reps", rows, 5)])}
    same = pairs[("a again", "a")]
    assert (same["mean_abs_pct"], same["max_abs_pct"], same["level_removed_mean_abs_pct"]) == (0, 0, 0)
    up = pairs[("scaled", "a")]
    assert up["mean_abs_pct"] == up["max_abs_pct"] == up["mean_signed_pct"] == 20.0
    assert up["level_removed_max_abs_pct"] == 0.0
    assert pairs[("one", "a")]["max_abs_pct"] == 50.0
    assert not any("other reps" in k for k in pairs)
    with pytest.raises(ValueError, match=re.escape(key)):
        errors_pct({k: v for k, v in rows.items() if k != key}, rows)
    per_run = summarise([run("a", rows), run("later", scaled)])["per_run"]
    assert per_run[0]["model_mean_abs_pct"] == summarise([base])["per_run"][0]["model_mean_abs_pct"]


def test_reproducibility_add_keeps_a_new_run_beside_the_old_ones(tmp_path, capsys):
    """``--add DIR --label L`` appends DIR's grid-1 run to the runs file and prints the table with it: the way the next
    run joins the floor. A directory without a grid-1 file is refused by the missing file's name."""
    import json
    import shutil

    import pytest

    from experiments.cost_model.reproducibility import RUNS_FILE, main

    runs = tmp_path / "runs.json"
    shutil.copy(RUNS_FILE, runs)
    before = len(json.loads(runs.read_text())["runs"])
    (tmp_path / "new").mkdir()
    shutil.copy(RESULTS / "cost_model_validation_grid1.json", tmp_path / "new")
    main(["--runs", str(runs), "--add", str(tmp_path / "new"), "--label", "again"])
    kept = json.loads(runs.read_text())["runs"]
    assert len(kept) == before + 1 and kept[-1]["label"] == "again"
    committed = _grid("grid1")  # its figures from rows rounded to 0.1%; the table's from the unrounded times
    line = next(ln for ln in capsys.readouterr().out.splitlines() if ln.startswith("| again | "))
    mean, worst = (float(x) for x in line.split("|")[2].split("/"))
    assert (mean, worst) == (pytest.approx(committed["mean_abs_error_pct"], abs=0.11),
                             pytest.approx(committed["max_abs_error_pct"], abs=0.11))
    with pytest.raises(FileNotFoundError, match="cost_model_validation_grid1.json"):
        main(["--runs", str(runs), "--add", str(tmp_path)])


def _one_row_run(run_dir, hw, rows, barrier, date, grid_extra=None, calibration_extra=None) -> dict:
    """A run directory whose calibration profile is ``hw`` and whose two grid files hold ``rows``, each measured at
    what ``hw`` predicts and priced by it (what ``ablation`` reads); returns the grid file's contents."""
    import json

    from experiments.cost_model import ablation

    with_ms = [ablation.predict_row(r, hw, barrier) for r in rows]
    grid = {"date": date, "calibration_profile": hw.to_dict(), **(grid_extra or {}),
            "results": [{**r, "measured_ms": m, "model_predicted_ms": round(m, 3)} for r, m in zip(rows, with_ms)]}
    (run_dir / "cost_model_calibration.json").write_text(json.dumps(
        {"profile": hw.to_dict(), "links": {"2": {"barrier_s": barrier}}, **(calibration_extra or {})}))
    for g in ablation.GRIDS:
        (run_dir / f"cost_model_validation_{g}.json").write_text(json.dumps(grid))
    return grid


def _judged_alike_priced_by(run_dir, grid, other, barrier, study, recorded) -> list[dict]:
    """The study's rows for ``grid``'s rows priced by the profile ``other`` instead (to compare with the rows as
    priced first: a study judges a run the same whichever variant priced it); then checks that the grid without the
    ``recorded`` key is refused by name."""
    import json

    import pytest

    from experiments.cost_model import ablation

    priced = {**grid, "calibration_profile": other.to_dict(), "results": [
        {**r, "model_predicted_ms": round(ablation.predict_row(r, other, barrier), 3)} for r in grid["results"]]}
    (run_dir / "cost_model_validation_grid1.json").write_text(json.dumps(priced))
    rows = ablation.ablate_run(run_dir, study)["grid1"]["rows"]
    del priced[recorded]  # a grid of the code before the study
    (run_dir / "cost_model_validation_grid1.json").write_text(json.dumps(priced))
    with pytest.raises(ValueError, match=f"did not record {recorded}"):
        ablation.ablate_run(run_dir, study)
    return rows


def test_sync_delay_ablation_is_paired_and_the_rule_is_applied_as_written(tmp_path):
    """``experiments.cost_model.ablation``: a run's rows predicted from its own grid profile with the delay per
    synchronisation (checked equal to the file's model column, so it judges what the grid ran) and without it (the
    same profile, ``sync_delay_s`` empty); the measured column is the same for both. ``judge`` applies ``RULE``."""
    import json
    from dataclasses import replace

    import pytest

    from experiments.cost_model import ablation
    from lightning_sp.cost_model import preset

    hw = replace(preset("a100-80gb"), compute_slots=None, sync_delay_s=((2, 1e-3),))
    row = {"P": 2, "N": 1024, "backend": "ulysses", "heads": 8, "kv_heads": 4, "head_dim": 32, "causal": True,
           "kv_pieces": 1}
    barrier = 1e-4
    with_ms = ablation.predict_row(row, hw, barrier)
    grid = {"date": "2026-11-24T22:00:00+00:00", "calibration_profile": hw.to_dict(),
            "results": [{**row, "measured_ms": with_ms * 1.1, "model_predicted_ms": round(with_ms, 3)}]}
    (tmp_path / "cost_model_calibration.json").write_text(json.dumps(
        {"profile": hw.to_dict(), "links": {"2": {"barrier_s": barrier}}}))
    for g in ablation.GRIDS:
        (tmp_path / f"cost_model_validation_{g}.json").write_text(json.dumps(grid))
    run = ablation.ablate_run(tmp_path)
    got = run["grid1"]
    assert got["with"]["mean_signed_pct"] == pytest.approx(100 * (1 / 1.1 - 1), abs=0.01)
    assert got["rows"][0]["with_ms"] - got["rows"][0]["without_ms"] == pytest.approx(2.0, abs=1e-3)  # 2 syncs x 1 ms
    assert got["sync_delay_ms"] == {"2": 1.0}
    grid["results"][0]["model_predicted_ms"] += 1.0  # a file this code did not write
    (tmp_path / "cost_model_validation_grid1.json").write_text(json.dumps(grid))
    with pytest.raises(ValueError, match="re-run the grid"):
        ablation.ablate_run(tmp_path)

    def fake(g1_with, g1_without, g2_with=5.0, g2_without=5.0):
        entry = lambda mean, signed: {"mean_abs_pct": mean, "max_abs_pct": 2 * mean, "mean_signed_pct": signed}
        return {"grid1": {"with": entry(g1_with, -g1_with / 2), "without": entry(g1_without, -g1_without)},
                "grid2": {"with": entry(g2_with, 0.0), "without": entry(g2_without, 0.0)}}

    better = [fake(10, 20)] * ablation.RULE["runs"]
    assert ablation.judge(better)["keep"]
    assert not ablation.judge(better[:-1])["keep"]  # fewer runs than the rule asks for
    assert not ablation.judge([fake(10, 20, g2_with=8.1)] * 5)["keep"]  # grid 2 over 2 points worse
    assert not ablation.judge([fake(25, 20)] * 5)["keep"]  # grid 1 worse on the mean over runs
    assert ablation.judge([fake(10, 20)] * 4 + [fake(60, 20)])["checks"][0] is False  # one bad run moves the mean


def test_stretch_during_rows_is_the_rounds_median_probe_over_the_time_alone():
    """``calibrate.stretch_during_rows``: per world, the median of the rounds' probes (a slow round does not move
    it) over the grid's time alone; a world without rounds is left out; a non-positive time alone is refused."""
    import pytest

    from experiments.cost_model.calibrate import stretch_during_rows

    got = stretch_during_rows({2: [0.010, 0.011, 0.050], 4: [0.020, 0.021, 0.022, 0.080, 0.019], 8: []}, 0.010)
    assert got == {2: pytest.approx(1.1), 4: pytest.approx(2.1)}
    with pytest.raises(ValueError, match="alone_s must be positive"):
        stretch_during_rows({2: [0.01]}, 0.0)


def test_sharing_study_prices_the_same_rows_by_the_stretch_at_the_grids_start(tmp_path):
    """The ``sharing`` study: "with" prices the rows by the stretch during them, "without" by the stretch measured at
    the grid's start, both from the grid's own profile (checked to reproduce the file's column), whichever of the two
    the grid was priced by; a grid that did not record the stretch during its rows is refused; ``SHARING_RULE`` is
    applied as written."""
    from dataclasses import replace

    import pytest

    from experiments.cost_model import ablation
    from lightning_sp.cost_model import preset

    hw = replace(preset("a100-80gb"), compute_slots=None, compute_sharing=((2, 1.0),))
    row = {"P": 2, "N": 32768, "backend": "zigzag_ring", "heads": 8, "kv_heads": 4, "head_dim": 32, "causal": True,
           "kv_pieces": 1}  # long enough that the shared compute, not the messages, sets the steps
    barrier = 1e-4
    grid = _one_row_run(tmp_path, hw, [row], barrier, "2026-11-24T23:50:00+00:00", {
        "sharing_now": {"alone_s": 0.014, "2": 1.5, "slowest_2": 1.6}, "sharing_during_rows": {"2": 1.0}})
    got = ablation.ablate_run(tmp_path, "sharing")["grid1"]
    assert got["with"]["max_abs_pct"] == pytest.approx(0.0, abs=0.01)
    assert got["rows"][0]["without_ms"] > got["rows"][0]["with_ms"] * 1.2  # priced by the 1.5 stretch instead
    assert got["stretch_during_rows"] == {"2": 1.0} and got["stretch_at_start"] == {"2": 1.5}
    at_start = replace(hw, compute_sharing=((2, 1.5),))  # the same rows as main prices them: the same two variants
    assert _judged_alike_priced_by(tmp_path, grid, at_start, barrier, "sharing", "sharing_during_rows") == got["rows"]

    def fake(g1, g2):  # per grid ((mean, max) with, (mean, max) without), % |error|
        entry = lambda mean_max: {"mean_abs_pct": mean_max[0], "max_abs_pct": mean_max[1], "mean_signed_pct": 0.0}
        return {g: {"with": entry(got[0]), "without": entry(got[1])} for g, got in (("grid1", g1), ("grid2", g2))}

    good = fake(((10, 25), (10, 40)), ((8, 20), (8, 30)))
    assert ablation.judge([good] * 5, "sharing")["keep"]
    assert not ablation.judge([good] * 4, "sharing")["keep"]  # fewer runs than the rule asks for
    assert not ablation.judge([fake(((10, 25), (10, 40)), ((8, 31), (8, 30)))] * 5, "sharing")["keep"]  # grid 2 max
    assert not ablation.judge([fake(((11.1, 25), (10, 40)), ((8, 20), (8, 30)))] * 5, "sharing")["keep"]  # mean +1.1
    worse_count = fake(((10, 34), (10, 35)), ((16, 20), (14, 30)))  # lower maxes, but grid 2 no longer meets 15%
    assert ablation.judge([worse_count] * 5, "sharing")["checks"][-1] is False
    assert ablation.judge([good] * 5, "sync_delay")["study"] == "sync_delay"  # the other rule, by name
    # SHARING_AGAIN_RULE: no fewer pairs meeting both targets, and no more than a point worse on any grid's mean or max
    tie = fake(((10.9, 25.9), (10, 25)), ((6.9, 17.9), (6, 17)))
    assert ablation.judge([tie] * 5, "sharing_again")["keep"]
    assert not ablation.judge([tie] * 5, "sharing")["keep"]  # the first rule asked for lower maxes
    assert not ablation.judge([fake(((10, 26.1), (10, 25)), ((6, 17), (6, 17)))] * 5, "sharing_again")["keep"]
    assert not ablation.judge([fake(((10, 25), (10, 25)), ((6, 36), (6, 30)))] * 5, "sharing_again")["keep"]
    assert not ablation.judge([tie] * 4, "sharing_again")["keep"]


def test_colossal_rounds_study_prices_colossal_by_the_median_over_rounds_and_by_round_0(tmp_path):
    """The ``colossal_rounds`` study: "with" prices the rows by the calibration's colossal table over its rounds,
    "without" by round 0's alone (the one pass of before), both from the grid's own profile (checked to reproduce the
    file's column) whichever of the two priced it; other backends' rows do not move; a calibration without rounds is
    refused; ``COLOSSAL_ROUNDS_RULE`` is applied as written, its first condition on ``colossal``'s rows alone."""
    import json
    from dataclasses import replace

    import pytest

    from experiments.cost_model import ablation, calibrate
    from lightning_sp.cost_model import preset

    points = ((1024, 32), (2048, 32))
    rounds = [[n, d, [3e-9 * e * (1.5 if r == 0 else 1.0) for r in range(5)]]  # round 0 read 1.5x slow
              for n, d in points for e in [calibrate.COLOSSAL_HEADS * n * n * calibrate.COLOSSAL_WORLD]]
    colossal = {"colossal_table": calibrate.colossal_table(points, [t[2] for _, _, t in rounds]), "rounds": rounds}
    hw = replace(preset("a100-80gb"), compute_slots=None, colossal_table=tuple(map(tuple, colossal["colossal_table"])))
    rows = [{"P": 2, "N": 2048, "backend": b, "heads": 8, "kv_heads": 4, "head_dim": 32, "causal": True,
             "kv_pieces": 1} for b in ("colossal", "zigzag_ring")]
    barrier = 1e-4
    grid = _one_row_run(tmp_path, hw, rows, barrier, "2026-11-25T03:00:00+00:00",
                        calibration_extra={"local": {"colossal": colossal}})
    with_ms = [r["measured_ms"] for r in grid["results"]]
    got = ablation.ablate_run(tmp_path, "colossal_rounds")["grid1"]
    assert got["with"]["max_abs_pct"] == pytest.approx(0.0, abs=0.01)
    colossal_row, other_row = got["rows"]
    assert colossal_row["without_ms"] > colossal_row["with_ms"] * 1.3  # its compute priced 1.5x
    assert other_row["without_ms"] == other_row["with_ms"]
    assert got["colossal_ns_per_score"] == {"4194304/32": [3.0, 4.5], "16777216/32": [3.0, 4.5]}  # 2 heads x n x 2n
    first = replace(hw, colossal_table=tuple(map(tuple, calibrate.colossal_table_of_round(colossal, 0))))
    priced = {**grid, "calibration_profile": first.to_dict(), "results": [  # the same rows priced by round 0
        {**r, "measured_ms": m, "model_predicted_ms": round(ablation.predict_row(r, first, barrier), 3)}
        for r, m in zip(rows, with_ms)]}
    (tmp_path / "cost_model_validation_grid1.json").write_text(json.dumps(priced))
    assert ablation.ablate_run(tmp_path, "colossal_rounds")["grid1"]["rows"] == got["rows"]
    del colossal["rounds"]  # a calibration of the code before session 27
    (tmp_path / "cost_model_calibration.json").write_text(json.dumps(
        {"profile": hw.to_dict(), "links": {"2": {"barrier_s": barrier}}, "local": {"colossal": colossal}}))
    with pytest.raises(ValueError, match="one pass"):
        ablation.ablate_run(tmp_path, "colossal_rounds")

    def fake(colossal_errors, g1=((8, 20), (8, 20)), g2=((6, 17), (6, 17))):  # colossal rows' % (with, without)
        entry = lambda mean_max: {"mean_abs_pct": mean_max[0], "max_abs_pct": mean_max[1], "mean_signed_pct": 0.0}
        row = lambda err: {"backend": "colossal", "measured_ms": 100.0, "with_ms": 100.0 + err[0],
                           "without_ms": 100.0 + err[1]}
        return {g: {"with": entry(got[0]), "without": entry(got[1]), "rows": [row(e) for e in errs]}
                for g, got, errs in (("grid1", g1, colossal_errors), ("grid2", g2, ()))}

    better = fake([(10, 20), (-5, 30)])
    assert ablation.colossal_mean_abs_pct([better] * 5, "with") == 7.5
    assert ablation.judge([better] * 5, "colossal_rounds")["keep"]
    assert not ablation.judge([better] * 4, "colossal_rounds")["keep"]  # fewer runs than the rule asks for
    tied = fake([(10, -10), (5, 5)])  # colossal no closer: the change is for those rows
    assert ablation.judge([tied] * 5, "colossal_rounds")["checks"] == [False, True, True, True, True, True]
    worse_max = fake([(10, 20)], g2=((6, 18.1), (6, 17)))
    assert ablation.judge([worse_max] * 5, "colossal_rounds")["checks"][1:] == [True, True, True, True, False]
    fewer_pairs = fake([(10, 20)], g1=((8, 36), (8, 34)))  # within a point, but grid 1 misses the max target
    assert ablation.judge([fewer_pairs] * 5, "colossal_rounds")["checks"][1] is False


def test_probe_call_is_priced_by_the_calibrations_own_kernel_table():
    """``calibrate.probe_call_priced_s``: what the profile's kernel table prices one ``SHARING_CALL`` (FULL, forward
    and backward, its heads) at, fixed call time included; a table twice as slow prices it twice (less the fixed
    part), so a stretch taken against it sees the machine's speed at calibration."""
    from dataclasses import replace

    import pytest

    from experiments.cost_model import calibrate
    from lightning_sp.cost_model import preset

    q_len, k_len, heads, d = calibrate.SHARING_CALL
    table = tuple((kind, dd, q, k, 1e-4, 2e-4) for kind in ("full", "causal") for dd in (32, 64, 128)
                  for q in (128, 512, 2048) for k in (128, 512, 2048))
    hw = replace(preset("a100-80gb"), kernel_table=table, kernel_call_s=(1e-5, 2e-5))
    assert calibrate.probe_call_priced_s(hw) == pytest.approx(heads * 3e-4 + 3e-5)
    slow = replace(hw, kernel_table=tuple((*r[:4], 2 * r[4], 2 * r[5]) for r in table))
    assert calibrate.probe_call_priced_s(slow) == pytest.approx(2 * heads * 3e-4 + 3e-5)


def test_stretch_against_table_study_prices_the_same_rows_by_the_stretch_at_the_grids_start(tmp_path):
    """The ``stretch_against_table`` study: "with" prices the rows by the stretch they met against the calibration's
    table, "without" by the stretch at the grid's start, both from the grid's own profile whichever priced it; a grid
    without the record is refused; ``AGAINST_TABLE_RULE`` is the rule ``SHARING_AGAIN_RULE``'s checks apply."""
    from dataclasses import replace

    import pytest

    from experiments.cost_model import ablation
    from lightning_sp.cost_model import preset

    hw = replace(preset("a100-80gb"), compute_slots=None, compute_sharing=((2, 1.2),))
    row = {"P": 2, "N": 32768, "backend": "zigzag_ring", "heads": 8, "kv_heads": 4, "head_dim": 32, "causal": True,
           "kv_pieces": 1}
    barrier = 1e-4
    grid = _one_row_run(tmp_path, hw, [row], barrier, "2026-11-25T03:50:00+00:00", {
        "sharing_now": {"alone_s": 0.014, "2": 1.0, "slowest_2": 1.1}, "sharing_against_table": {"2": 1.2}})
    got = ablation.ablate_run(tmp_path, "stretch_against_table")["grid1"]
    assert got["with"]["max_abs_pct"] == pytest.approx(0.0, abs=0.01)
    assert got["rows"][0]["without_ms"] < got["rows"][0]["with_ms"] / 1.1  # priced by the start's 1.0 instead
    assert got["stretch_against_table"] == {"2": 1.2} and got["stretch_at_start"] == {"2": 1.0}
    at_start = replace(hw, compute_sharing=((2, 1.0),))
    assert _judged_alike_priced_by(tmp_path, grid, at_start, barrier, "stretch_against_table",
                                   "sharing_against_table") == got["rows"]
    assert ablation.AGAINST_TABLE_RULE["keep if"] == ablation.SHARING_AGAIN_RULE["keep if"]
    assert ablation.STUDIES["stretch_against_table"].checks is ablation.STUDIES["sharing_again"].checks


def test_each_study_results_file_holds_what_its_rule_makes_of_its_runs():
    """Every committed paired study (``results/cost_model_*_runs.json``): each grid's two columns of figures are what
    its rows give, the verdict is what ``ablation.judge`` makes of its runs under the study's rule, and that rule is
    the one in ``ablation.py`` now (a rule edited after its runs, or a verdict typed in, fails here)."""
    import json

    import pytest

    from experiments.cost_model import ablation

    files = sorted(RESULTS.glob("cost_model_*_runs.json"))
    assert len(files) >= 4
    for path in files:
        data = json.loads(path.read_text())
        study = data.get("study", "sync_delay")  # session 25's file predates the key
        for run in data["runs"]:
            for g in ablation.GRIDS:
                rows = run[g]["rows"]
                for variant in ("with", "without"):
                    got = ablation.stats([r[f"{variant}_ms"] for r in rows], [r["measured_ms"] for r in rows])
                    assert got == pytest.approx(run[g][variant], abs=0.02), (path.name, run["run"], g, variant)
        verdict = ablation.judge(data["runs"], study)
        assert (verdict["checks"], verdict["keep"]) == (data["checks"], data["keep"]), path.name
        assert verdict["means_over_runs"] == data["means_over_runs"], path.name
        assert data["rule"] == ablation.STUDIES[study].rule, path.name


