"""Smoke tests of the benchmark scripts: ``benchmarks/attention/run.py``'s volume and memory sections in
``--quick`` mode (its DeepSpeed section is left out: it takes minutes), and ``benchmarks/peers/run.py --quick``
(one run for every pair that can run here; the DeepSpeed pair needs the optional ``bench`` extra)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.distributed

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ["-m", "benchmarks.attention.run"]
BACKENDS = {"ulysses", "ring", "zigzag_ring", "allgather_kv", "usp", "colossal"}


def test_bench_quick_volume_and_memory(tmp_path):
    cmd = [sys.executable, *SCRIPT, "--quick", "--sections", "volume,memory", "--vol-seq-len", "128",
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


PEERS_SCRIPT = ["-m", "benchmarks.peers.run"]


def _has_deepspeed() -> bool:
    import importlib.util

    return importlib.util.find_spec("deepspeed") is not None


TORCH_PAIRS = ["zigzag_ring", "ring", "allgather_kv"]  # PyTorch's ring ships with torch: always runs


@pytest.fixture(scope="module")
def peers_quick(tmp_path_factory):
    """One ``bench_peers.py --quick`` run over every pair that can run here: ``(rows by pair, stdout)``."""
    out = tmp_path_factory.mktemp("peers")
    pairs = TORCH_PAIRS + (["ulysses"] if _has_deepspeed() else [])
    cmd = [sys.executable, *PEERS_SCRIPT, "--quick", "--pairs", ",".join(pairs), "--out", str(out),
           "--name", "peers", "--timeout", "120", "--launches", "2"]  # two fresh starts of the ranks, pooled
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, f"exit {proc.returncode}\nstdout:\n{proc.stdout[-4000:]}\nstderr:\n{proc.stderr[-4000:]}"
    data = json.loads((out / "peers.json").read_text())
    assert (out / "peers.csv").stat().st_size > 0
    for key in ("command", "date", "hardware", "runtime_s", "config", "load_average_1m_start"):
        assert key in data, key
    assert [r["pair"] for r in data["results"]] == pairs
    assert "time ratio" in proc.stdout and "mem ratio" in proc.stdout
    for r in data["results"]:  # both launches' reps pooled, each launch's verdict kept
        assert r["launches"] == 2 and r["reps_per_launch"] == [1, 1] and len(r["ours_all_s"]) == 2, r
        assert r["launch_verdicts"] == ["few reps", "few reps"] and r["time_verdict"] == "few reps"
    assert "launch 2 of 2 done" in proc.stdout
    return {r["pair"]: r for r in data["results"]}


def _check_row(r):
    """Both sides agreed (out, dq, dk, dv) and the negative control is far; both ratios were measured."""
    assert r["max_abs_diff_out_and_grads"] <= 1e-3 < r["negative_control_diff"] / 100, r
    assert r["time_ratio"] > 0 and r["time_ratio_best"] > 0 and r["memory_ratio"] > 0, r
    assert r["ours_peak_bytes"] > 0 and r["peer_peak_bytes"] > 0, r
    assert len(r["peaks_by_rank"]) == 2
    assert r["ours_settings"].startswith("defaults")
    lo, hi = r["time_ratio_ci95"]  # the ratio's interval is recorded; one rep (--quick) earns no verdict
    assert lo <= r["time_ratio"] <= hi and r["time_verdict"] == "few reps", r


def test_bench_peers_quick_torch_ring(peers_quick):
    """Ours vs PyTorch's ring in its three forms; the load-balanced pairs shard exactly as PyTorch's
    head-tail balancer does (our zigzag layout), so both sides hold the same tokens."""
    for pair in TORCH_PAIRS:
        r = peers_quick[pair]
        _check_row(r)
        assert ("head-tail" in r["peer"]) == (pair != "ring"), r["peer"]
        assert r["same_positions"], r


@pytest.mark.skipif(not _has_deepspeed(), reason="DeepSpeed is not installed (the optional `bench` extra: "
                    "DS_BUILD_OPS=0 pip install deepspeed)")
def test_bench_peers_quick_deepspeed(peers_quick):
    r = peers_quick["ulysses"]
    _check_row(r)
    assert r["peer"].startswith("deepspeed.sequence.layer.DistributedAttention") and r["peer_version"]


def test_bench_kv_pieces_writes_what_it_prints(tmp_path):
    """``benchmarks/kv_pieces/run.py --out``: one row per (N, backend), each ratio the quotient of the medians it
    records, and the file says what ran (the README's kv_pieces figures are read from such a file)."""
    out = tmp_path / "kv.json"
    cmd = [sys.executable, "-m", "benchmarks.kv_pieces.run", "--seq-lens", "256", "--reps", "1",
           "--backends", "ring,ulysses", "--pieces", "auto", "--out", str(out)]
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, f"exit {proc.returncode}\nstdout:\n{proc.stdout[-4000:]}\nstderr:\n{proc.stderr[-4000:]}"
    data = json.loads(out.read_text())
    assert data["meta"]["kind"] == "measured" and "--pieces auto" in data["meta"]["command"]
    assert [(r["N"], r["backend"], r["kv_pieces"]) for r in data["rows"]] == [(256, "ring", "auto"), (256, "ulysses", "auto")]
    for r in data["rows"]:
        assert r["median_s"] > 0 and r["whole_median_s"] > 0
        assert r["ratio_median"] == pytest.approx(r["median_s"] / r["whole_median_s"])
        assert f"{r['backend']:12s} kv_pieces=auto: median {r['median_s']:.3f} s" in proc.stdout


def test_bench_peer_cell_quick(tmp_path):
    """``benchmarks/peers/cell.py --quick``: one launch of ours, ours unchecked and the peer in one cell; the file
    holds each side's reps and ratios that are the quotients of its medians."""
    cmd = [sys.executable, "-m", "benchmarks.peers.cell", "--quick", "--pair", "zigzag_ring",
           "--out", str(tmp_path), "--name", "cell"]
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, f"exit {proc.returncode}\nstdout:\n{proc.stdout[-4000:]}\nstderr:\n{proc.stderr[-4000:]}"
    data = json.loads((tmp_path / "cell.json").read_text())
    assert data["meta"]["config"]["pair"] == "zigzag_ring" and data["meta"]["launches"] == 1
    (row,) = data["rows"]
    for side in ("ours", "ours_unchecked", "peer"):
        assert len(row[f"{side}_all_s"]) == 2 and row[f"{side}_median_s"] > 0
    assert row["ours_over_peer"] == pytest.approx(row["ours_median_s"] / row["peer_median_s"])
    assert row["ours_over_unchecked"] == pytest.approx(row["ours_median_s"] / row["ours_unchecked_median_s"])


def test_bench_cross_rank_check_quick(tmp_path):
    """The benchmark calls the check's private functions: a smoke run keeps it in step with their signatures."""
    cmd = [sys.executable, "-m", "benchmarks.cross_rank_check.run", "--quick", "--world", "2", "--seq-len", "256",
           "--heads", "4", "--head-dim", "16", "--backends", "zigzag_ring", "--out", str(tmp_path), "--timeout", "120"]
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, f"exit {proc.returncode}\nstdout:\n{proc.stdout[-4000:]}\nstderr:\n{proc.stderr[-4000:]}"
    (path,) = tmp_path.glob("cross_rank_check_*_quick.json")
    rows = json.loads(path.read_text())["results"]
    assert {r["rank"] for r in rows} == {0, 1}
    assert all(r["check_alone_s"] > 0 and r["fwd_bwd_unchecked_s"] > 0 for r in rows)
