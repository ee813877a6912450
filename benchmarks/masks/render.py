"""Markdown rendered from ``benchmarks/masks/results/`` for the README's generated blocks
(``experiments.common.generated``): ``traffic_table`` (bytes per rank, every case), ``window_table`` (the windowed
ring's time against the local limit and the full ring), ``prefix_table`` (prefix-LM against causal) and
``work_table`` (the prefix-LM plans' pairs per rank)."""

from __future__ import annotations

from collections import defaultdict

MIB = 2 ** 20
OWN_LAYOUT = {"ring": "contiguous", "zigzag_ring": "zigzag"}


def _cells(data, case):
    """Rows of ``case`` grouped by (P, backend, N, prefix, layout), in file order (``layout``: ``None`` unless a
    prefix row ran on another layout than its backend's own)."""
    cells = defaultdict(list)
    for r in data["rows"]:
        if r["case"] == case:
            layout = r.get("layout") if r.get("layout") not in (None, OWN_LAYOUT.get(r["backend"])) else None
            cells[(r["P"], r["backend"], r["N"], r.get("prefix"), layout)].append(r)
    return cells


def _span(values, fmt="{:.3f}") -> str:
    lo, hi = min(values), max(values)
    return fmt.format(lo) if fmt.format(lo) == fmt.format(hi) else f"{fmt.format(lo)}-{fmt.format(hi)}"


def traffic_table(data, path) -> str:
    """Forward K/V MiB per rank (the range over ranks): ours, the minimum, before (the mask ignored for traffic)."""
    lines = ["| case | backend | N | P | forward MiB ours | minimum | mask ignored | fwd+bwd MiB ours | mask ignored |",
             "|---" * 9 + "|"]
    for case in ("docs", "window", "prefix"):
        for (p, backend, n, prefix, layout), rows in _cells(data, case).items():
            what = case if prefix is None else f"prefix {prefix / n:.0%}" + (f" ({layout})" if layout else "")
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
    for (p, _backend, n, _, _), rows in _cells(data, "window").items():
        if "ours_median_s" not in rows[0]:
            continue
        lines.append(f"| {n} | {p} | {_span([r['ours_median_s'] for r in rows])} | "
                     f"{_span([r['limit_median_s'] for r in rows])} | {_span([r['full_ring_median_s'] for r in rows])} | "
                     f"{_span([r['ratio_to_limit'] for r in rows], '{:.2f}')} | "
                     f"{_span([r['ratio_to_full_ring'] for r in rows], '{:.2f}')} |")
    return "\n".join(lines)


TARGET_PER_PAIR = 1.05


def prefix_table(data, path) -> str:
    """Prefix-LM against causal (same backend, its own layout): the time ratio (range over ranks), the pairs the span
    adds (visible pairs over causal's, all ranks), the time per visible pair over causal's (the target: <= 1.05),
    the busiest rank's pairs over causal's busiest and over the mean, and the masked (dense) kernel calls."""
    lines = ["| backend | layout | P | prefix | prefix-LM s | causal s | time / causal | pairs / causal | "
             "per pair / causal | busiest rank / causal's | busiest / mean | dense calls | per pair <= 1.05 |",
             "|---" * 13 + "|"]
    cells = defaultdict(list)
    for r in data["rows"]:
        if r["case"] == "prefix" and "ratio_to_causal" in r:
            cells[(r["P"], r["backend"], r.get("layout", OWN_LAYOUT.get(r["backend"])), r["N"], r["prefix"])].append(r)
    for (p, backend, layout, n, prefix), rows in sorted(cells.items(), key=lambda kv: (kv[0][0], kv[0][1], kv[0][4],
                                                                                          kv[0][2] == "balanced")):
        pairs = sum(r["prefix_lm_pairs"] for r in rows) / sum(r["causal_pairs"] for r in rows)
        per_pair = [r["ratio_to_causal"] / pairs for r in rows]
        busiest = max(r["prefix_lm_pairs"] for r in rows) / max(r["causal_pairs"] for r in rows)
        over_mean = max(r["prefix_lm_pairs"] for r in rows) / (sum(r["prefix_lm_pairs"] for r in rows) / len(rows))
        dense = sum(r["prefix_lm_calls"]["dense"] for r in rows)
        met = "met" if max(per_pair) <= TARGET_PER_PAIR else "not met"
        lines.append(f"| {backend} | {layout} | {p} | {prefix / n:.0%} | {_span([r['prefix_lm_median_s'] for r in rows])} | "
                     f"{_span([r['causal_median_s'] for r in rows])} | {_span([r['ratio_to_causal'] for r in rows])} | "
                     f"{pairs:.3f} | {_span(per_pair)} | {busiest:.3f} | {over_mean:.3f} | {dense} | {met} |")
    return "\n".join(lines)


def work_table(data, path) -> str:
    """The prefix-LM plans' visible pairs per rank (``run.py --work``; exact counts, nothing timed): the busiest
    rank over the mean and over causal's busiest on the backend's own layout."""
    lines = ["| P | backend | layout | span | busiest / mean | busiest / causal's busiest | pairs / causal | table |",
             "|---" * 8 + "|"]
    for w in data.get("work", []):
        table = w["layout_table"] if w["layout"] == "balanced" else ""
        lines.append(f"| {w['P']} | {w['backend']} | {w['layout']} | {w['prefix_fraction']:.0%} | "
                     f"{w['busiest_over_mean']:.3f} | {w['busiest_over_causal_busiest']:.3f} | "
                     f"{w['pairs_over_causal']:.3f} | {table} |")
    return "\n".join(lines)
