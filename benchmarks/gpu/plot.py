#!/usr/bin/env python
"""Draw ``<stem>.png`` (beside it; ``--publish``: ``paper_figures/``) from a ``benchmarks/gpu/run.py`` results file (reads results;
never measures) and log it into TensorBoard (``runs/gpu/figures``).

    .venv/bin/python -m benchmarks.gpu.plot benchmarks/gpu/results/gpu_<date>_<device>.json

Left: per-rank schedule efficiency (one kernel call's time for the same useful work / one rank's fwd+bwd)
against tokens per rank, one line per backend and P, causal solid and bidirectional dashed; the 0.95
goal dotted. Right: peak memory of one training step of the protein encoder against the
global length, one line per P (measured: filled markers; predicted for the full depth from two layer
counts: open markers, dashed); OOM lengths marked on the axis. Rows from simulated ranks are labelled.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]

GOAL = 0.95


def draw(results: dict, png: Path) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    meta, rows = results["meta"], results["results"]
    fig, (ax, ax2) = plt.subplots(1, 2, figsize=(12, 4.6))
    schedule = [r for r in rows.get("schedule", []) if "efficiency" in r]
    lines = sorted({(r["backend"], r["world"], r["causal"]) for r in schedule})
    for backend, world, causal in lines:
        rs = sorted((r for r in schedule if (r["backend"], r["world"], r["causal"]) == (backend, world, causal)),
                    key=lambda r: r["local_len"])
        ax.plot([r["local_len"] for r in rs], [r["efficiency"] for r in rs], "-" if causal else "--", marker="o",
                label=f"{backend} P={world}{'' if causal else ' bidir.'}")
    ax.axhline(GOAL, color="k", linestyle=":", linewidth=1, label=f"goal {GOAL}")
    ax.set_xscale("log", base=2)
    ax.set_xlabel("tokens per rank")
    ax.set_ylabel("one kernel call / one rank (same useful work)")
    ax.set_title("per-rank schedule efficiency (other ranks simulated)" if schedule else "schedule: no rows")
    if schedule:
        ax.legend(fontsize=6, ncol=2)

    longest = rows.get("longest", [])
    for world in sorted({r["world"] for r in longest}):
        rs = sorted((r for r in longest if r["world"] == world), key=lambda r: r["seq_len"])
        ok = [r for r in rs if r.get("peak_gib") is not None]
        sim = " (simulated ranks)" if any(r.get("simulated_ranks") for r in rs) else ""
        if ok:
            line, = ax2.plot([r["seq_len"] for r in ok], [r["peak_gib"] for r in ok], "-o", label=f"P={world} measured{sim}")
            pred = [r for r in ok if r.get("predicted_peak_gib_full_layers") is not None]
            if pred:
                ax2.plot([r["seq_len"] for r in pred], [r["predicted_peak_gib_full_layers"] for r in pred], "--o",
                         mfc="none", color=line.get_color(), label=f"P={world} predicted, full depth (model)")
        for r in rs:
            if r.get("peak_bytes") == "OOM":
                ax2.plot([r["seq_len"]], [0], "x", color="red")
                ax2.annotate(f"OOM P={world}", (r["seq_len"], 0), fontsize=7, rotation=90, va="bottom")
    if not any(r.get("peak_gib") is not None for r in longest):
        ax2.text(0.5, 0.5, "no measured peaks\n(a CPU run measures no device memory)", ha="center", va="center",
                 transform=ax2.transAxes, fontsize=9)
    if meta.get("device_memory_gib"):
        ax2.axhline(meta["device_memory_gib"], color="k", linestyle=":", linewidth=1, label="device memory")
    ax2.set_xscale("log", base=2)
    ax2.set_xlabel("global sequence length N (residues)")
    ax2.set_ylabel("peak allocated per rank (GiB)")
    ax2.set_title("protein encoder, one training step" if longest else "longest: no rows")
    if ax2.get_legend_handles_labels()[0]:
        ax2.legend(fontsize=7)
    fig.suptitle(f"{meta.get('device_name', '?')}, torch {meta.get('torch')}, {meta.get('date_utc', '?')[:10]}", fontsize=9)
    fig.tight_layout()
    png.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(png, dpi=130)
    plt.close(fig)
    return png


def main(argv: list[str] | None = None) -> int:
    from experiments.common.results import PAPER_FIGURES, RUNS, log_figure

    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("results", type=Path, help="a bench_gpu.py results file (.json)")
    p.add_argument("--png", type=Path, default=None, help="default: beside the results (--publish: paper_figures/<stem>.png)")
    p.add_argument("--publish", action="store_true", help="write the figure to paper_figures/ (committed)")
    p.add_argument("--log-dir", default=str(RUNS / "gpu"), help="TensorBoard dir for the figure")
    args = p.parse_args(argv)
    if not args.results.is_file():
        raise SystemExit(f"no results at {args.results}; run: PYTHONPATH=. python -m benchmarks.gpu.run")
    png = draw(json.loads(args.results.read_text()), args.png or (PAPER_FIGURES / f"{args.results.stem}.png" if args.publish else args.results.with_suffix(".png")))
    log_figure(args.log_dir, "gpu/" + png.stem, png)
    print(f"wrote {png}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
