"""Context matters: full context (sequence parallel) vs truncated context on the long-range question, and, at
full context, image patches read causally (like text) vs each image one bidirectional span (PaliGemma, Gemma 3).

    python -m experiments.context_matters.run                  # the documented run: writes runs/context_matters/
    python -m experiments.context_matters.run --publish        # the same, into paper_figures/ (the committed results)
    python -m experiments.context_matters.run --quick --out /tmp/x   # seconds: 4 steps, 2 ranks (smoke test)

Each arm is ``lightning-sp fit`` on ``experiments/context_matters/base.yaml`` (plus
``full_context_sp.yaml`` for the full-context arms; ``--image-attention`` picks which image attention the
full-context arms train with, one arm each; the truncated arms read images causally), run in a subprocess; the final validation
metrics are read back from its TensorBoard events. Results: ``context_matters.{json,csv,png}`` in
``runs/context_matters/`` (ignored by git) unless ``--publish`` or ``--out`` says otherwise; the figure is
drawn by ``experiments/context_matters/plot.py`` (which never trains). A progress line is printed when an
arm starts, every 30 s while it trains, and when it ends.

Reruns reproduce: every arm is seeded (model init, data, sampler: ``--seed_everything`` and
``data.seed``), trains with ``trainer.deterministic`` and one thread per process, so the same command
at the same commit gives the same numbers bit for bit (``tests/experiments/test_context_matters.py``
checks a rerun). The file records the commit that produced it.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]

from experiments.common.results import RUNS, add_output_arguments, output_dir, run_metadata, write_results

NAME = "context_matters"
EXP = ROOT / "experiments" / NAME
FULL_LEN = 21 * 8 + 9
HEARTBEAT_S = 30
QUICK = {"steps": 4, "seeds": [0], "truncate": [48], "full_ranks": 2}
IMAGE_ATTENTION = ("causal", "bidirectional")
"""``MultimodalDecoder(image_attention=)``: base.yaml's is causal (patches read like text)."""


def arm_name(truncate: int | None, full_ranks: int, image_attention: str = "causal") -> str:
    if truncate is not None:
        return f"trunc{truncate}"
    return f"full_sp{full_ranks}" + ("_bidir" if image_attention == "bidirectional" else "")


def arm_command(*, truncate: int | None, seed: int, steps: int, log_root: Path, full_ranks: int,
                val_batches: int | None, image_attention: str = "causal") -> list[str]:
    name = arm_name(truncate, full_ranks, image_attention)
    cmd = [sys.executable, "-m", "lightning_sp.cli", "fit", "--config", str(EXP / "base.yaml"),
           "--model.init_args.image_attention", image_attention]
    if truncate is None:
        cmd += ["--config", str(EXP / "full_context_sp.yaml"),
                # ranks start slowly on a loaded machine: the rendezvous waits this long (no effect on results)
                "--trainer.strategy.init_args.process_group_timeout", "900"]
        if full_ranks != 4:
            cmd += ["--trainer.devices", str(full_ranks),
                    "--trainer.strategy.init_args.sequence_parallel_size", str(full_ranks)]
    else:
        cmd += ["--data.init_args.truncate_to", str(truncate)]
    cmd += ["--seed_everything", str(seed), "--data.init_args.seed", str(seed), "--trainer.max_steps", str(steps),
            "--data.init_args.samples_per_epoch", str(16 * steps),  # one epoch = the whole run (batch size 16)
            "--trainer.deterministic", "true",
            "--trainer.val_check_interval", str(steps), "--trainer.logger.init_args.save_dir", str(log_root),
            "--trainer.logger.init_args.name", f"{name}_seed{seed}"]
    if val_batches is not None:
        cmd += ["--trainer.limit_val_batches", str(val_batches)]
    if steps < 10:  # base.yaml logs every 10 steps: the last training loss must be logged
        cmd += ["--trainer.log_every_n_steps", "1"]
    return cmd


