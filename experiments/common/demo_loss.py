"""Plot a demo run's TensorBoard scalars (reads event files; never trains).

    python -m experiments.common.demo_loss runs/protein_demo/version_0 [--out PNG | --publish]
    python -m experiments.common.demo_loss runs/multimodal_demo/version_0 --out paper_figures/demo_multimodal_loss.png

Writes the PNG and a CSV of the scalars next to it: ``Loss/train``, ``Loss/val`` and, for the multimodal
decoder, ``answer_acc/val`` (in the CSV only). ``tests/unit/test_readme_numbers.py`` checks the README's
demo numbers against these CSVs and the CSVs' first steps against the current code.
"""

from __future__ import annotations

import argparse
import csv
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("run_dir", help="a TensorBoard run folder (with events.out.tfevents.*)")
    p.add_argument("--out", default=None, help="PNG path (default: <run_dir>/demo_protein_loss.png)")
    p.add_argument("--publish", action="store_true", help="write paper_figures/demo_protein_loss.png (committed)")
    p.add_argument("--title", default="Protein encoder, masked-residue loss (4 gloo ranks, sequence parallel)")
    a = p.parse_args(argv)
    run = Path(a.run_dir)
    if not any(run.glob("events.out.tfevents.*")):
        raise SystemExit(f"no TensorBoard event files in {run}")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(run))
    acc.Reload()
    loss_tags = [t for t in ("Loss/train", "Loss/val") if t in acc.Tags()["scalars"]]
    if not loss_tags:
        raise SystemExit(f"{run} has no Loss/train or Loss/val scalars; found {acc.Tags()['scalars']}")
    tags = loss_tags + [t for t in ("answer_acc/val",) if t in acc.Tags()["scalars"]]
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    out = Path(a.out) if a.out else (ROOT / "paper_figures" if a.publish else Path(a.run_dir)) / "demo_protein_loss.png"
    out.parent.mkdir(parents=True, exist_ok=True)
    fig, ax = plt.subplots(figsize=(6, 3.4))
    with out.with_suffix(".csv").open("w", newline="") as f:
        w = csv.writer(f)
        w.writerow(["tag", "step", "value"])
        for tag in tags:
            ev = acc.Scalars(tag)
            w.writerows([tag, e.step, e.value] for e in ev)
            if tag not in loss_tags:
                continue
            ax.plot([e.step for e in ev], [e.value for e in ev], marker="o" if tag.endswith("val") else None, label=tag)
    ax.set_xlabel("step")
    ax.set_ylabel("cross-entropy (nats)")
    ax.set_title(a.title, fontsize=9)
    ax.legend()
    fig.tight_layout()
    fig.savefig(out, dpi=150)
    print(f"wrote {out} and {out.with_suffix('.csv')}")


if __name__ == "__main__":
    main()
