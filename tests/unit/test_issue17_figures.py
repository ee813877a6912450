"""Issue 17's figures measured on the new machine (benchmarks/README.md section 10, section 9's session-28 table, and
the README's kv_pieces sentence) are those of the committed results files: a figure edited by hand, or a rerun not
copied over, fails here. (The regret and peers tables have their own tests: test_auto_regret_numbers.py,
test_bench_peers.py; the cost model's: test_cost_model_experiment.py.)"""

from __future__ import annotations

import json
from pathlib import Path
from tests.docs_text import documentation_text

ROOT = Path(__file__).resolve().parents[2]
RESULTS = ROOT / "benchmarks" / "results"
BENCH = (ROOT / "benchmarks" / "README.md").read_text()
SECTION_10 = BENCH.split("## 10. Issue 17's targets")[1]


def _rows(name: str) -> list[dict]:
    return json.loads((RESULTS / name).read_text())["rows"]


def test_kv_pieces_default_cost_is_the_files_range():
    rows = _rows("2026-11-28_cpu-amd-epyc-2c_kv-pieces-auto-session28.json")
    assert {(r["backend"], r["N"]) for r in rows} == {(b, n) for b in ("ring", "zigzag_ring", "allgather_kv", "ulysses")
                                                      for n in (4096, 8192)}
    ratios = [r["ratio_median"] for r in rows]
    quoted = f"{min(ratios):.3f}-{max(ratios):.3f}x"
    assert f"**{quoted}**" in SECTION_10
    assert f"the default\nmeasured {quoted} the time of `kv_pieces=1`" in documentation_text()
    assert max(ratios) <= 1.03  # issue 17's bound, as measured
    ulysses = [f"{r['ratio_median']:.3f}" for r in rows if r["backend"] == "ulysses"]
    assert f"`ulysses` ({ulysses[0]} / {ulysses[1]} at N = 4096 / 8192)" in SECTION_10


def test_efficiency_tables_and_summary_are_the_files():
    p2 = _rows("2026-11-28_cpu-amd-epyc-2c_efficiency-session28.json")
    p4 = _rows("2026-11-28_cpu-amd-epyc-2c_efficiency-p4-session28.json")
    session = BENCH.split("### Session 28, 2026-11-28: the new machine, P = 2 and P = 4")[1].split("\n## ")[0]
    for r in p2 + p4:
        row = (f"| {r['seq_len']} | {r['world']} | {r['backend']} | {r['median_s']:.3f} | {r['causal_call_s']:.3f} | "
               f"{r['full_call_s']:.3f} | {r['share']:.3f} | {r['own_work']:.3f} |")
        assert row in session, row
    balanced = [r["share"] for r in p2 if r["backend"] != "ring"]
    assert f"P = 2: **{min(balanced):.3f}-{max(balanced):.3f}**" in SECTION_10
    assert min(balanced) >= 0.90  # issue 17's bound, as measured
    balanced4 = [r["share"] for r in p4 if r["backend"] != "ring"]
    assert f"{min(balanced4):.3f}-{max(balanced4):.3f}" in SECTION_10


def test_regret_and_first_call_in_section_10_are_the_files():
    data = json.loads((RESULTS / "2026-11-28_cpu-amd-epyc-2c_auto-regret-session28.json").read_text())["rows"]
    regrets = [r["regret"] for r in data]
    first = [r["first_call_s"] for r in data]
    assert f"**{sum(regrets) / len(regrets):.3f} / {max(regrets):.3f}**; first call {min(first):.1f}-{max(first):.1f} s" \
        in SECTION_10
    assert f"(measured {min(first):.1f}-{max(first):.1f} s on the CPU grid below" in documentation_text()


def test_peer_cell_ratios_are_the_files():
    """The allgather_kv / ulysses cells timed alone (``scripts/bench_peer_cell.py``), as section 8's run 12 and the
    README's peers row quote them."""
    readme = " ".join(documentation_text().split())
    run12 = " ".join(BENCH.split("### Run 12,")[1].split("\n### ")[0].replace("**", "").split())
    for pair in ("allgather_kv", "ulysses"):
        rows = json.loads((RESULTS / f"2026-11-28_peer-cell_{pair}_N4096.json").read_text())["rows"]
        assert [r["launch"] for r in rows] == [1, 2, 3]
        ratios = [f"{r['ours_over_peer']:.3f}" for r in rows]
        check = [r["ours_over_unchecked"] for r in rows]
        assert ", ".join(ratios) in run12, (pair, ratios)
        assert f"ours / unchecked {min(check):.3f}-{max(check):.3f}" in run12, pair
    rows = json.loads((RESULTS / "2026-11-28_peer-cell_allgather_kv_N4096.json").read_text())["rows"]
    ratios = [f"{r['ours_over_peer']:.3f}" for r in rows]
    check = [r["ours_over_unchecked"] for r in rows]
    assert f"{ratios[0]}, {ratios[1]} and {ratios[2]} timed alone" in readme
    assert f"the cross-rank check cost {min(check):.3f}-{max(check):.3f}x" in readme
