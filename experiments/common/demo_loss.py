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


def series(rows: list[dict]) -> dict[str, list[float]]:
    """``{tag: values in step order}`` of the CSV this module writes (``tag, step, value`` rows)."""
    out: dict[str, list[tuple[int, float]]] = {}
    for row in rows:
        out.setdefault(row["tag"], []).append((int(row["step"]), float(row["value"])))
    return {tag: [v for _, v in sorted(points)] for tag, points in out.items()}


def trend(losses: list[float], window: int = 10) -> tuple[int, float, float]:
    """``(n, mean of the first n, mean of the last n)``, as the demo prints it at the end of fit (``LogLocation``)."""
    n = min(window, max(1, len(losses) // 2))
    return n, sum(losses[:n]) / n, sum(losses[-n:]) / n


def summary(data: list[dict], path) -> str:
    """A committed demo run's numbers (for a README's generated block): loss trend, validation loss, accuracy."""
    s = series(data)
    train = s["Loss/train"]
    n, first, last = trend(train)
    out = (f"Over {len(train)} steps `Loss/train` falls from {train[0]:.2f} to {train[-1]:.2f} (mean of the first {n} "
           f"steps {first:.4f} -> last {n} steps {last:.4f}); validation loss {s['Loss/val'][-1]:.3f}")
    if "answer_acc/val" in s:
        out += f", validation answer accuracy {s['answer_acc/val'][-1]:.4f} (chance 0.1)"
    return out + "."


def communication(text: str, path) -> str:
    """What a demo config's sequence-parallel attention sends per rank per optimizer step (fp32, every attention
    layer, forward + backward), from ``lightning_sp.comm.volume``: for a README's generated block."""
    import yaml

    from lightning_sp import SequenceParallelAttention
    from lightning_sp.comm.volume import backward_elements, forward_elements
    from lightning_sp.models import ProteinEncoder
    from lightning_sp.ops.ring_attention import piece_count

    cfg = yaml.safe_load(text)
    strategy = cfg["trainer"]["strategy"]["init_args"]
    model = ProteinEncoder(**cfg["model"]["init_args"])
    layers = [m for m in model.modules() if isinstance(m, SequenceParallelAttention)]
    n, p = cfg["data"]["init_args"]["context_len"], strategy["sequence_parallel_size"]
    shape = dict(seq_len=n, world=p, num_heads=model.net.cfg.n_heads, num_kv_heads=model.net.cfg.kv_heads,
                 head_dim=model.net.cfg.d_model // model.net.cfg.n_heads)
    # kv_pieces="auto" on CPU without a memory budget: whole blocks (lightning_sp.choices)
    pieces = 1 if layers[0].kv_pieces == "auto" else piece_count(layers[0].kv_pieces, n // p)
    fwd = forward_elements(strategy["backend"], **shape)
    bwd = backward_elements(strategy["backend"], **shape, kv_pieces=pieces)
    mib = 4 * len(layers) / 2**20
    return (f"{(fwd + bwd) * mib:.3f} MiB sent per rank per step: {2 * fwd * mib:.3f} MiB of K/V ring sends and "
            f"{(fwd + bwd - 2 * fwd) * mib:.3f} MiB of dK/dV (`{strategy['backend']}`, P = {p}, N = {n}, "
            f"{len(layers)} attention layers, fp32).")


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
