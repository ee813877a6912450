"""Markdown rendered from ``benchmarks/efficiency/results/`` for the READMEs' generated blocks
(``experiments.common.generated``): ``table`` (every backend and length: its median, the reference kernel calls, its
share of P of them, and of its own work) and ``share_range`` (the balanced backends' shares)."""

from __future__ import annotations

import json
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def _rows(data, also: str | None) -> list[dict]:
    rows = list(data["rows"])
    for extra in (also or "").split(","):
        if extra:
            rows += json.loads((ROOT / extra).read_text())["rows"]
    return rows


def table(data, path, also: str | None = None) -> str:
    """``also``: more results files (comma-separated, from the repository root) whose rows follow."""
    lines = ["| N | P | backend | median s | causal call on N/P (s) | full call on N/P (s) | share | own_work |",
             "|---" * 8 + "|"]
    for r in _rows(data, also):
        lines.append(f"| {r['seq_len']} | {r['world']} | {r['backend']} | {r['median_s']:.3f} | {r['causal_call_s']:.3f} | "
                     f"{r['full_call_s']:.3f} | {r['share']:.3f} | {r['own_work']:.3f} |")
    return "\n".join(lines)


def share_range(data, path) -> str:
    rows = data["rows"]
    balanced = [r["share"] for r in rows if r["backend"] != "ring"]
    ring = [r["own_work"] for r in rows if r["backend"] == "ring"]
    worlds = sorted({r["world"] for r in rows})
    out = (f"P = {'/'.join(map(str, worlds))}: the balanced backends ({', '.join(sorted({r['backend'] for r in rows} - {'ring'}))}) "
           f"**{min(balanced):.3f}-{max(balanced):.3f}** of P one-kernel calls on N/P tokens (goal >= 0.90)")
    if ring:
        out += f"; `ring` {min(ring):.3f}-{max(ring):.3f} of its own work"
    return out + "."
