"""The delay per synchronisation, judged paired: each complete run's measured rows predicted from its own
calibration with and without ``sync_delay_s`` (Note [Per-call terms] in ``lightning_sp/cost_model.py``), and the
rule written down before the runs (``RULE``) applied over them.

    .venv/bin/python -m experiments.cost_model.ablation RUN_DIR [RUN_DIR ...] [--write FILE]

A run directory holds a complete ``scripts/cost_model_validate.sh`` run: ``cost_model_calibration.json`` and
``cost_model_validation_grid{1,2}.json``. "with" is the grid's own ``model_predicted_ms`` (re-predicted here and
checked to agree); "without" is the same profile (the sharing and the delay measured at that grid's start) with
``sync_delay_s`` empty. The measured column never changes.
"""

from __future__ import annotations

import argparse
import json
import statistics
from dataclasses import replace
from pathlib import Path

from experiments.cost_model.calibrate import load_profile
from lightning_sp.cost_model import AttentionShape, HardwareProfile, predict_attention

GRIDS = ("grid1", "grid2")
RULE = {
    "written": "2026-11-24 21:29 UTC (session 25), committed before the five complete runs it judges",
    "runs": 5,
    "keep if": [
        "grid 1: the mean over the runs of mean |error| is lower with the term than without",
        "grid 1: the mean over the runs of |signed mean error| is no larger with the term than without",
        "grid 2: the mean over the runs of mean |error| with the term is at most 2 points above without",
    ],
}
GRID2_SLACK_PCT = 2.0


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


def ablate_grid(grid: dict, barriers: dict[int, float]) -> dict:
    """One grid file: the rows' errors with the term (checked equal to the file's model column) and without."""
    hw = HardwareProfile.from_dict(grid["calibration_profile"])
    without = replace(hw, sync_delay_s=())
    rows = grid["results"]
    measured = [r["measured_ms"] for r in rows]
    with_ms = [predict_row(r, hw, barriers[r["P"]]) for r in rows]
    for r, p in zip(rows, with_ms):
        if abs(p - r["model_predicted_ms"]) > 0.01:
            raise ValueError(f"{r['backend']} P={r['P']} N={r['N']}: this code predicts {p:.3f} ms, the file holds "
                             f"{r['model_predicted_ms']} ms; re-run the grid with this code")
    without_ms = [predict_row(r, without, barriers[r["P"]]) for r in rows]
    return {"date": grid["date"], "sync_delay_ms": {str(w): round(t * 1e3, 3) for w, t in hw.sync_delay_s},
            "with": stats(with_ms, measured), "without": stats(without_ms, measured),
            "rows": [{"P": r["P"], "N": r["N"], "backend": r["backend"], "measured_ms": m, "with_ms": round(a, 3),
                      "without_ms": round(b, 3)} for r, m, a, b in zip(rows, measured, with_ms, without_ms)]}


def ablate_run(run_dir: Path) -> dict:
    _, barriers = load_profile(run_dir)
    return {"run": str(run_dir), **{g: ablate_grid(json.loads((run_dir / f"cost_model_validation_{g}.json").read_text()),
                                                   barriers) for g in GRIDS}}


def judge(runs: list[dict]) -> dict:
    """``RULE`` over the runs: the means over runs of each variant's figures, and whether each condition holds."""
    def mean_over(grid, variant, key, absolute=False):
        vals = [r[grid][variant][key] for r in runs]
        return round(statistics.mean(abs(v) for v in vals) if absolute else statistics.mean(vals), 2)

    means = {g: {v: {"mean_abs_pct": mean_over(g, v, "mean_abs_pct"), "max_abs_pct": mean_over(g, v, "max_abs_pct"),
                     "abs_signed_pct": mean_over(g, v, "mean_signed_pct", absolute=True),
                     "runs_meeting_15_35": sum(r[g][v]["mean_abs_pct"] <= 15 and r[g][v]["max_abs_pct"] <= 35
                                               for r in runs)}
                 for v in ("with", "without")} for g in GRIDS}
    checks = [means["grid1"]["with"]["mean_abs_pct"] < means["grid1"]["without"]["mean_abs_pct"],
              means["grid1"]["with"]["abs_signed_pct"] <= means["grid1"]["without"]["abs_signed_pct"],
              means["grid2"]["with"]["mean_abs_pct"] <= means["grid2"]["without"]["mean_abs_pct"] + GRID2_SLACK_PCT]
    return {"rule": RULE, "runs_judged": len(runs), "means_over_runs": means, "checks": checks,
            "keep": len(runs) >= RULE["runs"] and all(checks)}


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("runs", nargs="+", type=Path)
    ap.add_argument("--write", type=Path)
    args = ap.parse_args(argv)
    runs = [ablate_run(d) for d in args.runs]
    print("| run | grid | delay ms (P = 2 / 4 / 8) | with: mean / max (signed), % | without: mean / max (signed), % |")
    print("|---|---|---|---|---|")
    for r in runs:
        for g in GRIDS:
            a, b = r[g]["with"], r[g]["without"]
            print(f"| {r[g]['date']} | {g[-1]} | {' / '.join(f'{v:.2f}' for v in r[g]['sync_delay_ms'].values())} | "
                  f"{a['mean_abs_pct']:.1f} / {a['max_abs_pct']:.1f} ({a['mean_signed_pct']:+.1f}) | "
                  f"{b['mean_abs_pct']:.1f} / {b['max_abs_pct']:.1f} ({b['mean_signed_pct']:+.1f}) |")
    verdict = judge(runs)
    print(json.dumps({k: verdict[k] for k in ("means_over_runs", "checks", "keep")}, indent=1))
    if args.write:
        args.write.write_text(json.dumps({"kind": "measured rows; with_ms / without_ms: model output", **verdict,
                                          "runs": runs}, indent=1) + "\n")


if __name__ == "__main__":
    main()
