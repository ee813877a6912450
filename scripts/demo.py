"""``make demo``: train a real model on real data with sequence parallelism (4 gloo ranks on CPU).

    python scripts/demo.py                                              # protein encoder (default)
    python scripts/demo.py --config experiments/multimodal_demo/config.yaml
    python scripts/demo.py -- --trainer.max_steps 40                    # extra LightningCLI arguments

It is ``lightning-sp fit --config <config>``: Lightning launches the ranks (re-running this script
once per extra rank), the strategy shards every batch along the sequence, and rank zero prints the
loss trend and where the TensorBoard events are.
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

DEFAULT_CONFIG = ROOT / "experiments" / "protein_demo" / "config.yaml"


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config", default=str(DEFAULT_CONFIG), help="LightningCLI YAML (default: %(default)s)")
    args, extra = parser.parse_known_args(argv)
    if extra and extra[0] == "--":
        extra = extra[1:]
    config = Path(args.config)
    if not config.is_file():
        raise SystemExit(f"demo: config file not found: {config}")
    os.environ.setdefault("OMP_NUM_THREADS", "1")  # 4 ranks share the cores
    import torch

    torch.set_num_threads(1)
    import warnings

    from lightning_sp.cli import main as cli_main

    # sys.argv is kept as is: Lightning re-runs this script with it for the other ranks
    warnings.filterwarnings("ignore", message=".*LightningCLI's args parameter.*")

    if os.environ.get("LOCAL_RANK", "0") == "0":
        shown = os.path.relpath(config) if config.resolve().is_relative_to(Path.cwd().resolve()) else config
        print(f"demo: lightning-sp fit --config {shown} {' '.join(extra)}".rstrip(), flush=True)
    cli_main(["fit", "--config", str(config), *extra])


if __name__ == "__main__":
    main()
