"""Write README.md's table of Hugging Face model families that are exact or refused under sequence parallelism.

    python scripts/hf_support_table.py            # run the sweep (2 gloo ranks, CPU), print the table
    python scripts/hf_support_table.py --write    # ... and replace the README block
    python scripts/hf_support_table.py --check    # ... exit 1 if the README block differs

The sweep is ``tests.hf_tiny.SWEEP`` (causal and masked LMs) and ``tests.hf_tiny.ENCODER_SWEEP`` (T5-family encoders),
the same one ``tests/distributed/test_hf_registry_sweep.py`` runs, which also fails when the README's table differs
from what it measures.
"""

from __future__ import annotations

import argparse
import os
import re
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--write", action="store_true", help="replace the table in README.md")
    parser.add_argument("--check", action="store_true", help="exit 1 if README.md's table differs")
    args = parser.parse_args()
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    try:
        import tests.hf_tiny  # noqa: F401  (the sweep lives with the tests)
    except ModuleNotFoundError:  # run by path from anywhere: start again with the repository importable
        env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))}
        os.execve(sys.executable, [sys.executable, str(Path(__file__).resolve()), *sys.argv[1:]], env)
    from tests.distributed.harness import run_on_ranks
    from tests.hf_tiny import TABLE_BEGIN, TABLE_END, support_table, sweep_worker

    table = support_table(run_on_ranks(sweep_worker, 2, timeout_s=900)[0])
    print(table)
    readme = ROOT / "docs" / "guides" / "huggingface.md"
    text = readme.read_text()
    pattern = re.compile(re.escape(TABLE_BEGIN) + r"\n.*?\n" + re.escape(TABLE_END), re.S)
    block = f"{TABLE_BEGIN}\n{table}\n{TABLE_END}"
    if args.check:
        if block not in text:
            print("README.md's table differs from the sweep: run with --write", file=sys.stderr)
            return 1
    if args.write:
        if not pattern.search(text):
            print(f"README.md has no {TABLE_BEGIN!r} ... {TABLE_END!r} block to replace", file=sys.stderr)
            return 1
        readme.write_text(pattern.sub(lambda _: block, text))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
