"""Smoke test of ``scripts/bench_attention.py``: the volume and memory sections in ``--quick`` mode
(the DeepSpeed section is left out: it needs the optional ``bench`` extra and takes minutes)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.distributed

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "scripts" / "bench_attention.py"
BACKENDS = {"ulysses", "ring", "zigzag_ring", "allgather_kv", "usp", "colossal"}


def test_bench_quick_volume_and_memory(tmp_path):
    cmd = [sys.executable, str(SCRIPT), "--quick", "--sections", "volume,memory", "--vol-seq-len", "128",
           "--mem-seq-len", "512", "--out", str(tmp_path), "--name", "smoke", "--timeout", "120"]
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, f"exit {proc.returncode}\nstdout:\n{proc.stdout[-4000:]}\nstderr:\n{proc.stderr[-4000:]}"
    data = json.loads((tmp_path / "smoke.json").read_text())
    assert (tmp_path / "smoke.csv").stat().st_size > 0
    meta, results = data["meta"], data["results"]
    for key in ("device", "date", "command", "runtime_s", "config", "memory_method"):
        assert key in meta, key
    assert {"cpu_model", "cpu_cores", "torch"} <= meta["device"].keys()
    assert set(results) == {"volume", "memory"}

    volume = results["volume"]
    assert {(r["backend"], r["world"]) for r in volume} == {(b, p) for b in BACKENDS for p in (2, 4)}
    for r in volume:
        assert r["analytic_elements"] > 0
        assert r["ratio"] == pytest.approx(1.0, abs=0.05), r

    memory = results["memory"]
    assert {(r["backend"], r["world"]) for r in memory} == {("local", 1)} | {(b, p) for b in BACKENDS for p in (2, 4)}
    for r in memory:
        assert r["saved_for_backward_bytes"] > 0
        for key in ("peak_rss_increase_fwd_bytes", "peak_rss_increase_fwd_bwd_bytes", "local_qkv_bytes"):
            assert key in r
