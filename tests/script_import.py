"""Import a file of ``scripts/`` in a test: the scripts are entry points run by path, not an installed package."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from types import ModuleType

SCRIPTS = Path(__file__).resolve().parents[1] / "scripts"


def load_script(name: str, *, register: bool = False) -> ModuleType:
    """``scripts/<name>.py`` as a fresh module named ``scripts.<name>``. ``register``: also put it in
    ``sys.modules`` under that name, so that spawned ranks can unpickle a worker function defined in it."""
    spec = importlib.util.spec_from_file_location(f"scripts.{name}", SCRIPTS / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    if register:
        sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module
