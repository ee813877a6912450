"""Draw ``convergence.png`` beside ``convergence.json`` (reads results; never trains) and log
it into TensorBoard (``runs/convergence/figures``); the max-difference table goes to ``convergence.md``.

    python -m experiments.convergence.plot [--publish | --results runs/convergence/convergence.json] [--log-dir runs/convergence]

One row per model: the training loss of every run overlaid on the one-process run (left), and
per step the largest |loss - one-process loss| / one-process loss over each method's runs (P, DDP/FSDP) on
a log axis (right), with the 1e-4 goal. Line style of the loss curves: P=2 dotted/dash-dot (DDP/FSDP),
P=4 dashed/solid.
"""

from __future__ import annotations

import argparse
import sys
from collections import defaultdict
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]

from experiments.common.results import RUNS, default_results, log_figure, read_results

METHOD_COLORS = {"ulysses": "tab:blue", "ring": "tab:orange", "zigzag_ring": "tab:green", "allgather_kv": "tab:red",
                 "usp": "tab:purple", "colossal": "tab:brown", "megatron_tp_sp": "tab:pink"}
LINESTYLES = {(2, "ddp"): ":", (2, "fsdp"): "-.", (4, "ddp"): "--", (4, "fsdp"): "-"}


def curves(rows: list[dict]) -> dict[str, dict[tuple, dict[str, list[float]]]]:
    """``{model: {(method, P, mode): {"step", "loss", "rel_diff": [...]}}}`` in step order, from the
    per-step rows (``one_process_loss`` and one ``loss:<method>-P<P>-<mode>`` column per run); the
    one-process run is ``("one_process", 1, "single")``."""
    out: dict = defaultdict(lambda: defaultdict(lambda: defaultdict(list)))
    for r in sorted(rows, key=lambda r: int(r["step"])):
        ref = float(r["one_process_loss"])
        series = {("one_process", 1, "single"): ref}
        for key, value in r.items():
            if key.startswith("loss:") and value not in (None, ""):
                method, degree, mode = key[len("loss:"):].rsplit("-", 2)
                series[(method, int(degree[1:]), mode)] = float(value)
        for run, loss in series.items():
            c = out[r["model"]][run]
            c["step"].append(int(r["step"]))
            c["loss"].append(loss)
            c["rel_diff"].append(abs(loss - ref) / abs(ref))
    return out


def markdown_table(meta: dict) -> str:
    """Max |loss difference| over all steps, absolute and relative, per model x method (rows) and
    P x mode (columns), from the result file's per-run summary."""
    summary = meta["summary"]
    configs = sorted({(s["P"], s["mode"]) for s in summary})
    cells = {(s["model"], s["method"], s["P"], s["mode"]): s for s in summary}
    lines = [f"Max over {meta['steps']} steps of |loss - one-process loss|: absolute / relative (fp32).", "",
             "| model | method | " + " | ".join(f"P={p} {m.upper()}" for p, m in configs) + " |",
             "|---|---|" + "---|" * len(configs)]
    order = list(dict.fromkeys(s["method"] for s in summary))
    for model in sorted({s["model"] for s in summary}, reverse=True):
        for method in order:
            row = [f"{c['max_abs_diff']:.1e} / {c['max_rel_diff']:.1e}" if (c := cells.get((model, method, p, m))) else "-"
                   for p, m in configs]
            lines.append(f"| {model} | {method} | " + " | ".join(row) + " |")
    worst = max(summary, key=lambda s: s["max_rel_diff"])
    lines += ["", f"Worst: {worst['max_rel_diff']:.1e} relative ({worst['run']}); goal < {meta['goal_max_rel_diff']:g}.",
              f"{meta['hardware']['device']}, torch {meta['hardware']['torch']}, {meta['date']}, `{meta['command']}`"]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> Path:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--results", type=Path, default=None, help="default: runs/convergence/convergence.json")
    p.add_argument("--publish", action="store_true", help="the committed results in paper_figures/ (default: runs/convergence/)")
    p.add_argument("--log-dir", type=Path, default=None,
                   help="TensorBoard dir the figure is logged into (default: the result file's log_dir, else runs/convergence)")
    args = p.parse_args(argv)
    args.results = args.results or default_results(args, "convergence", "convergence.json")
    if not args.results.is_file():
        raise SystemExit(f"no results at {args.results}; run: python -m experiments.convergence.run")
    meta, rows = read_results(args.results)
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    data = curves(rows)
    goal = float(meta.get("goal_max_rel_diff", 1e-4))
    fig, axes = plt.subplots(len(data), 2, figsize=(12, 3.8 * len(data)), squeeze=False)
    for (ax_loss, ax_diff), (model, runs) in zip(axes, sorted(data.items(), reverse=True)):
        ref = runs.pop(("one_process", 1, "single"))
        ax_loss.plot(ref["step"], ref["loss"], color="black", lw=3, alpha=0.35, label="one process", zorder=1)
        floor = 1e-9  # exact matches (0) drawn at the floor of the log axis
        by_method: dict[str, list[dict]] = defaultdict(list)
        for (method, degree, mode), c in sorted(runs.items()):
            ax_loss.plot(c["step"], c["loss"], color=METHOD_COLORS.get(method, "gray"), ls=LINESTYLES.get((degree, mode), "-"), lw=0.8)
            by_method[method].append(c)
        for method, cs in by_method.items():  # per step, the largest difference over the method's runs
            envelope = [max(max(c["rel_diff"][i] for c in cs), floor) for i in range(len(cs[0]["step"]))]
            ax_diff.plot(cs[0]["step"], envelope, color=METHOD_COLORS.get(method, "gray"), lw=0.9,
                         label=method)
        worst = max(max(c["rel_diff"]) for c in runs.values())
        ax_loss.set(title=f"{model}: training loss, one process + {len(runs)} parallel runs",
                    xlabel="step", ylabel="loss")
        ax_loss.legend(loc="upper right")
        ax_diff.axhline(goal, color="red", lw=1, label=f"goal {goal:g}")
        ax_diff.set_yscale("log")
        ax_diff.set_ylim(floor / 2, goal * 1000)  # room above the goal for the legend
        ax_diff.set(title=f"{model}: |loss - one-process loss| / loss (max {worst:.1e})", xlabel="step",
                    ylabel="max over the method's runs (0 at 1e-9)")
        ax_diff.legend(fontsize=7, ncol=4, loc="upper left")
    fig.suptitle(f"Convergence vs one process, fp32, {meta.get('steps')} steps (Ulysses Fig. 5 analogue)")
    fig.text(0.01, 0.005, f"{meta['hardware']['device']}; {meta['date'][:10]}; {meta['command']}", fontsize=7, color="gray")
    fig.tight_layout(rect=(0, 0.02, 1, 1))
    out = args.results.with_suffix(".png")
    fig.savefig(out, dpi=100)
    args.results.with_suffix(".md").write_text(markdown_table(meta))
    log_dir = args.log_dir or Path(meta.get("log_dir") or RUNS / "convergence")
    log_figure(log_dir, "convergence/figure", out)
    print(markdown_table(meta))
    print(f"wrote {out} and {out.with_suffix('.md').name}; logged it to TensorBoard under {log_dir}/figures")
    return out


if __name__ == "__main__":
    main()
