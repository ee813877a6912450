#!/usr/bin/env python
"""Draw ``longest_sequence.png`` (beside its results) and the tables ``longest_sequence.md`` (ours and the papers'
ratios) from ``longest_sequence.json`` (reads results; never trains); log the figure into TensorBoard
(``runs/longest_sequence/figures``).

    .venv/bin/python -m experiments.longest_sequence.plot [--publish | --results runs/longest_sequence/longest_sequence.json]

Left: the longest global sequence per method against the degree P (P = 1: one process). Right: the
measured per-rank peak of every probe of the search against N, with the budget.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]

STYLE = {  # method -> (color, marker)
    "vanilla": ("tab:gray", "x"), "memory_efficient": ("tab:brown", "s"), "memory_efficient+chunked_ffn": ("tab:olive", "D"),
    "ring": ("tab:blue", "o"), "zigzag_ring": ("tab:cyan", "v"), "ulysses": ("tab:green", "^"),
    "tp": ("tab:red", "P"), "tp_sp": ("tab:purple", "*"),
}


PAPERS = [  # (ours: method, P, baseline method, baseline P) -> the paper's ratio, from REFERENCES.md
    ("memory_efficient", 1, "vanilla", 1, "Ring Attention Table 3: memory-efficient / vanilla", "8x (7B, 8xA100: 16K / 2K; 3B: 32K / 4K)"),
    ("memory_efficient+chunked_ffn", 1, "vanilla", 1, "Ring Attention Table 3: + blockwise FFN / vanilla", "16x (7B: 32K / 2K; 3B: 64K / 4K)"),
    ("memory_efficient+chunked_ffn", 1, "memory_efficient", 1, "Ring Attention Table 3: + blockwise FFN / memory-efficient", "2x (32K / 16K)"),
    ("ring", 8, "memory_efficient+chunked_ffn", 1, "Ring Attention Table 3: ring (8 devices) / + blockwise FFN", "8x (7B: 256K / 32K; 3B: 512K / 64K)"),
    ("ring", 8, "vanilla", 1, "Ring Attention Table 3: ring (8 devices) / vanilla", "128x (7B: 256K / 2K)"),
    ("ring", 8, "tp", 8, "ColossalAI SP: sequence parallel / tensor parallel, same devices", "3.0x (BERT, 64 P100)"),
    ("ulysses", 8, "tp_sp", 8, "DeepSpeed-Ulysses: Ulysses / Megatron-SP, same devices", "4x"),
]


def markdown(rows: list[dict], meta: dict) -> str:
    """The result table and the papers' ratios beside ours, as markdown."""
    by = {(r["method"], r["P"]): r for r in rows}
    mib = lambda b: f"{b / 2**20:.2f}" if b else "n/a"  # noqa: E731
    out = [f"Measured {meta['date'][:10]} on {meta['hardware']['device']}, torch {meta['hardware']['torch']}; "
           f"`{meta['command']}`; budget {rows[0]['budget_bytes'] / 2**20:g} MiB per rank"
           + ("" if meta.get("complete", True) else f" (INCOMPLETE: degrees {meta.get('degrees_done')} only)") + ".", "",
           "| method | P | longest N (tokens) | peak at N (MiB, max over ranks) | N + step: peak (MiB) | x vanilla | x mem.-eff. + chunked FFN | x TP (same P) | x TP+SP (same P) |",
           "|---|---|---|---|---|---|---|---|---|"]
    for r in sorted(rows, key=lambda r: (r["P"], list(STYLE).index(r["method"]) if r["method"] in STYLE else 99)):
        out.append(f"| {r['label']} | {r['P']} | {r['longest_N']} | {mib(r['peak_at_longest_bytes'])} | "
                   f"{r['next_N_not_fitting']}: {mib(r['peak_at_next_bytes'])} | {r.get('x_vs_vanilla')} | "
                   f"{r.get('x_vs_memory_efficient+chunked_ffn')} | {r.get('x_vs_tp_same_P') or '-'} | {r.get('x_vs_tp_sp_same_P') or '-'} |")
    out += ["", "| paper comparison | paper's ratio | ours (measured, same budget) |", "|---|---|---|"]
    for m, p, base, bp, what, theirs in PAPERS:
        a, b = by.get((m, p)), by.get((base, bp))
        ours = f"{a['longest_N'] / b['longest_N']:.2f}x ({m} P={p}: {a['longest_N']} / {base} P={bp}: {b['longest_N']})" if a and b and b["longest_N"] else "not measured"
        out.append(f"| {what} | {theirs} | {ours} |")
    return "\n".join(out) + "\n"


def main(argv: list[str] | None = None) -> int:
    from experiments.common.results import RUNS, default_results, log_figure, read_results

    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--results", default=None, help="default: runs/longest_sequence/longest_sequence.json")
    p.add_argument("--publish", action="store_true", help="the committed results in paper_figures/ (default: runs/longest_sequence/)")
    p.add_argument("--log-dir", default=None, help=f"TensorBoard dir for the figure (default {RUNS / 'longest_sequence'})")
    args = p.parse_args(argv)
    path = Path(args.results) if args.results else default_results(args, "longest_sequence", "longest_sequence.json")
    if not path.is_file():
        raise SystemExit(f"no results at {path}; run: python -m experiments.longest_sequence.run")
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
    from matplotlib.ticker import ScalarFormatter

    ax.yaxis.set_major_formatter(ScalarFormatter())
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
    path.with_suffix(".md").write_text(markdown(rows, meta))
    log_dir = Path(args.log_dir) if args.log_dir else RUNS / "longest_sequence"
    log_figure(log_dir, "longest_sequence", out)
    print(f"wrote {out} and {path.with_suffix('.md')}; logged to {log_dir}/figures")
    return 0


if __name__ == "__main__":
    sys.exit(main())
