"""Smoke test of the cost-model experiment (``experiments/cost_model/run.py --quick``): calibration,
validation (both grids) on 2 gloo ranks and the papers' predictions land in result files that keep
measured and model columns apart; the plot script draws from them."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]

pytestmark = pytest.mark.distributed


def test_cost_model_quick(tmp_path):
    from experiments.cost_model import calibrate
    from lightning_sp.cost_model import HardwareProfile

    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}
    proc = subprocess.run([sys.executable, "-m", "experiments.cost_model.run", "--quick", "--out", str(tmp_path)],
                          env=env, capture_output=True, text=True, timeout=240, cwd=ROOT)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]

    val = json.loads((tmp_path / "cost_model_validation.json").read_text())
    assert val["kind"] == "measured" and "-m experiments.cost_model.run --quick" in val["command"]
    rows = val["results"]
    assert {r["backend"] for r in rows} == {"ulysses", "zigzag_ring", "allgather_kv"}
    for r in rows:
        assert r["P"] == 2 and r["measured_ms"] > 0 and r["model_predicted_ms"] > 0
        assert r["measured_iqr_pct"] >= 0  # the spread of its reps (2 with --quick), beside the median
        assert r["model_error_pct"] == pytest.approx(100 * (r["model_predicted_ms"] - r["measured_ms"]) / r["measured_ms"], abs=0.2)
        assert not any(k.startswith("paper") for k in r)  # no paper numbers among measurements
    assert {r["grid"] for r in rows} == {"grid1", "grid2"}
    for grid in ("grid1", "grid2"):  # how many reps each median is of, recorded
        data = json.loads((tmp_path / f"cost_model_validation_{grid}.json").read_text())
        assert data["reps_per_case"] == 2
        # the machine's speed while the rows ran (for reading a run): one probe per round, beside the calibration's
        probe = data["probe_s"]["2"]
        assert len(probe["rounds"]) == 2 and all(x > 0 for x in probe["rounds"]) and probe["at_calibration"] > 0
        assert probe["slowdown"] == pytest.approx(sum(probe["rounds"]) / 2 / probe["at_calibration"])
        # recorded: the stretch during the rows over the grid's time alone; priced by: the stretch against the table
        # (the rounds' median probe over what the calibration's kernel table prices the probe's call at)
        during = sum(probe["rounds"]) / 2 / data["sharing_now"]["alone_s"]
        assert data["sharing_during_rows"] == {"2": pytest.approx(during)}
        priced_s = calibrate.probe_call_priced_s(HardwareProfile.from_dict(data["calibration_profile"]))
        against = sum(probe["rounds"]) / 2 / priced_s
        assert data["sharing_against_table"] == {"2": pytest.approx(against)}
        assert data["calibration_profile"]["compute_sharing"] == [[2, pytest.approx(against)]]
    profile = val["calibration_profile"]
    assert profile["intra_bandwidth"] > 0 and profile["intra_latency"] >= 0 and len(profile["attention_curve"]) == 2
    assert profile["kernel_table"] and profile["message_s"] and profile["compute_sharing"]  # the calibrated terms
    assert {b for b, w, _ in profile["layer_latency_s"]} == {"ulysses", "ring", "zigzag_ring", "allgather_kv"}
    assert [w for w, _ in profile["sync_delay_s"]] == [2]  # measured at the grid's start, recorded in the profile
    calibration = json.loads((tmp_path / "cost_model_calibration.json").read_text())
    assert calibration["sync_delay"]["2"]["delay_s"] >= 0
    assert set(calibration["stubbed_layers"]["2"]) == {"ulysses", "ring", "zigzag_ring", "allgather_kv"}
    cal = json.loads((tmp_path / "cost_model_calibration.json").read_text())
    assert cal["kind"] == "measured" and cal["hardware"]["device"] and cal["date"]  # machine and date recorded

    pred = json.loads((tmp_path / "cost_model_predictions.json").read_text())
    assert pred["kind"] == "model"
    studies = {r["study"] for r in pred["results"]}
    assert {"Ulysses Fig. 2/3", "Ring Attention Table 3", "ring-flash-attn README"} <= studies
    for r in pred["results"]:
        assert "measured" not in " ".join(r)  # model output only
        if r["paper_value"] is not None and r["model_prediction"] is not None:
            assert r["diff_pct"] == pytest.approx(100 * (r["model_prediction"] - r["paper_value"]) / r["paper_value"], abs=0.1)

    png = tmp_path / "cost_model_validation.png"
    plot = subprocess.run([sys.executable, "-m", "experiments.cost_model.plot", "--results",
                           str(tmp_path / "cost_model_validation.json"), "--out", str(png), "--log-dir", str(tmp_path / "runs")],
                          env=env, capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert plot.returncode == 0, plot.stderr[-3000:]
    assert png.stat().st_size > 10_000
    assert list((tmp_path / "runs" / "figures").iterdir())  # the figure is in TensorBoard too




def test_sync_delay_primitive_reads_a_rank_that_reaches_its_synchronisations_late():
    """``calibrate.measure_sync_delay`` (the delay per synchronisation, Note [Per-call terms]): with the last rank
    sleeping 30 ms before every synchronisation in even rounds (3 of 5: the median round is a late one), the delay
    reads about 30 ms; the control, the same primitive without the sleep, reads under 10 ms."""
    from experiments.cost_model.calibrate import measure_sync_delay

    late = measure_sync_delay((2,), rounds=5, blocks=1, late_s=0.03)[2]
    calm = measure_sync_delay((2,), rounds=5, blocks=1)[2]
    assert 0.02 < late["delay_s"] < 0.05, late["delay_s"]
    assert calm["delay_s"] < 0.01, calm["delay_s"]
    assert len(calm["rounds"]) == 1 and all(len(step) == 5 for step in calm["rounds"][0])


_HOG = "import time\nwhile True: pass\n"


def test_probe_sees_a_competing_job():
    """The validation's probe of the machine's speed (``calibrate._kernel_seconds_per_call``, what
    ``shared_window`` runs on each rank every round) reads slower when another job takes half of its core: the
    probe pinned to one core, alone and then with a busy loop pinned to the same core. Control: alone twice
    reads the same speed within 50%."""
    if not hasattr(os, "sched_setaffinity"):
        pytest.skip("needs os.sched_setaffinity (Linux)")
    from experiments.cost_model.calibrate import _kernel_seconds_per_call

    core = min(os.sched_getaffinity(0))
    before = os.sched_getaffinity(0)
    os.sched_setaffinity(0, {core})
    try:
        alone = [_kernel_seconds_per_call(0.3) for _ in range(2)]
        hog = subprocess.Popen([sys.executable, "-c", _HOG], preexec_fn=lambda: os.sched_setaffinity(0, {core}))
        try:
            time.sleep(0.2)
            shared = _kernel_seconds_per_call(0.3)
        finally:
            hog.kill()
            hog.wait()
    finally:
        os.sched_setaffinity(0, before)
    assert max(alone) / min(alone) < 1.5, alone
    assert shared / max(alone) > 1.4, (alone, shared)


_TOUCH_TWICE = """
import ctypes, resource
libc = ctypes.CDLL(None); libc.malloc.restype = ctypes.c_void_p
def touch():  # a 16 MiB block from malloc, every page written once, then freed
    p = libc.malloc(16 << 20); ctypes.memset(p, 1, 16 << 20); libc.free(ctypes.c_void_p(p))
