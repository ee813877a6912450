"""Command line: ``lightning-sp fit --config experiments/protein_demo/config.yaml`` (LightningCLI).

Any model / data module / strategy is picked by ``class_path`` in the YAML; ``model.vocab_size`` is
linked to the data module's tokenizer. TensorBoard logging is the default (without Lightning's
empty ``hp_metric`` card; every experiment YAML sets ``default_hp_metric: false`` too), and rank zero
prints the model's size, where the event files are and how to open them, and at the end the loss trend.
Lightning's model-summary table is off by default (``--trainer.enable_model_summary true`` brings it
back): it cannot count FLOPs without an ``example_input_array`` and would print ``Total FLOPs: 0``.

``lightning-sp`` and ``lightning-sp --help`` print this project's usage (the subcommands and the example
configs) without importing Lightning, so they answer in about the time of ``import torch``; a subcommand
(``fit``, ``fit --help``, ...) builds Lightning's parser. :func:`main` returns the process's exit status
(0 after a run that finished; an exception or Lightning's ``sys.exit(1)`` after Ctrl-C propagates).
:class:`LogLocation` and :class:`SequenceParallelCLI` subclass Lightning classes, so they are defined on
first access (PEP 562), like the package's own Lightning-backed names.
"""

from __future__ import annotations

import os
import sys
import time
from functools import cache
from pathlib import Path
from typing import TYPE_CHECKING, Any

from lightning_sp.dependency_noise import silence_dependency_noise

if TYPE_CHECKING:
    from lightning.pytorch.cli import LightningCLI

__all__ = ["LogLocation", "SequenceParallelCLI", "build_cli", "example_configs", "expand_short_names", "main", "usage"]

# LightningCLI's subcommands (``LightningCLI.subcommands()``; tests/unit/test_cli.py keeps the two lists equal)
SUBCOMMANDS = {
    "fit": "train (and validate) a model",
    "validate": "one evaluation epoch over the validation set",
    "test": "one evaluation epoch over the test set",
    "predict": "run inference over a predict set",
}
REPO_ROOT = Path(__file__).resolve().parents[1]
CONFIG_PATTERN = "experiments/*/config*.yaml"


def example_configs(root: Path = REPO_ROOT) -> list[str]:
    """The example configs of a source checkout (``experiments/<name>/config*.yaml``), relative to ``root``;
    empty when the package was installed from a wheel (the configs are not packaged)."""
    return sorted(str(p.relative_to(root)) for p in root.glob(CONFIG_PATTERN))


def usage(root: Path = REPO_ROOT) -> str:
    """What ``lightning-sp --help`` prints: the subcommands and the example configs of the checkout at ``root``
    (an installed wheel has none: then where to find them)."""
    lines = [
        "usage: lightning-sp [-c CONFIG] {fit,validate,test,predict} [--config CONFIG] [OPTIONS]",
        "       lightning-sp plan --model CONFIG --seq-len N --devices P [--hardware h100] [--json]",
        "",
        "Train and evaluate Lightning models with exact sequence (context) parallelism (LightningCLI).",
        "",
        "subcommands:",
        *(f"  {name:<10} {text}" for name, text in SUBCOMMANDS.items()),
        f"  {'plan':<10} predict layouts, memory per GPU, step time and the longest sequence before a run "
        "(lightning-sp plan --help)",
        "",
        "options:",
        "  -h, --help            show this message and exit",
        "  -c, --config CONFIG   a YAML config (before or after the subcommand)",
        "  --print_config        print the resolved config and exit (after the subcommand)",
        "  SUBCOMMAND --help     every option of a subcommand: trainer, model, data (takes a few seconds)",
        "  --model.help ProteinEncoder, --data.help ProteinDataModule,",
        "  --trainer.strategy.help lightning_sp.SequenceParallelStrategy   one class's arguments",
        "",
    ]
    configs = example_configs(root)
    if configs:
        lines += ["example configs (run from the repository root):",
                  *(f"  lightning-sp fit --config {c}" for c in configs)]
    else:
        lines += ["example configs: experiments/<name>/config.yaml in the source repository",
                  "  (e.g. lightning-sp fit --config experiments/protein_demo/config.yaml)"]
    lines += ["", "Documentation: docs/ in the source repository (mkdocs serve), README.md for a quick start."]
    return "\n".join(lines)


