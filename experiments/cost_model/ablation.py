"""Paired studies of one model term: each complete run's measured rows predicted from its own calibration with
and without the term, and the rule written down before the runs applied over them.

    .venv/bin/python -m experiments.cost_model.ablation [--study NAME] RUN_DIR [RUN_DIR ...] [--write FILE]

A run directory holds a complete ``experiments/cost_model/validate.sh`` run: ``cost_model_calibration.json`` and
``cost_model_validation_grid{1,2}.json``. Both variants are priced from the grid's own profile, which this code must
first reproduce the file's ``model_predicted_ms`` from; the measured column never changes. The studies (``STUDIES``):

- ``sync_delay`` (2026-11-24, ``RULE``; kept): "with" is the grid's profile, "without" the same with ``sync_delay_s``
  empty (Note [Per-call terms] in ``lightning_sp/cost_model.py``).
- ``sharing`` (2026-11-24, ``SHARING_RULE``; not kept): "with" prices each world's rows by the stretch during its
  rows (the rounds' probes, ``calibrate.stretch_during_rows``, recorded as ``sharing_during_rows``), "without" by the
  stretch measured once at the grid's start (``sharing_now``, what main priced by until ``stretch_against_table``).
- ``sharing_again`` (2026-11-25, ``SHARING_AGAIN_RULE``; not kept): the same two variants on five new runs, judged by
  the targets (no fewer (run, grid) pairs meeting both) and no worse than a point on either grid's mean or max.
- ``colossal_rounds`` (2026-11-25, ``COLOSSAL_ROUNDS_RULE``; kept): "with" prices ``colossal``'s rows by its table's
  median over the calibration's rounds (``calibrate.COLOSSAL_ROUNDS``), "without" by the table of round 0 alone (the
  one pass timed until then; Note [Colossal table in rounds] in ``NOTES.md``).
- ``stretch_against_table`` (2026-11-25, ``AGAINST_TABLE_RULE``; kept, what main prices by): "with" prices each world's
  rows by the stretch they met against the calibration's own table (the rounds' median probe over what the kernel
  table prices the probe's call at alone, ``sharing_against_table``), "without" by the stretch at the grid's start
  (``sharing_now``). The three stretch studies share ``_stretch_study``.
"""

from __future__ import annotations

import argparse
import json
import statistics
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Callable

from experiments.cost_model.calibrate import colossal_table_of_round, load_profile
from lightning_sp.cost_model import AttentionShape, HardwareProfile, predict_attention

