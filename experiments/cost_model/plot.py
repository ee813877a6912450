#!/usr/bin/env python
"""Draw the cost model's validation from its result file (reads it; never measures or trains).

    .venv/bin/python -m experiments.cost_model.plot [--publish | --results runs/cost_model/cost_model_validation.json] [--out PNG]

Left: measured fwd+bwd time per attention layer (CPU gloo) vs the model's prediction, one marker per
backend, colour by P, the y = x line. Right: the model's error (%) per row. Also logged as an image
into ``runs/cost_model/figures`` (TensorBoard), and the README's tables written to ``<out>.md``.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]

from experiments.common.results import RUNS, default_results, log_figure, read_results

MARKERS = {"ulysses": "o", "ring": "v", "zigzag_ring": "^", "allgather_kv": "s", "colossal": "x"}


def plot(results: Path, out: Path, log_dir: Path | None) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    meta, rows = read_results(results)
    fig, (ax, ax_err) = plt.subplots(1, 2, figsize=(11, 4.5))
    worlds = sorted({r["P"] for r in rows})
    colors = dict(zip(worlds, plt.cm.viridis([i / max(len(worlds) - 1, 1) for i in range(len(worlds))])))
    for i, r in enumerate(rows):
        marker = MARKERS.get(r["backend"], "D")
        ax.scatter(r["measured_ms"], r["model_predicted_ms"], marker=marker, color=colors[r["P"]])
        ax_err.scatter(i, r["model_error_pct"], marker=marker, color=colors[r["P"]])
    lo = min(min(r["measured_ms"], r["model_predicted_ms"]) for r in rows)
    hi = max(max(r["measured_ms"], r["model_predicted_ms"]) for r in rows)
    ax.plot([lo, hi], [lo, hi], "k--", lw=1, label="model = measured")
    ax.set(xscale="log", yscale="log", xlabel="measured fwd+bwd per layer (ms, CPU gloo)",
           ylabel="cost model prediction (ms)", title="attention layer: model vs measurement")
    for b, m in MARKERS.items():
        if any(r["backend"] == b for r in rows):
            ax.scatter([], [], marker=m, color="gray", label=b)
    if any(r["backend"].startswith("usp") for r in rows):
        ax.scatter([], [], marker="D", color="gray", label="usp")
    for w in worlds:
        ax.scatter([], [], marker="s", color=colors[w], label=f"P={w}")
    ax.legend(fontsize=7)
    ax_err.axhline(0, color="k", lw=1)
    ax_err.set(xlabel="row (P, N, backend as in the CSV)", ylabel="model error (%)",
               title=f"mean |error| {meta.get('mean_abs_error_pct')}%")
    fig.suptitle(f"{meta['hardware']['device']}, {meta['date'][:10]} (measured; predictions are model output)", fontsize=8)
    fig.tight_layout()
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=120)
    plt.close(fig)
    if log_dir is not None:
        log_figure(log_dir, "cost_model/validation", out)
    return out


def tables(results: Path) -> tuple[str, str]:
    """Markdown tables (validation; predictions if the file is beside it) the README shows."""
    meta, rows = read_results(results)
    grids = meta.get("grids") or {"grid1": meta}  # a combined file names each grid's run; a one-grid file is its own
    header = " ".join(f"{name[:4].capitalize()} {name[4:]}: measured {g['date'][:16].replace('T', ' ')} UTC, command "
                      f"`{g['command']}`, mean |model error| {g['mean_abs_error_pct']}%, max {g['max_abs_error_pct']}%."
                      for name, g in grids.items())
    lines = [f"On {meta['hardware']['device']}. {header}", "",
             "| grid | P | N | H / H_kv / D, mask, pieces | backend | measured ms | model ms (compute / exposed comm) | model error % |",
             "|---|---|---|---|---|---|---|---|"]
    for r in rows:
        shape = (f"{r['heads']} / {r['kv_heads']} / {r['head_dim']}, {'causal' if r['causal'] else 'bidir'}, "
                 f"{r.get('kv_pieces', 8)}")
        lines.append(f"| {r.get('grid', 'grid1')[-1]} | {r['P']} | {r['N']} | {shape} | {r['backend']} | {r['measured_ms']:.1f} | "
                     f"{r['model_predicted_ms']:.1f} ({r['model_compute_ms']:.1f} / {r['model_exposed_comm_ms']:.1f}) | "
                     f"{r['model_error_pct']:+.0f} |")
    pred_path = results.with_name("cost_model_predictions.json")
    pred_lines = []
    if pred_path.exists():
        _, preds = read_results(pred_path)
        pred_lines = ["| study | setting | metric | model prediction | paper | model vs paper |", "|---|---|---|---|---|---|"]
        for r in preds:
            m = "OOM (model)" if r["model_prediction"] is None else r["model_prediction"]
            pv = "OOM" if r["paper_value"] is None else r["paper_value"]
            diff = "" if r["diff_pct"] is None else f"{r['diff_pct']:+.0f}%"
            pred_lines.append(f"| {r['study']} | {r['setting']} | {r['metric']} | {m} | {pv} | {diff} |")
    return "\n".join(lines), "\n".join(pred_lines)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--results", type=Path, default=None, help="default: runs/cost_model/cost_model_validation.json")
    p.add_argument("--publish", action="store_true", help="the committed results in paper_figures/ (default: runs/cost_model/)")
    p.add_argument("--out", type=Path, default=None, help="PNG path (default: beside the results)")
    p.add_argument("--log-dir", type=Path, default=RUNS / "cost_model", help="TensorBoard dir for the image")
    p.add_argument("--no-tensorboard", action="store_true")
    args = p.parse_args(argv)
    args.results = args.results or default_results(args, "cost_model", "cost_model_validation.json")
    out = args.out or args.results.with_suffix(".png")
    print(plot(args.results, out, None if args.no_tensorboard else args.log_dir))
    validation, predictions = tables(args.results)
    md = out.with_suffix(".md")
    md.write_text("## Validation (measured vs model)\n\n" + validation + "\n\n## Predictions (model)\n\n" + predictions + "\n")
    print(md)
    return 0


if __name__ == "__main__":
    sys.exit(main())
