"""``make`` picks the CUDA build of torch on a GPU machine, or when asked, and says which it installs; ``make test``
installs the docs extra its docs test needs. Checked with ``make -n`` (the commands, nothing run)."""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
CPU_SPEC, GPU_SPEC = '"torch==2.13.0"', '"torch"'

pytestmark = pytest.mark.skipif(shutil.which("make") is None, reason="make is not installed")


def _dry_install(tmp_path: Path, *make_args: str, env_extra: dict | None = None, path: str = "/usr/bin:/bin") -> str:
    env = {k: v for k, v in os.environ.items() if k not in ("CUDA_VISIBLE_DEVICES", "TORCH_SPEC", "GPU")}
    env.update({"PATH": path, **(env_extra or {})})
    proc = subprocess.run([shutil.which("make"), "-n", "-B", "install", f"VENV={tmp_path / 'venv'}", *make_args],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    return proc.stdout


def _torch_line(out: str) -> str:
    (line,) = [ln for ln in out.splitlines() if "pip install" in ln and "torch" in ln and "-e" not in ln]
    return line


def test_make_picks_the_cuda_build_where_a_gpu_is_seen_or_asked_for(tmp_path):
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "nvidia-smi").write_text("#!/bin/sh\nexit 0\n")
    (bin_dir / "nvidia-smi").chmod(0o755)
    cases = {
        "GPU=1": _dry_install(tmp_path, "GPU=1"),
        "nvidia-smi on the PATH": _dry_install(tmp_path, path=f"{bin_dir}:/usr/bin:/bin"),
        "CUDA_VISIBLE_DEVICES=0": _dry_install(tmp_path, env_extra={"CUDA_VISIBLE_DEVICES": "0"}),
    }
    for case, out in cases.items():
        assert GPU_SPEC in _torch_line(out), f"{case}: {out}"
        assert "make: installing torch (the CUDA build" in out, case
    forced = _dry_install(tmp_path, "GPU=0", path=f"{bin_dir}:/usr/bin:/bin")
    assert CPU_SPEC in _torch_line(forced) and "the CPU build" in forced
    given = _dry_install(tmp_path, "TORCH_SPEC=torch==2.12.0")
    assert '"torch==2.12.0"' in _torch_line(given) and "TORCH_SPEC given" in given
    # after the install, the installed build is printed
    assert "make: installed torch" in forced


@pytest.mark.skipif(Path("/proc/driver/nvidia").exists(), reason="this machine has an NVIDIA driver")
def test_make_picks_the_cpu_build_without_a_gpu(tmp_path):
    for hidden in ({}, {"CUDA_VISIBLE_DEVICES": ""}, {"CUDA_VISIBLE_DEVICES": "-1"}):
        out = _dry_install(tmp_path, env_extra=hidden)
        assert CPU_SPEC in _torch_line(out), (hidden, out)
        assert "the CPU build: no GPU found" in out


def test_make_test_installs_the_docs_extra_and_make_docs_builds_strictly(tmp_path):
    out = _dry_install(tmp_path)
    assert '-e ".[dev,data,docs]"' in out
    docs = subprocess.run([shutil.which("make"), "-n", "docs", f"VENV={tmp_path / 'venv'}"], cwd=ROOT,
                          capture_output=True, text=True, timeout=60)
    assert "mkdocs build --strict" in docs.stdout, docs.stdout + docs.stderr


def test_the_readmes_wheel_builds_under_the_name_it_quotes(tmp_path):
    """The README's install-anywhere path: ``pip wheel --no-deps -w dist .`` gives the file the README installs,
    with the console script. Built from a copy of the package (no build files in the checkout), offline."""
    import re
    import sys
    import zipfile

    src = tmp_path / "src"
    shutil.copytree(ROOT / "lightning_sp", src / "lightning_sp", ignore=shutil.ignore_patterns("__pycache__"))
    for name in ("pyproject.toml", "README.md"):
        shutil.copy(ROOT / name, src / name)
    proc = subprocess.run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation", "-w",
                           str(tmp_path / "dist"), str(src)], capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, proc.stderr[-3000:]
    (wheel,) = (tmp_path / "dist").glob("*.whl")
    quoted = set(re.findall(r"dist/(lightning_sp-[^\s\"\[]+\.whl)", (ROOT / "README.md").read_text()))
    assert quoted == {wheel.name}, (quoted, wheel.name)
    with zipfile.ZipFile(wheel) as zf:
        names = zf.namelist()
        entry_points = next(n for n in names if n.endswith("entry_points.txt"))
        assert "lightning-sp = lightning_sp.cli:main" in zf.read(entry_points).decode()
    assert "lightning_sp/cli.py" in names and not any(n.startswith(("tests/", "experiments/")) for n in names)