GRIDS = ("grid1", "grid2")
RULE = {
    "written": "2026-11-24 21:29 UTC, committed before the five complete runs it judges",
    "runs": 5,
    "keep if": [
        "grid 1: the mean over the runs of mean |error| is lower with the term than without",
        "grid 1: the mean over the runs of |signed mean error| is no larger with the term than without",
        "grid 2: the mean over the runs of mean |error| with the term is at most 2 points above without",
    ],
}
GRID2_SLACK_PCT = 2.0
SHARING_RULE = {
    "written": "2026-11-24 23:34 UTC, committed before the five complete runs it judges",
    "runs": 5,
    "keep if": [
        "each grid: the mean over the runs of max |error| is lower with the stretch during the rows",
        "each grid: the mean over the runs of mean |error| is at most 1 point above the stretch at the grid's start",
        "the (run, grid) pairs meeting both targets (mean <= 15%, max <= 35%) are at least as many",
    ],
    "committed results": "if kept, the last of the five runs, whatever it scores; if not, the R5 run of 2026-11-24 stays",
}
SHARING_MEAN_SLACK_PCT = 1.0
SHARING_AGAIN_RULE = {
    "written": "2026-11-25 00:35 UTC (after SHARING_RULE's five runs rejected the variant), committed "
               "before the five new complete runs it judges; those five runs only",
    "runs": 5,
    "why": "the stretch during the rows measures the minutes the rows ran in; SHARING_RULE's runs found it met the cost "
           "model's targets in 10 of 10 (run, grid) pairs against 9 of 10, with means 0.4-0.5 points higher: this rule "
           "asks what the issue asks (no fewer pairs meeting both targets) and that it be no worse by more than a point",
    "keep if": [
        "the (run, grid) pairs meeting both targets (mean <= 15%, max <= 35%) are at least as many",
        "each grid: the mean over the runs of mean |error| is at most 1 point above the stretch at the grid's start",
        "each grid: the mean over the runs of max |error| is at most 1 point above the stretch at the grid's start",
    ],
    "committed results": "none this session: if kept, the next session prices by the stretch during the rows, runs "
                         "scripts/cost_model_validate.sh once and commits that run",  # as written then
}
COLOSSAL_ROUNDS_RULE = {
    "written": "2026-11-25 02:17 UTC, committed before the five complete runs it judges; those five runs "
               "only",
    "runs": 5,
    "why": "3 of the 6 max misses of main's model over the fifteen runs of 2026-11-24/25 came with a colossal table "
           "point read high in its one pass: T1 grid 1 (colossal P = 2, N = 1024, +37%: 22.5 ns per score element at "
           "4.2 M elements, D = 32, against 13.3-19.7 in the other 14 calibrations) and R3 grid 2 (P = 4, N = 4096, "
           "D = 128, +41%: 48.9 ns at 16.8 M against 34.7-47.3); R3's P = 2, N = 2048 (+22%) read 33.7 there. "
           "Six passes over the points in one process (2026-11-25 02:12 UTC) read 21.4-29.5 ns at 16.8 M, D = 32",
    "keep if": [
        "colossal's rows (both grids): the mean over the runs of their mean |error| is lower with the rounds",
        "the (run, grid) pairs meeting both targets (mean <= 15%, max <= 35%) are at least as many",
        "each grid: the mean over the runs of mean |error| is at most 1 point above round 0's",
        "each grid: the mean over the runs of max |error| is at most 1 point above round 0's",
    ],
    "committed results": "if kept, the last of the five runs, whatever it scores; if not, calibrate.COLOSSAL_ROUNDS "
                         "goes back to 1 (the one pass) and the R5 run of 2026-11-24 stays",
}

AGAINST_TABLE_RULE = {
    "written": "2026-11-25 03:24 UTC, committed before the five complete runs it judges; those five runs "
               "only",
    "runs": 5,
    "why": "in the colossal_rounds study's last two runs the machine ran slower during the grids than at their "
           "calibration (the probe's call alone at a grid's start 16.0-16.9 ms against 13.9-14.1 at calibration) and "
           "main's model under-predicted those grids' rows by 20.8-23.7% on the mean: the stretch at the grid's start "
           "is a ratio of two times taken then, so the machine's own speed is not in it. Re-priced offline over the 20 "
           "complete runs of 2026-11-24/25 (the data that suggested it, not evidence): both targets met in 39 of 40 "
           "(run, grid) pairs against 32, mean of the means 7.43% against 9.08%, of the maxes 21.21% against 24.19%",
    "keep if": SHARING_AGAIN_RULE["keep if"],
    "committed results": "if kept, the last of the five runs, whatever it scores; if not, the grids go back to the "
                         "stretch at their start and the colossal_rounds study's last run stays",
}


def backend_and_degree(label: str) -> tuple[str, int | None]:
    """``"usp(ulysses=2)"`` -> ``("usp", 2)``; a plain backend name -> ``(name, None)``."""
    if "(" not in label:
        return label, None
    name, arg = label.rstrip(")").split("(")
    return name, int(arg.split("=")[1])


def predict_row(row: dict, hw: HardwareProfile, barrier_s: float) -> float:
    """Milliseconds the model predicts for one grid row (with the measured interval's two barriers)."""
    backend, u = backend_and_degree(row["backend"])
    shape = AttentionShape(seq_len=row["N"], num_heads=row["heads"], num_kv_heads=row["kv_heads"],
                           head_dim=row["head_dim"], dtype_bytes=4, causal=row["causal"])
    pred = predict_attention(backend, shape, row["P"], hw, ulysses_degree=u, kv_pieces=row["kv_pieces"])
    return (pred.total_s + 2 * barrier_s) * 1e3


def stats(predicted: list[float], measured: list[float]) -> dict:
    errs = [100.0 * (p / m - 1.0) for p, m in zip(predicted, measured)]
    return {"mean_abs_pct": round(statistics.mean(abs(e) for e in errs), 2),
            "max_abs_pct": round(max(abs(e) for e in errs), 2), "mean_signed_pct": round(statistics.mean(errs), 2)}


