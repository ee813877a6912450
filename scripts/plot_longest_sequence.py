#!/usr/bin/env python
"""Draw ``paper_figures/longest_sequence.png`` from ``longest_sequence.json`` (reads results; never trains),
and log it into TensorBoard (``runs/longest_sequence/figures``).

    .venv/bin/python scripts/plot_longest_sequence.py [--results paper_figures/longest_sequence.json]

Left: the longest global sequence per method against the degree P (P = 1: one process). Right: the
measured per-rank peak of every probe of the search against N, with the budget.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

STYLE = {  # method -> (color, marker)
    "vanilla": ("tab:gray", "x"), "memory_efficient": ("tab:brown", "s"), "memory_efficient+chunked_ffn": ("tab:olive", "D"),
    "ring": ("tab:blue", "o"), "zigzag_ring": ("tab:cyan", "v"), "ulysses": ("tab:green", "^"),
    "tp": ("tab:red", "P"), "tp_sp": ("tab:purple", "*"),
}


def main(argv: list[str] | None = None) -> int:
    from experiments.common import PAPER_FIGURES, RUNS, log_figure, read_results

    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--results", default=str(PAPER_FIGURES / "longest_sequence.json"))
    p.add_argument("--log-dir", default=None, help=f"TensorBoard dir for the figure (default {RUNS / 'longest_sequence'})")
    args = p.parse_args(argv)
    path = Path(args.results)
    if not path.is_file():
        raise SystemExit(f"no results at {path}; run: python scripts/longest_sequence_experiment.py")
    meta, rows = read_results(path)
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax, ax2) = plt.subplots(1, 2, figsize=(11, 4.4))
    methods = list(dict.fromkeys(r["method"] for r in rows))
    for m in methods:
        rs = sorted((r for r in rows if r["method"] == m), key=lambda r: r["P"])
        color, marker = STYLE.get(m, ("k", "o"))
        ps, ns = [r["P"] for r in rs], [r["longest_N"] for r in rs]
        if len(rs) == 1 and rs[0]["P"] == 1:  # single-process methods: a level to compare against
            ax.axhline(ns[0], color=color, ls="--", lw=1)
            ax.plot(ps, ns, marker=marker, color=color, ls="none", label=f"{rs[0]['label']} (P=1)")
        else:
            ax.plot(ps, ns, marker=marker, color=color, label=rs[0]["label"])
        for r in rs:
            pr = sorted(r["probes"], key=lambda x: x["N"])
            ax2.plot([x["N"] for x in pr], [x["peak_bytes"] / 2**20 for x in pr], marker=marker, color=color, ms=3, lw=0.8,
                     alpha=0.5 + 0.5 * (r["P"] == max(q["P"] for q in rs)))
    budget = rows[0]["budget_bytes"] / 2**20
    ax.set_xscale("log", base=2)
    ax.set_yscale("log", base=2)
    ax.set_xticks(sorted({r["P"] for r in rows}), [str(x) for x in sorted({r["P"] for r in rows})])
    ax.set_xlabel("ranks P (gloo, one CPU process each)")
    ax.set_ylabel("longest global N that fits (tokens)")
    cfg = meta.get("config", {})
    ax.set_title(f"One training step within {budget:g} MiB per rank\nprotein encoder d={cfg.get('d_model')}, "
                 f"{cfg.get('n_layers')} layers, {cfg.get('n_heads')} heads", fontsize=10)
    ax.legend(fontsize=7, loc="upper left")
    ax2.axhline(budget, color="k", ls=":", lw=1, label=f"budget {budget:g} MiB")
    ax2.set_xscale("log", base=2)
    ax2.set_xlabel("global N of a probe")
    ax2.set_ylabel("measured peak per rank (MiB, max over ranks)")
    ax2.set_title("every probe of the searches (darker: largest P)", fontsize=10)
    ax2.legend(fontsize=7)
    hw = meta.get("hardware", {})
    fig.text(0.01, 0.01, f"measured; {hw.get('device', '')}; {meta.get('date', '')[:10]}; {meta.get('command', '')}",
             fontsize=6, color="gray")
    fig.tight_layout(rect=(0, 0.03, 1, 1))
    out = path.with_suffix(".png")
    fig.savefig(out, dpi=150)
    log_dir = Path(args.log_dir) if args.log_dir else RUNS / "longest_sequence"
    log_figure(log_dir, "longest_sequence", out)
    print(f"wrote {out}; logged to {log_dir}/figures")
    return 0


if __name__ == "__main__":
    sys.exit(main())
