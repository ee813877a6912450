#!/usr/bin/env python
"""Throughput per rank vs sequence length for every backend and Megatron TP+SP (Ulysses Fig. 3), and each
backend's attention fwd+bwd as a share of one local kernel call (ring-flash-attn's table). Measured.

    .venv/bin/python -m experiments.throughput.run            # full run (see experiments/throughput/README.md)
    .venv/bin/python -m experiments.throughput.run --quick    # smoke run, seconds
    .venv/bin/python -m experiments.throughput.run --causal   # GPT-like decoder instead of the protein encoder

Writes ``<out>/throughput.{json,csv}`` (default ``runs/throughput/``; ``--publish``: ``paper_figures/``), TensorBoard scalars under
``<log-dir>/<method>-P<P>`` (x axis: sequence length), then draws the figure with
``experiments/throughput/plot.py`` (``--no-plot`` skips it). Spawns gloo ranks on CPU, one thread each.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[2]

from experiments.common.results import RUNS, add_output_arguments, output_dir, run_metadata, run_name, write_results
from experiments.common.launch import run_on_ranks
from experiments.throughput.measure import (
    ATTENTION_BACKENDS,
    LOCAL,
    METHODS,
    GridSpec,
    ModelShape,
    collect_rows,
    rank_worker,
    spec_dict,
)

NAME = "throughput"
LOSS_RTOL = 1e-4  # every method trains the same model on the same batch: step-0 losses agree to fp32 round-off

# full run: est. 8-12 min on a quiet 2-core machine (experiments/throughput/README.md); quick: the smoke test's
FULL = dict(shape=ModelShape(d_model=256, n_layers=2, n_heads=8), seq_lens=[512, 1024, 2048, 4096],
            attention_seq_lens=[2048, 4096], worlds=[1, 2, 4], warmup=1, reps=5)
QUICK = dict(shape=ModelShape(d_model=64, n_layers=1, n_heads=4), seq_lens=[256], attention_seq_lens=[256],
             worlds=[1, 2], warmup=1, reps=2)


def check_losses(rows: list[dict]) -> None:
    """Every method's loss at step 0 equals the one-process loss at the same length (else what is timed is
    not the same computation): raises naming the rows that differ."""
    ref = {r["seq_len"]: r["loss_step0"] for r in rows if r["section"] == "training_step" and r["method"] == LOCAL}
    bad = []
    for r in rows:
        if r["section"] != "training_step":
            continue
        base = ref.get(r["seq_len"])
        r["loss_rel_diff_vs_one_process"] = None if base is None else abs(r["loss_step0"] - base) / abs(base)
        if base is not None and r["loss_rel_diff_vs_one_process"] > LOSS_RTOL:
            bad.append((r["method"], r["world"], r["seq_len"], r["loss_step0"], base))
    if bad:
        raise RuntimeError(f"step-0 losses differ from the one-process run by more than {LOSS_RTOL} (method, P, N, "
                           f"loss, one-process loss): {bad}")


def one_process(spec: GridSpec) -> list[dict]:
    """The P = 1 run in this process (idle otherwise; saves a spawn), with one thread like every rank."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        return [rank_worker(0, 1, spec)]
    finally:
        torch.set_num_threads(threads)


def log_scalars(rows: list[dict], log_dir: Path) -> None:
    """One TensorBoard run per (method, P); the step axis is the sequence length N."""
    from torch.utils.tensorboard import SummaryWriter

    writers: dict[str, SummaryWriter] = {}
    for r in sorted(rows, key=lambda r: r["seq_len"]):
        name = run_name(r["method"], P=r["world"])
        w = writers.setdefault(name, SummaryWriter(str(log_dir / name)))
        if r["section"] == "training_step":
            w.add_scalar("throughput/tokens_per_s_per_rank", r["tokens_per_s_per_rank"], r["seq_len"])
            w.add_scalar("throughput/model_tflops_per_rank", r["model_tflops_per_rank"], r["seq_len"])
            w.add_scalar("throughput/step_s", r["step_s"], r["seq_len"])
        else:
            w.add_scalar("attention/share_of_one_kernel_call", r["share_of_kernel"], r["seq_len"])
    for w in writers.values():
        w.close()


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true", help="tiny model, N=256, P=1 and 2, 2 reps (smoke test)")
    p.add_argument("--causal", action="store_true", help="GPT-like causal decoder (default: bidirectional protein encoder)")
    p.add_argument("--worlds", type=int, nargs="+", help="degrees P to run (1 = the one-process run)")
    p.add_argument("--seq-lens", type=int, nargs="+", help="global lengths N of the training step")
    p.add_argument("--attention-seq-lens", type=int, nargs="+", help="global lengths N of the attention-share section")
    p.add_argument("--reps", type=int, help="timed reps per implementation (median reported)")
    add_output_arguments(p, NAME)  # throughput.{json,csv,png}
    p.add_argument("--log-dir", type=Path, default=RUNS / NAME, help="TensorBoard dir")
    p.add_argument("--no-plot", action="store_true", help="do not draw the figure")
    a = p.parse_args(argv)
    a.out = output_dir(a, NAME)
    cfg = dict(QUICK if a.quick else FULL)
    for key in ("worlds", "seq_lens", "attention_seq_lens", "reps"):
        if getattr(a, key) is not None:
            cfg[key] = getattr(a, key)
    if a.causal:
        cfg["shape"] = ModelShape(**{**cfg["shape"].__dict__, "causal": True})
    bad_world = [w for w in cfg["worlds"] if w < 1 or cfg["shape"].n_heads % w]
    if bad_world:
        p.error(f"--worlds {bad_world}: every P must be >= 1 and divide n_heads={cfg['shape'].n_heads} (Ulysses, TP)")
    bad_n = [n for n in cfg["seq_lens"] + cfg["attention_seq_lens"] if n < 1 or any(n % (2 * w) for w in cfg["worlds"])]
    if bad_n:
        p.error(f"--seq-lens {bad_n}: every N must be a multiple of 2P for every P in {cfg['worlds']} (no padding in timed runs)")
    if cfg["reps"] < 1:
        p.error(f"--reps must be >= 1, got {cfg['reps']}")
    a.cfg = cfg
    return a


