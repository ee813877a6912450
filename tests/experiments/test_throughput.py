"""Smoke test of ``experiments/throughput/run.py --quick`` (P = 1 in process, P = 2 gloo ranks) and of the
pieces it is built from: alternation order, the exported ``measure_step``, the step-0 loss check, bad input."""

from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path

import pytest

import importlib

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ["-m", "experiments.throughput.run"]


def _script_module():
    return importlib.import_module("experiments.throughput.run")


@pytest.fixture(scope="module")
def quick(tmp_path_factory):
    out = tmp_path_factory.mktemp("throughput")
    cmd = [sys.executable, *SCRIPT, "--quick", "--out", str(out), "--log-dir", str(out / "runs")]
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=600,
                          env={**__import__("os").environ, "OMP_NUM_THREADS": "1"})
    assert proc.returncode == 0, f"exit {proc.returncode}\nstdout:\n{proc.stdout[-4000:]}\nstderr:\n{proc.stderr[-4000:]}"
    data = json.loads((out / "throughput.json").read_text())
    return out, data


@pytest.mark.distributed
def test_quick_run_rows_metadata_and_figure(quick):
    from experiments.throughput.measure import ATTENTION_BACKENDS, METHODS
    from lightning_sp.callbacks import megatron_flops_per_iteration

    out, data = quick
    assert data["kind"] == "measured" and "--quick" in data["command"]
    assert data["cores"] >= 1 and data["oversubscribed_worlds"] == [w for w in data["worlds"] if w > data["cores"]]
    assert len(data["load_1m_5m_15m_start"]) == 3 and data["hardware"]["device"]
    rows = data["results"]
    train = [r for r in rows if r["section"] == "training_step"]
    attn = [r for r in rows if r["section"] == "attention_share"]
    assert {(r["method"], r["world"]) for r in train} == {("local", 1)} | {(m, 2) for m in METHODS}
    assert {(r["method"], r["world"]) for r in attn} == {(b, 2) for b in ATTENTION_BACKENDS}
    for r in train:
        n, p = r["seq_len"], r["world"]
        assert r["step_s"] > 0 and len(r["step_s_all"]) == r["reps"]
        assert r["tokens_per_s_per_rank"] * p * r["step_s"] == pytest.approx(r["batch"] * n, rel=1e-9)
        flops = megatron_flops_per_iteration(batch=r["batch"], seq_len=n, num_layers=r["n_layers"], hidden=r["d_model"],
                                             vocab=r["vocab_size"])
        assert r["model_tflops_per_rank"] == pytest.approx(flops / r["step_s"] / p / 1e12, rel=1e-9)
        assert 0 < r["cpu_over_wall"] <= 1.05, r
        # every method trained the same model on the same batch: the one-process loss, to fp32 round-off
        assert r["loss_rel_diff_vs_one_process"] < 1e-4, r
        assert abs(r["loss_step0"] - math.log(r["vocab_size"])) < 0.5, r  # a real loss from a fresh model
    assert train[0]["lib_comm_mib_per_step_rank0"] == 0  # one process sends nothing
    assert all(r["lib_comm_mib_per_step_rank0"] > 0 for r in train if r["world"] > 1)
    for r in attn:
        assert r["share_of_kernel"] == pytest.approx(r["world"] * r["one_kernel_call_s"] / r["attention_fwd_bwd_s"], rel=1e-9)
        assert 0 < r["share_of_kernel"] < 10, r
    assert (out / "throughput.csv").stat().st_size > 0
    assert (out / "throughput.png").stat().st_size > 10_000
    assert list((out / "runs" / "figures").glob("events.out.tfevents.*"))
    assert list((out / "runs" / "ulysses-P2").glob("events.out.tfevents.*"))


def test_loss_check_rejects_a_method_that_computes_something_else():
    mod = _script_module()
    rows = [{"section": "training_step", "method": m, "world": p, "seq_len": 64, "loss_step0": 3.4 * (1 + 1e-6 * i)}
            for i, (m, p) in enumerate([("local", 1), ("ulysses", 2), ("ring", 2)])]
    rows.append({"section": "attention_share", "method": "ring", "world": 2, "seq_len": 64})
    mod.check_losses(rows)  # round-off passes
    assert rows[2]["loss_rel_diff_vs_one_process"] == pytest.approx(2e-6, rel=1e-3)
    rows[2]["loss_step0"] *= 1 + 1e-3  # negative control: a step computing a different loss is caught
    with pytest.raises(RuntimeError, match="ring"):
        mod.check_losses(rows)


def test_time_alternating_rotates_order_and_drops_warmup():
    from experiments.throughput.measure import time_alternating

    order: list[str] = []
    res = time_alternating({"a": lambda: order.append("a"), "b": lambda: order.append("b")}, warmup=1, reps=2)
    assert order == ["a", "b", "b", "a", "a", "b"]
    assert [len(res[k].wall_s) for k in "ab"] == [2, 2] and all(t >= 0 for t in res["a"].cpu_s)
    with pytest.raises(ValueError, match="reps >= 1"):
        time_alternating({"a": lambda: None}, warmup=0, reps=0)


def test_measure_step_one_process_and_bad_input():
    import torch

    from experiments.throughput import ModelShape, build_training_step, measure_step

    threads = torch.get_num_threads()
    try:
        t = measure_step("local", seq_len=16, shape=ModelShape(d_model=16, n_layers=1, n_heads=2), warmup=0, reps=2)
    finally:
        torch.set_num_threads(threads)
    assert len(t.wall_s) == 2 and t.median_s > 0
    with pytest.raises(ValueError, match="n_heads"):
        ModelShape(d_model=30, n_heads=4)
    with pytest.raises(ValueError, match="'local' runs on one rank"):
        build_training_step("ulysses", seq_len=16, shape=ModelShape(d_model=16, n_heads=2))
    with pytest.raises(ValueError, match="method must be one of"):
        build_training_step("tp", seq_len=16, shape=ModelShape(d_model=16, n_heads=2))


def test_cli_rejects_degrees_and_lengths_it_cannot_run(capsys):
    mod = _script_module()
    with pytest.raises(SystemExit):
        mod.parse_args(["--quick", "--worlds", "1", "3"])
    assert "divide n_heads=4" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        mod.parse_args(["--quick", "--seq-lens", "250"])
    assert "multiple of 2P" in capsys.readouterr().err
