"""``.gitignore`` keeps the environment out of commits in every shape it takes: ``make`` builds ``.venv`` as a
directory, a second checkout (a git worktree) often links it. A ``.venv`` link that git does not ignore gets
committed, and merging that commit replaces a checkout's ``.venv`` directory with the link (git treats ignored
files as expendable): it happened once (2026-11-24)."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def _ignored(repo: Path, path: str) -> bool:
    return subprocess.run(["git", "check-ignore", "-q", path], cwd=repo).returncode == 0


@pytest.mark.skipif(shutil.which("git") is None, reason="git is not installed")
def test_a_venv_directory_and_a_venv_link_are_both_ignored(tmp_path):
    """In a fresh repository with this ``.gitignore``: a ``.venv`` directory and a ``.venv`` symlink are both
    ignored. Control: the old pattern ``.venv/`` ignores the directory and not the link."""
    target = tmp_path / "env"
    target.mkdir()
    for rules, link_ignored in ((ROOT / ".gitignore").read_text(), True), (".venv/\n", False):
        repo = tmp_path / f"repo{int(link_ignored)}"
        (repo / "dir").mkdir(parents=True)
        subprocess.run(["git", "init", "-q"], cwd=repo, check=True)
        (repo / ".gitignore").write_text(rules)
        (repo / "dir" / ".venv").mkdir()
        (repo / ".venv").symlink_to(target)
        assert _ignored(repo, "dir/.venv"), rules
        assert _ignored(repo, ".venv") == link_ignored, rules
