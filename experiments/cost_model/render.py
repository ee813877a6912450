"""Markdown rendered from ``experiments/cost_model/results/`` for the READMEs' generated blocks
(``experiments.common.generated``): ``grid_errors`` (a validation grid's rows and mean / max |error|),
``validation_table`` (the drawn table of ``cost_model_validation.md``, without its heading),
``reproducibility`` (the model's error beside the replay floor of the kept runs), ``predictions`` (the papers'
numbers against the model's)."""

from __future__ import annotations

from experiments.cost_model.reproducibility import table


def grid_errors(data, path, label: str | None = None) -> str:
    name = label or data["results"][0]["grid"]
    return (f"- {name}: {len(data['results'])} rows, **mean |error| {data['mean_abs_error_pct']}%, max "
            f"{data['max_abs_error_pct']}%** (measured {data['date'][:10]})")


def validation_table(text, path) -> str:
    return text.split("\n", 2)[2].split("## Predictions")[0].strip()


def reproducibility_table(data, path) -> str:
    return table(data)


def reproducibility(data, path) -> str:
    near = data["near_pairs"]
    lo, hi = near["range_of_means_pct"]
    shape = [r["model_level_removed_mean_abs_pct"] for r in data["per_run"]]
    levels = [r["model_mean_signed_pct"] for r in data["per_run"]]
    under = [x for x in levels if x < 0]
    return (f"The {near['pairs']} ordered pairs of runs at most {data['near_minutes']:g} minutes apart replay each other "
            f"with **{near['median_of_means_pct']:.1f}% mean |error|** (median; {lo:.1f}-{hi:.1f}%): the floor a "
            f"model of this machine can reach. With each run's level removed, the model's error is "
            f"{min(shape):.1f}-{max(shape):.1f}% mean per run; its signed mean is below zero in {len(under)} of the "
            f"{len(levels)} runs.")


def predictions(data, path) -> str:
    lines = ["| study | setting | metric | paper | model | model - paper |", "|---|---|---|---|---|---|"]
    for r in data["results"]:
        diff = "-" if r.get("diff_pct") is None else f"{r['diff_pct']:+.0f}%"
        paper = "-" if r.get("paper_value") is None else f"{r['paper_value']:g}"
        model = "-" if r.get("model_prediction") is None else f"{r['model_prediction']:.4g}"
        lines.append(f"| {r['study']} | {r['setting']} | {r['metric']} | {paper} | {model} | {diff} |")
    return "\n".join(lines)
