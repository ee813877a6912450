"""The README's and benchmarks/README.md's ``auto`` regret tables quote the committed results files: every row,
the mean and the worst (a number edited by hand, or a rerun not copied over, fails here). The README quotes the
newest run; benchmarks/README.md keeps each run under its own heading."""

from __future__ import annotations

import json
import re
from pathlib import Path
from tests.docs_text import documentation_text

ROOT = Path(__file__).resolve().parents[2]
RESULTS = ROOT / "benchmarks/results/2026-11-28_cpu-amd-epyc-2c_auto-regret-session28.json"
"""The newest run: the README's table."""
RUNS = {RESULTS: "### On a new machine, session 28",
        ROOT / "benchmarks/results/2026-11-24_cpu-amd-epyc-2c_auto-regret-groups.json": "### On the merged tree, after"}
"""Each run's file and the heading of its subsection in benchmarks/README.md."""


def _quoted_rows(text: str, after: str) -> list[list[str]]:
    """The rows of the first regret table after ``after`` in ``text``."""
    start = text.index(after)
    rows = []
    for line in text[start:].splitlines():
        if line.startswith("| P |"):
            rows = []
            continue
        if rows == [] and line.startswith("|---"):
            continue
        if line.startswith("| ") and re.match(r"\| \d", line):
            rows.append([c.strip() for c in line.strip("|").split("|")])
        elif rows:
            break
    return rows


def _expected_rows(results: Path = RESULTS) -> list[list[str]]:
    data = json.loads(results.read_text())
    return [[str(r["P"]), str(r["N"]), f"{r['H']} / {r['H_kv']}", str(r["D"]),
             "causal" if r["causal"] else "bidirectional", r["auto_ran"], r["fastest"], f"{r['regret']:.3f}",
             f"{r['first_call_s']:.2f}"] for r in data["rows"]]


def test_regret_tables_quote_the_results_file():
    expected = _expected_rows()
    assert len(expected) == 6
    regrets = [float(r[7]) for r in expected]
    summary = f"mean {sum(regrets) / len(regrets):.3f}, worst {max(regrets):.3f}"
    readme = documentation_text()
    bench = (ROOT / "benchmarks/README.md").read_text()
    assert _quoted_rows(readme, "<!-- auto regret table") == expected
    assert f"**{summary}**" in readme
    for results, heading in RUNS.items():
        rows = _expected_rows(results)
        regrets = [float(r[7]) for r in rows]
        assert _quoted_rows(bench, heading) == rows, f"{heading}: not {results.name}'s rows"
        section = bench[bench.index(heading):]
        assert f"**Mean {sum(regrets) / len(regrets):.3f}, worst {max(regrets):.3f}**" in section.split("\n### ")[0]
    # control: the parser reads numbers, so an edited one is caught
    first = "| " + " | ".join(expected[0]) + " |"
    assert first in readme
    edited = readme.replace(first, first.replace(f"| {expected[0][7]} |", f"| {float(expected[0][7]) + 0.001:.3f} |"))
    assert _quoted_rows(edited, "<!-- auto regret table") != expected
