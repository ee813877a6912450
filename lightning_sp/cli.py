"""Command line: ``lightning-sp fit --config experiments/protein_demo/config.yaml`` (LightningCLI).

Any model / data module / strategy is picked by ``class_path`` in the YAML; ``model.vocab_size`` is
linked to the data module's tokenizer. TensorBoard logging is the default (without Lightning's
empty ``hp_metric`` card; every experiment YAML sets ``default_hp_metric: false`` too), and rank zero
prints the model's size, where the event files are and how to open them, and at the end the loss trend.
Lightning's model-summary table is off by default (``--trainer.enable_model_summary true`` brings it
back): it cannot count FLOPs without an ``example_input_array`` and would print ``Total FLOPs: 0``.
"""

from __future__ import annotations

import os
import sys
import time

import lightning as L
from lightning.pytorch.cli import LightningCLI
from lightning.pytorch.loggers import TensorBoardLogger
from lightning.pytorch.utilities.model_summary import get_human_readable_count
from lightning.pytorch.utilities.rank_zero import rank_zero_only
from typing_extensions import override

from lightning_sp.dependency_noise import silence_dependency_noise


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


def main(args: list[str] | None = None, *, run: bool = True) -> SequenceParallelCLI:
    """Entry point of ``lightning-sp``; ``args`` defaults to ``sys.argv[1:]``."""
    silence_dependency_noise()  # also when the config's strategy is not SequenceParallelStrategy
    if args is None:  # LightningCLI reads sys.argv itself (and warns if it is also passed as `args`)
        sys.argv[1:] = expand_short_names(sys.argv[1:])
    return SequenceParallelCLI(
        L.LightningModule,
        L.LightningDataModule,
        subclass_mode_model=True,
        subclass_mode_data=True,
        trainer_defaults={"callbacks": [LogLocation()]},
        args=expand_short_names(args) if args is not None else None,
        run=run,
        save_config_kwargs={"overwrite": True},
    )


if __name__ == "__main__":
    main()
