"""Markdown rendered from ``paper_figures/comm_volume.json`` for the READMEs' generated blocks
(``experiments.common.generated``): ``table`` is what ``plot.table`` draws for ``heads`` (``mha`` or ``gqa``)."""

from __future__ import annotations

from experiments.common.generated import table as nth_table
from experiments.comm_volume.plot import table as volume_table


def table(data, path, heads: str = "mha") -> str:
    return nth_table(volume_table(data["results"], heads), path, "0")
