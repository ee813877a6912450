"""The protein demo through the CLI under tensor x context parallelism (tp=2 x sp=2 on 4 gloo ranks,
Lightning's launcher in a subprocess), changing only the strategy's arguments: the loss equals a
one-process run step for step (float32, the demo's own config: packed documents, zigzag ring,
gradient clipping, a length of 250 that neither degree divides evenly into 2 x 2 x 2 chunks)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.distributed

ROOT = Path(__file__).resolve().parents[2]
STEPS = 5
EXTRA = ["--data.init_args.context_len", "250", "--data.init_args.val_samples", "0",
         "--model.init_args.d_model", "32", "--model.init_args.n_layers", "2",
         "--trainer.max_steps", str(STEPS), "--trainer.limit_val_batches", "0",
         "--trainer.enable_progress_bar", "false", "--trainer.enable_model_summary", "false"]


def _losses(log_dir: Path, strategy_args: list[str]) -> tuple[list[float], str]:
    args = [sys.executable, str(ROOT / "scripts" / "demo.py"), "--config", str(ROOT / "experiments/protein_demo/config.yaml"),
            "--", *EXTRA, *strategy_args, "--trainer.logger.init_args.save_dir", str(log_dir),
            "--trainer.logger.init_args.name", "run"]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}
    proc = subprocess.run(args, cwd=log_dir, env=env, capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-6000:]
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    (events,) = list((log_dir / "run").iterdir())
    acc = EventAccumulator(str(events))
    acc.Reload()
    return [e.value for e in sorted(acc.Scalars("Loss/train"), key=lambda e: e.step)], proc.stdout + proc.stderr


def test_protein_demo_tp2_sp2_matches_one_process(tmp_path):
    (tmp_path / "tp").mkdir()
    (tmp_path / "local").mkdir()
    tp, out = _losses(tmp_path / "tp", ["--trainer.strategy.init_args.sequence_parallel_size", "2",
                                         "--trainer.strategy.init_args.tensor_parallel_size", "2"])
    assert "tensor_parallel_size=2" in out and "world=4 dp=1 sp=2" in out
    local, _ = _losses(tmp_path / "local", ["--trainer.strategy", "auto", "--trainer.devices", "1"])
    assert len(tp) == len(local) == STEPS
    assert max(abs(a - b) for a, b in zip(tp, local)) < 2e-4, (tp, local)
    assert abs(local[0] - local[-1]) > 100 * 2e-4, local  # negative control: training moves the loss