@cache
def _lightning_classes() -> dict[str, type]:
    """Defines the two classes that subclass Lightning's (imported here, not at module import)."""
    import lightning as L
    from lightning.pytorch.cli import LightningCLI
    from lightning.pytorch.loggers import TensorBoardLogger
    from lightning.pytorch.utilities.model_summary import get_human_readable_count
    from lightning.pytorch.utilities.rank_zero import rank_zero_only
    from typing_extensions import override

    class LogLocation(L.Callback):
        """Prints the model size and the TensorBoard location at the start, and the loss trend and wall time at
        the end."""

        def __init__(self, monitor: str = "Loss/train", window: int = 10) -> None:
            self.monitor, self.window = monitor, window
            self.losses: list[float] = []
            self._t0 = 0.0

        @override
        def on_fit_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
            self._t0 = time.perf_counter()
            n_params = sum(p.numel() for p in pl_module.parameters())  # FSDP2 DTensors: global; tp slices: this rank
            self._say(trainer, f"model: {type(pl_module).__name__}, {get_human_readable_count(n_params)} parameters\n"
                               "TensorBoard event files: {log_dir}\n  view them with:  tensorboard --logdir {save_dir}"
                               "  (Custom Scalars tab: http://localhost:6006/#custom_scalars)")

        @override
        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
            value = trainer.callback_metrics.get(self.monitor)
            if value is not None:
                self.losses.append(float(value))

        @override
        def on_fit_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
            n = min(self.window, max(1, len(self.losses) // 2))
            if self.losses:
                first, last = sum(self.losses[:n]) / n, sum(self.losses[-n:]) / n
                trend = f"{self.monitor}: mean of first {n} steps {first:.4f} -> last {n} steps {last:.4f}"
            else:
                trend = f"{self.monitor}: not logged"
            secs = time.perf_counter() - self._t0
            self._say(trainer, f"{trend}; {trainer.global_step} steps in {secs:.1f} s\n"
                               "TensorBoard event files: {log_dir}\n  view them with:  tensorboard --logdir {save_dir}"
                               "  (Custom Scalars tab: http://localhost:6006/#custom_scalars)")

        @rank_zero_only
        def _say(self, trainer: L.Trainer, template: str) -> None:
            tb = next((lg for lg in trainer.loggers if isinstance(lg, TensorBoardLogger)), None)
            if tb is None:
                print(template.split("TensorBoard")[0].strip() or "no TensorBoard logger configured", flush=True)
                return
            log_dir = os.path.abspath(tb.log_dir)
            if log_dir.startswith(os.path.join(os.getcwd(), "")):  # under the working directory: say it short
                log_dir = os.path.relpath(log_dir)
            print(template.format(log_dir=log_dir, save_dir=os.path.relpath(tb.save_dir)), flush=True)

    class SequenceParallelCLI(LightningCLI):
        """LightningCLI with the vocabulary linked from data to model and TensorBoard on by default."""

        @override
        def add_arguments_to_parser(self, parser) -> None:
            parser.link_arguments("data.vocab_size", "model.init_args.vocab_size", apply_on="instantiate")
            parser.set_defaults({
                "trainer.enable_model_summary": False,  # LogLocation prints the parameter count instead
                "trainer.logger": {"class_path": "lightning.pytorch.loggers.TensorBoardLogger",
                                   "init_args": {"save_dir": "runs", "name": "default", "default_hp_metric": False}},
            })

    classes = {"LogLocation": LogLocation, "SequenceParallelCLI": SequenceParallelCLI}
    for name, cls in classes.items():  # picklable by name, like a class defined at module level
        cls.__module__, cls.__qualname__ = __name__, name
    return classes


def __getattr__(name: str) -> Any:
    if name in ("LogLocation", "SequenceParallelCLI"):
        return _lightning_classes()[name]
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


# Short names accepted wherever a class path is expected on the command line (``--model.help ProteinEncoder``).
_SHORT_NAMES = {
    "--model.help": ("lightning_sp.models", ("ProteinEncoder", "MultimodalDecoder")),
    "--data.help": ("lightning_sp.data", ("ProteinDataModule", "DigitSequenceDataModule")),
}


def expand_short_names(args: list[str]) -> list[str]:
    """``--model.help ProteinEncoder`` -> ``--model.help lightning_sp.models.ProteinEncoder`` (jsonargparse's
    help action wants an import path; ``--model ProteinEncoder`` already accepts short names)."""
    out = list(args)
    for i, arg in enumerate(out[:-1]):
        if arg in _SHORT_NAMES and "." not in out[i + 1]:
            package, names = _SHORT_NAMES[arg]
            if out[i + 1] in names:
                out[i + 1] = f"{package}.{out[i + 1]}"
    return out


def build_cli(args: list[str] | None = None, *, run: bool = True) -> LightningCLI:
    """Builds (and with ``run=True`` runs) the :class:`SequenceParallelCLI`; ``args`` defaults to
    ``sys.argv[1:]``. ``run=False`` parses the config and instantiates the model, data and trainer only
    (``cli.model``, ``cli.trainer``), without a subcommand."""
    import lightning as L

    silence_dependency_noise()  # also when the config's strategy is not SequenceParallelStrategy
    if args is None:  # LightningCLI reads sys.argv itself (and warns if it is also passed as `args`)
        sys.argv[1:] = expand_short_names(sys.argv[1:])
    classes = _lightning_classes()
    return classes["SequenceParallelCLI"](
        L.LightningModule,
        L.LightningDataModule,
        subclass_mode_model=True,
        subclass_mode_data=True,
        trainer_defaults={"callbacks": [classes["LogLocation"]()]},
        args=expand_short_names(args) if args is not None else None,
        run=run,
        save_config_kwargs={"overwrite": True},
    )


def main(args: list[str] | None = None) -> int:
    """Entry point of ``lightning-sp`` (the console script calls ``sys.exit(main())``); ``args`` defaults to
    ``sys.argv[1:]``. Returns 0 when the subcommand finished; errors propagate as exceptions (exit status 1)
    and a bad command line exits with status 2, as argparse does."""
    argv = sys.argv[1:] if args is None else list(args)
    if argv in (["-h"], ["--help"]):
        print(usage(), flush=True)
        return 0
    if not argv:
        print(usage(), file=sys.stderr, flush=True)
        print("lightning-sp: error: a subcommand is required", file=sys.stderr, flush=True)
        return 2
    if argv[0] == "plan":  # the planner: no Lightning, no model, no process group
        from lightning_sp.planner import main as plan_main

        return plan_main(argv[1:])
    build_cli(args)
    return 0


if __name__ == "__main__":
    sys.exit(main())
