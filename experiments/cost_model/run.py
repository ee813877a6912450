#!/usr/bin/env python
"""The cost model (``lightning_sp/cost_model.py``): calibrate its terms with microbenchmarks of the
primitives on this CPU, validate against measured gloo step times on two grids, predict the papers'
setups.

    .venv/bin/python -m experiments.cost_model.run --part calibrate   # primitives -> cost_model_calibration.json
    .venv/bin/python -m experiments.cost_model.run --part grid1       # the CPU grid (34 rows)
    .venv/bin/python -m experiments.cost_model.run --part grid2       # shapes never used in calibration (24 rows)
    .venv/bin/python -m experiments.cost_model.run --part papers      # the papers' setups (model output only)
    .venv/bin/python -m experiments.cost_model.run --quick            # smoke: all four, tiny
    .venv/bin/python -m experiments.cost_model.plot                          # figure from cost_model_validation.json

Each part is one short exclusive timing run (run them with nothing else busy on the machine, one
after the other; ``experiments/cost_model/validate.sh`` does all four). A grid part reads the calibration
written by ``--part calibrate`` in the same ``--out``; it never changes it.

(a) Calibrate (``experiments/cost_model/calibrate.py``): kernel calls vs (q, k, D, mask), the tiny call,
    merge, in-place add, a batched matmul; per world size a ring exchange, all-to-all and all-gather
    latency + bandwidth, ping-pong bandwidth. -> ``<out>/cost_model_calibration.json`` (measured, with the
    machine and date) and ``cost_model_cpu_profile.{json,csv}`` (the profile the model reads).
(b) Validate: one attention layer fwd+bwd per backend on P gloo ranks, measured (median between
    barriers), beside the model's prediction from the calibrated profile; error % per row ->
    ``<out>/cost_model_validation_grid{1,2}.{json,csv}`` and both together in
    ``cost_model_validation.{json,csv}``: ``measured_ms`` (this machine) and ``model_*`` (cost model)
    are separate columns.
(c) Predict the papers' setups with the GPU presets (datasheet + cited assumptions) beside the
    papers' numbers (``experiments/cost_model/papers.py``) -> ``<out>/cost_model_predictions.{json,csv}``
    (``kind: model``).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from dataclasses import replace
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]

from experiments.common.results import add_output_arguments, output_dir, run_metadata, write_results
from experiments.common.launch import keep_freed_memory
from experiments.cost_model import calibrate, measure, papers, split
from experiments.cost_model.calibrate import load_profile
from lightning_sp.cost_model import AttentionShape, HardwareProfile, predict_attention

PARTS = ("calibrate", "grid1", "grid2", "papers")
WORLDS = (2, 4, 8)

# grid 1: the CPU grid (H = 8, H_kv = 4, D = 32, causal, kv_pieces = 8 as it was measured)
GRID1_SHAPE = (8, 4, 32, True, 8)


def grid1_cases(world: int, seq_lens=(1024, 2048), quick: bool = False) -> list[tuple]:
    """``(backend, ulysses_degree, N, H, H_kv, D, causal, kv_pieces)`` timed at ``world``."""
    h, hkv, d, causal, pieces = GRID1_SHAPE
    backends = [("ulysses", None), ("zigzag_ring", None), ("allgather_kv", None)]
    if not quick:
        backends += [("ring", None), ("colossal", None)] + ([("usp", 2)] if world >= 4 else [])
    return [(b, u, n, h, hkv, d, causal, pieces) for n in seq_lens for b, u in backends]


# grid 2: shapes never used in calibration or in grid 1 (H, H_kv, D, N up to 8192, causal and
# bidirectional, whole K/V blocks and pieces); (world, N, H, H_kv, D, causal, kv_pieces, backends)
GRID2 = [
    (2, 8192, 4, 2, 64, True, 1, [("ulysses", None), ("zigzag_ring", None), ("allgather_kv", None), ("ring", None)]),
    (2, 4096, 6, 6, 48, False, 1, [("ulysses", None), ("zigzag_ring", None), ("allgather_kv", None)]),
    (4, 4096, 4, 1, 128, True, 1, [("ulysses", None), ("zigzag_ring", None), ("allgather_kv", None), ("usp", 2),
                                   ("colossal", None)]),
    (4, 2048, 12, 4, 32, False, 1, [("ulysses", None), ("ring", None), ("zigzag_ring", None), ("allgather_kv", None)]),
    (8, 8192, 8, 2, 64, True, 4, [("ulysses", None), ("zigzag_ring", None), ("allgather_kv", None), ("usp", 2)]),
    (8, 3072, 16, 8, 32, False, 1, [("ulysses", None), ("zigzag_ring", None), ("ring", None), ("allgather_kv", None)]),
]


def grid2_cases(world: int) -> list[tuple]:
    return [(b, u, n, h, hkv, d, causal, pieces) for w, n, h, hkv, d, causal, pieces, bs in GRID2 if w == world
            for b, u in bs]


GRID_REPS = {"grid1": 15, "grid2": 5}
"""Timed repetitions per validation case (rotated rounds, median). Grid 1's rows are single 35-600 ms calls, and a
median of 5 moved by up to 25% between runs of the same code (zigzag_ring, P = 2, N = 1024: 44.6 vs 35.4 ms on
2026-11-24), more than the model's target error; grid 2's are 0.3-2.6 s calls, steadier at 5. Each row also
reports the spread of its reps (``measured_iqr_pct``)."""


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true", help="tiny run of every part (smoke test)")
    p.add_argument("--part", choices=PARTS + ("all",), default="all", help="which part (default: all, in order)")
    add_output_arguments(p, "cost_model")
    p.add_argument("--reps", type=int, default=None,
                   help=f"timed repetitions per case (median); default per grid: {GRID_REPS}, 2 with --quick")
    args = p.parse_args(argv)
    args.out = output_dir(args, "cost_model")
    return args


def grid_reps(args, grid: str) -> int:
    return args.reps or (2 if args.quick else GRID_REPS[grid])


def run_calibration(args, argv) -> dict:
    t0 = time.perf_counter()
    if args.quick:
        local = calibrate.calibrate_local(reps=2, sides=(32, 128), dims=(32,), causal_extra=(256,))
        local["colossal"] = calibrate.calibrate_colossal(reps=2, points=((256, 32), (512, 32), (512, 64)))
        links = calibrate.calibrate_links((2,), reps=2, sizes=(1 << 12, 1 << 18))
        busy = calibrate.measure_busy((2,), iters=10, reps=1)
        sharing = calibrate.measure_sharing((2,))
        stubbed = split.measure_stubbed_layers((2,), reps=2)
        sync = calibrate.measure_sync_delay((2,), rounds=3, blocks=1)
    else:
        local = calibrate.calibrate_local()
        local["colossal"] = calibrate.calibrate_colossal()
        links = calibrate.calibrate_links(WORLDS)
        busy = calibrate.measure_busy(WORLDS)
        sharing = calibrate.measure_sharing(WORLDS)
        stubbed = split.measure_stubbed_layers(WORLDS)
        sync = calibrate.measure_sync_delay(WORLDS)
    cores = len(os.sched_getaffinity(0))
    hw = calibrate.calibrated_profile(local, links, cores, sharing, busy)
    hw = calibrate.with_layer_latency(hw, stubbed, {int(w): v["barrier_s"] for w, v in links.items()})
    hw = calibrate.with_sync_delay(hw, sync)  # after the latency's fit: the stubbed layers compute nothing
    meta = run_metadata(__file__, argv, kind="measured", cores=cores, seconds=round(time.perf_counter() - t0, 1),
                        profile=hw.to_dict(), note="microbenchmarks of primitives, and each backend with its kernel stubbed "
                        "at a tiny shape (layer latency); no validation row was timed")
    write_results("cost_model_calibration", {**meta, "local": local, "links": links, "busy": busy, "sharing": sharing,
                                             "stubbed_layers": stubbed, "sync_delay": sync},
                  [], args.out)
    write_results("cost_model_cpu_profile", {**meta}, [{"block_tokens": b, "attention_fwd_bwd_flops": r}
                                                      for b, r in hw.attention_curve], args.out)
    print(f"calibrated in {time.perf_counter() - t0:.0f} s: kernel call {hw.kernel_call_s[0] * 1e6:.0f}/"
          f"{hw.kernel_call_s[1] * 1e6:.0f} us, merge {hw.merge_s[0] * 1e6:.0f} us + {hw.merge_s[1] * 1e9:.2f} ns/elem, "
          f"messages {[(w, round(t * 1e6)) for w, t in hw.message_s]} us, p2p {hw.intra_bandwidth / 1e9:.2f} GB/s, "
          f"layer latency {[(b, w, round(t * 1e3, 2)) for b, w, t in hw.layer_latency_s]} ms, "
          f"delay per synchronisation {[(w, round(t * 1e3, 2)) for w, t in hw.sync_delay_s]} ms", flush=True)
    return meta


def predict_rows(hw: HardwareProfile, barriers: dict[int, float], grid: str, measured: dict) -> list[dict]:
    """Measured beside predicted. The measured interval holds two barriers (``measure.time_backends_worker``):
    the prediction adds the calibrated barrier time twice (``model_barriers_ms``)."""
    rows = []
    for world, (cases, got) in measured.items():
        barrier = barriers.get(world) or barriers[min(barriers, key=lambda w: abs(w - world))]
        for (b, u, n, h, hkv, d, causal, pieces), reps in zip(cases, got):
            m = statistics.median(reps)
            q1, _, q3 = statistics.quantiles(reps, n=4) if len(reps) > 1 else (m, m, m)
            shape = AttentionShape(seq_len=n, num_heads=h, num_kv_heads=hkv, head_dim=d, dtype_bytes=4, causal=causal)
            pred = predict_attention(b, shape, world, hw, ulysses_degree=u, kv_pieces=pieces)
            total = pred.total_s + 2 * barrier
            rows.append({
                "grid": grid, "P": world, "N": n, "backend": pred.label, "heads": h, "kv_heads": hkv, "head_dim": d,
                "causal": causal, "kv_pieces": pieces,
                "measured_ms": round(m * 1e3, 3),
                "measured_iqr_pct": round(100 * (q3 - q1) / m, 1),
                "model_predicted_ms": round(total * 1e3, 3),
                "model_compute_ms": round(pred.compute_s * 1e3, 3),
                "model_exposed_comm_ms": round(pred.exposed_comm_s * 1e3, 3),
                "model_barriers_ms": round(2 * barrier * 1e3, 3),
                "model_error_pct": round(100 * (total - m) / m, 1),
            })
    return rows


def _summary(rows) -> dict:
    errors = [abs(r["model_error_pct"]) for r in rows]
    return {"mean_abs_error_pct": round(sum(errors) / len(errors), 1), "max_abs_error_pct": max(errors)}


def run_grid(args, argv, grid: str) -> list[dict]:
    hw, barriers = load_profile(args.out)
    t0 = time.perf_counter()
    # the machine's sharing at the grid's start (a primitive kernel loop on P ranks at once): recorded, not priced by
    sharing = calibrate.measure_sharing((2,) if args.quick else WORLDS)
    # and the delay a synchronisation meets now (as the sharing, the machine's state more than its hardware)
    sync = calibrate.measure_sync_delay((2,), rounds=3, blocks=1) if args.quick else calibrate.measure_sync_delay(WORLDS)
    hw = calibrate.with_sync_delay(hw, sync)
    print(f"{grid}: sharing stretch now {sharing}; delay per synchronisation now "
          f"{[(w, round(t * 1e3, 2)) for w, t in hw.sync_delay_s]} ms", flush=True)
    measured, probes = {}, {}
    probe_at_calibration = calibrate.calibration_shared_seconds(args.out)
    for world in ((2,) if args.quick else WORLDS):
        if args.quick:
            cases = grid1_cases(world, (512,), quick=True) if grid == "grid1" else [("zigzag_ring", None, 768, 6, 2, 48, False, 1)]
        else:
            cases = grid1_cases(world) if grid == "grid1" else grid2_cases(world)
        if not cases:
            continue
        t1 = time.perf_counter()
        times, probes[world] = measure.measure_world(world, cases, grid_reps(args, grid))
        measured[world] = (cases, times)
        print(f"{grid} P={world}: {len(cases)} cases measured in {time.perf_counter() - t1:.0f} s; probe "
              f"{statistics.median(probes[world]) * 1e3:.1f} ms per call (median of the rounds; "
              f"{probe_at_calibration[world] * 1e3:.1f} ms at calibration)", flush=True)
    # priced by: the stretch each world's rows met against the calibration's own table (the rounds' median probe
    # over what the kernel table prices the probe's call at alone; Note [The stretch against the table]). Recorded
    # beside it: the stretch at the grid's start (sharing_now) and during the rows over the grid's time alone,
    # judged paired twice and not kept (README, "The stretch during the rows"; ablation.py --study sharing)
    during = calibrate.stretch_during_rows(probes, sharing["alone_s"])
    against_table = calibrate.stretch_during_rows(probes, calibrate.probe_call_priced_s(hw))
    hw = replace(hw, compute_sharing=tuple(sorted(against_table.items())))
    rows = predict_rows(hw, barriers, grid, measured)
    meta = run_metadata(
        __file__, argv, kind="measured", calibration_profile=hw.to_dict(), seconds=round(time.perf_counter() - t0, 1),
        columns={"measured_ms": "measured here (median fwd+bwd between barriers, slowest rank)",
                 "measured_iqr_pct": "measured here: interquartile range of the reps, % of their median",
                 "model_*": "cost-model output from the calibrated profile (not measured)"},
        **_summary(rows), sharing_now=sharing, sharing_during_rows=during, sharing_against_table=against_table,
        sync_delay_now=sync,
        reps_per_case=grid_reps(args, grid),
        # measured, for reading a run (not used by the model): the machine's speed while each world's rows ran
        probe_s={str(w): {"rounds": p, "at_calibration": probe_at_calibration[w],
                          "slowdown": statistics.median(p) / probe_at_calibration[w]} for w, p in probes.items()},
        note="CPU gloo, shared cores: timings depend on what else runs (load in the README)",
    )
    write_results(f"cost_model_validation_{grid}", meta, rows, args.out)
    print(f"{grid}: {len(rows)} rows, mean |error| {meta['mean_abs_error_pct']}%, max {meta['max_abs_error_pct']}% "
          f"(stretch against the table {({w: round(x, 2) for w, x in against_table.items()})})", flush=True)
    combine_grids(args.out, argv)
    return rows


def combine_grids(out: Path, argv) -> None:
    """``cost_model_validation.{json,csv}``: the grids measured so far in ``out``, one table."""
    rows, metas = [], {}
    for grid in ("grid1", "grid2"):
        path = Path(out) / f"cost_model_validation_{grid}.json"
        if path.exists():
            data = json.loads(path.read_text())
            rows += data.pop("results")
            metas[grid] = {k: data[k] for k in ("date", "command", "mean_abs_error_pct", "max_abs_error_pct", "seconds")
                           if k in data}
    if not rows:
        return
    first = json.loads((Path(out) / f"cost_model_validation_{next(iter(metas))}.json").read_text())
    meta = {k: v for k, v in first.items() if k != "results"}
    meta.update(_summary(rows), grids=metas)
    write_results("cost_model_validation", meta, rows, out)


def write_predictions(argv, out) -> list[dict]:
    preds = papers.predict_all()
    write_results("cost_model_predictions", run_metadata(
        __file__, argv, kind="model",
        presets={name: hw_.source for name, hw_ in papers.presets_used().items()},
        note="model_prediction is cost-model output at the papers' scale (never measured); paper_value is the paper's"),
        preds, out)
    return preds


def main(argv=None) -> int:
    args = parse_args(argv)
    keep_freed_memory()  # primitives and measured layers on warm memory, whatever ran before (Note [Fresh pages])
    t0 = time.perf_counter()
    parts = PARTS if args.part == "all" else (args.part,)
    for part in parts:
        if part == "calibrate":
            run_calibration(args, argv)
        elif part == "papers":
            preds = write_predictions(argv, args.out)
            print(f"{len(preds)} paper predictions (model output)", flush=True)
        else:
            run_grid(args, argv, part)
    print(f"{', '.join(parts)}: {time.perf_counter() - t0:.0f} s -> {args.out}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
