"""Markdown rendered from ``benchmarks/peers/results/`` for the READMEs' generated blocks
(``experiments.common.generated``): ``grid_table`` (a grid run's cells), ``launch_table`` (a run with several
launches, launch by launch), ``summary`` (one line per pair: time and memory ratios and verdicts at each length),
``cell`` (a cell timed alone, ``cell.py``)."""

from __future__ import annotations

from benchmarks.peers.run import _short


def _peer(name: str) -> str:
    return "DeepSpeed" if name.startswith("deepspeed") else _short(name)


def grid_table(data, path) -> str:
    rows = data["results"]
    reps, launches = rows[0]["reps"], rows[0].get("launches", 1)
    last = ("time ratio: 95% interval of the pooled reps, verdict over the launches" if launches > 1
            else "time ratio: 95% interval, verdict")
    lines = [f"| pair | peer | N | time ratio (median) | (best-of-{reps}) | memory ratio | per-rep ratio: median [IQR] | "
             f"reps <= 1.0 | ours / peer median s | ours / peer peak MiB | {last} |", "|---" * 11 + "|"]
    for r in rows:
        lines.append(
            f"| {r['pair']} | {_peer(r['peer'])} | {r['seq_len']} | {r['time_ratio']:.3f} | {r['time_ratio_best']:.3f} | "
            f"**{r['memory_ratio']:.3f}** | {r['time_ratio_rep_median']:.3f} [{r['time_ratio_q1']:.3f}-"
            f"{r['time_ratio_q3']:.3f}] | {round(r['time_ratio_share_le_1'] * r['reps'])} / {r['reps']} | "
            f"{r['ours_median_s']:.3f} / {r['peer_median_s']:.3f} | {r['ours_peak_bytes'] / 2**20:.1f} / "
            f"{r['peer_peak_bytes'] / 2**20:.1f} | [{r['time_ratio_ci95'][0]:.3f}-{r['time_ratio_ci95'][1]:.3f}] "
            f"{r['time_verdict']} |")
    return "\n".join(lines)


def launch_table(data, path) -> str:
    rows = data["results"]
    n = rows[0]["launches"]
    labels = " / ".join(str(i + 1) for i in range(n))
    lines = [f"| pair | N | ratio: launch {labels} | interval, verdict: launch {labels} | pooled reps | over the launches |",
             "|---" * 6 + "|"]
    for r in rows:
        lines.append(f"| {r['pair']} | {r['seq_len']} | " + " / ".join(f"{x:.3f}" for x in r["launch_time_ratios"])
                     + " | " + " / ".join(f"[{a:.3f}-{b:.3f}] {v}" for (a, b), v in zip(r["launch_ci95"], r["launch_verdicts"]))
                     + f" | {r['time_verdict_pooled']} | **{r['time_verdict']}** |")
    return "\n".join(lines)


def summary(data, path) -> str:
    """Per pair: ours / peer time (median) and memory at each N, and the verdict (``--launches``: over the launches)."""
    rows = data["results"]
    lengths = sorted({r["seq_len"] for r in rows})
    by = {(r["pair"], r["seq_len"]): r for r in rows}
    pairs = list(dict.fromkeys(r["pair"] for r in rows))
    ns = " / ".join(str(n) for n in lengths)
    lines = [f"| ours | peer | time ratio, N = {ns} | verdict | memory ratio |", "|---" * 5 + "|"]
    for pair in pairs:
        cells = [by[pair, n] for n in lengths if (pair, n) in by]
        lines.append(f"| {pair} | {_peer(cells[0]['peer'])} | " + " / ".join(f"{c['time_ratio']:.3f}" for c in cells)
                     + " | " + " / ".join(c["time_verdict"] for c in cells) + " | "
                     + " / ".join(f"**{c['memory_ratio']:.3f}**" for c in cells) + " |")
    return "\n".join(lines)


def cell(data, path) -> str:
    """A cell timed alone: ours / peer in each launch, and what the cross-rank check costs (ours / unchecked)."""
    rows, meta = data["rows"], data["meta"]
    check = [r["ours_over_unchecked"] for r in rows]
    return (f"`{meta['config']['pair']}` at N = {meta['config']['seq_len']}, {len(rows)} launches: ours / peer "
            + ", ".join(f"**{r['ours_over_peer']:.3f}**" for r in rows)
            + f"; ours / ours without the cross-rank check {min(check):.3f}-{max(check):.3f}.")
