"""TensorBoard opens on what matters: a run's event files have no ``hp_metric``,
hold the Custom Scalars layout with Loss, Throughput, Memory, Communication in that order, and the
monitor's throughput / memory / communication tag groups; every TensorBoardLogger the project
configures switches ``hp_metric`` off. The default tab (Time Series) sorts tag groups with TensorBoard's
own comparator (ported below) and expands the first two: the first must be ``Loss``, and the demos
validate often enough for the validation loss to be a line."""

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


def _scalar_series(log_dir: Path) -> dict[str, list[float]]:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    (events_dir,) = {p.parent for p in log_dir.rglob("events.out.tfevents.*")}
    acc = EventAccumulator(str(events_dir), size_guidance={"scalars": 0})
    acc.Reload()
    return {tag: [e.value for e in acc.Scalars(tag)] for tag in acc.Tags()["scalars"]}


def _is_digit(c: str) -> bool:
    return "0" <= c <= "9"


def _number_end(s: str, i: int) -> int:
    """End of the number starting before ``i`` (TensorBoard's ``tb_sorting``: integers, reals, exponents)."""
    state = "natural"
    while i < len(s):
        c = s[i]
        if state == "natural":
            if c == ".":
                state = "real"
            elif c in "eE":
                state = "exponent_sign"
            elif not _is_digit(c):
                break
        elif state == "real":
            if c in "eE":
                state = "exponent_sign"
            elif not _is_digit(c):
                break
        elif state == "exponent_sign":
            if not _is_digit(c) and c not in "+-":
                break
            state = "exponent"
        elif not _is_digit(c):
            break
        i += 1
    return i


def compare_tag_names(a: str, b: str) -> int:
    """TensorBoard 2.x ``compareTagNames`` (the Time Series and Scalars dashboards): numbers compare by
    value, ``/`` and digits before any other character, other characters by code point (upper case first)."""
    i = j = 0
    while True:
        if i == len(a):
            return 0 if j == len(b) else -1
        if j == len(b):
            return 1
        if _is_digit(a[i]) and _is_digit(b[j]):
            i0, j0 = i, j
            i, j = _number_end(a, i + 1), _number_end(b, j + 1)
            try:
                x, y = float(a[i0:i]), float(b[j0:j])
            except ValueError:  # JavaScript's Number() gives NaN: compares neither less nor greater
                continue
            if x != y:
                return -1 if x < y else 1
            continue
        a_break, b_break = a[i] == "/" or _is_digit(a[i]), b[j] == "/" or _is_digit(b[j])
        if a_break and not b_break:
            return -1
        if b_break and not a_break:
            return 1
        if not a_break and a[i] != b[j]:
            return -1 if a[i] < b[j] else 1
        i, j = i + 1, j + 1


def tensorboard_groups(tags) -> list[str]:
    """Tag groups in the order TensorBoard's Time Series tab shows them (it expands the first two)."""
    from functools import cmp_to_key

    groups: list[str] = []
    for tag in sorted(tags, key=cmp_to_key(compare_tag_names)):
        if tag.split("/", 1)[0] not in groups:
            groups.append(tag.split("/", 1)[0])
    return groups


def test_comparator_matches_tensorboards_documented_order():
    # natural numbers, "/" and digits first, upper case before lower case
    assert tensorboard_groups(["b/x", "a10/x", "a9/x", "A/x", "1_x/y"]) == ["1_x", "A", "a9", "a10", "b"]
    assert compare_tag_names("loss/2", "loss/10") == -1 and compare_tag_names("x", "x") == 0


