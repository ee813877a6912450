"""``lightning-sp`` as a shell, CI or SLURM job sees it: through the real console script, its exit status is 0
after a run that finished and non-zero after one that failed; ``--help`` names the example configs and answers
without importing Lightning."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from lightning_sp.cli import SUBCOMMANDS, example_configs, usage

ROOT = Path(__file__).resolve().parents[2]
CONSOLE_SCRIPT = Path(sys.executable).parent / "lightning-sp"
# one process, two steps of a tiny decoder on the digit data: a whole `fit` in a few seconds
TINY = """\
seed_everything: 0
trainer:
  accelerator: cpu
  devices: 1
  max_steps: 2
  max_epochs: 1
  limit_val_batches: 0
  enable_checkpointing: false
  enable_progress_bar: false
  logger: false
model:
  class_path: lightning_sp.models.MultimodalDecoder
  init_args: {d_model: 16, n_layers: 1, n_heads: 2, lr: 0.001, warmup_steps: 1}
data:
  class_path: lightning_sp.data.DigitSequenceDataModule
  init_args: {n_images: 2, batch_size: 2, samples_per_epoch: 4, val_samples: 0}
"""


def _console(*args: str, cwd: Path) -> subprocess.CompletedProcess:
    assert CONSOLE_SCRIPT.is_file(), f"no console script at {CONSOLE_SCRIPT}: pip install -e . installs it"
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    return subprocess.run([str(CONSOLE_SCRIPT), *args], cwd=cwd, env=env, capture_output=True, text=True,
                          timeout=240)


def test_fit_exits_zero_on_success_and_non_zero_on_failure(tmp_path):
    (tmp_path / "tiny.yaml").write_text(TINY)
    done = _console("fit", "--config", "tiny.yaml", cwd=tmp_path)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-3000:]
    assert "`Trainer.fit` stopped: `max_steps=2` reached" in done.stdout + done.stderr
    # a run that fails while building the model (heads do not divide d_model): an error, status 1
    failed = _console("fit", "--config", "tiny.yaml", "--model.init_args.d_model", "15", cwd=tmp_path)
    assert failed.returncode == 1, failed.stderr[-3000:]
    assert "divisible by n_heads" in failed.stderr
    # a bad command line: argparse's status 2
    bad = _console("fit", "--config", "tiny.yaml", "--trainer.no_such_option", "1", cwd=tmp_path)
    assert bad.returncode == 2, bad.stderr[-3000:]


def test_help_names_every_example_config_and_does_not_import_lightning(tmp_path):
    configs = example_configs()
    assert len(configs) >= 3 and all((ROOT / c).is_file() for c in configs), configs
    shown = _console("--help", cwd=ROOT)
    assert shown.returncode == 0, shown.stderr
    for config in configs:
        assert f"lightning-sp fit --config {config}" in shown.stdout
    assert "experiments/protein_demo/config.yaml" in shown.stdout
    # no arguments: the same text on stderr, and a usage error
    bare = _console(cwd=ROOT)
    assert bare.returncode == 2 and "fit --config experiments/protein_demo/config.yaml" in bare.stderr
    # the help path never imports Lightning (what made it take 6-19 s)
    probe = textwrap.dedent("""
        import sys
        from lightning_sp.cli import main
        assert main(["--help"]) == 0
        print("lightning imported:", "lightning" in sys.modules)
    """)
    out = subprocess.run([sys.executable, "-c", probe], cwd=tmp_path, capture_output=True, text=True, timeout=120,
                         env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert "lightning imported: False" in out.stdout, out.stdout + out.stderr
    # installed from a wheel (no experiments/ beside the package): it says where the configs are
    assert example_configs(tmp_path) == []
    assert "experiments/<name>/config.yaml in the source repository" in usage(tmp_path)


def test_help_lists_lightnings_subcommands_and_the_cli_classes_load_lazily():
    from lightning.pytorch.cli import LightningCLI

    assert list(SUBCOMMANDS) == list(LightningCLI.subcommands())
    assert "{" + ",".join(SUBCOMMANDS) + "}" in usage()
    import pickle

    from lightning_sp.cli import LogLocation, SequenceParallelCLI

    assert issubclass(SequenceParallelCLI, LightningCLI)
    assert type(pickle.loads(pickle.dumps(LogLocation()))) is LogLocation  # spawn launchers pickle callbacks
    with pytest.raises(ImportError):
        from lightning_sp.cli import NoSuchName  # noqa: F401
