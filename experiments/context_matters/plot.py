"""Draw ``context_matters.png`` beside ``context_matters.json`` (reads results; never trains).

    python -m experiments.context_matters.plot              # runs/context_matters/ (a rerun's results)
    python -m experiments.context_matters.plot --publish    # paper_figures/ (the committed results)
    python -m experiments.context_matters.plot --results some/dir/context_matters.json
"""

from __future__ import annotations

import argparse
import json
import sys
from collections import defaultdict
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]

from experiments.common.results import default_results


def meta_ranks(meta: dict) -> int:
    """Ranks of the full-context arms (their name ``full_sp<P>...``)."""
    for r in meta["results"]:
        if r["sequence_parallel"]:
            return int(r["arm"].removeprefix("full_sp").split("_")[0])
    return 4


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--results", type=Path, default=None, help="default: runs/context_matters/context_matters.json")
    p.add_argument("--publish", action="store_true", help="draw paper_figures/context_matters.png from the committed results")
    a = p.parse_args(argv)
    path = a.results or default_results(a, "context_matters", "context_matters.json")
    if not path.is_file():
        raise SystemExit(f"no results at {path}; run: python -m experiments.context_matters.run (or pass --publish / --results)")
    meta = json.loads(path.read_text())
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    by_ctx = defaultdict(list)
    for r in meta["results"]:  # files written before the image-attention arms have causal images only
        by_ctx[(r["context_tokens"], r["sequence_parallel"], r.get("image_attention", "causal"))].append(r["val_answer_acc"])
    keys = sorted(by_ctx, key=lambda k: (k[0], k[2] == "bidirectional"))
    labels = [f"{c} tokens\n" + ((f"full, SP={meta_ranks(meta)}\n{image} images") if sp else "truncated")
              for c, sp, image in keys]
    means = [sum(by_ctx[k]) / len(by_ctx[k]) for k in keys]
    fig, ax = plt.subplots(figsize=(1.3 * len(keys) + 1.5, 3.8))
    colors = [("tab:orange" if image == "bidirectional" else "tab:blue") if sp else "tab:gray" for _, sp, image in keys]
    ax.bar(range(len(keys)), means, color=colors)
    for i, k in enumerate(keys):
        ax.scatter([i] * len(by_ctx[k]), by_ctx[k], color="k", s=12, zorder=3)
        ax.text(i, means[i] + 0.02, f"{means[i]:.2f}", ha="center")
    ax.axhline(0.1, ls="--", color="tab:red", lw=1, label="chance (10 digits)")
    ax.set_xticks(range(len(keys)), labels)
    ax.set_ylim(0, 1.05)
    ax.set_ylabel("val accuracy: label of the first image")
    ax.set_title("Answering about an image ~170 tokens back")
    ax.legend(loc="upper left")
    hw = meta["hardware"]["device"] if isinstance(meta["hardware"], dict) else meta["hardware"]
    fig.text(0.01, 0.01, f"{hw}; {meta['date'][:10]}; commit {meta.get('git_commit') or '?'}", fontsize=7, color="gray")
    fig.tight_layout()
    out = path.with_suffix(".png")
    fig.savefig(out, dpi=150)
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
