"""Smoke test of the communication-volume experiment (``experiments/comm_volume``): ``--quick`` (one
spawn of 4 gloo ranks, P = 2 and 4, N = 64) into a temporary dir, then the plot script on its result
file. Every backend's measured forward and backward bytes per rank equal ``lightning_sp.comm.volume``
exactly, on every rank."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from experiments.common.results import read_results

pytestmark = pytest.mark.distributed

ROOT = Path(__file__).resolve().parents[2]
BACKENDS = {"ulysses", "ring", "zigzag_ring", "allgather_kv", "colossal", "usp", "megatron_tp_sp"}


def _run(*args: str, timeout: int = 300) -> None:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}
    proc = subprocess.run([sys.executable, *args], cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]


@pytest.fixture(scope="module")
def result(tmp_path_factory):
    out = tmp_path_factory.mktemp("comm_volume")
    _run("-m", "experiments.comm_volume.run", "--quick", "--out", str(out))
    _run("-m", "experiments.comm_volume.plot", "--json", str(out / "comm_volume.json"), "--out", str(out / "comm_volume.png"),
         "--log-dir", str(out / "runs"))
    meta, rows = read_results(out / "comm_volume.json")
    return out, meta, rows


def test_every_backend_measured_at_both_degrees(result):
    _, meta, rows = result
    assert meta["kind"] == "measured" and meta["command"].endswith("--quick --out " + str(result[0]))
    assert {r["backend"] for r in rows} == BACKENDS
    expected = {(b, p) for b in BACKENDS for p in (2, 4)} - {("usp", 2)}  # usp needs 1 < U < P
    assert {(r["backend"], r["P"]) for r in rows if r["heads"] == "mha"} == expected
    assert all(r["same_on_all_ranks"] for r in rows)


def test_measured_bytes_equal_formula_forward_and_backward(result):
    _, _, rows = result
    for r in rows:
        assert r["formula_fwd_bytes"] > 0 and r["formula_bwd_bytes"] > 0, r
        assert r["measured_fwd_bytes"] == r["formula_fwd_bytes"], r
        assert r["measured_bwd_bytes"] == r["formula_bwd_bytes"], r


def test_negative_controls(result):
    """The backward formulas are not the forward ones, so equality above cannot come from mixing them up;
    and the volumes move with P the way the papers say."""
    _, _, rows = result
    by = {(r["method"], r["heads"], r["P"]): r for r in rows}
    for m in ("ring", "zigzag_ring", "colossal", "allgather_kv", "megatron_tp_sp"):
        r = by[(m, "mha", 4)]
        assert r["measured_bwd_bytes"] != r["measured_fwd_bytes"], r
    # Ulysses falls with P (4Nh/P); Megatron TP+SP's layer volume grows towards 4Nh
    assert by[("ulysses", "mha", 4)]["measured_fwd_bytes"] * 2 == by[("ulysses", "mha", 2)]["measured_fwd_bytes"]
    assert by[("megatron_tp_sp", "mha", 4)]["measured_fwd_bytes"] > by[("megatron_tp_sp", "mha", 2)]["measured_fwd_bytes"]
    # GQA shrinks the ring's K/V traffic by H_kv/H
    assert by[("ring", "gqa", 4)]["measured_fwd_bytes"] * 4 == by[("ring", "mha", 4)]["measured_fwd_bytes"]


def test_figure_drawn_and_logged(result):
    out, _, _ = result
    assert (out / "comm_volume.png").stat().st_size > 10_000
    assert list((out / "runs" / "figures").glob("events.out.tfevents.*"))
