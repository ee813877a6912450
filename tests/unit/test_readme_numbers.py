"""The README's demo outputs and numbers are current (issue 19): each quoted number is recomputed here, and
a test fails when one drifts.

- Communication per step: the README's MiB equal ``lightning_sp.comm.volume`` for the protein demo config
  (degrees, heads, layers, ``kv_pieces`` read from the config and the model the config builds).
- Loss trends, validation loss, answer accuracy: the README's numbers equal what the committed demo runs
  (``paper_figures/demo_{protein,multimodal}_loss.csv``, written by ``scripts/plot_demo_loss.py`` from the
  runs' event files) contain, computed as ``LogLocation`` prints them.
- Those runs are what the current code trains: both demo configs, unshrunk, trained 5 steps in one process
  (the sequence-parallel run equals it, ``tests/distributed/test_demo_equivalence.py``), give the CSVs'
  first 5 losses, and print the README's quoted lines (model size, TensorBoard location, the summary
  format) and none of the noise issue 19 removed.
"""

from __future__ import annotations

import csv
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import yaml
from tests.docs_text import documentation_text

ROOT = Path(__file__).resolve().parents[2]
README = ROOT / "README.md"
DEMOS = {  # README block marker -> (config, committed run data)
    "protein demo": (ROOT / "experiments/protein_demo/config.yaml", ROOT / "paper_figures/demo_protein_loss.csv"),
    "multimodal demo": (ROOT / "experiments/multimodal_demo/config.yaml",
                        ROOT / "paper_figures/demo_multimodal_loss.csv"),
}
STEPS = 5
LOSS_TOL = 2e-4  # sequence parallel vs one process over 5 steps, as in test_demo_equivalence
NOISE = ("LeafSpec", "💡 Tip", "Total FLOPs", "Epoch 0/-")


def _output_block(marker: str) -> list[str]:
    """The lines of the text block after ``<!-- output: <marker> ...-->`` in the README."""
    match = re.search(rf"<!-- output: {re.escape(marker)}[^>]*-->\s*```text\n(.*?)```", documentation_text(), re.DOTALL)
    assert match, f"README has no output block marked '{marker}'"
    return match.group(1).splitlines()


def _readme_number(pattern: str) -> str:
    found = re.findall(pattern, documentation_text())  # patterns use \s+ where the README may wrap
    assert len(found) == 1, f"README: expected one match of {pattern!r}, found {found}"
    return found[0]


def _series(path: Path) -> dict[str, list[float]]:
    out: dict[str, list[tuple[int, float]]] = {}
    with path.open() as f:
        for row in csv.DictReader(f):
            out.setdefault(row["tag"], []).append((int(row["step"]), float(row["value"])))
    return {tag: [v for _, v in sorted(rows)] for tag, rows in out.items()}


