#!/usr/bin/env python
"""Draw the communication-volume experiment from its result file (never measures).

    .venv/bin/python -m experiments.comm_volume.plot [--publish | --json runs/comm_volume/comm_volume.json] [--out PNG]

Bytes sent per rank per layer, forward (top) and backward (bottom): markers are measured
(``CommStats``), lines the formulas of ``lightning_sp.comm.volume``. Columns: vs P at the largest N
(MHA), vs N at the largest P (MHA), vs P at the largest N (GQA). Prints the README's tables (MiB) and
logs the figure into TensorBoard (``runs/comm_volume/figures``).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]

from experiments.common.results import RUNS, default_results, log_figure, read_results

ORDER = ["megatron_tp_sp", "ulysses", "usp(U=2)", "usp(U=4)", "ring", "zigzag_ring", "allgather_kv", "colossal"]
LABEL = {"megatron_tp_sp": "Megatron TP+SP (layer)", "zigzag_ring": "zigzag ring", "allgather_kv": "all-gather KV",
         "colossal": "ColossalAI RingQK+RingAV"}
MIB = 2**20


def _methods(rows) -> list[str]:
    present = {r["method"] for r in rows}
    return [m for m in ORDER if m in present] + sorted(present - set(ORDER))


def table(rows: list[dict], heads: str) -> str:
    """Markdown: one line per method, measured forward / backward MiB per rank at the largest N for
    every P, and whether each equals its formula."""
    sel = [r for r in rows if r["heads"] == heads]
    if not sel:
        return ""
    n = max(r["N"] for r in sel)
    ps = sorted({r["P"] for r in sel})
    by = {(r["method"], r["P"]): r for r in sel if r["N"] == n}
    h, h_kv = sel[0]["num_heads"], sel[0]["num_kv_heads"]
    lines = [f"{heads.upper()} (H={h}, H_kv={h_kv}, D=16), N={n}, fp32: measured MiB per rank per layer, "
             "forward / backward (= formula: measured equals lightning_sp.comm.volume exactly)", "",
             "| method | forward formula | " + " | ".join(f"P={p}" for p in ps) + " |",
             "|" + "---|" * (len(ps) + 2)]
    for m in _methods(sel):
        cells = []
        for p in ps:
            r = by.get((m, p))
            if r is None:
                cells.append("-")
                continue
            ok = (r["measured_fwd_bytes"], r["measured_bwd_bytes"]) == (r["formula_fwd_bytes"], r["formula_bwd_bytes"])
            cells.append(f"{r['measured_fwd_bytes'] / MIB:.3f} / {r['measured_bwd_bytes'] / MIB:.3f}"
                         + (" (=)" if ok else " (differs)"))
        formula = next(r["formula"] for r in sel if r["method"] == m)
        lines.append(f"| {LABEL.get(m, m)} | {formula} | " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def _panel(ax, rows, x_key, direction, title):
    import matplotlib.pyplot as plt

    colors = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    for i, m in enumerate(_methods(rows)):
        pts = sorted((r[x_key], r[f"measured_{direction}_bytes"] / MIB, r[f"formula_{direction}_bytes"] / MIB)
                     for r in rows if r["method"] == m)
        if not pts:
            continue
        xs, meas, form = zip(*pts)
        c = colors[i % len(colors)]
        ax.plot(xs, form, "-", color=c, alpha=0.6, lw=1.5)
        ax.plot(xs, meas, "o^sDvP*X"[i % 8], color=c, ms=6, mfc="none", label=LABEL.get(m, m))
    from matplotlib.ticker import NullFormatter, ScalarFormatter

    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xticks(sorted({r[x_key] for r in rows}))
    ax.xaxis.set_major_formatter(ScalarFormatter())
    ax.xaxis.set_minor_formatter(NullFormatter())
    ax.set_xlabel(x_key)
    ax.set_ylabel(f"{'forward' if direction == 'fwd' else 'backward'} MiB / rank / layer")
    ax.set_title(title, fontsize=9)
    ax.grid(alpha=0.3, which="both")


def plot(rows: list[dict], meta: dict, out: Path) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    mha = [r for r in rows if r["heads"] == "mha"]
    gqa = [r for r in rows if r["heads"] == "gqa"]
    n_max, p_max = max(r["N"] for r in rows), max(r["P"] for r in rows)
    cols = [(mha, "P", lambda r: r["N"] == n_max, f"MHA H=8, N={n_max}: vs P"),
            (mha, "N", lambda r: r["P"] == p_max, f"MHA H=8, P={p_max}: vs N"),
            (gqa, "P", lambda r: r["N"] == n_max, f"GQA H=8, H_kv=2, N={n_max}: vs P")]
    fig, axes = plt.subplots(2, 3, figsize=(15, 8.5))
    for j, (sel, x_key, keep, title) in enumerate(cols):
        for i, direction in enumerate(("fwd", "bwd")):
            _panel(axes[i, j], [r for r in sel if keep(r)], x_key, direction,
                   f"{'forward' if direction == 'fwd' else 'backward'} - {title}")
    axes[0, 0].legend(fontsize=7, loc="lower left")
    fig.suptitle("Bytes sent per rank per layer: measured (markers, CommStats) vs formula (lines, "
                 "lightning_sp.comm.volume)\n"
                 f"{meta['hardware']['device']}, gloo, fp32, {meta['date'][:10]}; Megatron TP+SP: one transformer "
                 "layer at t = P; the others: one attention layer", fontsize=10)
    fig.tight_layout()
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=110)
    plt.close(fig)
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--json", type=Path, default=None, help="default: runs/comm_volume/comm_volume.json")
    p.add_argument("--publish", action="store_true", help="the committed results in paper_figures/ (default: runs/comm_volume/)")
    p.add_argument("--out", type=Path, default=None, help="PNG path (default: beside the results)")
    p.add_argument("--log-dir", type=Path, default=RUNS / "comm_volume", help="TensorBoard dir for the figure")
    args = p.parse_args(argv)
    args.json = args.json or default_results(args, "comm_volume", "comm_volume.json")
    args.out = args.out or args.json.with_suffix(".png")
    if not args.json.exists():
        raise SystemExit(f"{args.json} does not exist: run experiments/comm_volume/run.py first")
    meta, rows = read_results(args.json)
    png = plot(rows, meta, args.out)
    log_figure(args.log_dir, "comm_volume", png)
    print(f"wrote {png}; figure logged to {args.log_dir}/figures\n")
    for heads in ("mha", "gqa"):
        print(table(rows, heads))
    return 0


if __name__ == "__main__":
    sys.exit(main())
