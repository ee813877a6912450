"""One house: the import layering holds and fails on a planted violation; ``import lightning_sp``
for standalone use loads neither Lightning nor transformers; the Lightning-facing names and the strategy
registry names still work, whichever of Lightning and lightning_sp is imported first.

Costs (2 cores): two ``lint-imports`` runs (~1 s each unloaded) and two fresh interpreters that import
torch and Lightning (~5 s each unloaded).
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from lightning_sp import cost_model, flops

REPO = Path(__file__).resolve().parents[2]
CONTRACTS = 6  # [[tool.importlinter.contracts]] in pyproject.toml


def _lint_imports(root: Path) -> subprocess.CompletedProcess:
    exe = Path(sys.executable).with_name("lint-imports")
    if not exe.exists():
        pytest.fail(f"{exe} is missing: install the dev extra (pip install -e '.[dev]'), which has import-linter")
    env = {**os.environ, "PYTHONPATH": str(root)}
    return subprocess.run([str(exe), "--no-cache"], cwd=root, env=env, capture_output=True, text=True, timeout=120)


def _python(code: str, tmp_path: Path) -> str:
    env = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1"}
    out = subprocess.run([sys.executable, "-c", textwrap.dedent(code)], cwd=tmp_path, env=env, capture_output=True,
                         text=True, timeout=280)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    return out.stdout


def test_layering_contracts_hold_and_each_breaks_on_a_planted_violation(tmp_path):
    clean = _lint_imports(REPO)
    assert clean.returncode == 0, clean.stdout[-4000:]
    assert f"Contracts: {CONTRACTS} kept, 0 broken." in clean.stdout

    # negative control: a copy of the package with one violation per contract
    shutil.copytree(REPO / "lightning_sp", tmp_path / "lightning_sp", ignore=shutil.ignore_patterns("__pycache__"))
    shutil.copy(REPO / "pyproject.toml", tmp_path / "pyproject.toml")
    plants = {
        # the cycle once removed: attention -> cost_model -> callbacks -> strategy -> attention
        "cost_model.py": "\n\ndef _planted():\n    from lightning_sp.callbacks import SequenceParallelMonitor\n",
        "ops/merge.py": "\nimport lightning  # planted: Lightning below the strategy\n",
        "layout.py": "\nfrom lightning_sp.data import packing  # planted: the library imports data/\n",
        "data/packing.py": "\nfrom lightning_sp import topology  # planted: data/ imports the library\n",
        "__init__.py": "\nfrom lightning_sp.strategy import SequenceParallelStrategy  # planted: an eager heavy import\n",
    }
    for name, line in plants.items():
        with open(tmp_path / "lightning_sp" / name, "a") as f:
            f.write(line)
    planted = _lint_imports(tmp_path)
    assert planted.returncode != 0
    assert f"Contracts: 0 kept, {CONTRACTS} broken." in planted.stdout, planted.stdout[-4000:]


def test_package_import_and_standalone_use_leave_lightning_and_transformers_out(tmp_path):
    out = _python(f"""
        import sys, torch, torch.distributed as dist
        HEAVY = ("lightning", "pytorch_lightning", "transformers", "torch._dynamo", "torchmetrics")
        import lightning_sp
        from lightning_sp import (SequenceParallelAttention, gather_sequence, sequence_parallel_cross_entropy,
                                  shard_sequence)
        assert not [m for m in HEAVY if m in sys.modules], [m for m in HEAVY if m in sys.modules]

        # standalone use on a real (one-rank gloo) group: shard, ring attention, gather, loss, backward
        dist.init_process_group("gloo", init_method="file://{tmp_path}/store", rank=0, world_size=1)
        g = dist.group.WORLD
        torch.manual_seed(0)
        q, k, v = (torch.randn(1, 7, 2, 4, dtype=torch.float64, requires_grad=True) for _ in range(3))
        attn = SequenceParallelAttention(causal=True, backend="ring", group=g)
        out = attn(*(shard_sequence(t, g, layout=attn.layout) for t in (q, k, v)))
        out = gather_sequence(out, g, layout=attn.layout)
        ref = torch.nn.functional.scaled_dot_product_attention(*(t.transpose(1, 2) for t in (q, k, v)),
                                                               is_causal=True).transpose(1, 2)
        assert (out - ref).abs().max() < 1e-12
        logits = out.reshape(1, 7, 8)
        loss = sequence_parallel_cross_entropy(logits, torch.arange(7).view(1, 7), group=g)
        loss.backward()
        assert q.grad is not None
        print("still light:", [m for m in HEAVY[:3] if m in sys.modules])

        # negative control: the check sees Lightning once a Lightning-facing name is used
        from lightning_sp import SequenceParallelStrategy
        assert "lightning" in sys.modules
        print("registered:", sorted(n for n in ("sequence_parallel", "sequence_parallel_spawn")
                                    if n in __import__("lightning.pytorch.strategies").pytorch.strategies.StrategyRegistry))
        dist.destroy_process_group()
    """, tmp_path)
    assert "still light: []" in out, out
    assert "registered: ['sequence_parallel', 'sequence_parallel_spawn']" in out, out


@pytest.mark.parametrize("lightning_first", [True, False], ids=["lightning-first", "lightning_sp-first"])
def test_lazy_names_and_registry_names_work_in_either_import_order(tmp_path, lightning_first):
    first, second = ("lightning", "lightning_sp") if lightning_first else ("lightning_sp", "lightning")
    out = _python(f"""
        import {first}, {second}
        import lightning as L
        import lightning_sp
        from lightning.pytorch.strategies import StrategyRegistry

        # a user's own entry under one of our names is never replaced
        StrategyRegistry.register("sequence_parallel_spawn", lambda **kw: "mine", description="user", override=True)
        import lightning_sp._registry as r
        r.register(StrategyRegistry)
        assert StrategyRegistry.get("sequence_parallel_spawn") == "mine"
        StrategyRegistry.remove("sequence_parallel_spawn")
        r.register(StrategyRegistry)

        t = L.Trainer(strategy="sequence_parallel", accelerator="cpu", devices=2, logger=False,
                      enable_checkpointing=False, enable_progress_bar=False)
        from lightning_sp import SequenceParallelStrategy, SequenceParallelMonitor, TokenAccuracy
        from lightning_sp.strategy import SequenceParallelStrategy as direct
        assert SequenceParallelStrategy is direct and type(t.strategy) is direct
        spawn = L.Trainer(strategy="sequence_parallel_spawn", accelerator="cpu", devices=2, logger=False,
                          enable_checkpointing=False, enable_progress_bar=False).strategy
        assert type(spawn) is direct and spawn._start_method == "spawn", spawn

        assert set(lightning_sp.__all__) <= set(dir(lightning_sp))
        namespace = {{}}
        exec("from lightning_sp import *", namespace)
        assert set(lightning_sp.__all__) <= set(namespace)
        try:
            lightning_sp.NoSuchName
        except AttributeError as err:
            assert "NoSuchName" in str(err)
        else:
            raise AssertionError("lightning_sp.NoSuchName did not raise")
        print("ok")
    """, tmp_path)
    assert out.strip().endswith("ok"), out


def test_flops_formulas_by_hand_and_shared_by_the_monitor_and_the_cost_model():
    from lightning_sp import callbacks

    assert callbacks.megatron_flops_per_iteration is flops.megatron_flops_per_iteration
    b, s, n_layers, h, vocab = 2, 64, 3, 32, 96
    full = 72 * b * n_layers * s * h**2 * (1 + s / (6 * h) + vocab / (12 * h * n_layers))
    assert flops.megatron_flops_per_iteration(batch=b, seq_len=s, num_layers=n_layers, hidden=h,
                                              vocab=vocab) == pytest.approx(full, rel=1e-15)
    saved = 72 * b * n_layers * s * h**2 * s / (12 * h)
    assert flops.causal_attention_flops_saved(batch=b, seq_len=s, num_layers=n_layers, hidden=h) == pytest.approx(saved)
    from experiments.cost_model import papers  # the step-level model the papers' predictions use

    shape = papers.ModelShape(num_layers=n_layers, hidden=h, num_heads=4, vocab=vocab)
    assert papers.model_flops(shape, s, b, causal=False) == pytest.approx(full, rel=1e-15)
    assert papers.model_flops(shape, s, b) == pytest.approx(full - saved, rel=1e-15)
    assert papers.model_flops(shape, s, b) != pytest.approx(full)  # negative control: causal counts less
