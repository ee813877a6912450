"""Markdown rendered from ``benchmarks/masks/results/`` for the README's generated blocks
(``experiments.common.generated``): ``traffic_table`` (bytes per rank, every case), ``window_table`` (the windowed
ring's time against the local limit and the full ring) and ``prefix_table`` (prefix-LM against causal)."""

from __future__ import annotations

from collections import defaultdict

MIB = 2 ** 20


def _cells(data, case):
    """Rows of ``case`` grouped by (P, backend, N, prefix), in file order."""
    cells = defaultdict(list)
    for r in data["rows"]:
        if r["case"] == case:
            cells[(r["P"], r["backend"], r["N"], r.get("prefix"))].append(r)
    return cells


def _span(values, fmt="{:.3f}") -> str:
    lo, hi = min(values), max(values)
    return fmt.format(lo) if fmt.format(lo) == fmt.format(hi) else f"{fmt.format(lo)}-{fmt.format(hi)}"


def traffic_table(data, path) -> str:
    """Forward K/V MiB per rank (the range over ranks): ours, the minimum, before (the mask ignored for traffic)."""
    lines = ["| case | backend | N | P | forward MiB ours | minimum | mask ignored | fwd+bwd MiB ours | mask ignored |",
             "|---" * 9 + "|"]
    for case in ("docs", "window", "prefix"):
        for (p, backend, n, prefix), rows in _cells(data, case).items():
            what = case if prefix is None else f"prefix {prefix / n:.0%}"
            lines.append(
                f"| {what} | {backend} | {n} | {p} | {_span([r['forward_bytes'] / MIB for r in rows])} | "
                f"{_span([r['minimum_forward_bytes'] / MIB for r in rows])} | "
                f"{_span([r['today_forward_bytes'] / MIB for r in rows])} | "
                f"{_span([r['fwd_bwd_bytes'] / MIB for r in rows])} | {_span([r['today_fwd_bwd_bytes'] / MIB for r in rows])} |")
    at_min = all(r["forward_bytes"] == r["minimum_forward_bytes"] for r in data["rows"])
    return "\n".join(lines) + ("\n\nForward K/V bytes equal the minimum on every rank of every row." if at_min else "")


def window_table(data, path) -> str:
    """The windowed ring's median fwd+bwd (range over ranks) against the local limit and the full ring."""
    lines = ["| N | P | ours s | local limit s | full ring s | ours / limit | ours / full ring |", "|---" * 7 + "|"]
    for (p, _backend, n, _), rows in _cells(data, "window").items():
        if "ours_median_s" not in rows[0]:
            continue
        lines.append(f"| {n} | {p} | {_span([r['ours_median_s'] for r in rows])} | "
                     f"{_span([r['limit_median_s'] for r in rows])} | {_span([r['full_ring_median_s'] for r in rows])} | "
                     f"{_span([r['ratio_to_limit'] for r in rows], '{:.2f}')} | "
                     f"{_span([r['ratio_to_full_ring'] for r in rows], '{:.2f}')} |")
    return "\n".join(lines)


def prefix_table(data, path) -> str:
    """Prefix-LM against causal: the time ratio (range over ranks), the work the span adds (visible pairs, summed
    over ranks and on the busiest rank), and the masked (dense) kernel calls of the plan."""
    lines = ["| backend | N | P | prefix | prefix-LM s | causal s | time / causal | work / causal: all ranks | "
             "busiest rank | dense calls |", "|---" * 10 + "|"]
    ratios = []
    for (p, backend, n, prefix), rows in _cells(data, "prefix").items():
        if "ratio_to_causal" not in rows[0]:
            continue
        total = sum(r["prefix_lm_pairs"] for r in rows) / sum(r["causal_pairs"] for r in rows)
        busiest = max(r["prefix_lm_pairs"] for r in rows) / max(r["causal_pairs"] for r in rows)
        dense = sum(r["prefix_lm_calls"]["dense"] for r in rows)
        ratios += [r["ratio_to_causal"] for r in rows]
        lines.append(f"| {backend} | {n} | {p} | {prefix / n:.0%} | {_span([r['prefix_lm_median_s'] for r in rows])} | "
                     f"{_span([r['causal_median_s'] for r in rows])} | {_span([r['ratio_to_causal'] for r in rows])} | "
                     f"{total:.3f} | {busiest:.3f} | {dense} |")
    return "\n".join(lines)