def _fit(tmp_path: Path, model=None, *, steps: int = 2, val_every: int | None = None, **logger_kwargs):
    """Train ``model`` (default: the tiny module below; batches as the project's models take them) for
    ``steps`` steps with ``SequenceParallelMonitor``, validating every ``val_every`` steps; the log dir."""
    import lightning as L
    from lightning.pytorch.loggers import TensorBoardLogger

    from lightning_sp.callbacks import SequenceParallelMonitor

    class Model(L.LightningModule):
        def __init__(self):
            super().__init__()
            self.embed = torch.nn.Embedding(8, 4)
            self.head = torch.nn.Linear(4, 8)

        def training_step(self, batch, _):
            ids = batch["input_ids"] % 8  # [B, S]
            loss = torch.nn.functional.cross_entropy(self.head(self.embed(ids)).flatten(0, 1), ids.flatten())
            self.log("Loss/train", loss)
            return loss

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=0.1)

    torch.manual_seed(0)
    n = 12  # tokens per sample
    data = [{"input_ids": torch.randint(8, (n,)), "labels": torch.randint(8, (n,)), "position_ids": torch.arange(n),
             "answer_mask": torch.arange(n) == n - 1} for _ in range(2 * steps)]
    loader = torch.utils.data.DataLoader(data, batch_size=2)
    logger = TensorBoardLogger(save_dir=tmp_path, name="run", version=0, **logger_kwargs)
    trainer = L.Trainer(max_steps=steps, logger=logger, callbacks=[SequenceParallelMonitor()], log_every_n_steps=1,
                        val_check_interval=val_every, limit_val_batches=1 if val_every else 0,
                        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                        accelerator="cpu", devices=1)
    trainer.fit(model or Model(), loader, loader if val_every else None)
    return Path(logger.log_dir)


def test_default_tab_opens_on_the_loss_of_the_project_models(tmp_path):
    from lightning_sp.models import MultimodalDecoder, ProteinEncoder

    for cls in (ProteinEncoder, MultimodalDecoder):
        model = cls(d_model=16, n_layers=1, n_heads=2)
        series = _scalar_series(_fit(tmp_path / cls.__name__, model, steps=10, val_every=2, default_hp_metric=False))
        groups = tensorboard_groups(series)
        assert groups[0] == "Loss", (cls.__name__, groups)  # expanded, at the top of the default tab
        # the monitor's groups and Lightning's "epoch" exist and come after it
        assert {"epoch", "throughput", "memory", "communication"} <= set(groups[1:]), groups
        assert len(series["Loss/train"]) == 10, series["Loss/train"]
        assert len(series["Loss/val"]) == 5, series["Loss/val"]  # one point per validation: a line, not a dot
    # negative control: the earlier tags (train/loss, val/loss) open on communication
    old = [t.replace("Loss/train", "train/loss").replace("Loss/val", "val/loss") for t in series]
    assert tensorboard_groups(old)[:2] == ["answer_acc", "communication"], tensorboard_groups(old)
    assert tensorboard_groups(set(old) - {"answer_acc/train", "answer_acc/val"})[0] == "communication"


def test_demo_configs_validate_often_and_show_a_finite_epoch():
    # two validation points drew no visible line
    for name in ("protein_demo", "multimodal_demo"):
        trainer = yaml.safe_load((ROOT / "experiments" / name / "config.yaml").read_text())["trainer"]
        assert trainer["max_steps"] // trainer["val_check_interval"] >= 8, (name, trainer)
    # Rich's bar reads "Epoch 0/-2" when max_steps is set and max_epochs is not: every config that shows a bar
    shown = 0
    for path in sorted(ROOT.glob("experiments/*/*.yaml")):
        cfg = yaml.safe_load(path.read_text())
        trainer, data = cfg.get("trainer") or {}, ((cfg.get("data") or {}).get("init_args") or {})
        if "max_steps" not in trainer or trainer.get("enable_progress_bar") is False:
            continue
        shown += 1
        assert trainer.get("max_epochs") == 1, f"{path}: set trainer.max_epochs (Rich shows max_epochs - 1)"
        steps_per_epoch = data["samples_per_epoch"] // data.get("batch_size", 1)
        assert steps_per_epoch == trainer["max_steps"], (path, steps_per_epoch)  # the bar's total is the run
    assert shown >= 3, shown  # protein_demo, multimodal_demo, hf_protein


def test_run_opens_on_loss_throughput_memory_communication(tmp_path):
    tags, layout = _events(_fit(tmp_path, default_hp_metric=False))
    assert "hp_metric" not in tags, tags
    assert layout is not None, "no Custom Scalars layout in the event files"
    assert [c.title for c in layout.category] == ["Loss", "Throughput", "Memory", "Communication"]
    groups = {t.split("/", 1)[0] for t in tags}
    assert {"Loss", "throughput", "memory", "communication"} <= groups, tags
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
