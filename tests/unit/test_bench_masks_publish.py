"""benchmarks/masks ``--publish``: a run replaces exactly the rows it measured, never the others."""

from benchmarks.masks.run import _section_rows


def _row(case, P, N, backend="ring"):
    return {"case": case, "P": P, "N": N, "backend": backend}


ROWS = [_row("window", 2, 16384), _row("window", 2, 65536), _row("window", 4, 16384),
        _row("docs", 2, 16384), _row("prefix", 2, 16384, "ring"), _row("prefix", 2, 16384, "zigzag_ring")]


def test_a_run_of_some_window_lengths_keeps_the_other_lengths():
    kept = _section_rows(ROWS, [2], ["window"], window_lens=[65536])
    assert _row("window", 2, 65536) not in kept
    assert _row("window", 2, 16384) in kept and _row("window", 4, 16384) in kept
    # control: without the lengths every window row of the world is replaced
    assert _row("window", 2, 16384) not in _section_rows(ROWS, [2], ["window"])


def test_a_run_keeps_other_sections_worlds_and_prefix_backends():
    kept = _section_rows(ROWS, [2], ["prefix"], prefix_backends=["ring"])
    assert kept == [r for r in ROWS if not (r["case"] == "prefix" and r["backend"] == "ring")]