def _sync_delay_variants(hw: HardwareProfile, grid: dict, calibration: dict) -> tuple[HardwareProfile, HardwareProfile]:
    return hw, replace(hw, sync_delay_s=())


def stretch_at_start(grid: dict) -> tuple[tuple[int, float], ...]:
    """The grid file's sharing stretch read at its start (``sharing_now``, whose other keys are ``alone_s`` and
    ``slowest_<P>``), as ``HardwareProfile.compute_sharing``."""
    return tuple(sorted((int(w), float(x)) for w, x in grid["sharing_now"].items() if str(w).isdigit()))


def _recorded_stretch(grid: dict, key: str, since: str) -> tuple[tuple[int, float], ...]:
    """A stretch the grid file recorded under ``key`` (written by the experiment from ``since`` on), as
    ``HardwareProfile.compute_sharing``; a grid without it is refused by name."""
    if key not in grid:
        raise ValueError(f"the grid of {grid['date']} did not record {key}: the study needs runs of "
                         f"experiments/cost_model/run.py from {since} on")
    return tuple(sorted((int(w), float(x)) for w, x in grid[key].items()))


def _stretch_during_rows(grid: dict) -> tuple[tuple[int, float], ...]:
    return _recorded_stretch(grid, "sharing_during_rows", "2026-11-24")


def stretch_against_table(grid: dict) -> tuple[tuple[int, float], ...]:
    """The grid file's stretch against the calibration's table (``sharing_against_table``), as
    ``HardwareProfile.compute_sharing``: what the grids are priced by since 2026-11-25."""
    return _recorded_stretch(grid, "sharing_against_table", "2026-11-25")


def _colossal_tables(calibration: dict) -> tuple[tuple, tuple]:
    """(the table over the rounds, round 0's table) of a calibration, as ``HardwareProfile.colossal_table``."""
    colossal = calibration["local"]["colossal"]
    return (tuple(tuple(row) for row in colossal["colossal_table"]),
            tuple(tuple(row) for row in colossal_table_of_round(colossal, 0)))


def _colossal_rounds_variants(hw: HardwareProfile, grid: dict,
                              calibration: dict) -> tuple[HardwareProfile, HardwareProfile]:
    over_rounds, first = _colossal_tables(calibration)
    return replace(hw, colossal_table=over_rounds), replace(hw, colossal_table=first)


def _sync_delay_record(grid: dict, calibration: dict) -> dict:
    hw = grid["calibration_profile"]
    return {"sync_delay_ms": {str(w): round(t * 1e3, 3) for w, t in hw.get("sync_delay_s", ())}}


def _colossal_rounds_record(grid: dict, calibration: dict) -> dict:
    over_rounds, first = _colossal_tables(calibration)
    return {"colossal_ns_per_score": {f"{e}/{d}": [round(t * 1e9, 2), round(t0 * 1e9, 2)]
                                      for (e, d, t), (_, _, t0) in zip(over_rounds, first)}}


def _judge_sync_delay(means: dict, runs: list[dict]) -> list[bool]:
    return [means["grid1"]["with"]["mean_abs_pct"] < means["grid1"]["without"]["mean_abs_pct"],
            means["grid1"]["with"]["abs_signed_pct"] <= means["grid1"]["without"]["abs_signed_pct"],
            means["grid2"]["with"]["mean_abs_pct"] <= means["grid2"]["without"]["mean_abs_pct"] + GRID2_SLACK_PCT]


def _no_fewer_pairs_meeting_both(means: dict) -> bool:
    """The (run, grid) pairs meeting both targets: at least as many with the variant as without."""
    return (sum(means[g]["with"]["runs_meeting_15_35"] for g in GRIDS)
            >= sum(means[g]["without"]["runs_meeting_15_35"] for g in GRIDS))


def _judge_sharing(means: dict, runs: list[dict]) -> list[bool]:
    return ([means[g]["with"]["max_abs_pct"] < means[g]["without"]["max_abs_pct"] for g in GRIDS]
            + [means[g]["with"]["mean_abs_pct"] <= means[g]["without"]["mean_abs_pct"] + SHARING_MEAN_SLACK_PCT
               for g in GRIDS]
            + [_no_fewer_pairs_meeting_both(means)])


