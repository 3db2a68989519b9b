"""The ``PDPLUG_REQUIRE`` rule: a test needing an optional backend (nixl, mooncake, triton,
torch) skips naming what is missing, unless ``PDPLUG_REQUIRE`` lists it (the ``all`` tox
envs): then its absence fails the test, so a CI machine that lost a backend cannot pass.
:func:`pdplug.testing.netns.require_netns` applies the same rule to network namespaces."""

from __future__ import annotations

import importlib
import os
from collections.abc import Mapping
from types import ModuleType

import pytest

__all__ = ["REQUIRE_ENV", "BACKEND_MODULES", "required_modules", "probe_module", "require"]

#: env var listing optional modules whose absence is a failure, not a skip (CI sets it)
REQUIRE_ENV = "PDPLUG_REQUIRE"
#: short name -> modules tried in order (the first that imports wins)
BACKEND_MODULES: dict[str, tuple[str, ...]] = {
    "nixl": ("nixl._api", "nixl_cu12._api", "nixl_cu13._api"),
    "mooncake": ("mooncake.engine",),
    "triton": ("triton",),
}


def required_modules(env: Mapping[str, str] | None = None) -> set[str]:
    """Short names listed in ``PDPLUG_REQUIRE`` (comma-separated, case-insensitive)."""
    raw = (os.environ if env is None else env).get(REQUIRE_ENV, "")
    return {x.strip().lower() for x in raw.split(",") if x.strip()}


def probe_module(name: str) -> tuple[ModuleType | None, str]:
    """Try to import an optional backend.

    :param name: a key of :data:`BACKEND_MODULES` (``"nixl"``, ``"mooncake"``, ``"triton"``)
        or any importable module name.
    :returns: ``(module, "")`` on success, else ``(None, why)`` naming every module tried and
        its error (a missing shared library such as libibverbs shows up here).
    """
    errors = []
    for mod in BACKEND_MODULES.get(name, (name,)):
        try:
            return importlib.import_module(mod), ""
        except Exception as e:  # ImportError, or OSError from a missing shared library
            errors.append(f"{mod}: {type(e).__name__}: {e}")
    return None, "; ".join(errors)


def require(name: str, env: Mapping[str, str] | None = None) -> ModuleType:
    """Import an optional backend for a test, or skip — or fail when ``PDPLUG_REQUIRE`` lists it.

    Works at module level (``nixl = require("nixl")`` skips the whole module) and inside a
    test. ``PDPLUG_REQUIRE=nixl,mooncake,triton`` (the ``all`` tox envs) turns the skip into a
    failure, so a CI machine that silently lost a backend cannot pass.

    :param name: see :func:`probe_module`.
    :param env: environment mapping (default ``os.environ``).
    :returns: the imported module.
    :raises pytest.skip.Exception: the module is missing and not required.
    :raises pytest.fail.Exception: the module is missing and required.
    """
    mod, why = probe_module(name)
    if mod is not None:
        return mod
    if name.lower() in required_modules(env):
        pytest.fail(f"{name} is required ({REQUIRE_ENV} lists it) but missing: {why}", False)
    pytest.skip(
        f"needs {name} (pip install 'pdplug[{name}]'); missing: {why}",
        allow_module_level=True,
    )
