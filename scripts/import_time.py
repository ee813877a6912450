#!/usr/bin/env python
"""What ``import lightning_sp`` costs on top of ``import torch`` (issue 18), in fresh interpreters.

    PYTHONPATH=. .venv/bin/python scripts/import_time.py --runs 9

Each run starts two fresh interpreters, in alternating order so load drifts hit both alike: one
``import torch``, one ``import torch; import lightning_sp``; each reports its own import wall time
(``time.perf_counter`` around the imports, so interpreter start-up is excluded). Prints the medians,
their difference, and which heavy packages the package import loaded (none of ``lightning``,
``transformers`` is the promise; ``tests/unit/test_import_layering.py`` asserts it).
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
t0 = time.perf_counter()
import torch
t1 = time.perf_counter()
{extra}
t2 = time.perf_counter()
heavy = sorted(m for m in ("lightning", "pytorch_lightning", "transformers", "torchmetrics") if m in sys.modules)
print(json.dumps({{"torch_s": t1 - t0, "total_s": t2 - t0, "heavy": heavy}}))
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
    torch_alone, with_package, heavy = [], [], set()
    for i in range(args.runs):
        order = [("torch", ""), ("pkg", f"import {args.module}")]
        for which, extra in (order if i % 2 == 0 else order[::-1]):
            result = _probe(extra)
            if which == "torch":
                torch_alone.append(result["total_s"])
            else:
                with_package.append(result["total_s"])
                heavy.update(result["heavy"])
    t, p = statistics.median(torch_alone), statistics.median(with_package)
    load = os.getloadavg()
    print(f"{time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}, {platform.node()}, {os.cpu_count()} cores, "
          f"load average {load[0]:.1f} {load[1]:.1f} {load[2]:.1f}, {args.runs} runs")
    print(f"import torch alone:           median {t:.2f} s (min {min(torch_alone):.2f}, max {max(torch_alone):.2f})")
    print(f"import torch + {args.module}: median {p:.2f} s (min {min(with_package):.2f}, max {max(with_package):.2f})")
    print(f"{args.module} on top of torch: {p - t:.2f} s (difference of the medians)")
    print(f"heavy packages loaded by the import: {sorted(heavy) or 'none'}")


if __name__ == "__main__":
    main()
