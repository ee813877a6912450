"""The README and docs blocks rendered from results files (``experiments.common.generated``): every block in
the repository matches its results file, and the mechanism notices a stale or broken block."""

from __future__ import annotations

import json

import pytest

from experiments.common import generated


def test_every_generated_block_matches_its_results_file(capsys):
    assert generated.main(["--check"]) == 0, capsys.readouterr().out


def _render_rows(data, path, columns="a"):  # a marker's function in the synthetic repository below
    return "\n".join(f"| {row[c]} |" for row in data["rows"] for c in columns.split(","))


def _repo(tmp_path, body):
    (tmp_path / "r.json").write_text(json.dumps({"rows": [{"a": 1, "b": 2}, {"a": 3, "b": 4}]}))
    readme = tmp_path / "README.md"
    readme.write_text(f"# T\n\n<!-- generated: {__name__}:_render_rows r.json columns=a,b -->\n{body}"
                      "<!-- end generated -->\nprose after\n")
    return readme


def test_check_fails_on_a_stale_block_and_rewrite_makes_it_current(tmp_path, capsys):
    readme = _repo(tmp_path, "| 1 |\n| 2 |\n| 3 |\n| 5 |\n")  # a typed number that drifted: 5, not 4
    assert generated.main(["--check"], root=tmp_path) == 1
    out = capsys.readouterr().out
    assert "-| 5 |" in out and "+| 4 |" in out
    assert "| 5 |" in readme.read_text(), "--check must not write"
    assert generated.main([], root=tmp_path) == 0
    assert generated.main(["--check"], root=tmp_path) == 0
    text = readme.read_text()
    assert "| 4 |" in text and "| 5 |" not in text and text.endswith("<!-- end generated -->\nprose after\n")


@pytest.mark.parametrize("spec, message", [
    ("no_function_here r.json", "MODULE:FUNCTION"),
    ("tests.unit.test_generated_blocks:missing r.json", "cannot import"),
    ("tests.unit.test_generated_blocks:_render_rows absent.json", "does not exist"),
])
def test_a_broken_marker_names_what_to_fix(tmp_path, spec, message):
    (tmp_path / "r.json").write_text("{}")
    (tmp_path / "README.md").write_text(f"<!-- generated: {spec} -->\nold\n<!-- end generated -->\n")
    with pytest.raises(generated.GeneratedBlockError, match=message):
        generated.main(["--check"], root=tmp_path)
