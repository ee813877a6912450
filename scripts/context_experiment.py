"""Context matters: full context (sequence parallel) vs truncated context on the long-range question.

    python scripts/context_experiment.py [--steps 800] [--seeds 0 1] [--truncate 48 96 144]

Each arm is ``lightning-sp fit`` on ``experiments/context_matters/base.yaml`` (plus
``full_context_sp.yaml`` for the full-context arm), run in a subprocess; the final validation
metrics are read back from its TensorBoard events. Results go to ``paper_figures/context_matters.json``
and ``.csv``; the figure is drawn by ``scripts/plot_context_experiment.py`` (which never trains).
"""

from __future__ import annotations

import argparse
import csv
import datetime
import json
import os
import platform
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
EXP = ROOT / "experiments" / "context_matters"
OUT = ROOT / "paper_figures"
FULL_LEN = 21 * 8 + 9


def run_arm(*, truncate: int | None, seed: int, steps: int, log_root: Path) -> dict:
    name = "full_sp4" if truncate is None else f"trunc{truncate}"
    cmd = [sys.executable, "-m", "lightning_sp.cli", "fit", "--config", str(EXP / "base.yaml")]
    if truncate is None:
        cmd += ["--config", str(EXP / "full_context_sp.yaml")]
    else:
        cmd += ["--data.init_args.truncate_to", str(truncate)]
    cmd += ["--seed_everything", str(seed), "--data.init_args.seed", str(seed), "--trainer.max_steps", str(steps),
            "--data.init_args.samples_per_epoch", str(16 * steps),  # one epoch = the whole run (batch size 16)
            "--trainer.val_check_interval", str(steps), "--trainer.logger.init_args.save_dir", str(log_root),
            "--trainer.logger.init_args.name", f"{name}_seed{seed}"]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}
    t0 = time.perf_counter()
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True)
    secs = time.perf_counter() - t0
    if proc.returncode != 0:
        raise RuntimeError(f"arm {name} seed {seed} failed:\n{proc.stdout[-2000:]}\n{proc.stderr[-4000:]}")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    runs = sorted((log_root / f"{name}_seed{seed}").iterdir(), key=lambda p: p.stat().st_mtime)
    acc = EventAccumulator(str(runs[-1]))
    acc.Reload()
    last = {tag: acc.Scalars(tag)[-1].value for tag in ("answer_acc/val", "Loss/val", "Loss/train")}
    return {"arm": name, "context_tokens": FULL_LEN if truncate is None else truncate, "sequence_parallel": truncate is None,
            "seed": seed, "steps": steps, "val_answer_acc": last["answer_acc/val"], "val_loss": last["Loss/val"],
            "train_loss_last": last["Loss/train"], "wall_s": round(secs, 1)}


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--steps", type=int, default=800)
    p.add_argument("--seeds", type=int, nargs="+", default=[0, 1])
    p.add_argument("--truncate", type=int, nargs="+", default=[48, 96, 144])
    p.add_argument("--log-root", default=str(ROOT / "runs" / "context_matters"))
    p.add_argument("--out", default=str(OUT))
    a = p.parse_args(argv)
    bad = [t for t in a.truncate if not 8 <= t < FULL_LEN]
    if bad or a.steps < 1:
        p.error(f"--truncate values must be in [8, {FULL_LEN}) and --steps >= 1; got truncate={a.truncate}, steps={a.steps}")
    rows = []
    for seed in a.seeds:
        for trunc in [None, *a.truncate]:
            row = run_arm(truncate=trunc, seed=seed, steps=a.steps, log_root=Path(a.log_root))
            print(json.dumps(row), flush=True)
            rows.append(row)
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    meta = {
        "command": "python scripts/context_experiment.py " + " ".join(argv if argv is not None else sys.argv[1:]),
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "hardware": f"{platform.machine()} CPU, {os.cpu_count()} cores, gloo",
        "task": "8 digit images + captions; question: label of the first image (chance ~0.1)",
        "results": rows,
    }
    (out / "context_matters.json").write_text(json.dumps(meta, indent=2) + "\n")
    with (out / "context_matters.csv").open("w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=list(rows[0]))
        w.writeheader()
        w.writerows(rows)
    print(f"wrote {out / 'context_matters.json'} and .csv; draw with: python scripts/plot_context_experiment.py")
    subprocess.run([sys.executable, str(ROOT / "scripts" / "plot_context_experiment.py"), "--results", str(out / "context_matters.json")], check=True)


if __name__ == "__main__":
    main()
