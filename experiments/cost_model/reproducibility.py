"""How close one run of grid 1 comes to another: the machine's reproducibility, the floor under the model's error.

    .venv/bin/python -m experiments.cost_model.reproducibility                 # the tables, from results/grid1_runs.json
    .venv/bin/python -m experiments.cost_model.reproducibility --add DIR --label L   # add DIR's grid-1 run to the file
    .venv/bin/python -m experiments.cost_model.reproducibility --write         # results/cost_model_reproducibility.json

**Replay error**: one run's measured rows taken as the prediction of another run's rows, |a / b - 1| per row, mean
and max over the rows, as the model's error is computed (``b`` is the run judged). The same backends' code, the same
shapes, the same timing: a model calibrated at one time and judged at another cannot be expected to come closer to
a run than the machine's own earlier measurement of those rows does. Measured numbers only; the model's rows (each
run's code on its own calibration; a ``note`` says where they were re-predicted) stay in their own ``model_*`` fields.
"""

from __future__ import annotations

import argparse
import json
import statistics
from datetime import datetime
from itertools import permutations
from pathlib import Path

RESULTS = Path(__file__).resolve().parent / "results"
RUNS_FILE = RESULTS / "grid1_runs.json"
OUT_FILE = RESULTS / "cost_model_reproducibility.json"
NEAR_MINUTES = 20.0
"""Pairs of runs at most this far apart: a complete validation run calibrates 2-10 minutes before its grid."""
TARGET = (15.0, 35.0)
"""The mean / max |error| target, %."""


def row_key(row: dict) -> str:
    return f"P={row['P']} N={row['N']} {row['backend']}"


def run_from_grid(grid: dict, label: str) -> dict:
    """One grid-1 results file (``cost_model_validation_grid1.json``) as an entry of ``grid1_runs.json``."""
    return {"label": label, "date": grid["date"], "git_commit": grid["git_commit"], "git_dirty": grid["git_dirty"],
            "reps_per_case": grid["reps_per_case"],
            "measured_ms": {row_key(r): r["measured_ms"] for r in grid["results"]},
            "model_predicted_ms": {row_key(r): r["model_predicted_ms"] for r in grid["results"]},
            "model_mean_abs_error_pct": grid["mean_abs_error_pct"], "model_max_abs_error_pct": grid["max_abs_error_pct"]}


def errors_pct(predicted: dict[str, float], measured: dict[str, float]) -> list[float]:
    """Signed ``100 (predicted / measured - 1)`` over the rows both hold (every row of ``measured`` must be there)."""
    missing = sorted(set(measured) - set(predicted))
    if missing:
        raise ValueError(f"rows missing from the prediction: {missing}; the runs compared must be of the same grid")
    return [100.0 * (predicted[k] / measured[k] - 1.0) for k in sorted(measured)]


def level_removed(errs: list[float]) -> list[float]:
    """The errors left once the run's level is taken out: every prediction divided by ``1 + mean signed error``.
    A diagnosis, not a prediction (the level comes from the run judged): how well the rows' relative times, which
    decide ``auto``'s ranking, are predicted apart from the machine's overall speed."""
    level = 1.0 + statistics.mean(errs) / 100.0
    return [100.0 * ((1.0 + e / 100.0) / level - 1.0) for e in errs]


def _stats(errs: list[float]) -> dict:
    shape = level_removed(errs)
    return {"mean_abs_pct": round(statistics.mean(abs(e) for e in errs), 2),
            "max_abs_pct": round(max(abs(e) for e in errs), 2), "mean_signed_pct": round(statistics.mean(errs), 2),
            "level_removed_mean_abs_pct": round(statistics.mean(abs(e) for e in shape), 2),
            "level_removed_max_abs_pct": round(max(abs(e) for e in shape), 2)}


def minutes_apart(a: dict, b: dict) -> float:
    return abs((datetime.fromisoformat(a["date"]) - datetime.fromisoformat(b["date"])).total_seconds()) / 60.0


def replay_pairs(runs: list[dict]) -> list[dict]:
    """Every ordered pair ``(a predicts b)`` of runs with the same reps per row: its replay error and time apart."""
    out = []
    for a, b in permutations(runs, 2):
        if a["reps_per_case"] != b["reps_per_case"]:
            continue
        out.append({"predictor": a["label"], "judged": b["label"], "minutes_apart": round(minutes_apart(a, b), 1),
                    **_stats(errors_pct(a["measured_ms"], b["measured_ms"]))})
    return out


