"""Calibration of the score-modified kernel path and the sinks' per-row term for the cost model (Note [Cost model of
score modifiers] in ``lightning_sp/cost_model.py``), and a check of the result against measured layers it never saw.

    python -m experiments.cost_model.score_mods --part calibrate --out experiments/cost_model/results
    python -m experiments.cost_model.score_mods --part validate --out experiments/cost_model/results

- ``calibrate``: one call of ``ops.kernels.ScoreModKernel`` (what a call with score modifiers runs under every
  ``kernel=`` but ``"flex"``) over the plain kernel's (``make_kernel("auto")``: SDPA's CPU flash op, the kernel table's
  kernel) on the same call, forward and backward separately, for ``blockwise`` (the path with no modifier set:
  the pure-PyTorch tiles alone), ``softcap``, ``alibi`` and ``relative_bias`` (T5's buckets with a learned table, so
  the backward accumulates the table's gradient), FULL and CAUSAL squares of ``SIDES`` at ``DIMS``, fp32, one thread.
  Each kernel is timed rep by rep in turn with the plain one (``ROUNDS`` rounds), so a slow spell of the machine
  lands on both sides of a ratio. Sinks: ``absorb_sinks`` (forward) + ``sink_grad`` (backward) on ``[1, S, H, D]``
  at ``SINK_SIZES``: seconds at each output size ``E`` (per element it grows ~5x once the output leaves the caches).
- ``validate``: one ``SequenceParallelAttention`` layer (one rank, fp32) fwd+bwd, plain and with modifiers/sinks, at
  ``VALIDATION_CASES`` (shapes the calibration did not time), against ``predict_attention`` on the committed
  CPU profile (``results/new_machine``) with this calibration; printed and written with the errors.

Ratios, not times, are stored: the plain kernel's own time comes from the profile's kernel table, so the factor
carries to a profile calibrated on another day (the two kernels' speeds move together with the machine's load).
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import time
from dataclasses import replace
from pathlib import Path

import torch

SIDES = (128, 512, 2048)
DIMS = (32, 128)
HEADS = 2
ROUNDS = 3
MODIFIERS = ("blockwise", "softcap", "alibi", "relative_bias")
SINK_SIZES = ((256, 4, 32), (1024, 4, 64), (2048, 4, 64), (4096, 4, 64), (16384, 8, 64))
"""``(S, H, D)`` of the sinks' timing."""


def _mods(name: str, heads: int):
    from lightning_sp.masks import RelativePositionBias, ScoreMods

    if name == "blockwise":
        return ScoreMods()
    if name == "softcap":
        return ScoreMods(softcap=30.0)
    if name == "alibi":
        return ScoreMods(alibi_slopes=tuple(2.0 ** (-8 * (h + 1) / heads) for h in range(heads)))
    if name == "relative_bias":
        table = torch.randn(32, heads, requires_grad=True)  # learned: the backward accumulates its gradient
        return ScoreMods(relative_bias=RelativePositionBias(table, num_buckets=32, max_distance=128))
    raise ValueError(name)


def _time_call(kernel, kind, q, k, v, dout, reps: int) -> tuple[float, float]:
    from lightning_sp.ops.plan import MaskKind

    mk, scale = MaskKind(kind), q.size(-1) ** -0.5
    out, lse = kernel.forward(q, k, v, scale=scale, kind=mk, mask=None)
    fwd, bwd = [], []
    for _ in range(reps):
        t0 = time.perf_counter()
        kernel.forward(q, k, v, scale=scale, kind=mk, mask=None)
        t1 = time.perf_counter()
        kernel.backward(dout, q, k, v, out, lse, scale=scale, kind=mk, mask=None)
        fwd.append(t1 - t0)
        bwd.append(time.perf_counter() - t1)
    return statistics.median(fwd), statistics.median(bwd)


