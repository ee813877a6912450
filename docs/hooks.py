"""MkDocs hook: publish the figures of ``paper_figures/`` with the site, so pages show them as
``paper_figures/<name>.png`` without keeping a second copy under ``docs/`` (one file, one truth)."""

from __future__ import annotations

from pathlib import Path

from mkdocs.structure.files import File, Files

ROOT = Path(__file__).resolve().parents[1]


def on_files(files: Files, config) -> Files:
    for png in sorted((ROOT / "paper_figures").glob("*.png")):
        files.append(File(f"paper_figures/{png.name}", src_dir=str(ROOT), dest_dir=config["site_dir"],
                          use_directory_urls=config["use_directory_urls"]))
    return files