def run_arm(*, truncate: int | None, seed: int, steps: int, log_root: Path, full_ranks: int = 4,
            val_batches: int | None = None, label: str = "", image_attention: str = "causal") -> dict:
    name = arm_name(truncate, full_ranks, image_attention)
    cmd = arm_command(truncate=truncate, seed=seed, steps=steps, log_root=log_root, full_ranks=full_ranks,
                      val_batches=val_batches, image_attention=image_attention)
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}
    log_root.mkdir(parents=True, exist_ok=True)
    log_path = log_root / f"{name}_seed{seed}.log"
    print(f"{label} {name} seed {seed}: training {steps} steps ({'sequence parallel over ' + str(full_ranks) + ' ranks' if truncate is None else 'one process'}); log {log_path}", flush=True)
    t0 = time.perf_counter()
    with log_path.open("w") as log:
        proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT)
        while True:
            try:
                proc.wait(timeout=HEARTBEAT_S)
                break
            except subprocess.TimeoutExpired:
                print(f"{label} {name} seed {seed}: still training ({time.perf_counter() - t0:.0f} s)", flush=True)
    secs = time.perf_counter() - t0
    if proc.returncode != 0:
        raise RuntimeError(f"arm {name} seed {seed} failed (exit {proc.returncode}):\n{log_path.read_text()[-4000:]}")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    runs = sorted((log_root / f"{name}_seed{seed}").iterdir(), key=lambda p: p.stat().st_mtime)
    acc = EventAccumulator(str(runs[-1]))
    acc.Reload()
    last = {tag: acc.Scalars(tag)[-1].value for tag in ("answer_acc/val", "Loss/val", "Loss/train")}
    row = {"arm": name, "context_tokens": FULL_LEN if truncate is None else truncate,
           "sequence_parallel": truncate is None, "image_attention": image_attention, "seed": seed, "steps": steps,
           "val_answer_acc": last["answer_acc/val"], "val_loss": last["Loss/val"],
           "train_loss_last": last["Loss/train"], "wall_s": round(secs, 1)}
    print(f"{label} {name} seed {seed}: val answer accuracy {row['val_answer_acc']:.3f}, val loss "
          f"{row['val_loss']:.4f} ({secs:.0f} s)", flush=True)
    return row


def main(argv: list[str] | None = None) -> Path:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--steps", type=int, default=800)
    p.add_argument("--seeds", type=int, nargs="+", default=[0, 1])
    p.add_argument("--truncate", type=int, nargs="+", default=[48, 96, 144])
    p.add_argument("--jobs", type=int, default=1,
                   help="arms trained at the same time (default 1; the numbers do not depend on it)")
    p.add_argument("--image-attention", nargs="+", choices=IMAGE_ATTENTION, default=list(IMAGE_ATTENTION),
                   help="one full-context arm per value (default: both); the truncated arms read images causally")
    p.add_argument("--skip-full", action="store_true", help="only the truncated arms (one process each)")
    p.add_argument("--quick", action="store_true",
                   help=f"smoke run: {QUICK['steps']} steps, seed 0, truncate 48, full arm on {QUICK['full_ranks']} "
                        "ranks, one validation batch (not the published setup)")
    p.add_argument("--log-root", default=None, help="TensorBoard runs and arm logs (default: runs/context_matters/, "
                   "or --out's directory)")
    add_output_arguments(p, NAME)
    a = p.parse_args(argv)
    full_ranks, val_batches = 4, None
    if a.quick:
        a.steps, a.seeds, a.truncate, full_ranks, val_batches = QUICK["steps"], QUICK["seeds"], QUICK["truncate"], QUICK["full_ranks"], 1
    bad = [t for t in a.truncate if not 8 <= t < FULL_LEN]
    if bad or a.steps < 1 or a.jobs < 1:
        p.error(f"--truncate values must be in [8, {FULL_LEN}) and --steps, --jobs >= 1; got truncate={a.truncate}, steps={a.steps}, jobs={a.jobs}")
    out = output_dir(a, NAME)
    log_root = Path(a.log_root) if a.log_root else (out if a.out else RUNS / NAME)  # never into paper_figures/
    # provenance taken before training: the commit and tree state the arms run from
    meta = run_metadata(__file__, argv, kind="measured",
                        task="8 digit images + captions; question: label of the first image (chance ~0.1)",
                        quick=a.quick, load_average_at_start=[round(x, 1) for x in os.getloadavg()])
    full = [] if a.skip_full else [(None, image) for image in a.image_attention]
    arms = [(seed, trunc, image) for seed in a.seeds for trunc, image in full + [(t, "causal") for t in a.truncate]]
    print(f"context_matters: {len(arms)} arms x {a.steps} steps -> {out} (the full arm takes ~90 s, a truncated "
          "one 15-40 s on 2 quiet cores)", flush=True)
    from concurrent.futures import ThreadPoolExecutor

    def one(i: int) -> dict:
        seed, trunc, image = arms[i]
        return run_arm(truncate=trunc, seed=seed, steps=a.steps, log_root=log_root, full_ranks=full_ranks,
                       val_batches=val_batches, label=f"[{i + 1}/{len(arms)}]", image_attention=image)

    with ThreadPoolExecutor(max_workers=a.jobs) as pool:  # each arm is its own subprocess(es)
        rows = list(pool.map(one, range(len(arms))))  # in arm order whatever finishes first
    path = write_results(NAME, meta, rows, out)
    print(f"wrote {path} and .csv", flush=True)
    subprocess.run([sys.executable, "-m", "experiments.context_matters.plot", "--results", str(path)], check=True, cwd=ROOT)
    return path


if __name__ == "__main__":
    main()
