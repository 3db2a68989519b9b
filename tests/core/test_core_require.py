"""The PDPLUG_REQUIRE rule (tests/README.md): missing backend -> skip, unless required."""

from __future__ import annotations

import pytest

from pdplug.testing import BACKEND_MODULES, probe_module, require, required_modules

MISSING = "pdplug_no_such_backend_xyz"


def test_present_module_is_returned() -> None:
    assert require("json").__name__ == "json"


def test_missing_module_skips_with_a_reason() -> None:
    with pytest.raises(pytest.skip.Exception) as e:
        require(MISSING, env={})
    assert f"needs {MISSING}" in str(e.value) and "ModuleNotFoundError" in str(e.value)


def test_missing_required_module_fails() -> None:
    env = {"PDPLUG_REQUIRE": f"nixl, {MISSING.upper()} ,triton"}
    assert required_modules(env) == {"nixl", MISSING, "triton"}
    with pytest.raises(pytest.fail.Exception) as e:
        require(MISSING, env=env)
    assert f"{MISSING} is required (PDPLUG_REQUIRE lists it) but missing" in str(e.value)


def test_backend_names_map_to_their_modules() -> None:
    assert BACKEND_MODULES["nixl"] == ("nixl._api", "nixl_cu12._api", "nixl_cu13._api")
    assert BACKEND_MODULES["mooncake"] == ("mooncake.engine",)
    mod, why = probe_module(MISSING)
    assert mod is None and MISSING in why


@pytest.mark.parametrize("backend", sorted(BACKEND_MODULES))
def test_backends_under_pdplug_require(backend: str, request: pytest.FixtureRequest) -> None:
    """In the ``all`` envs (PDPLUG_REQUIRE set) every backend must import; else this skips."""
    mod = require(backend)
    assert mod.__name__ in BACKEND_MODULES[backend]
