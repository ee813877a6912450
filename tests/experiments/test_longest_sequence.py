"""Smoke test of ``experiments/longest_sequence/run.py --quick``: the searched N fits the budget and
N + granularity does not, re-measured in fresh processes; ring attention on 2 ranks reaches a longer N
than one process; the figure script draws from the result file."""

from __future__ import annotations

import importlib
import statistics
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]

# Repeatability of one measurement: the same step re-measured in another process differs by up to
# ~0.16 MiB (malloc/gloo/page-level noise, measured on the first machine); on the AVX-512 machine of
# 2026-11-24, ring at P = 2, N = 1280 read 2.81-3.03 MiB in five fresh spawns (idle) and 2.72 against the
# search's 3.07 under CI's load, where one re-measure failed this test. So the test re-measures each point
# REMEASURES times in fresh ranks and compares the median: a searched boundary that moved by a step
# (~0.35 MiB) still fails.
REPEATABILITY_BYTES = int(0.25 * 2**20)
REMEASURES = 3


def _load(name: str):
    return importlib.import_module(name)  # spawned ranks find the workers by this name


@pytest.mark.distributed
@pytest.mark.timeout(900)  # ~30 s on a quiet 2-core machine; the ranks' own timeouts (240 s) catch hangs
def test_quick_search_boundary_is_measured(tmp_path):
    exp = _load("experiments.longest_sequence.run")
    from experiments.common.results import read_results

    assert exp.main(["--quick", "--out", str(tmp_path), "--timeout", "240"]) == 0
    meta, rows = read_results(tmp_path / "longest_sequence.json")
    assert meta["kind"] == "measured" and meta["quick"] and meta["complete"] and "VmHWM" in meta["memory_method"]
    assert (tmp_path / "longest_sequence.csv").is_file() and (tmp_path / "runs").is_dir()
    cfg, budget = exp.QUICK, exp.QUICK.budget_bytes
    by = {(r["method"], r["P"]): r for r in rows}
    assert set(by) == {(m, p) for p, ms in exp.QUICK_PLAN.items() for m in ms}
    for (method, p), r in by.items():
        n, step = r["longest_N"], cfg.step(p)
        assert n > 0 and n % step == 0 and r["next_N_not_fitting"] == n + step
        # the search's own probes: N measured within the budget, N + step over it
        assert r["peak_at_longest_bytes"] <= budget < r["peak_at_next_bytes"]
        # re-measured from scratch in fresh ranks, the median of REMEASURES spawns
        again = [exp.measure_points(p, [(method, n), (method, n + step)], cfg, timeout_s=240) for _ in range(REMEASURES)]
        at_n, at_next = (statistics.median(point) for point in zip(*again))
        assert at_n <= budget + REPEATABILITY_BYTES, (method, p, n, at_n, budget)
        assert at_next > budget - REPEATABILITY_BYTES, (method, p, n + step, at_next, budget)
        assert at_n < at_next  # negative control: the measurement sees the extra tokens
    # ring attention splits the activations over 2 ranks: a longer sequence fits than in one process
    assert by[("ring", 2)]["longest_N"] > by[("memory_efficient+chunked_ffn", 1)]["longest_N"]

    plot = _load("experiments.longest_sequence.plot")
    assert plot.main(["--results", str(tmp_path / "longest_sequence.json"), "--log-dir", str(tmp_path / "runs")]) == 0
    assert (tmp_path / "longest_sequence.png").stat().st_size > 10_000
    assert "| ring attention (+ chunked FFN) | 2 |" in (tmp_path / "longest_sequence.md").read_text()


def test_bad_configs_are_rejected():
    exp = _load("experiments.longest_sequence.run")
    with pytest.raises(ValueError, match="multiple of granularity"):
        exp.SearchConfig(budget_mib=4, granularity=64, start=100, max_tokens=4096)
    with pytest.raises(ValueError, match="budget_mib must be > 0"):
        exp.SearchConfig(budget_mib=0, granularity=64, start=128, max_tokens=4096)
    with pytest.raises(ValueError, match="need P=1"):
        exp.run_search({2: ["vanilla"]}, exp.QUICK)
    with pytest.raises(ValueError, match="unknown methods"):
        exp.run_search({2: ["megatron"]}, exp.QUICK)
