#!/usr/bin/env python
"""The cost model (``lightning_sp/cost_model.py``): calibrate on this CPU, validate against measured
gloo step times, predict the papers' setups (issue 10, item 5).

    .venv/bin/python scripts/cost_model_experiment.py            # P = 2, 4, 8; N = 1024, 2048
    .venv/bin/python scripts/cost_model_experiment.py --quick    # P = 2, N = 512, three backends (smoke test)
    .venv/bin/python scripts/plot_cost_model.py                  # the figure, from the result file

(a) Calibrate: attention fwd+bwd FLOP/s of the local kernel vs block size, a matmul rate, gloo
    latency/bandwidth from a ping-pong between ranks 0 and 1 at the smallest P, in the same spawn as
    that P's timings (``experiments/cost_model/measure.py``). The profile is written to
    ``<out>/cost_model_cpu_profile.{json,csv}`` (measured).
(b) Validate: one attention layer fwd+bwd per backend on P gloo ranks, measured (median between
    barriers), beside the model's prediction from the calibrated profile; error % per row.
    -> ``<out>/cost_model_validation.{json,csv}``: ``measured_ms`` (this machine) and
    ``model_predicted_ms`` (cost model) are separate columns.
(c) Predict the papers' setups with the GPU presets (datasheet + cited assumptions) beside the
    papers' numbers (``experiments/cost_model/papers.py``) -> ``<out>/cost_model_predictions.{json,csv}``
    (``kind: model``).
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from experiments.common import add_output_arguments, output_dir, run_metadata, write_results  # noqa: E402
from experiments.cost_model import measure, papers  # noqa: E402
from lightning_sp.cost_model import AttentionShape, HardwareProfile, predict_attention  # noqa: E402

HEADS, KV_HEADS, HEAD_DIM = 8, 4, 32


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true", help="tiny run for the smoke test (P=2, N=512)")
    add_output_arguments(p, "cost_model")
    p.add_argument("--worlds", type=int, nargs="+", default=None, help="gloo world sizes to validate at")
    p.add_argument("--seq-lens", type=int, nargs="+", default=None, help="global sequence lengths")
    p.add_argument("--reps", type=int, default=None, help="timed repetitions per case (median)")
    p.add_argument("--predict-only", action="store_true", help="only (c): the papers' setups (no measurement)")
    args = p.parse_args(argv)
    args.out = output_dir(args, "cost_model")
    args.worlds = args.worlds or ([2] if args.quick else [2, 4, 8])
    args.seq_lens = args.seq_lens or ([512] if args.quick else [1024, 2048])
    args.reps = args.reps or (2 if args.quick else 5)
    for w in args.worlds:
        if w < 2 or HEADS % w and w != 8:
            raise ValueError(f"--worlds: each must be >= 2 and divide {HEADS} heads (or be 8), got {w}")
    for n in args.seq_lens:
        if n % (2 * max(args.worlds)):
            raise ValueError(f"--seq-lens: each must be a multiple of 2 x the largest world ({2 * max(args.worlds)}), got {n}")
    return args


def backend_cases(world: int, seq_lens, quick: bool) -> list[tuple]:
    """``(backend, ulysses_degree, N, H, H_kv, D, causal)`` timed at ``world``."""
    backends = [("ulysses", None), ("zigzag_ring", None), ("allgather_kv", None)]
    if not quick:
        backends += [("ring", None), ("colossal", None)] + ([("usp", 2)] if world >= 4 else [])
    if HEADS % world:
        backends = [b for b in backends if b[0] != "ulysses"]
    return [(b, u, n, HEADS, KV_HEADS, HEAD_DIM, True) for n in seq_lens for b, u in backends]


def calibrated_profile(compute: dict, links: dict) -> HardwareProfile:
    cores = len(os.sched_getaffinity(0))
    return HardwareProfile(
        name="cpu-calibrated",
        source=f"measured here: {cores} cores, SDPA CPU kernel fp32, gloo loopback ping-pong",
        attention_curve=tuple(compute["attention_curve"]), matmul_flops=compute["matmul_flops"],
        intra_bandwidth=links["bandwidth"], intra_latency=links["latency"],
        inter_bandwidth=links["bandwidth"], inter_latency=links["latency"],
        ranks_per_node=64, compute_slots=cores,
    )


def run(args) -> tuple[HardwareProfile, dict, list[dict]]:
    """(a) calibrate, (b) measure every world and predict each case from the calibrated profile."""
    blocks = (64, 128, 256) if args.quick else (32, 64, 128, 256, 512, 1024, 2048)
    compute = measure.calibrate_compute(blocks, heads=HEADS, head_dim=HEAD_DIM, reps=2 if args.quick else 5)
    sizes = (1 << 12, 1 << 20) if args.quick else tuple(1 << k for k in range(10, 23, 2))
    measured = {}
    for world in args.worlds:
        t0 = time.perf_counter()
        cases = backend_cases(world, args.seq_lens, args.quick)
        measured[world] = (cases, measure.measure_world(world, sizes, 3 if args.quick else 10, cases, args.reps))
        print(f"P={world}: {len(cases)} cases measured in {time.perf_counter() - t0:.0f} s", flush=True)
    links = measure.fit_links(measured[min(args.worlds)][1]["links"])  # the ping-pong at the smallest world
    hw = calibrated_profile(compute, links)
    rows = []
    for world, (cases, got) in measured.items():
        for (b, u, n, h, hkv, d, causal), m in zip(cases, got["times"]):
            shape = AttentionShape(seq_len=n, num_heads=h, num_kv_heads=hkv, head_dim=d, dtype_bytes=4, causal=causal)
            pred = predict_attention(b, shape, world, hw, ulysses_degree=u)
            rows.append({
                "P": world, "N": n, "backend": pred.label, "heads": h, "kv_heads": hkv, "head_dim": d, "causal": causal,
                "measured_ms": round(m * 1e3, 3),
                "model_predicted_ms": round(pred.total_s * 1e3, 3),
                "model_compute_ms": round(pred.compute_s * 1e3, 3),
                "model_exposed_comm_ms": round(pred.exposed_comm_s * 1e3, 3),
                "model_error_pct": round(100 * (pred.total_s - m) / m, 1),
            })
    calibration = {"compute": compute, "links": links,
                   "all_to_all": {w: got["links"] for w, (_, got) in measured.items()}}
    return hw, calibration, rows


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
    t0 = time.perf_counter()
    if args.predict_only:
        write_predictions(argv, args.out)
        return 0
    hw, calibration, rows = run(args)
    meta = run_metadata(__file__, argv, kind="measured", calibration_profile=hw.to_dict(), calibration=calibration)
    write_results("cost_model_cpu_profile", meta, [{"block_tokens": b, "attention_fwd_bwd_flops": r}
                                                   for b, r in hw.attention_curve], args.out)
    print(f"calibrated: {[(b, f'{r / 1e9:.2f} GFLOP/s') for b, r in hw.attention_curve]}, latency "
          f"{hw.intra_latency * 1e6:.0f} us, bandwidth {hw.intra_bandwidth / 1e9:.2f} GB/s", flush=True)
    errors = [abs(r["model_error_pct"]) for r in rows]
    meta = run_metadata(
        __file__, argv, kind="measured", calibration_profile=hw.to_dict(),
        columns={"measured_ms": "measured here (median fwd+bwd between barriers, slowest rank)",
                 "model_*": "cost-model output from the calibrated profile (not measured)"},
        mean_abs_error_pct=round(sum(errors) / len(errors), 1), max_abs_error_pct=max(errors),
        note="2 shared CPU cores, other jobs running: timings are noisy",
    )
    write_results("cost_model_validation", meta, rows, args.out)
    preds = write_predictions(argv, args.out)
    print(f"validation: {len(rows)} rows, mean |error| {meta['mean_abs_error_pct']}%, max {meta['max_abs_error_pct']}%; "
          f"{len(preds)} paper predictions; {time.perf_counter() - t0:.0f} s -> {args.out}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