touch()  # glibc's default: mapped fresh, unmapped on free (its thresholds move), then served from a heap it trims
f0 = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
touch()
print(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - f0)
"""
_KEEP_THEN_TOUCH = f"""
import subprocess, sys
from experiments.common.launch import keep_freed_memory
assert keep_freed_memory()
child = subprocess.run([sys.executable, "-c", {_TOUCH_TWICE!r}], capture_output=True, text=True, check=True)
print(child.stdout.split()[-1])  # a process started afterwards
exec({_TOUCH_TWICE!r})  # this process
"""


def test_keep_freed_memory_keeps_pages_warm_here_and_in_processes_started_after():
    """``keep_freed_memory`` (Note [Fresh pages]): after it, this process and one it starts write a freed
    16 MiB block's pages again without a page fault; without it (the control) the second block is fresh
    memory (~4096 faults of 4 KiB)."""
    import platform

    if sys.platform != "linux" or platform.libc_ver()[0] != "glibc":
        pytest.skip("glibc only")
    env = {k: v for k, v in os.environ.items() if not k.startswith("MALLOC_")}
    env["PYTHONPATH"] = str(ROOT)

    def faults(code):
        out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120, cwd=ROOT)
        assert out.returncode == 0, out.stderr[-2000:]
        return [int(x) for x in out.stdout.split()]

    child, here = faults(_KEEP_THEN_TOUCH)
    (default,) = faults(_TOUCH_TWICE)
    assert child < 64 and here < 64 and default > 2048, (child, here, default)


def test_split_puts_the_kernel_apart_from_the_rest_measured_and_modelled(tmp_path):
    """``experiments.cost_model.split``: the time inside the kernel calls and the rest of the step, per backend,
    beside the model's split. With ``--stub-kernel`` the kernel calls return zeros (the control: their time must
    collapse while the rest remains); the model's columns add up to its total and are the same in both runs."""
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}
    runs = {}
    for stub in (False, True):
        out = tmp_path / f"split_{stub}.json"
        cmd = [sys.executable, "-m", "experiments.cost_model.split", "--world", "2", "--seq", "512", "--heads", "4",
               "--kv-heads", "2", "--head-dim", "32", "--kv-pieces", "2", "--backends", "ulysses", "zigzag_ring",
               "--reps", "3", "--out", str(out)] + (["--stub-kernel"] if stub else [])
        proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=240, cwd=ROOT)
        assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
        runs[stub] = {r["backend"]: r for r in json.loads(out.read_text())["results"]}
    for backend in ("ulysses", "zigzag_ring"):
        real, stub = runs[False][backend], runs[True][backend]
        for r in (real, stub):
            assert 0 < r["measured_kernel_ms"] < r["measured_step_ms"] and 0 < r["measured_rest_ms"] <= r["measured_step_ms"]
            assert r["model_kernel_ms"] + r["model_rest_ms"] == pytest.approx(r["model_total_ms"])
        assert stub["measured_kernel_ms"] < 0.5 * real["measured_kernel_ms"], (backend, stub, real)
        assert stub["model_total_ms"] == pytest.approx(real["model_total_ms"])  # the model does not see the stub


def test_split_kernel_stub_returns_zeros_shaped_as_the_real_call():
    """The stub's results have the real call's shapes, strides and dtypes (a mismatch would break the backend's
    merges, not time them), are zeros, and its first call per signature runs the real kernel outside the timed sum."""
    import torch

    from experiments.cost_model.split import SplitKernel
    from lightning_sp.ops.kernels import MaskKind, make_kernel

    inner = make_kernel("sdpa")
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, 64, 2, 16, generator=g) for _ in range(3))
    real = inner.forward(q, k, v, scale=0.25, kind=MaskKind.CAUSAL, mask=None)
    stub = SplitKernel(inner, stub=True)
    for _ in range(2):
        got = stub.forward(q, k, v, scale=0.25, kind=MaskKind.CAUSAL, mask=None)
        assert [(t.shape, t.stride(), t.dtype) for t in got] == [(t.shape, t.stride(), t.dtype) for t in real]
        assert all(not t.any() for t in got)
    timed = SplitKernel(inner, stub=False)
    out, lse = timed.forward(q, k, v, scale=0.25, kind=MaskKind.CAUSAL, mask=None)
    assert torch.equal(out, real[0]) and timed.seconds > 0