def calibrate(sides=SIDES, dims=DIMS, rounds: int = ROUNDS) -> dict:
    """``{"score_mod_factors": [(modifier, kind, D, side, fwd factor, bwd factor)], "times": ..., "sinks_s": ...}``."""
    from lightning_sp.ops.kernels import ScoreModKernel, make_kernel

    torch.set_num_threads(1)
    plain = make_kernel("auto")
    factors, times = [], []
    for d in dims:
        for side in sides:
            g = torch.Generator().manual_seed(side + d)
            q, k, v, dout = (torch.randn(1, side, HEADS, d, generator=g) for _ in range(4))
            for kind in ("full", "causal"):
                reps = 1 if side >= 2048 else 3 if side >= 512 else 10
                kernels = {"plain": plain, **{m: ScoreModKernel(_mods(m, HEADS), q_global=0, k_global=0, head_offset=0)
                                              for m in MODIFIERS}}
                got = {name: [] for name in kernels}
                for r in range(rounds):  # each modifier right after the plain kernel, the order rotated per round
                    names = list(MODIFIERS)
                    names = names[r % len(names):] + names[:r % len(names)]
                    for name in names:
                        got["plain"].append(_time_call(plain, kind, q, k, v, dout, reps))
                        got[name].append(_time_call(kernels[name], kind, q, k, v, dout, reps))
                med = {name: tuple(statistics.median(t[i] for t in ts) for i in (0, 1)) for name, ts in got.items()}
                for m in MODIFIERS:
                    factors.append([m, kind, d, side, med[m][0] / med["plain"][0], med[m][1] / med["plain"][1]])
                times.append({"kind": kind, "head_dim": d, "side": side, "heads": HEADS,
                              "median_fwd_bwd_s": {n: list(t) for n, t in med.items()}})
                print(f"D={d} side={side} {kind}: " + ", ".join(
                    f"{m} x{f[4]:.2f}/x{f[5]:.2f}" for m, f in zip(MODIFIERS, factors[-len(MODIFIERS):])), flush=True)
    return {"score_mod_factors": factors, "times": times, "sinks": calibrate_sinks()}


def calibrate_sinks(sizes=SINK_SIZES, reps: int = 20) -> dict:
    from experiments.common.timing import median_seconds
    from lightning_sp.ops.ring_attention import AttentionResult
    from lightning_sp.ops.ring_attention import absorb_sinks, sink_grad

    torch.set_num_threads(1)
    elems, secs = [], []
    for s, h, d in sizes:
        out, dout = torch.randn(1, s, h, d), torch.randn(1, s, h, d)
        lse, sinks = torch.randn(1, h, s), torch.randn(h, requires_grad=True)

        def both(out=out, lse=lse, dout=dout, sinks=sinks):
            res = absorb_sinks(AttentionResult(out, lse), sinks, 0)
            sink_grad(dout, res.out, res.lse, sinks, 0)

        elems.append(s * h * d)
        secs.append(median_seconds(both, reps))
    return {"sinks_s": [list(p) for p in zip(elems, secs)]}


def with_score_mods(hw, calibration: dict):
    """``hw`` with the measured score-modifier factors and sinks' term of ``calibration`` (``calibrate``'s output)."""
    return replace(hw, score_mod_factors=tuple((str(m), str(k), int(d), int(s), float(f), float(b))
                                               for m, k, d, s, f, b in calibration["score_mod_factors"]),
                   sinks_s=tuple((int(e), float(t)) for e, t in calibration["sinks"]["sinks_s"]))


# ------------------------------------------------------------------------------------------------ validation

VALIDATION_CASES = (
    # (N, H, H_kv, D, causal, modifiers, sinks)
    (1024, 4, 2, 64, True, ("softcap",), False),
    (1536, 2, 2, 96, False, ("relative_bias",), False),
    (768, 4, 4, 48, True, ("alibi", "softcap"), True),
)


def _mask(names, heads):
    from lightning_sp.masks import AttentionMask, RelativePositionBias

    kw = {}
    if "softcap" in names:
        kw["softcap"] = 30.0
    if "alibi" in names:
        kw["alibi_slopes"] = tuple(2.0 ** (-8 * (h + 1) / heads) for h in range(heads))
    if "relative_bias" in names:
        kw["relative_bias"] = RelativePositionBias(torch.randn(32, heads, requires_grad=True), num_buckets=32,
                                                   max_distance=128)
    return AttentionMask(**kw)