def _summary_line(losses: list[float], steps: int, window: int = 10) -> str:
    """``LogLocation``'s end-of-fit trend, without the wall time."""
    n = min(window, max(1, len(losses) // 2))
    first, last = sum(losses[:n]) / n, sum(losses[-n:]) / n
    return f"Loss/train: mean of first {n} steps {first:.4f} -> last {n} steps {last:.4f}; {steps} steps in"


def test_communication_per_step_is_the_formula_for_the_demo_config():
    from lightning_sp import SequenceParallelAttention
    from lightning_sp.comm.volume import backward_elements, forward_elements
    from lightning_sp.models import ProteinEncoder
    from lightning_sp.ops.ring_attention import piece_count

    cfg = yaml.safe_load(DEMOS["protein demo"][0].read_text())
    strategy = cfg["trainer"]["strategy"]["init_args"]
    model = ProteinEncoder(**cfg["model"]["init_args"])
    attention = [m for m in model.modules() if isinstance(m, SequenceParallelAttention)]
    n, p = cfg["data"]["init_args"]["context_len"], strategy["sequence_parallel_size"]
    assert p == cfg["trainer"]["devices"] and n % (2 * p) == 0  # one sp group, no padding
    shape = dict(seq_len=n, world=p, num_heads=model.net.cfg.n_heads, num_kv_heads=model.net.cfg.kv_heads,
                 head_dim=model.net.cfg.d_model // model.net.cfg.n_heads)
    fwd = forward_elements(strategy["backend"], **shape)
    # kv_pieces="auto" (the default) on CPU without a memory budget: whole blocks (lightning_sp.choices)
    pieces = 1 if attention[0].kv_pieces == "auto" else piece_count(attention[0].kv_pieces, n // p)

    def mib(kv_pieces: int) -> float:  # fp32, every attention layer, forward + backward
        bwd = backward_elements(strategy["backend"], **shape, kv_pieces=kv_pieces)
        return (fwd + bwd) * 4 * len(attention) / 2**20

    quoted = float(_readme_number(r"([\d.]+) MiB sent per rank\s+per step"))
    assert quoted == pytest.approx(mib(pieces), abs=5e-4), (quoted, mib(pieces))
    # negative control: K/V in 8 pieces (dK/dV straight back to its owner) would send 10.125
    assert mib(piece_count(8, n // p)) == pytest.approx(10.125) and abs(mib(piece_count(8, n // p)) - quoted) > 0.5
    parts = [float(x) for x in re.findall(r"([\d.]+) MiB of K/V ring\s+sends and ([\d.]+) MiB of dK/dV", documentation_text())[0]]
    assert parts == pytest.approx([2 * fwd * 4 * len(attention) / 2**20, (mib(pieces) - 2 * fwd * 4 * len(attention) / 2**20)])


@pytest.mark.parametrize("marker", sorted(DEMOS))
def test_committed_run_is_what_the_current_code_trains(marker, tmp_path):
    config, data = DEMOS[marker]
    local_config = tmp_path / config.relative_to(ROOT)  # run from a folder that looks like a checkout
    local_config.parent.mkdir(parents=True)
    local_config.write_text(config.read_text())
    args = [sys.executable, str(ROOT / "scripts" / "demo.py"), "--config", str(config.relative_to(ROOT)), "--",
            "--trainer.max_steps", str(STEPS), "--trainer.limit_val_batches", "0", "--trainer.strategy", "auto",
            "--trainer.devices", "1", "--trainer.enable_progress_bar", "false",
            "--trainer.logger.init_args.save_dir", "runs"]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}
    proc = subprocess.run(args, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
    log = proc.stdout + proc.stderr
    assert proc.returncode == 0, log[-6000:]
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    (events,) = {p.parent for p in (tmp_path / "runs").rglob("events.out.tfevents.*")}
    acc = EventAccumulator(str(events))
    acc.Reload()
    now = [e.value for e in sorted(acc.Scalars("Loss/train"), key=lambda e: e.step)]
    committed = _series(data)["Loss/train"][:STEPS]
    assert len(now) == STEPS and max(abs(a - b) for a, b in zip(now, committed)) < LOSS_TOL, (
        f"the current code trains differently from the committed run {data.name} (now {now}, committed {committed}):"
        f" rerun the demo, redraw with scripts/plot_demo_loss.py and update the README's quoted numbers")
    assert abs(now[0] - now[-1]) > 100 * LOSS_TOL, now  # negative control: the loss moves far more than the tolerance

    # the README's quoted lines: verbatim where they do not depend on the run, as a template where they do
    block = _output_block(marker)
    printed = proc.stdout.splitlines()
    demo_line = next(line for line in block if line.startswith("demo: "))
    assert any(line.startswith(demo_line + " ") for line in printed), (demo_line, printed[:3])
    for line in block:
        if line.startswith(("model: ", "TensorBoard event files: ", "  view them with:")):
            assert line in printed, f"README line not printed by the current code: {line!r}\n{proc.stdout}"
    template = re.escape(_summary_line(now, STEPS)) + r" [\d.]+ s$"
    assert any(re.match(template, line) for line in printed), (template, printed[-5:])
    noisy = [word for word in NOISE if word in log]
    assert not noisy, f"{noisy} printed:\n{log[-4000:]}"


def test_hf_training_example_defines_what_it_uses():
    """The README's Hugging Face Trainer example runs as written up to ``trainer.fit`` (shrunk, Trainer
    stubbed: its training is ``tests/distributed/test_hf_transformers.py``'s): ``loader`` exists and yields
    global batches of ``input_ids`` and ``labels``, the same on every rank (seeded)."""
    match = re.search(r"<!-- test: hf training example[^>]*-->\s*```python\n(.*?)```", documentation_text(), re.DOTALL)
    assert match, "README has no block marked 'hf training example'"
    code = match.group(1)
    for big, small in [("hidden_size=1024", "hidden_size=32"), ("intermediate_size=2816", "intermediate_size=64"),
                       ("num_hidden_layers=8", "num_hidden_layers=1"), ("num_attention_heads=16", "num_attention_heads=4"),
                       ("num_key_value_heads=4", "num_key_value_heads=2"), ("(64, 8192)", "(4, 16)")]:
        assert big in code, big
        code = code.replace(big, small)
    fitted = []

    class Trainer:  # records what the example passes; builds nothing, launches nothing
        def __init__(self, **kwargs):
            self.kwargs = kwargs

        def fit(self, module, loader):
            fitted.append((self.kwargs, module, loader))

    import lightning as L

    runs = []
    for _ in range(2):  # two "ranks": each runs the script
        scope: dict = {}
        original = L.Trainer
        L.Trainer = Trainer
        try:
            exec(compile(code, "README.md", "exec"), scope)  # noqa: S102 - the README's own code
        finally:
            L.Trainer = original
        (kwargs, module, loader), = fitted[-1:]
        batch = next(iter(loader))
        assert set(batch) == {"input_ids", "labels"} and batch["input_ids"].shape == (1, 16), batch
        runs.append(batch["input_ids"])
        assert type(module).__name__ == "HFSequenceParallelModule"
    assert runs[0].equal(runs[1]), "the ranks would shard different sequences"
