#!/usr/bin/env python
"""Draw ``throughput.png`` beside ``throughput.json`` (reads results; never trains or times).

    .venv/bin/python -m experiments.throughput.plot [--publish | --results runs/throughput/throughput.json] [--log-dir runs/throughput]

Panels: (a) the paper's Fig. 3 (DeepSpeed-Ulysses vs Megatron-SP, TFLOPs per A100, as read from the paper;
not measured here); (b, c) measured model TFLOP/s per rank vs N on this machine, P = 2 and P = 4, with the
one-process run; (d) measured attention fwd+bwd per rank as a share of P x one local kernel call, beside
ring-flash-attn's 8xH800 figures. Also logs the figure into TensorBoard and prints the README tables.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]

from experiments.common.results import RUNS, default_results, log_figure, read_results

# DeepSpeed-Ulysses (arXiv 2309.14509) Fig. 3, TFLOPs per GPU; None = out of memory. From ../shared/REFERENCES.md.
PAPER_SEQ_K = [8, 16, 32, 64, 128, 256]
PAPER_FIG3 = {
    "7B, 32 A100": {"ulysses": [159, 175, 178, 181, 176, 174], "megatron_sp": [106, 143, 164, 165, 158, None]},
    "30B, 64 A100 (~read off chart)": {"ulysses": [165, 157, 152, 147, 140, 134], "megatron_sp": [45, 68, 86, 105, None, None]},
}
# ring-flash-attn README, fwd+bwd share of the theoretic flash_attn, 8xH800, causal
PAPER_SHARE = {"zigzag_ring": 0.902, "ring": 0.539}
ORDER = ["ulysses", "ring", "zigzag_ring", "allgather_kv", "usp", "colossal", "megatron_sp"]
COLORS = dict(zip(ORDER, ["tab:blue", "tab:orange", "tab:green", "tab:purple", "tab:brown", "tab:gray", "tab:red"]))


def tables(rows: list[dict]) -> str:
    """Markdown: model TFLOP/s per rank (GFLOP/s shown) per method x N for each P, and attention shares."""
    out = []
    train = [r for r in rows if r["section"] == "training_step"]
    lens = sorted({r["seq_len"] for r in train})
    one = {r["seq_len"]: r for r in train if r["world"] == 1}
    for world in sorted({r["world"] for r in train if r["world"] > 1}):
        by = {(r["method"], r["seq_len"]): r for r in train if r["world"] == world}
        over = any(r["oversubscribed"] for r in by.values())
        out.append(f"P = {world}{' (oversubscribed: more ranks than cores)' if over else ''}: model GFLOP/s per rank "
                   "(tokens/s per rank), median step\n")
        out.append("| method | " + " | ".join(f"N={n}" for n in lens) + " |")
        out.append("|---|" + "---|" * len(lens))
        if one:
            out.append("| one process (P=1) | " + " | ".join(
                f"{one[n]['model_tflops_per_rank'] * 1e3:.2f} ({one[n]['tokens_per_s_per_rank']:.0f})" if n in one else "-"
                for n in lens) + " |")
        for m in ORDER:
            cells = [f"{by[m, n]['model_tflops_per_rank'] * 1e3:.2f} ({by[m, n]['tokens_per_s_per_rank']:.0f})"
                     if (m, n) in by else "-" for n in lens]
            out.append(f"| {m} | " + " | ".join(cells) + " |")
        cpu = [r["cpu_over_wall"] for r in by.values()]
        out.append(f"\ncpu/wall per rank: {min(cpu):.2f}..{max(cpu):.2f}\n")
    attn = [r for r in rows if r["section"] == "attention_share"]
    if attn:
        keys = sorted({(r["world"], r["seq_len"]) for r in attn})
        by = {(r["method"], r["world"], r["seq_len"]): r for r in attn}
        out.append("Attention fwd+bwd per rank as a share of P x one local kernel call on N/P tokens "
                   f"(causal={attn[0]['causal']}, kernel={attn[0]['kernel']})\n")
        out.append("| backend | " + " | ".join(f"P={w}, N={n}" for w, n in keys) + " | ring-flash-attn, 8xH800 |")
        out.append("|---|" + "---|" * (len(keys) + 1))
        for m in ORDER[:-1]:
            cells = [f"{by[m, w, n]['share_of_kernel']:.1%}" if (m, w, n) in by else "-" for w, n in keys]
            paper = f"{PAPER_SHARE[m]:.1%}" if m in PAPER_SHARE else "-"
            out.append(f"| {m} | " + " | ".join(cells) + f" | {paper} |")
    return "\n".join(out) + "\n"


def main(argv: list[str] | None = None) -> Path:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--results", type=Path, default=None, help="default: runs/throughput/throughput.json")
    p.add_argument("--publish", action="store_true", help="the committed results in paper_figures/ (default: runs/throughput/)")
    p.add_argument("--log-dir", type=Path, default=RUNS / "throughput", help="TensorBoard dir the figure is logged to")
    a = p.parse_args(argv)
    a.results = a.results or default_results(a, "throughput", "throughput.json")
    if not a.results.is_file():
        raise SystemExit(f"no results at {a.results}; run: .venv/bin/python -m experiments.throughput.run")
    meta, rows = read_results(a.results)
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(2, 2, figsize=(13, 9))
    ax = axes[0, 0]
    for (label, series), style in zip(PAPER_FIG3.items(), ["-", "--"]):
        for m, ys in series.items():
            pts = [(x, y) for x, y in zip(PAPER_SEQ_K, ys) if y is not None]
            ax.plot([x for x, _ in pts], [y for _, y in pts], style, marker="o", color=COLORS[m],
                    label=f"{'Ulysses' if m == 'ulysses' else 'Megatron-SP'}, {label}")
    ax.set_xscale("log", base=2)
    ax.set_xlabel("sequence length (K tokens)")
    ax.set_ylabel("TFLOPs per GPU")
    ax.set_title("(a) paper: DeepSpeed-Ulysses Fig. 3 (not measured here;\nmissing points = out of memory)", fontsize=10)
    ax.legend(fontsize=7)

    train = [r for r in rows if r["section"] == "training_step"]
    worlds = sorted({r["world"] for r in train if r["world"] > 1})
    one = sorted((r for r in train if r["world"] == 1), key=lambda r: r["seq_len"])
    if len(worlds) < 2:
        axes[1, 0].set_axis_off()
    for ax, world in zip([axes[0, 1], axes[1, 0]], worlds[:2]):
        sub = [r for r in train if r["world"] == world]
        if one:
            ax.plot([r["seq_len"] for r in one], [r["model_tflops_per_rank"] * 1e3 for r in one], "k:", marker="x",
                    label="one process (P=1)")
        for m in ORDER:
            pts = sorted((r for r in sub if r["method"] == m), key=lambda r: r["seq_len"])
            if pts:
                ax.plot([r["seq_len"] for r in pts], [r["model_tflops_per_rank"] * 1e3 for r in pts], marker="o",
                        color=COLORS[m], ls="--" if m == "megatron_sp" else "-", label=m)
        over = any(r["oversubscribed"] for r in sub)
        cpu = [r["cpu_over_wall"] for r in sub]
        ax.set_xscale("log", base=2)
        ax.set_xlabel("global sequence length N (tokens)")
        ax.set_ylabel("model GFLOP/s per rank (measured)")
        note = f" on {meta['cores']} cores: OVERSUBSCRIBED" if over else ""
        ax.set_title(f"({'b' if world == worlds[0] else 'c'}) measured, P = {world} gloo ranks{note}\ncpu/wall per rank "
                     f"{min(cpu):.2f}..{max(cpu):.2f}", fontsize=10)
        ax.set_ylim(bottom=0)
        ax.legend(fontsize=7)

    ax = axes[1, 1]
    attn = [r for r in rows if r["section"] == "attention_share"]
    if attn:
        keys = sorted({(r["world"], r["seq_len"]) for r in attn})
        by = {(r["method"], r["world"], r["seq_len"]): r["share_of_kernel"] for r in attn}
        backends = [m for m in ORDER if any(r["method"] == m for r in attn)]
        width = 0.8 / (len(keys) + 1)
        for j, (w, n) in enumerate(keys):
            xs = [i + (j - len(keys) / 2) * width for i in range(len(backends))]
            ax.bar(xs, [by.get((m, w, n), 0) for m in backends], width, label=f"measured P={w}, N={n}")
        j = len(keys)
        xs = [i + (j - len(keys) / 2) * width for i, m in enumerate(backends) if m in PAPER_SHARE]
        ax.bar(xs, [PAPER_SHARE[m] for m in backends if m in PAPER_SHARE], width, color="black",
               label="ring-flash-attn, 8xH800 (paper)")
        ax.axhline(1.0, color="gray", lw=0.8)
        ax.set_xticks(range(len(backends)))
        ax.set_xticklabels(backends, rotation=20, fontsize=8)
        ax.set_ylabel("P x t(one kernel call on N/P) / t(backend)")
        ax.set_title(f"(d) attention fwd+bwd per rank, share of one local kernel\ncausal={attn[0]['causal']}, "
                     f"kernel={attn[0]['kernel']}", fontsize=10)
        ax.legend(fontsize=7)
    else:
        ax.set_axis_off()
    shape = meta["spec"]["shape"]
    fig.suptitle(f"Throughput per rank: L={shape['n_layers']}, h={shape['d_model']}, heads={shape['n_heads']}, "
                 f"V={shape['vocab_size']}, causal={shape['causal']}, B={shape['batch']}, fp32", fontsize=11)
    load = meta.get("load_1m_5m_15m_start", [float("nan")])[0], meta.get("load_1m_5m_15m_end", [float("nan")])[0]
    fig.text(0.01, 0.005, f"measured on {meta['hardware']['device']}, gloo; {meta['date']}; load avg (1 min) "
             f"{load[0]:.1f} -> {load[1]:.1f}; {meta['command']}", fontsize=7, color="gray")
    fig.tight_layout(rect=(0, 0.02, 1, 0.97))
    out = a.results.with_suffix(".png")
    fig.savefig(out, dpi=110)
    plt.close(fig)
    log_figure(a.log_dir, "throughput", out)
    print(tables(rows))
    print(f"wrote {out}; logged into {a.log_dir}")
    return out


if __name__ == "__main__":
    main()
