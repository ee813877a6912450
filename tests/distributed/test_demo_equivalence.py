"""The demo path end to end: the same config trained with and without sequence parallelism gives the
same loss step for step (4 gloo ranks via Lightning's launcher in a subprocess vs one process)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
from tests.docs_text import documentation_text

pytestmark = pytest.mark.distributed

ROOT = Path(__file__).resolve().parents[2]
DEMO = ROOT / "scripts" / "demo.py"
README = ROOT / "README.md"
STEPS = 5

CASES = {
    # bidirectional encoder, packed documents (cu_seqlens), zigzag ring
    "protein": (ROOT / "experiments/protein_demo/config.yaml", [
        "--data.init_args.context_len", "250",  # not divisible by 2 * 4: exercises the strategy's padding
        "--data.init_args.val_samples", "0",
        "--model.init_args.d_model", "32", "--model.init_args.n_layers", "2",
    ]),
    # causal decoder over image patches + text, each image one bidirectional span (the config's default), plain ring
    "multimodal": (ROOT / "experiments/multimodal_demo/config.yaml", [
        "--data.init_args.n_images", "3", "--data.init_args.batch_size", "2", "--data.init_args.val_samples", "0",
        "--model.init_args.d_model", "32", "--model.init_args.n_layers", "2",
        "--trainer.strategy.init_args.backend", "ring",
    ]),
}


def _train_losses(config: Path, extra: list[str], log_dir: Path, *, parallel: bool) -> list[float]:
    args = [sys.executable, str(DEMO), "--config", str(config), "--", *extra,
            "--trainer.max_steps", str(STEPS), "--trainer.limit_val_batches", "0", "--trainer.enable_progress_bar", "false",
            "--trainer.logger.init_args.save_dir", str(log_dir), "--trainer.logger.init_args.name", "run"]
    if not parallel:
        args += ["--trainer.strategy", "auto", "--trainer.devices", "1"]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}
    proc = subprocess.run(args, cwd=log_dir, env=env, capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-6000:]
    log = proc.stdout + proc.stderr
    if parallel:
        assert "SequenceParallelStrategy: world=4 dp=1 sp=4" in log
        if "--trainer.strategy.init_args.backend" not in extra:  # the README quotes the demo's banner
            banner = next(line for line in documentation_text().splitlines() if line.startswith("SequenceParallelStrategy: world="))
            assert banner in log.splitlines(), (banner, log[-3000:])
    # no rank prints Lightning's LeafSpec deprecation or product tips, no FLOPs-less summary
    noisy = [word for word in ("LeafSpec", "💡 Tip", "Total FLOPs") if word in log]
    assert not noisy, f"{noisy} printed:\n{log[-4000:]}"
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    (events_dir,) = list((log_dir / "run").iterdir())
    acc = EventAccumulator(str(events_dir))
    acc.Reload()
    return [e.value for e in sorted(acc.Scalars("Loss/train"), key=lambda e: e.step)]


@pytest.mark.parametrize("case", sorted(CASES))
def test_loss_matches_step_for_step(case, tmp_path):
    config, extra = CASES[case]
    (tmp_path / "sp").mkdir()
    (tmp_path / "local").mkdir()
    sp = _train_losses(config, extra, tmp_path / "sp", parallel=True)
    local = _train_losses(config, extra, tmp_path / "local", parallel=False)
    assert len(sp) == len(local) == STEPS
    diffs = [abs(a - b) for a, b in zip(sp, local)]
    assert max(diffs) < 2e-4, f"sp={sp} local={local}"
    # negative control: training moves the loss far more than the tolerance, so a match is not vacuous
    assert abs(local[0] - local[-1]) > 100 * 2e-4, local
