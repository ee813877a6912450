"""Suite-wide settings: ``backend="auto"``'s per-machine decision cache (``lightning_sp.choices``) lives in a
temporary directory for the session, so tests neither read a developer's cache nor leave one behind (spawned
ranks inherit the environment)."""

from __future__ import annotations

import os

import pytest


@pytest.fixture(scope="session", autouse=True)
def _private_auto_cache(tmp_path_factory):
    old = os.environ.get("LIGHTNING_SP_CACHE_DIR")
    os.environ["LIGHTNING_SP_CACHE_DIR"] = str(tmp_path_factory.mktemp("lightning_sp_cache"))
    yield
    if old is None:
        os.environ.pop("LIGHTNING_SP_CACHE_DIR", None)
    else:
        os.environ["LIGHTNING_SP_CACHE_DIR"] = old