def _meeting(pairs: list[dict]) -> dict:
    mean_t, max_t = TARGET
    if not pairs:
        return {"pairs": 0}
    means = [p["mean_abs_pct"] for p in pairs]
    shapes = [p["level_removed_mean_abs_pct"] for p in pairs]
    return {"pairs": len(pairs), "median_of_means_pct": round(statistics.median(means), 2),
            "range_of_means_pct": [min(means), max(means)],
            "level_removed_median_of_means_pct": round(statistics.median(shapes), 2),
            "level_removed_range_of_means_pct": [min(shapes), max(shapes)],
            "meeting_mean": sum(m <= mean_t for m in means),
            "meeting_both": sum(p["mean_abs_pct"] <= mean_t and p["max_abs_pct"] <= max_t for p in pairs)}


def summarise(runs: list[dict], near_minutes: float = NEAR_MINUTES) -> dict:
    """The replay floor over all pairs and over the pairs at most ``near_minutes`` apart, and per run judged: the
    model's error (its rows in the runs file) beside the replay error of the runs near it (measured vs measured)."""
    pairs = replay_pairs(runs)
    near = [p for p in pairs if p["minutes_apart"] <= near_minutes]
    per_run = []
    for run in runs:
        judged_near = [p for p in near if p["judged"] == run["label"]]
        model_errors = errors_pct(run["model_predicted_ms"], run["measured_ms"])
        model = _stats(model_errors)
        per_run.append({"judged": run["label"], "date": run["date"], "rows": len(run["measured_ms"]),
                        "model_mean_abs_pct": model["mean_abs_pct"], "model_max_abs_pct": model["max_abs_pct"],
                        "model_mean_signed_pct": model["mean_signed_pct"],
                        "model_level_removed_mean_abs_pct": model["level_removed_mean_abs_pct"],
                        "model_level_removed_max_abs_pct": model["level_removed_max_abs_pct"],
                        "model_rows_under": sum(e < 0 for e in model_errors),
                        "replay_near": [{k: p[k] for k in ("predictor", "minutes_apart", "mean_abs_pct", "max_abs_pct",
                                                           "mean_signed_pct", "level_removed_mean_abs_pct")}
                                        for p in judged_near]})
    return {"kind": "measured (replay: one run's measured rows against another's); model_*: model output",
            "target_mean_max_pct": list(TARGET), "near_minutes": near_minutes,
            "runs": [{k: r[k] for k in ("label", "date", "git_commit", "reps_per_case")} for r in runs],
            "all_pairs": _meeting(pairs), "near_pairs": _meeting(near), "per_run": per_run, "pairs": pairs}


def table(summary: dict) -> str:
    """Markdown: per run judged, the model's error beside the replay error of the runs near it."""
    lines = ["| run judged (UTC) | model: mean / max, % | model: signed mean, %; rows under | model, level removed: "
             f"mean / max, % | replay by the runs <= {summary['near_minutes']:g} min apart: mean / max, % (signed "
             "mean; level removed: mean) |", "|---|---|---|---|---|"]
    for r in summary["per_run"]:
        near = "; ".join(f"{p['predictor']} ({p['minutes_apart']:g} min): {p['mean_abs_pct']:.1f} / "
                         f"{p['max_abs_pct']:.1f} ({p['mean_signed_pct']:+.1f}; {p['level_removed_mean_abs_pct']:.1f})"
                         for p in r["replay_near"]) or "none"
        lines.append(f"| {r['judged']} | {r['model_mean_abs_pct']:.1f} / {r['model_max_abs_pct']:.1f} | "
                     f"{r['model_mean_signed_pct']:+.1f}; {r['model_rows_under']} of {r['rows']} | "
                     f"{r['model_level_removed_mean_abs_pct']:.1f} / {r['model_level_removed_max_abs_pct']:.1f} | {near} |")
    return "\n".join(lines)


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--runs", type=Path, default=RUNS_FILE)
    ap.add_argument("--add", type=Path, help="a directory holding a run's cost_model_validation_grid1.json")
    ap.add_argument("--label", help="the added run's name (default: its date)")
    ap.add_argument("--write", action="store_true", help=f"write the summary to {OUT_FILE.relative_to(RESULTS.parents[2])}")
    args = ap.parse_args(argv)
    runs = json.loads(args.runs.read_text())["runs"] if args.runs.exists() else []
    if args.add:
        grid = json.loads((args.add / "cost_model_validation_grid1.json").read_text())
        runs.append(run_from_grid(grid, args.label or grid["date"]))
        args.runs.write_text(json.dumps({"kind": "measured grid-1 rows of every run kept (model_*: model output, each "
                                                 "run's code on its calibration)", "runs": runs}, indent=1) + "\n")
    summary = summarise(runs)
    print(table(summary))
    for name in ("all_pairs", "near_pairs"):
        print(f"{name}: {summary[name]}")
    if args.write:
        OUT_FILE.write_text(json.dumps(summary, indent=1) + "\n")


if __name__ == "__main__":
    main()
