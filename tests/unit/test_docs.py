"""The documentation holds: the docs site builds with warnings as errors (broken links and anchors included,
no network), the README stays short and opens with the two make commands, no page speaks of the project's own
sessions or issues, and the code the docs show runs."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from tests.docs_text import documentation_pages

ROOT = Path(__file__).resolve().parents[2]
README = ROOT / "README.md"
README_MAX_LINES = 200


def _mkdocs_build(config: Path, site: Path) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": str(ROOT), "NO_MKDOCS_2_WARNING": "1"}
    return subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict", "-f", str(config), "-d", str(site)],
                          cwd=config.parent, env=env, capture_output=True, text=True, timeout=300)


def _config() -> dict:
    # mkdocs.yml uses no custom YAML tags, so the safe loader reads it
    return yaml.safe_load((ROOT / "mkdocs.yml").read_text())


def test_docs_site_builds_strictly(tmp_path):
    pytest.importorskip("mkdocs", reason="the docs extra: make install / pip install -e '.[docs]'")
    proc = _mkdocs_build(ROOT / "mkdocs.yml", tmp_path / "site")
    log = proc.stdout + proc.stderr
    assert proc.returncode == 0, log[-5000:]
    assert not [line for line in log.splitlines() if line.startswith("WARNING")], log[-5000:]
    site = tmp_path / "site"
    for page in ("index.html", "api/index.html", "guides/strategy/index.html", "results/index.html"):
        assert (site / page).is_file(), page
    api = (site / "api/index.html").read_text()
    assert "Ranks that share one sequence" in api  # the strategy's Args section, rendered by mkdocstrings
    assert "fonts.googleapis" not in (site / "index.html").read_text()  # theme.font: false, no CDN at view time
    assert (site / "paper_figures/demo_protein_loss.png").is_file()  # the hook publishes the figures


def test_the_strict_build_catches_a_broken_anchor_and_a_missing_page(tmp_path):
    """Control: the same validation settings fail a build whose page links a heading or a page that is not there."""
    pytest.importorskip("mkdocs")
    ours = _config()
    assert ours["strict"] is True and ours["validation"]["anchors"] == "warn"
    assert ours["theme"]["font"] is False
    docs = tmp_path / "docs"
    docs.mkdir()
    (docs / "index.md").write_text("# Home\n\nSee [the part](other.md#a-part).\n")
    (docs / "other.md").write_text("# Other\n\n## A part\n")
    config = tmp_path / "mkdocs.yml"
    base = {"site_name": "control", "strict": True, "validation": ours["validation"]}
    config.write_text(yaml.safe_dump(base))
    assert _mkdocs_build(config, tmp_path / "site").returncode == 0
    (docs / "index.md").write_text("# Home\n\nSee [the part](other.md#no-such-part).\n")
    broken = _mkdocs_build(config, tmp_path / "site")
    assert broken.returncode != 0 and "no-such-part" in broken.stdout + broken.stderr
    (docs / "index.md").write_text("# Home\n\nSee [the page](missing.md).\n")
    assert _mkdocs_build(config, tmp_path / "site").returncode != 0


def test_every_docs_page_is_in_the_nav():
    def pages(nav):
        for item in nav:
            for value in item.values() if isinstance(item, dict) else [item]:
                yield from pages(value) if isinstance(value, list) else [value]

    in_nav = set(pages(_config()["nav"]))
    on_disk = {str(p.relative_to(ROOT / "docs")) for p in (ROOT / "docs").rglob("*.md")}
    assert on_disk == in_nav, (on_disk - in_nav, in_nav - on_disk)
    for required in ("guides/huggingface-finetuning.md", "guides/preemption.md", "guides/masks.md",
                     "guides/planning.md", "guides/data.md", "gpu-status.md", "results.md", "api.md"):
        assert required in in_nav, required


def test_readme_is_short_and_opens_with_the_two_make_commands():
    text = README.read_text()
    assert len(text.splitlines()) <= README_MAX_LINES, f"README.md has {len(text.splitlines())} lines"
    first_block = re.search(r"```bash\n(.*?)```", text, re.DOTALL).group(1)
    assert [line.split()[:2] for line in first_block.splitlines()] == [["make", "demo"], ["make", "test"]]
    assert text.index("```bash") < text.index("## "), "the make commands come before the first section"
    assert 'pip install -e ".[hf]"' in text and "make install" in text and ".venv/bin" in text
    assert "pip install 'lightning-sp[hf]'" not in text  # not on an index
    # every relative link in the README points at a file of the repository
    for target in re.findall(r"\]\(([^)#:]+)(?:#[^)]*)?\)", text):
        assert (ROOT / target).exists(), target


SELF_HISTORY = re.compile(r"\b(?:sessions?|issues?)[ -]\d+|\bissue #\d+|\brun \d+\b", re.IGNORECASE)


def test_no_page_speaks_of_the_projects_own_sessions_or_issues():
    pages = [*documentation_pages(), ROOT / "CHANGELOG.md"]
    found = {str(p.relative_to(ROOT)): SELF_HISTORY.findall(p.read_text()) for p in pages}
    assert not {page: hits for page, hits in found.items() if hits}
    # control: the pattern catches what it is for, and leaves upstream references alone
    planted = "fixed in " + "session" + " 28 (" + "issue" + " 17, " + "issue" + "-7 goal)"  # built, so this file names none
    assert SELF_HISTORY.findall(planted) == ["session" + " 28", "issue" + " 17", "issue" + "-7"]
    assert not SELF_HISTORY.findall("pytorch #135712; see the issues page")


def _docs_block(marker: str) -> str:
    text = "\n".join(p.read_text() for p in documentation_pages())
    match = re.search(rf"<!-- test: {re.escape(marker)}[^>]*-->\s*```python\n(.*?)```", text, re.DOTALL)
    assert match, f"no block marked '{marker}'"
    return match.group(1)


def test_planning_example_runs_and_names_a_candidate(capsys):
    from lightning_sp.cost_model import MODEL_BACKENDS

    scope: dict = {}
    exec(compile(_docs_block("planning example"), "docs/guides/planning.md", "exec"), scope)  # noqa: S102
    printed = capsys.readouterr().out
    assert scope["choice"].backend in MODEL_BACKENDS and f"auto would run: {scope['choice'].backend}" in printed
    assert len(scope["choice"].predictions) >= 3
