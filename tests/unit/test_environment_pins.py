"""``make`` installs the environment the suite was green in, not whatever is newest that day.

A fresh clone once went red a week after its last green run with no commit in between: transformers 5.24 moved
GPT-J and CodeGen onto ``AttentionInterface``, so the README's HF support table (swept with 5.23) no longer
matched (2026-11-24). ``constraints.txt`` pins every package ``make`` installs except torch; these
tests check that every install in the Makefile uses it, that it pins everything pyproject asks for, that this
environment is the one it describes, and that the README's support table names the transformers it pins.
"""

from __future__ import annotations

import re
import tomllib
from importlib import metadata
from pathlib import Path

from packaging.requirements import Requirement
from packaging.utils import canonicalize_name
from tests.docs_text import HF_GUIDE

ROOT = Path(__file__).resolve().parents[2]
UNPINNED = {"torch", "lightning-sp"}  # torch: the Makefile's TORCH_SPEC picks the CPU or CUDA build
UNINSTALLED_EXTRAS = {"flash"}  # GPU only, never installed by make


def pins(text: str) -> dict[str, str]:
    """``{canonical name: version}`` of a constraints file's ``name==version`` lines."""
    out = {}
    for line in text.splitlines():
        line = line.split("#", 1)[0].strip()
        if line:
            name, sep, version = line.partition("==")
            assert sep and version, f"constraints.txt line {line!r} is not name==version"
            out[canonicalize_name(name)] = version
    return out


def installs_without_constraints(makefile: str) -> list[str]:
    """The Makefile's ``pip install`` lines that do not pass ``-c constraints.txt``."""
    return [line.strip() for line in makefile.splitlines()
            if "pip install" in line and "-c constraints.txt" not in line]


def unpinned_requirements(pyproject: dict, pinned: dict[str, str]) -> list[str]:
    """The packages pyproject's dependencies and the extras ``make`` installs name that constraints.txt does
    not pin (extras of extras included, through the packages they pull in)."""
    project = pyproject["project"]
    reqs = list(project["dependencies"])
    for extra, items in project["optional-dependencies"].items():
        if extra not in UNINSTALLED_EXTRAS:
            reqs += items
    names = {canonicalize_name(Requirement(r).name) for r in reqs}
    return sorted(n for n in names - {canonicalize_name(u) for u in UNPINNED} if n not in pinned)


CONSTRAINTS = (ROOT / "constraints.txt").read_text()


def test_every_install_in_the_makefile_uses_the_constraints():
    makefile = (ROOT / "Makefile").read_text()
    assert "pip install" in makefile
    assert installs_without_constraints(makefile) == []
    assert re.search(r"^\$\(STAMP\):.*\bconstraints\.txt\b", makefile, re.M), "editing the pins must rebuild .venv"
    # control: an install without it is reported
    assert installs_without_constraints('\t$(PY) -m pip install -q -e ".[dev]"\n') != []


def test_constraints_pin_everything_pyproject_asks_for_except_torch():
    pinned = pins(CONSTRAINTS)
    pyproject = tomllib.loads((ROOT / "pyproject.toml").read_text())
    assert unpinned_requirements(pyproject, pinned) == []
    assert "torch" not in pinned, "torch is TORCH_SPEC's to choose (CPU or CUDA build)"
    # control: without the transformers line it is reported
    del pinned["transformers"]
    assert unpinned_requirements(pyproject, pinned) == ["transformers"]


def test_this_environment_is_the_one_the_constraints_describe():
    """Every pinned package that is installed here is at its pinned version (a stale lock, or a hand upgrade
    the lock does not record, fails here instead of on the next fresh clone)."""
    wrong = []
    for name, version in pins(CONSTRAINTS).items():
        try:
            installed = metadata.version(name)
        except metadata.PackageNotFoundError:
            continue  # e.g. the bench extra, installed by `make bench` only
        if installed != version:
            wrong.append(f"{name} {installed} (constraints.txt: {version})")
    assert not wrong, "run `make install` (or regenerate constraints.txt, see its header): " + ", ".join(wrong)


def test_readme_support_table_names_the_pinned_transformers():
    from tests.hf_tiny import TABLE_BEGIN, TABLE_VERSION

    readme = HF_GUIDE.read_text()
    block = readme[readme.index(TABLE_BEGIN):]
    swept = TABLE_VERSION.search(block)
    assert swept, "README's HF support table does not name the transformers it was swept with"
    assert swept.group(1) == pins(CONSTRAINTS)["transformers"]
