"""``scripts/bench_peers.py`` without ranks: its agreement check can fail (a peer that disagrees, or a tolerance
too loose to fail, stops the run before timing), and the ratios the README and benchmarks/README quote are the
committed results file's."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
import torch

from tests.script_import import load_script

ROOT = Path(__file__).resolve().parents[2]


def _bench_peers():
    return load_script("bench_peers")


def _grads(seed: int) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(1, 64, 2, 8, generator=g) for _ in range(4)]  # out, dq, dk, dv [B, N, H, D]


def test_agreement_passes_close_sides_and_stops_disagreeing_ones():
    agreement = _bench_peers().agreement
    ours = _grads(0)
    peer = [t + 1e-7 for t in ours]
    diff, control = agreement(ours, peer, 1e-5, "x and y")
    assert diff == pytest.approx(1e-7, rel=0.5) and control > 1e-3
    wrong = [t.clone() for t in ours]
    wrong[2][0, 5, 1, 3] += 1e-3  # one element of dk
    with pytest.raises(AssertionError, match=r"x and y disagree: max \|diff\| over out, dq, dk, dv 0.001"):
        agreement(ours, wrong, 1e-5, "x and y")
    with pytest.raises(AssertionError, match="negative control .* cannot fail at this tolerance"):
        agreement(ours, peer, 1.0, "x and y")  # a tolerance that a shifted output would pass


def _recomputed_verdict(row: dict) -> str:
    """A results row's time verdict from its own reps: each launch's interval (the pooled reps split by
    ``reps_per_launch``), combined by ``launch_verdict``; files before ``--launches`` are one launch."""
    bp = _bench_peers()
    sizes, ours, peer, verdicts, start = row.get("reps_per_launch", [len(row["ours_all_s"])]), row["ours_all_s"], \
        row["peer_all_s"], [], 0
    for n in sizes:
        verdicts.append(bp.time_verdict(bp.ratio_ci(ours[start:start + n], peer[start:start + n])))
        start += n
    assert start == len(ours) == len(peer)
    return bp.launch_verdict(verdicts)


def _cell(pair: str, n: int, ours_s: list[float], peer_s: list[float], peak: int = 100) -> dict:
    """A ``_worker`` row of one launch, as far as ``pool_launches`` reads it."""
    import statistics

    bp = _bench_peers()
    return {"pair": pair, "seq_len": n, "ours_peak_bytes": peak, "peer_peak_bytes": 200,
            "peaks_by_rank": [{"ours": peak, "peer": 200}, {"ours": peak - 10, "peer": 190}],
            "max_abs_diff_out_and_grads": 1e-7, "negative_control_diff": 3.0, "ours_all_s": ours_s, "peer_all_s": peer_s,
            "time_ratio": statistics.median(ours_s) / statistics.median(peer_s), "load_average_1m": 1.0,
            "load_average_1m_by_round": [1.0], **bp.ratio_spread(ours_s, peer_s)}


def test_a_verdict_must_hold_in_every_launch():
    """``launch_verdict``: ahead / behind only where every launch says so; one launch is its own verdict; a launch
    with too few reps withholds it. ``pool_launches``: a cell ahead in one launch and behind in the next pools to
    parity although its pooled reps alone would call it (the control), and times, peaks and launches are kept."""
    bp = _bench_peers()
    lv = bp.launch_verdict
    assert lv(["ahead"]) == "ahead" and lv(["behind"]) == "behind" and lv(["parity"]) == "parity"
    assert lv(["ahead", "ahead", "ahead"]) == "ahead" and lv(["behind", "behind"]) == "behind"
    assert lv(["ahead", "parity"]) == "parity" and lv(["ahead", "behind"]) == "parity"
    assert lv(["ahead", "few reps"]) == "few reps" and lv([]) == "few reps"
    peer = [1.0 + 0.001 * i for i in range(30)]
    fast, slow = [0.95 * t for t in peer], [1.02 * t for t in peer[:10]]  # a long launch ahead, a short one behind
    pooled = bp.pool_launches([[_cell("ring", 4096, fast, peer, peak=90)], [_cell("ring", 4096, slow, peer[:10])]])
    (row,) = pooled
    assert row["launch_verdicts"] == ["ahead", "behind"] and row["time_verdict"] == "parity"
    assert row["time_verdict_pooled"] == "ahead"  # the control: the pooled reps alone claim a lead
    assert row["reps"] == 40 and row["reps_per_launch"] == [30, 10] and row["launches"] == 2
    assert row["ours_peak_bytes"] == 100 and row["memory_ratio"] == 0.5  # the worst launch's peak
    assert row["peaks_by_rank"] == [{"ours": 100, "peer": 200}, {"ours": 90, "peer": 190}]  # each rank's worst
    assert _recomputed_verdict(row) == "parity"
    (one,) = bp.pool_launches([[_cell("ring", 4096, fast, peer)]])
    assert one["time_verdict"] == "ahead" and one["launch_time_ratios"] == [pytest.approx(0.95)]
    with pytest.raises(ValueError, match="different grids"):
        bp.pool_launches([[_cell("ring", 4096, fast, peer)], [_cell("ring", 8192, fast, peer)]])


def test_ratio_spread_pairs_reps_and_rejects_unpaired():
    """The per-rep ratios pair rep i of each side (not sorted lists), and their quartiles bracket the median."""
    spread = _bench_peers().ratio_spread
    s = spread([1.0, 2.0, 3.0, 4.0, 6.0], [2.0, 2.0, 2.0, 2.0, 2.0])
    assert s["time_ratios"] == [0.5, 1.0, 1.5, 2.0, 3.0]
    assert (s["time_ratio_min"], s["time_ratio_q1"], s["time_ratio_rep_median"], s["time_ratio_q3"], s["time_ratio_max"]) \
        == (0.5, 1.0, 1.5, 2.0, 3.0)
    assert s["time_ratio_share_le_1"] == pytest.approx(0.4)
    assert spread([3.0, 1.0], [1.0, 3.0])["time_ratios"] == [3.0, 1 / 3]  # paired by rep, not by rank of time
    with pytest.raises(ValueError, match="as many ours as peer reps"):
        spread([1.0, 2.0], [1.0])


def test_ratio_ci_brackets_the_ratio_and_gives_a_verdict_only_beyond_the_noise():
    """A side 10% faster in every rep is ahead; the same times are at parity; 10% slower is behind. Noise of +-20%
    around a 1% lead is parity (the interval spans 1.0), and the interval holds the ratio of medians."""
    import random
    import statistics

    bp = _bench_peers()
    rng = random.Random(1)
    peer = [1.0 + 0.01 * rng.random() for _ in range(20)]
    assert bp.time_verdict(bp.ratio_ci([0.9 * t for t in peer], peer)) == "ahead"
    assert bp.time_verdict(bp.ratio_ci(list(peer), peer)) == "parity"
    assert bp.time_verdict(bp.ratio_ci([1.1 * t for t in peer], peer)) == "behind"
    spread = [1 + 0.2 * (2 * i / 19 - 1) for i in range(20)]  # -20% .. +20%, evenly, in a shuffled order
    rng.shuffle(spread)
    noisy = [0.99 * t * f for t, f in zip(peer, spread)]
    lo, hi = bp.ratio_ci(noisy, peer)
    assert lo < statistics.median(noisy) / statistics.median(peer) < hi and lo < 1.0 < hi
    assert bp.ratio_ci(noisy, peer) == (lo, hi)  # seeded: the same reps give the same interval
    # paired: slow spells that hit both sides of half the reps stay out of the ratio. Control: the same times
    # resampled unpaired (each side on its own indices) give an interval across 1.0
    spell = [3.0 if i % 2 else 1.0 for i in range(20)]
    ours = [0.95 * t for t in spell]
    assert bp.time_verdict(bp.ratio_ci(ours, spell)) == "ahead"
    unpaired = sorted(statistics.median(rng.choices(ours, k=20)) / statistics.median(rng.choices(spell, k=20))
                      for _ in range(2000))
    assert unpaired[50] < 1.0 < unpaired[1949]
    # too few reps for a verdict, however clear the one rep looks (the --quick smoke run)
    assert bp.ratio_spread([0.5], [1.0])["time_verdict"] == "few reps"
    assert bp.ratio_spread([0.9 * t for t in peer], peer)["time_verdict"] == "ahead"


def test_rank_timeout_covers_the_measured_runs():
    """The default timeout grows with the rounds: the measured runs (5 rounds in 672 s, 8 in 992 s on the 2-core
    CPU, 2026-11-24) fit with room to spare, which a fixed 900 s did not for 8 rounds."""
    bp = _bench_peers()
    assert bp.rank_timeout(5) > 1.5 * 672 and bp.rank_timeout(8) > 1.5 * 992 > 900


def test_run12_launch_table_is_its_file():
    """benchmarks/README.md's launch-by-launch table of run 12 holds each launch's ratio, interval and verdict as the
    file records them, and the verdict over the launches is ``launch_verdict`` of the file's own reps."""
    data = json.loads((ROOT / "benchmarks/results/2026-11-28_cpu-amd-epyc-2c_run12_peers.json").read_text())
    section = (ROOT / "benchmarks" / "README.md").read_text().split("### Run 12,")[1].split("\n### ")[0]
    for r in data["results"]:
        assert r["launches"] == 3 and r["time_verdict"] == _recomputed_verdict(r), r["pair"]
        row = (f"| {r['pair']} | {r['seq_len']} | " + " / ".join(f"{x:.3f}" for x in r["launch_time_ratios"]) + " | "
               + " / ".join(f"[{a:.3f}-{b:.3f}] {v}" for (a, b), v in zip(r["launch_ci95"], r["launch_verdicts"]))
               + f" | {r['time_verdict_pooled']} | **{r['time_verdict']}** |")
        assert row in section, row
