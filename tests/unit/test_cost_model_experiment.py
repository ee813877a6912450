"""``scripts/cost_model_experiment.py`` without ranks: how many reps each validation grid's medians are of."""

from __future__ import annotations

from pathlib import Path

from tests.script_import import load_script

ROOT = Path(__file__).resolve().parents[2]


def _experiment():
    return load_script("cost_model_experiment")


def test_grid_reps_default_per_grid_and_yield_to_the_flags(tmp_path):
    """Grid 1's short rows get 15 reps and grid 2's 5 (as the experiment README says); ``--reps`` overrides both,
    ``--quick`` takes 2."""
    exp = _experiment()
    args = exp.parse_args(["--out", str(tmp_path)])
    assert (exp.grid_reps(args, "grid1"), exp.grid_reps(args, "grid2")) == (15, 5)
    args = exp.parse_args(["--out", str(tmp_path), "--reps", "7"])
    assert (exp.grid_reps(args, "grid1"), exp.grid_reps(args, "grid2")) == (7, 7)
    args = exp.parse_args(["--out", str(tmp_path), "--quick"])
    assert (exp.grid_reps(args, "grid1"), exp.grid_reps(args, "grid2")) == (2, 2)
    readme = (ROOT / "experiments" / "cost_model" / "README.md").read_text()
    assert "15 rounds for grid 1, 5 for grid 2" in readme
