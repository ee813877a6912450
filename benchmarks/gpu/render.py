"""Tables of the GPU results for the docs' generated blocks (``python -m experiments.common.generated``).

The ready check's files (``kernels.json``, ``ranks.json``, ``perf.json``: rows written by the independent check in
``shared/gpu``) and ``benchmarks.gpu.run``'s results (``{"meta", "results": {section: rows}}``) are read as they were
written; every table names its device, torch build and date from the file itself.
"""

from __future__ import annotations

import json
from collections import defaultdict
from pathlib import Path

ERRS = ("err_out", "err_dq", "err_dk", "err_dv")


def _f(v) -> float:
    return float(v)


def _worst(row: dict) -> float:
    return max(_f(row[k]) for k in ERRS if k in row)


def _source(meta: dict, path: Path) -> str:
    device = meta.get("device_name") or meta.get("device") or "?"
    env = Path(path).parent / "env.json"  # the ready check names the device once, in env.json beside its files
    if device in ("cuda", "one GPU") and env.exists():
        device = ("one " if device == "one GPU" else "") + json.loads(env.read_text()).get("device", device)
    return f"`{path}`: {device}, torch {meta.get('torch', '?')}, {str(meta.get('date_utc', '?'))[:16]} UTC."


def kernels(data: dict, path: Path) -> str:
    """Each kernel path against dense float64 on the GPU: cases passed, the worst relative error of out/dQ/dK/dV
    (relative to the reference's largest magnitude), and which ops ran."""
    cases = defaultdict(lambda: {"pass": 0, "all": 0, "worst": 0.0, "ops": set()})
    for row in data["rows"]:
        if row.get("section") not in ("block", "splitK", "module"):
            continue
        c = cases[(row["kernel"], row["dtype"])]
        c["all"] += 1
        c["pass"] += row.get("status") == "pass"
        if row.get("status") == "pass":
            c["worst"] = max(c["worst"], _worst(row))
        if row.get("op"):
            c["ops"].add(row["op"])
    tol = data["meta"].get("tolerance_rel_to_max_ref", {})
    lines = ["| kernel | dtype | cases passed | worst rel. error | tolerance | ops that ran |", "|---|---|---|---|---|---|"]
    for (kernel, dtype), c in sorted(cases.items()):
        lines.append(f"| {kernel} | {dtype} | {c['pass']} / {c['all']} | {c['worst']:.1e} | {tol.get(dtype, '?')} | "
                     f"{', '.join(sorted(c['ops'])) or '-'} |")
    skipped = [r["case"] for r in data["rows"] if r.get("section") == "info"]
    return "\n".join(lines + ["", _source(data["meta"], path) + (f" Not run: {'; '.join(skipped)}." if skipped else "")])


def ranks(data: dict, path: Path) -> str:
    """Every backend with P ranks sharing the one GPU (gloo groups, CUDA tensors staged through host memory)."""
    cases = defaultdict(lambda: {"pass": 0, "all": 0, "worst": 0.0})
    for row in data["rows"]:
        c = cases[(int(row["world"]), row["case"].split()[0])]
        c["all"] += 1
        c["pass"] += row.get("status") == "pass"
        if row.get("status") == "pass":
            c["worst"] = max(c["worst"], _worst(row))
    lines = ["| P | backend | cases passed | worst rel. error |", "|---|---|---|---|"]
    lines += [f"| {p} | {b} | {c['pass']} / {c['all']} | {c['worst']:.1e} |" for (p, b), c in sorted(cases.items())]
    return "\n".join(lines + ["", _source({**data["meta"], "device": "one GPU"}, path)])


def kernel_tflops(data: dict, path: Path) -> str:
    """Local attention fwd+bwd TFLOP/s per kernel and mask (bf16, 32 query / 8 K/V heads of 128). Reads the ready
    check's rows (``{"rows": [{"section": "bench:kernels", ...}]}``) and ``benchmarks.gpu.run``'s results alike."""
    rows = data["rows"] if "rows" in data else [{"section": "bench:kernels", "status": "ok", **r}
                                                for r in data["results"].get("kernels", []) if "error" not in r]
    by = defaultdict(dict)
    for row in rows:
        if row.get("section") == "bench:kernels" and row.get("status") == "ok":
            mask = "causal" if row.get("causal", True) in (True, "True") else "full"
            by[(mask, row["kernel"])][int(row["seq_len"])] = _f(row["tflops"])
    lens = sorted({n for v in by.values() for n in v})
    lines = ["| mask | kernel | " + " | ".join(f"N = {n // 1024}K" for n in lens) + " |", "|---" * (len(lens) + 2) + "|"]
    lines += [f"| {m} | {k} | " + " | ".join(f"{v[n]:.0f}" if n in v else "-" for n in lens) + " |"
              for (m, k), v in sorted(by.items())]
    return "\n".join(lines + ["", _source(data["meta"], path)])


def schedule(data: dict, path: Path) -> str:
    """One rank's fwd+bwd against one FULL-mask kernel call doing the same visible pairs (other ranks simulated)."""
    lines = ["| backend | P | mask | K/V pieces | rank (s) | one call (s) | efficiency |", "|---|---|---|---|---|---|---|"]
    for row in data["rows"]:
        if row.get("section") == "bench:schedule" and row.get("status") == "ok":
            mask = "causal" if row["causal"] in (True, "True") else "bidirectional"
            lines.append(f"| {row['backend']} | {row['world']} | {mask} | {row['kv_pieces']} | {_f(row['rank_s']):.3f} | "
                         f"{_f(row['one_call_s']):.3f} | {_f(row['efficiency']):.2f} |")
    return "\n".join(lines + ["", _source(data["meta"], path) + " 16K tokens per rank, bf16, 32 / 8 heads of 128; "
                              "the other ranks are a fake process group (no data moves)."])


def longest_and_mfu(data: dict, path: Path) -> str:
    """ESM-2-650M-shaped encoder (33 layers, d_model 1280, 20 heads), bf16 parameters and AdamW state, full
    activation checkpointing, tiled MLP, one GPU: peak allocated memory of a step, and MFU under a Trainer."""
    mfu = {r["seq_len"]: r for r in data["results"].get("mfu", [])}
    lines = ["| N | peak allocated, bare step (GiB) | step under the Trainer (s) | model TFLOP/s | MFU | "
             "peak under the Trainer (GiB) |", "|---|---|---|---|---|---|"]
    for r in data["results"].get("longest", []):
        m = mfu.get(r["seq_len"], {})
        step = f"{m['step_s']:.2f}" if m else "-"
        lines.append(f"| {r['seq_len'] // 1024}K | {r['peak_gib']:.2f} | {step} | "
                     f"{m['tflops']:.0f} | {m['mfu']:.2f} | {m['peak_memory_gib']:.2f} |" if m else
                     f"| {r['seq_len'] // 1024}K | {r['peak_gib']:.2f} | - | - | - | - |")
    peak = next(iter(mfu.values()), {}).get("measured_peak_tflops")
    note = f" MFU is against the dense bf16 matmul rate measured in the same run ({peak:.0f} TFLOP/s)." if peak else ""
    return "\n".join(lines + ["", _source(data["meta"], path) + note + f" Command: `{data['meta'].get('command', '?')}`."])