def _judge_sharing_again(means: dict, runs: list[dict]) -> list[bool]:
    return ([_no_fewer_pairs_meeting_both(means)]
            + [means[g]["with"][key] <= means[g]["without"][key] + SHARING_MEAN_SLACK_PCT
               for key in ("mean_abs_pct", "max_abs_pct") for g in GRIDS])


def colossal_mean_abs_pct(runs: list[dict], variant: str) -> float:
    """The mean over the runs of the mean |error| of ``colossal``'s rows, both grids' pooled, in ``variant``."""
    def run_mean(run):
        rows = [r for g in GRIDS for r in run[g]["rows"] if r["backend"] == "colossal"]
        return statistics.mean(abs(100.0 * (r[f"{variant}_ms"] / r["measured_ms"] - 1.0)) for r in rows)
    return round(statistics.mean(run_mean(run) for run in runs), 2)


def _judge_colossal_rounds(means: dict, runs: list[dict]) -> list[bool]:
    return ([colossal_mean_abs_pct(runs, "with") < colossal_mean_abs_pct(runs, "without")]
            + _judge_sharing_again(means, runs))


def _show_delay(got: dict) -> str:
    return " / ".join(f"{v:.2f}" for v in got["sync_delay_ms"].values())


def _show_colossal(got: dict) -> str:
    return ", ".join(f"{a:.1f} vs {b:.1f}" for key, (a, b) in got["colossal_ns_per_score"].items()
                     if key.startswith("16777216/"))


@dataclass(frozen=True)
class Study:
    rule: dict
    variants: Callable  # (grid's profile, grid file, calibration file) -> (with, without) profiles
    record: Callable  # (grid file, calibration file) -> what each grid records of the term
    checks: Callable  # (means over runs, runs) -> the rule's conditions, in its order
    shown: tuple[str, Callable]  # the table's column for the record: (its header, record -> text)


def _stretch_study(rule: dict, checks: Callable, name: str, read: Callable, header: str) -> Study:
    """A study of one stretch against the stretch at the grid's start: "with" prices the rows by ``read(grid)``
    (recorded as ``name``), "without" by ``stretch_at_start``."""
    def variants(hw, grid, calibration):
        return replace(hw, compute_sharing=read(grid)), replace(hw, compute_sharing=stretch_at_start(grid))

    def record(grid, calibration):
        return {key: {str(w): round(x, 3) for w, x in stretch} for key, stretch in
                ((name, read(grid)), ("stretch_at_start", stretch_at_start(grid)))}

    def show(got):
        return " vs ".join(" / ".join(f"{v:.2f}" for v in got[key].values()) for key in (name, "stretch_at_start"))

    return Study(rule, variants, record, checks, (f"{header} / at start (P = 2 / 4 / 8)", show))


STUDIES = {
    "sync_delay": Study(RULE, _sync_delay_variants, _sync_delay_record, _judge_sync_delay,
                        ("delay ms (P = 2 / 4 / 8)", _show_delay)),
    "sharing": _stretch_study(SHARING_RULE, _judge_sharing, "stretch_during_rows", _stretch_during_rows,
                              "stretch during rows"),
    "sharing_again": _stretch_study(SHARING_AGAIN_RULE, _judge_sharing_again, "stretch_during_rows",
                                    _stretch_during_rows, "stretch during rows"),
    "colossal_rounds": Study(COLOSSAL_ROUNDS_RULE, _colossal_rounds_variants, _colossal_rounds_record,
                             _judge_colossal_rounds, ("colossal ns per score at 16.8 M, rounds vs round 0 (D = 32, "
                                                      "128)", _show_colossal)),
    "stretch_against_table": _stretch_study(AGAINST_TABLE_RULE, _judge_sharing_again, "stretch_against_table",
                                            stretch_against_table, "stretch against the table"),
}


