"""Markdown rendered from ``paper_figures/throughput.json`` for the READMEs' generated blocks
(``experiments.common.generated``): ``table`` is table ``index`` of what ``plot.tables`` draws (per P, model GFLOP/s
per rank of every method and N; then the attention shares)."""

from __future__ import annotations

from experiments.common.generated import table as nth_table
from experiments.throughput.plot import tables


def table(data, path, index: str = "0") -> str:
    return nth_table(tables(data["results"]), path, index)
