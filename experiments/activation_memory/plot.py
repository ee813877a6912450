"""Draw the Korthikanti Table 2 reproduction from its data (reads the CSV; never measures).

    python -m experiments.activation_memory.plot [--publish | --csv runs/activation_memory/activation_memory.csv] [--out PNG]

Left: measured bytes saved per layer (bars) and the paper's formula (black ticks) for one shape,
every row and degree. Right: measured / formula for every row, shape and degree (band: 1.00 +- 0.02).
Also writes ``activation_memory.md``, the table the README shows.
"""

from __future__ import annotations

import argparse
import csv
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
ORDER = ["no parallelism", "TP", "TP+SP", "TP + selective recompute", "TP+SP + selective recompute",
         "full recompute", "TP+SP, flash attention", "CP ulysses", "CP ring"]


def _load(path: Path) -> list[dict]:
    with open(path) as f:
        rows = list(csv.DictReader(f))
    for r in rows:
        for k in ("s", "h", "a", "b", "t", "measured_bytes", "comm_fwd_bytes"):
            r[k] = int(r[k])
        for k in ("formula_bytes", "ratio", "comm_analytic_bytes"):
            r[k] = float(r[k])
    return rows


def table(rows: list[dict], shape: tuple[int, int, int]) -> str:
    """Markdown: one line per row, MiB measured / formula at t = 1, 2, 4 for ``shape``."""
    s, h, a = shape
    degrees = sorted({r["t"] for r in rows})
    by = {(r["row"], r["t"]): r for r in rows if (r["s"], r["h"], r["a"]) == shape}
    head = "| configuration | formula (bytes) | " + " | ".join(f"t={t}: measured MiB (ratio)" for t in degrees) + \
        " | fwd comm/layer t=4 (measured = analytic) |"
    lines = [f"Shape s={s}, h={h}, a={a}, b=1, bfloat16.", "", head, "|" + "---|" * (len(degrees) + 3)]
    for name in ORDER:
        cells = []
        for t in degrees:
            r = by.get((name, t))
            cells.append("-" if r is None else f"{r['measured_bytes'] / 2**20:.2f} ({r['ratio']:.4f})")
        formula = next((r["formula"] for (n, _), r in by.items() if n == name), "")
        r4 = by.get((name, 4))
        comm = "-" if r4 is None else f"{r4['comm_fwd_bytes'] / 2**20:.2f} MiB"
        if formula:
            lines.append(f"| {name} | {formula} | " + " | ".join(cells) + f" | {comm} |")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--csv", type=Path, default=None, help="default: runs/activation_memory/activation_memory.csv")
    p.add_argument("--publish", action="store_true", help="the committed results in paper_figures/ (default: runs/activation_memory/)")
    p.add_argument("--out", type=Path, default=None, help="PNG path (default: beside the CSV)")
    a = p.parse_args(argv)
    from experiments.common.results import default_results

    a.csv = a.csv or default_results(a, "activation_memory", "activation_memory.csv")
    a.out = a.out or a.csv.with_suffix(".png")
    if not a.csv.is_file():
        raise SystemExit(f"no results at {a.csv}; run: python -m experiments.activation_memory.run (or pass --publish)")
    rows = _load(a.csv)
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    shapes = sorted({(r["s"], r["h"], r["a"]) for r in rows}, key=lambda x: (x[0] * x[1], x))
    shape = shapes[len(shapes) // 2]
    degrees = sorted({r["t"] for r in rows})
    names = [n for n in ORDER if any(r["row"] == n for r in rows)]
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(15, 5.5))
    width = 0.8 / len(degrees)
    for j, t in enumerate(degrees):
        by = {r["row"]: r for r in rows if r["t"] == t and (r["s"], r["h"], r["a"]) == shape}
        xs = [i + (j - (len(degrees) - 1) / 2) * width for i in range(len(names))]
        meas = [by[n]["measured_bytes"] / 2**20 if n in by else 0 for n in names]
        form = [by[n]["formula_bytes"] / 2**20 if n in by else float("nan") for n in names]
        ax1.bar(xs, meas, width, label=f"t = P = {t}")
        ax1.scatter(xs, form, marker="_", s=200, color="black", zorder=3, label="formula" if j == 0 else None)
    ax1.set_xticks(range(len(names)))
    ax1.set_xticklabels(names, rotation=35, ha="right", fontsize=8)
    ax1.set_ylabel("MiB saved for backward per layer (rank 0)")
    ax1.set_title(f"Korthikanti et al. Table 2 measured: s={shape[0]}, h={shape[1]}, a={shape[2]}, b=1, bf16")
    ax1.legend(fontsize=8)
    for k, n in enumerate(names):
        pts = [r for r in rows if r["row"] == n]
        ax2.scatter([k + 0.08 * (r["t"] - 2) for r in pts], [r["ratio"] for r in pts], s=14)
    ax2.axhspan(0.98, 1.02, color="green", alpha=0.12, label="1.00 +- 0.02")
    ax2.set_xticks(range(len(names)))
    ax2.set_xticklabels(names, rotation=35, ha="right", fontsize=8)
    ax2.set_ylabel("measured / formula")
    ax2.set_ylim(0.97, 1.03)
    ax2.set_title(f"(s, h, a) in {', '.join(f'({s},{h},{a_})' for s, h, a_ in shapes)}\nt = P in {degrees}", fontsize=10)
    ax2.legend(fontsize=8)
    fig.tight_layout()
    a.out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(a.out, dpi=120)
    md = a.out.with_suffix(".md")
    md.write_text(table(rows, shape))
    print(f"wrote {a.out} and {md}")


if __name__ == "__main__":
    main()
