#!/usr/bin/env python
"""What ``import lightning_sp`` costs on top of ``import torch``, in fresh interpreters.

    PYTHONPATH=. .venv/bin/python -m benchmarks.import_time.run --runs 9

Each run starts two fresh interpreters, in alternating order so load drifts hit both alike: one
``import torch``, one ``import torch; import lightning_sp``; each reports its own import wall time
(``time.perf_counter`` around the imports, so interpreter start-up is excluded) and CPU time
(``time.process_time``: on a loaded machine the wall time mostly measures the other processes). Prints
the medians, their differences, and which heavy packages the package import loaded (none of
``lightning``, ``transformers`` is the promise; ``tests/unit/test_import_layering.py`` asserts it).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import time

_PROBE = """
import sys, time, json
t0, c0 = time.perf_counter(), time.process_time()
import torch
{extra}
t1, c1 = time.perf_counter(), time.process_time()
heavy = sorted(m for m in ("lightning", "pytorch_lightning", "transformers", "torchmetrics", "torch._dynamo")
               if m in sys.modules)
print(json.dumps({{"wall_s": t1 - t0, "cpu_s": c1 - c0, "heavy": heavy}}))
"""


def _probe(extra: str) -> dict:
    out = subprocess.run([sys.executable, "-c", _PROBE.format(extra=extra)], check=True, capture_output=True,
                         text=True, env={**os.environ, "OMP_NUM_THREADS": "1"})
    return json.loads(out.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=9, help="pairs of fresh interpreters (median over them)")
    parser.add_argument("--module", default="lightning_sp", help="what to import after torch")
    args = parser.parse_args()
    runs: dict[str, list[dict]] = {"torch": [], "pkg": []}
    for i in range(args.runs):
        order = [("torch", ""), ("pkg", f"import {args.module}")]
        for which, extra in (order if i % 2 == 0 else order[::-1]):
            runs[which].append(_probe(extra))
    load = os.getloadavg()
    print(f"{time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}, {platform.node()}, {os.cpu_count()} cores, "
          f"load average {load[0]:.1f} {load[1]:.1f} {load[2]:.1f}, {args.runs} runs")
    for key, what in (("wall_s", "wall"), ("cpu_s", "CPU")):
        t = statistics.median(r[key] for r in runs["torch"])
        p = statistics.median(r[key] for r in runs["pkg"])
        print(f"{what:>4}: import torch {t:.2f} s, import torch + {args.module} {p:.2f} s (medians): "
              f"{args.module} adds {p - t:.2f} s")
    heavy = sorted({m for r in runs["pkg"] for m in r["heavy"]})
    print(f"heavy packages loaded by the import: {heavy or 'none'}")

if __name__ == "__main__":
    main()
