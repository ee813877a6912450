"""Markdown rendered from ``paper_figures/context_matters.json`` for the README's generated blocks
(``experiments.common.generated``): ``table`` (one row per arm, accuracy per seed and the mean), ``provenance``
(date, machine, commit, command) and ``images`` (bidirectional against causal images at full context, per seed)."""

from __future__ import annotations

from collections import defaultdict


def _arms(data) -> dict[tuple, dict[int, dict]]:
    """``{(context_tokens, sequence_parallel, image_attention): {seed: row}}``, full context first, causal first."""
    arms: dict[tuple, dict[int, dict]] = defaultdict(dict)
    for r in data["results"]:
        arms[(r["context_tokens"], r["sequence_parallel"], r.get("image_attention", "causal"))][r["seed"]] = r
    return dict(sorted(arms.items(), key=lambda kv: (-kv[0][0], kv[0][2] == "bidirectional")))


def _mean(xs) -> float:
    return sum(xs) / len(xs)


def table(data, path) -> str:
    arms = _arms(data)
    seeds = sorted({s for rows in arms.values() for s in rows})
    head = " / ".join(f"seed {s}" for s in seeds)
    lines = [f"| context | image patches | sequence parallel | val accuracy, first-image question ({head}) | mean |",
             "|---|---|---|---|---|"]
    for (tokens, sp, image), rows in arms.items():
        accs = [rows[s]["val_answer_acc"] for s in seeds if s in rows]
        ranks = rows[min(rows)]["arm"].removeprefix("full_sp").split("_")[0] if sp else ""
        bold = (lambda x: f"**{x}**") if sp else (lambda x: x)
        lines.append(f"| {tokens} tokens ({'full' if sp else 'truncated'}) | "
                     f"{'one bidirectional span per image' if image == 'bidirectional' else 'causal, like text'} | "
                     f"{'yes, ' + ranks + ' ranks' if sp else 'no'} | {bold(' / '.join(f'{a:.3f}' for a in accs))} | "
                     f"{_mean(accs):.3f} |")
    return "\n".join(lines)


def provenance(data, path) -> str:
    hw = data["hardware"]["device"] if isinstance(data["hardware"], dict) else data["hardware"]
    n = {r["steps"] for r in data["results"]}
    return (f"Measured {data['date'][:10]} on {hw}, gloo, commit {data.get('git_commit') or '?'}"
            f"{' (dirty tree)' if data.get('git_dirty') else ''}, {'/'.join(map(str, sorted(n)))} steps per arm: "
            f"`{data['command']}` (results: `{path}`).")


def images(data, path) -> str:
    """Full context, bidirectional images against causal ones, seed by seed."""
    arms = _arms(data)
    full = {image: rows for (tokens, sp, image), rows in arms.items() if sp}
    if set(full) != {"causal", "bidirectional"}:
        return "(this results file has no pair of full-context arms with causal and bidirectional images)"
    seeds = sorted(set(full["causal"]) & set(full["bidirectional"]))
    acc = {image: [full[image][s]["val_answer_acc"] for s in seeds] for image in full}
    loss = {image: [full[image][s]["val_loss"] for s in seeds] for image in full}
    diffs = [b - c for b, c in zip(acc["bidirectional"], acc["causal"])]
    better = sum(d > 0 for d in diffs)
    worse = sum(d < 0 for d in diffs)
    return (f"At full context, over {len(seeds)} seeds, first-image accuracy with bidirectional images "
            f"{_mean(acc['bidirectional']):.3f} against causal images {_mean(acc['causal']):.3f} (mean difference "
            f"{_mean(diffs):+.3f}; per seed {', '.join(f'{d:+.3f}' for d in diffs)}: higher in {better}, lower in "
            f"{worse}, equal in {len(seeds) - better - worse}); validation loss {_mean(loss['bidirectional']):.4f} "
            f"against {_mean(loss['causal']):.4f}.")