def validate(profile, reps: int = 5) -> list[dict]:
    """Measured fwd+bwd of one layer (one rank) at ``VALIDATION_CASES``, plain and modified, beside the predictions."""
    from lightning_sp import SequenceParallelAttention
    from lightning_sp.cost_model import AttentionShape, predict_attention

    torch.set_num_threads(1)
    rows = []
    for n, h, hkv, d, causal, names, with_sinks in VALIDATION_CASES:
        g = torch.Generator().manual_seed(n + d)
        q = torch.randn(1, n, h, d, generator=g).requires_grad_()
        k, v = (torch.randn(1, n, hkv, d, generator=g).requires_grad_() for _ in range(2))
        dout = torch.randn(1, n, h, d, generator=g)
        sinks = torch.randn(h, requires_grad=True) if with_sinks else None
        attn = SequenceParallelAttention(causal=causal)
        mask = _mask(names, h)

        def plain():
            attn(q, k, v).backward(dout)

        def modified():
            attn(q, k, v, mask=mask, sinks=sinks).backward(dout)

        plain(), modified()  # warm-up
        got = {"plain": [], "modified": []}
        for r in range(reps):
            for name, fn in ((("plain", plain), ("modified", modified)) if r % 2 == 0
                             else (("modified", modified), ("plain", plain))):
                t0 = time.perf_counter()
                fn()
                got[name].append(time.perf_counter() - t0)
        shape = AttentionShape(seq_len=n, num_heads=h, num_kv_heads=hkv, head_dim=d, dtype_bytes=4, causal=causal)
        pred_plain = predict_attention("ring", shape, 1, profile).total_s
        pred_mod = predict_attention("ring", shape, 1, profile, mask=mask, sinks=with_sinks).total_s
        meas_plain, meas_mod = statistics.median(got["plain"]), statistics.median(got["modified"])
        rows.append({"N": n, "H": h, "H_kv": hkv, "D": d, "causal": causal, "modifiers": list(names),
                     "sinks": with_sinks, "measured_plain_s": meas_plain, "measured_modified_s": meas_mod,
                     "model_plain_s": pred_plain, "model_modified_s": pred_mod,
                     "error_modified": pred_mod / meas_mod - 1, "error_plain": pred_plain / meas_plain - 1,
                     "measured_ratio": meas_mod / meas_plain, "model_ratio": pred_mod / pred_plain})
    return rows


def _meta(part: str) -> dict:
    commit = subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True).stdout.strip()
    return {"command": f"python -m experiments.cost_model.score_mods --part {part}", "git_commit": commit,
            "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "kind": "measured",
            "hardware": "CPU (this VM), fp32, one thread", "torch": torch.__version__}


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--part", choices=("calibrate", "validate"), required=True)
    p.add_argument("--out", default="experiments/cost_model/results")
    p.add_argument("--quick", action="store_true", help="smoke: one side, one D, one round")
    args = p.parse_args(argv)
    out = Path(args.out)
    if args.part == "calibrate":
        data = calibrate(sides=(128,), dims=(32,), rounds=1) if args.quick else calibrate()
        (out / "score_mods_calibration.json").write_text(json.dumps({**_meta("calibrate"), **data}, indent=1) + "\n")
        return
    from experiments.cost_model.calibrate import load_profile

    calibration = json.loads((out / "score_mods_calibration.json").read_text())
    profile = with_score_mods(load_profile(Path("experiments/cost_model/results/new_machine"))[0], calibration)
    rows = validate(profile)
    for r in rows:
        print(f"N={r['N']} H={r['H']}/{r['H_kv']} D={r['D']} causal={r['causal']} {'+'.join(r['modifiers'])}"
              f"{' +sinks' if r['sinks'] else ''}: measured {r['measured_modified_s'] * 1e3:.1f} ms, model "
              f"{r['model_modified_s'] * 1e3:.1f} ms ({100 * r['error_modified']:+.0f}%); plain measured "
              f"{r['measured_plain_s'] * 1e3:.1f} ms, model {r['model_plain_s'] * 1e3:.1f} ms "
              f"({100 * r['error_plain']:+.0f}%); ratio measured {r['measured_ratio']:.2f}, model {r['model_ratio']:.2f}")
    (out / "score_mods_validation.json").write_text(json.dumps({**_meta("validate"), "rows": rows}, indent=1) + "\n")


if __name__ == "__main__":
    main()
