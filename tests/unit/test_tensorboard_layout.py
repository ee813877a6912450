"""TensorBoard opens on what matters (issue 10, item 7): a run's event files have no ``hp_metric``, hold
the Custom Scalars layout with Loss, Throughput, Memory, Communication in that order, and the
monitor's throughput / memory / communication tag groups; every TensorBoardLogger the project
configures switches ``hp_metric`` off."""

from __future__ import annotations

from pathlib import Path

import torch
import yaml

ROOT = Path(__file__).resolve().parents[2]


def _events(log_dir: Path):
    """``(scalar tags, custom-scalars layout or None)`` from the event files under ``log_dir``."""
    from tensorboard.backend.event_processing.event_file_loader import EventFileLoader
    from tensorboard.plugins.custom_scalar import layout_pb2
    from tensorboard.util import tensor_util

    tags, layout = set(), None
    for path in sorted(log_dir.rglob("events.out.tfevents.*")):
        for event in EventFileLoader(str(path)).Load():
            for value in event.summary.value:
                if value.metadata.plugin_data.plugin_name == "custom_scalars":
                    layout = layout_pb2.Layout.FromString(tensor_util.make_ndarray(value.tensor).item())
                elif value.HasField("simple_value") or value.metadata.plugin_data.plugin_name == "scalars":
                    tags.add(value.tag)
    return tags, layout


def _fit(tmp_path: Path, **logger_kwargs):
    import lightning as L
    from lightning.pytorch.loggers import TensorBoardLogger

    from lightning_sp.callbacks import SequenceParallelMonitor

    class Model(L.LightningModule):
        def __init__(self):
            super().__init__()
            self.embed = torch.nn.Embedding(8, 4)
            self.head = torch.nn.Linear(4, 8)

        def training_step(self, batch, _):
            ids = batch["input_ids"]  # [B, S]
            loss = torch.nn.functional.cross_entropy(self.head(self.embed(ids)).flatten(0, 1), ids.flatten())
            self.log("train/loss", loss)
            return loss

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=0.1)

    data = [{"input_ids": torch.randint(8, (6,))} for _ in range(4)]
    loader = torch.utils.data.DataLoader(data, batch_size=2)
    logger = TensorBoardLogger(save_dir=tmp_path, name="run", version=0, **logger_kwargs)
    trainer = L.Trainer(max_steps=2, logger=logger, callbacks=[SequenceParallelMonitor()], log_every_n_steps=1,
                        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                        accelerator="cpu", devices=1)
    trainer.fit(Model(), loader)
    return Path(logger.log_dir)


def test_run_opens_on_loss_throughput_memory_communication(tmp_path):
    tags, layout = _events(_fit(tmp_path, default_hp_metric=False))
    assert "hp_metric" not in tags, tags
    assert layout is not None, "no Custom Scalars layout in the event files"
    assert [c.title for c in layout.category] == ["Loss", "Throughput", "Memory", "Communication"]
    groups = {t.split("/", 1)[0] for t in tags}
    assert {"train", "throughput", "memory", "communication"} <= groups, tags
    assert {"throughput/tokens_per_s", "memory/peak_gib", "communication/mib"} <= tags, tags
    # every monitor tag is matched by a chart of the layout (nothing falls outside the ordered view)
    import re

    patterns = [p for c in layout.category for chart in c.chart for p in chart.multiline.tag]
    for tag in tags - {"epoch"}:
        assert any(re.search(p, tag) for p in patterns), f"{tag} is in no Custom Scalars chart"


def test_negative_control_default_logger_writes_hp_metric(tmp_path):
    # what the projects' loggers switch off: Lightning's default writes an (empty) hp_metric card
    from lightning.pytorch.loggers import TensorBoardLogger

    logger = TensorBoardLogger(save_dir=tmp_path, name="run", version=0)
    logger.log_hyperparams({"lr": 0.1})
    logger.finalize("success")
    tags, layout = _events(Path(logger.log_dir))
    assert "hp_metric" in tags and layout is None


def test_experiment_configs_switch_hp_metric_off():
    loggers = {}
    for path in sorted(ROOT.glob("experiments/*/*.yaml")):
        logger = (yaml.safe_load(path.read_text()).get("trainer") or {}).get("logger")
        if logger:  # configs that extend a base config may configure none
            loggers[path.relative_to(ROOT)] = logger
    assert len(loggers) >= 4, loggers  # protein_demo, multimodal_demo, hf_protein, context_matters
    bad = [str(p) for p, lg in loggers.items() if (lg.get("init_args") or {}).get("default_hp_metric") is not False]
    assert not bad, f"set default_hp_metric: false in the TensorBoardLogger of {bad}"


def test_cli_default_logger_switches_hp_metric_off():
    from lightning_sp.cli import SequenceParallelCLI

    class Parser:  # records what the CLI sets on its parser
        def __init__(self):
            self.defaults = {}

        def link_arguments(self, *args, **kwargs):
            pass

        def set_defaults(self, defaults):
            self.defaults.update(defaults)

    parser = Parser()
    SequenceParallelCLI.add_arguments_to_parser(None, parser)
    assert parser.defaults["trainer.logger"]["init_args"]["default_hp_metric"] is False
