"""Markdown rendered from ``benchmarks/auto/results/`` for the READMEs' generated blocks
(``experiments.common.generated``): ``regret_table`` (every shape: what auto ran, the fastest, the regret, auto's
first call) and ``regret_summary`` (mean and worst regret, the first calls' range)."""

from __future__ import annotations

GOAL = "goal: mean <= 1.05, worst <= 1.15"


def regret_table(data, path) -> str:
    lines = ["| P | N | H / H_kv | D | mask | auto ran | fastest | regret | auto's first call (s) |", "|---" * 9 + "|"]
    for r in data["rows"]:
        lines.append(f"| {r['P']} | {r['N']} | {r['H']} / {r['H_kv']} | {r['D']} | "
                     f"{'causal' if r['causal'] else 'bidirectional'} | {r['auto_ran']} | {r['fastest']} | "
                     f"{r['regret']:.3f} | {r['first_call_s']:.2f} |")
    return "\n".join(lines) + "\n\n" + regret_summary(data, path)


def regret_summary(data, path) -> str:
    regrets = [r["regret"] for r in data["rows"]]
    first = [r["first_call_s"] for r in data["rows"]]
    return (f"**Mean regret {sum(regrets) / len(regrets):.3f}, worst {max(regrets):.3f}** ({GOAL}) over "
            f"{len(regrets)} shapes; auto's first call (it measures the candidates) {min(first):.1f}-{max(first):.1f} s.")
