"""The user-facing documentation as one text: README.md and every page under docs/. Tests that check a quoted
number, an output block or a code block find it wherever the docs put it."""

from __future__ import annotations

from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
HF_GUIDE = ROOT / "docs" / "guides" / "huggingface.md"
"""The page that holds the Hugging Face support table (``scripts/hf_support_table.py --write`` rewrites it)."""


def documentation_pages() -> list[Path]:
    return [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]


def documentation_text() -> str:
    """README.md, then each docs/ page in path order, joined by blank lines."""
    return "\n\n".join(page.read_text() for page in documentation_pages() if page.is_file())
