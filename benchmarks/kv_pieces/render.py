"""Markdown rendered from ``benchmarks/kv_pieces/results/`` for the READMEs' generated blocks
(``experiments.common.generated``): ``table`` (each backend and length: the default's time over whole blocks') and
``ratio_range`` (the spread of those ratios)."""

from __future__ import annotations


def table(data, path) -> str:
    lines = ["| N | P | backend | kv_pieces | median s | kv_pieces=1 median s | ratio of medians |", "|---" * 7 + "|"]
    for r in data["rows"]:
        lines.append(f"| {r['N']} | {r['P']} | {r['backend']} | {r['kv_pieces']} | {r['median_s']:.3f} | "
                     f"{r['whole_median_s']:.3f} | {r['ratio_median']:.3f} |")
    return "\n".join(lines) + "\n\n" + ratio_range(data, path)


def ratio_range(data, path) -> str:
    ratios = [r["ratio_median"] for r in data["rows"]]
    pieces = data["rows"][0]["kv_pieces"]
    return (f"`kv_pieces={pieces!r}` against `kv_pieces=1`: **{min(ratios):.3f}-{max(ratios):.3f}x** the time "
            f"(medians, {len(ratios)} cells; goal <= 1.03x).")