def ablate_grid(grid: dict, barriers: dict[int, float], study: str = "sync_delay",
                calibration: dict | None = None) -> dict:
    """One grid file: the rows' errors with the term and without, both from the grid's own profile, which this code
    must first reproduce the file's model column from (so it judges what the grid ran); ``calibration``: the run's
    calibration file, for the studies whose variants come from it."""
    spec = STUDIES[study]
    hw = HardwareProfile.from_dict(grid["calibration_profile"])
    rows = grid["results"]
    for r in rows:
        p = predict_row(r, hw, barriers[r["P"]])
        if abs(p - r["model_predicted_ms"]) > 0.01:
            raise ValueError(f"{r['backend']} P={r['P']} N={r['N']}: this code predicts {p:.3f} ms, the file holds "
                             f"{r['model_predicted_ms']} ms; re-run the grid with this code")
    with_hw, without_hw = spec.variants(hw, grid, calibration)
    measured = [r["measured_ms"] for r in rows]
    with_ms = [predict_row(r, with_hw, barriers[r["P"]]) for r in rows]
    without_ms = [predict_row(r, without_hw, barriers[r["P"]]) for r in rows]
    return {"date": grid["date"], **spec.record(grid, calibration),
            "with": stats(with_ms, measured), "without": stats(without_ms, measured),
            "rows": [{"P": r["P"], "N": r["N"], "backend": r["backend"], "measured_ms": m, "with_ms": round(a, 3),
                      "without_ms": round(b, 3)} for r, m, a, b in zip(rows, measured, with_ms, without_ms)]}


def ablate_run(run_dir: Path, study: str = "sync_delay") -> dict:
    _, barriers = load_profile(run_dir)
    calibration = json.loads((Path(run_dir) / "cost_model_calibration.json").read_text())
    return {"run": str(run_dir), **{g: ablate_grid(json.loads((run_dir / f"cost_model_validation_{g}.json").read_text()),
                                                   barriers, study, calibration) for g in GRIDS}}


def judge(runs: list[dict], study: str = "sync_delay") -> dict:
    """The study's rule over the runs: the means over runs of each variant's figures, and whether each condition
    holds."""
    rule, checks_of = STUDIES[study].rule, STUDIES[study].checks
    def mean_over(grid, variant, key, absolute=False):
        vals = [r[grid][variant][key] for r in runs]
        return round(statistics.mean(abs(v) for v in vals) if absolute else statistics.mean(vals), 2)

    means = {g: {v: {"mean_abs_pct": mean_over(g, v, "mean_abs_pct"), "max_abs_pct": mean_over(g, v, "max_abs_pct"),
                     "abs_signed_pct": mean_over(g, v, "mean_signed_pct", absolute=True),
                     "runs_meeting_15_35": sum(r[g][v]["mean_abs_pct"] <= 15 and r[g][v]["max_abs_pct"] <= 35
                                               for r in runs)}
                 for v in ("with", "without")} for g in GRIDS}
    checks = checks_of(means, runs)
    return {"study": study, "rule": rule, "runs_judged": len(runs), "means_over_runs": means, "checks": checks,
            "keep": len(runs) >= rule["runs"] and all(checks)}


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("runs", nargs="+", type=Path)
    ap.add_argument("--study", choices=sorted(STUDIES), default="sync_delay")
    ap.add_argument("--write", type=Path)
    args = ap.parse_args(argv)
    runs = [ablate_run(d, args.study) for d in args.runs]
    header, show = STUDIES[args.study].shown
    print(f"| run | grid | {header} | with: mean / max (signed), % | without: mean / max (signed), % |")
    print("|---|---|---|---|---|")
    for r in runs:
        for g in GRIDS:
            a, b = r[g]["with"], r[g]["without"]
            print(f"| {r[g]['date']} | {g[-1]} | {show(r[g])} | "
                  f"{a['mean_abs_pct']:.1f} / {a['max_abs_pct']:.1f} ({a['mean_signed_pct']:+.1f}) | "
                  f"{b['mean_abs_pct']:.1f} / {b['max_abs_pct']:.1f} ({b['mean_signed_pct']:+.1f}) |")
    verdict = judge(runs, args.study)
    if args.study == "colossal_rounds":
        print(f"colossal's rows, mean over runs of mean |error|: {colossal_mean_abs_pct(runs, 'with')}% with the "
              f"rounds, {colossal_mean_abs_pct(runs, 'without')}% with round 0")
    print(json.dumps({k: verdict[k] for k in ("means_over_runs", "checks", "keep")}, indent=1))
    if args.write:
        args.write.write_text(json.dumps({"kind": "measured rows; with_ms / without_ms: model output", **verdict,
                                          "runs": runs}, indent=1) + "\n")


if __name__ == "__main__":
    main()
