"""The README's code runs as written: the standalone recipe on 2 and 4 gloo ranks for every backend
(exact against dense float64 attention, causal and bidirectional, N = 37), and the Quick start training
example as a script (Lightning launches its 4 CPU ranks)."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from tests.distributed.harness import run_on_ranks
from tests.reference import dense_attention
from tests.docs_text import documentation_text

pytestmark = pytest.mark.distributed
README = Path(__file__).resolve().parents[2] / "README.md"
BACKENDS = ["ulysses", "ring", "zigzag_ring", "allgather_kv", "usp", "colossal", "auto"]


def readme_block(marker: str) -> str:
    """The python code block that follows ``<!-- test: <marker> ...-->`` in the README or a docs page."""
    text = documentation_text()
    match = re.search(rf"<!-- test: {re.escape(marker)}[^>]*-->\s*```python\n(.*?)```", text, re.DOTALL)
    assert match, f"README has no block marked '{marker}'"
    return match.group(1)


def _run_recipe(rank, world, code):
    results = {}
    for backend in BACKENDS:
        for causal in (False, True):
            variant = code.replace('backend="zigzag_ring"', f'backend="{backend}"').replace(
                "causal=False", f"causal={causal}")
            scope: dict = {}
            exec(compile(variant, "README.md", "exec"), scope)  # noqa: S102 - the README's own code
            q, k, v, out, n = scope["q"], scope["k"], scope["v"], scope["out"], scope["N"]
            ref = dense_attention(q, k, v, causal=causal)
            control = dense_attention(q, k, v, causal=not causal)
            results[(backend, causal)] = (tuple(out.shape) == (1, n, 4, 8),
                                          float((out.double() - ref).abs().max()),
                                          float((out.double() - control).abs().max()))
    return results


@pytest.mark.parametrize("world", [2, 4])
def test_readme_standalone_recipe_runs_as_written_and_is_exact(world):
    code = readme_block("standalone recipe")
    assert 'backend="zigzag_ring"' in code and "causal=False" in code  # the variants below substitute these
    for rank, results in enumerate(run_on_ranks(_run_recipe, world, args=(code,), timeout_s=300)):
        for (backend, causal), (shape_ok, err, control) in results.items():
            assert shape_ok, (backend, causal)
            assert err < 2e-5, f"world={world} rank={rank} {backend} causal={causal}: {err}"  # fp32 inputs
            assert control > 1e-2, f"{backend} causal={causal}: negative control passed ({control})"


def test_readme_training_example_runs_as_written(tmp_path):
    script = tmp_path / "example.py"
    script.write_text(readme_block("training example"))
    env = {**os.environ, "OMP_NUM_THREADS": "1"}  # warnings on: the LeafSpec deprecation must not be printed
    proc = subprocess.run([sys.executable, str(script)], cwd=tmp_path, env=env, capture_output=True, text=True,
                          timeout=420)
    log = proc.stdout + proc.stderr
    assert proc.returncode == 0, log[-4000:]
    assert "SequenceParallelStrategy: world=4 dp=1 sp=4" in log
    assert "padded to 256 (+6)" in log  # 250 tokens over a zigzag split of 4 ranks: the banner says so
    assert "max_epochs=1` reached" in log, log[-2000:]
    # the loss is logged (4 steps: 8 samples, batch 2), and no rank prints dependency noise
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    (events,) = {p.parent for p in (tmp_path / "lightning_logs").rglob("events.out.tfevents.*")}
    acc = EventAccumulator(str(events))
    acc.Reload()
    assert len(acc.Scalars("Loss/train")) == 4, acc.Tags()["scalars"]
    noisy = [word for word in ("LeafSpec", "💡 Tip", "Epoch 0/-") if word in log]
    assert not noisy, f"{noisy} printed:\n{log[-4000:]}"


def test_readme_standalone_recipe_runs_as_written_under_torchrun(tmp_path):
    """The block as a user saves it, launched by torchrun (2 ranks): it initialises its own process group
    (env://) and its output equals dense float64 attention on every rank."""
    from tests.distributed.harness import free_port

    check = (
        "\nfrom tests.reference import dense_attention\n"
        "err = float((out.double() - dense_attention(q, k, v, causal=False)).abs().max())\n"
        "control = float((out.double() - dense_attention(q, k, v, causal=True)).abs().max())\n"
        "print(f'rank {dist.get_rank()} of {dist.get_world_size()}: err {err:.3e} control {control:.3e}', flush=True)\n"
        "dist.destroy_process_group()\n"
    )
    script = tmp_path / "recipe.py"
    script.write_text(readme_block("standalone recipe") + check)
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(README.parent), "PYTHONWARNINGS": "ignore"}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node=2", "--rdzv-backend=c10d",
           f"--rdzv-endpoint=127.0.0.1:{free_port()}", "--max-restarts=0", str(script)]
    proc = subprocess.run(cmd, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    # the two ranks' lines may interleave without a newline between them: numbers, not \S+
    found = re.findall(r"rank (\d) of 2: err ([-+.\de]+) control ([-+.\de]+)", proc.stdout)
    assert sorted(r for r, _, _ in found) == ["0", "1"], proc.stdout
    for _, err, control in found:
        assert float(err) < 2e-5 and float(control) > 1e-2, proc.stdout
