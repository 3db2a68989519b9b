"""Core tests see a clean pdplug environment: every PDPLUG_* switch (but PDPLUG_REQUIRE) unset,
so the tox envs' PDPLUG_STRICT_PLUGINS / PDPLUG_DISABLE_PLUGIN_AUTOLOAD cannot leak in."""

from __future__ import annotations

import os

import pytest


@pytest.fixture(autouse=True)
def _clean_pdplug_env(monkeypatch: pytest.MonkeyPatch) -> None:
    for key in list(os.environ):
        if key.startswith("PDPLUG_") and key != "PDPLUG_REQUIRE":
            monkeypatch.delenv(key)