def _write(a: argparse.Namespace, cfg: dict, argv, rows: list[dict], t_start: float, load_start, *, complete: bool) -> Path:
    """(Re)write the result files after every degree P, so a run stopped early keeps what it measured."""
    check_losses(rows)
    spec_meta = spec_dict(GridSpec(shape=cfg["shape"], seq_lens=cfg["seq_lens"], methods=list(METHODS),
                                   attention_seq_lens=cfg["attention_seq_lens"], warmup=cfg["warmup"], reps=cfg["reps"]))
    cores = os.cpu_count() or 1
    meta = run_metadata(
        __file__, argv, kind="measured",
        what=("per-rank tokens/s and model TFLOP/s of one training step (fwd, loss, bwd, gradient reduction, AdamW) "
              "vs sequence length, every backend and Megatron TP+SP; attention fwd+bwd per rank as a share of "
              "P x one local kernel call on N/P tokens"),
        flops=("Megatron model FLOPs 72*B*L*s*h^2*(1 + s/(6h) + V/(12*h*L)) "
               "(lightning_sp.callbacks.megatron_flops_per_iteration): full attention counted also when causal"),
        timing=("one thread per rank; implementations alternate rep by rep; barrier before and after each; "
                "per rep the slowest rank; median over reps after warmup"),
        spec=spec_meta, worlds=cfg["worlds"], worlds_done=sorted({r["world"] for r in rows}), complete=complete,
        cores=cores, oversubscribed_worlds=[w for w in cfg["worlds"] if w > cores],
        load_1m_5m_15m_start=list(load_start), load_1m_5m_15m_end=list(os.getloadavg()),
        total_wall_s=round(time.perf_counter() - t_start, 1), dtype="float32", process_group="gloo",
        attention_backends=list(ATTENTION_BACKENDS),
    )
    return write_results(NAME, meta, rows, a.out)


def main(argv: list[str] | None = None) -> Path:
    a = parse_args(argv)
    cfg = a.cfg
    cores = os.cpu_count() or 1
    t_start = time.perf_counter()
    load_start = os.getloadavg()
    rows: list[dict] = []
    for world in cfg["worlds"]:
        spec = GridSpec(shape=cfg["shape"], seq_lens=cfg["seq_lens"], methods=[LOCAL] if world == 1 else list(METHODS),
                        attention_seq_lens=cfg["attention_seq_lens"] if world > 1 else (),
                        warmup=cfg["warmup"], reps=cfg["reps"])
        t0 = time.perf_counter()
        per_rank = one_process(spec) if world == 1 else run_on_ranks(rank_worker, world, (spec,), timeout_s=3600, pg_timeout_s=600)
        new = collect_rows(per_rank, world, spec, cores)
        rows += new
        note = " (oversubscribed: more ranks than cores)" if world > cores else ""
        print(f"P={world}{note}: {len(new)} rows in {time.perf_counter() - t0:.0f} s", flush=True)
        for r in new:
            if r["section"] == "training_step":
                print(f"  step  {r['method']:13s} N={r['seq_len']:6d}  {r['step_s']:.3f} s  "
                      f"{r['tokens_per_s_per_rank']:9.0f} tok/s/rank  {r['model_tflops_per_rank'] * 1e3:6.2f} GFLOP/s/rank  "
                      f"cpu/wall {r['cpu_over_wall']:.2f}", flush=True)
            else:
                print(f"  attn  {r['method']:13s} N={r['seq_len']:6d}  {r['attention_fwd_bwd_s']:.4f} s  "
                      f"share of one kernel call {r['share_of_kernel']:.3f}", flush=True)
        path = _write(a, cfg, argv, rows, t_start, load_start, complete=world == cfg["worlds"][-1])
    log_scalars(rows, a.log_dir)
    print(f"wrote {path} and .csv in {time.perf_counter() - t_start:.0f} s; TensorBoard: tensorboard --logdir {a.log_dir}")
    if not a.no_plot:  # in this process (the plot script only reads the file): saves a Python start-up
        from experiments.throughput import plot

        plot.main(["--results", str(path), "--log-dir", str(a.log_dir)])
    return path


if __name__ == "__main__":
    main()
