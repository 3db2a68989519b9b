"""The PDPLUG_REQUIRE rule (tests/README.md): missing backend -> skip, unless required."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

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


@pytest.mark.parametrize("backend", [*sorted(BACKEND_MODULES), "torch"])
def test_backends_under_pdplug_require(backend: str, request: pytest.FixtureRequest) -> None:
    """In the ``all`` envs (PDPLUG_REQUIRE set) every backend and torch must import; else this
    skips."""
    mod = require(backend)
    assert mod.__name__ in BACKEND_MODULES.get(backend, (backend,))


def _run_suite(tmp_path: Path, require: str) -> str:
    """A one-module suite under tests/conftest.py whose module needs a torch that is missing."""
    shutil.copy(Path(__file__).parents[1] / "conftest.py", tmp_path / "conftest.py")
    (tmp_path / "test_needs_torch.py").write_text(
        "raise ModuleNotFoundError(\"No module named 'torch'\", name='torch')\n"
    )
    env = {k: v for k, v in os.environ.items() if k != "PDPLUG_REQUIRE"}
    env["PDPLUG_REQUIRE"] = require
    res = subprocess.run(
        [sys.executable, "-m", "pytest", "-p", "no:cacheprovider", "-ra", "-q", str(tmp_path)],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    return res.stdout + res.stderr


def test_a_module_that_needs_missing_torch_is_skipped_with_the_reason(tmp_path: Path) -> None:
    out = _run_suite(tmp_path, require="")
    assert "1 skipped" in out and "needs torch (pip install 'pdplug[torch]'" in out, out


def test_a_module_that_needs_missing_torch_fails_when_torch_is_required(tmp_path: Path) -> None:
    out = _run_suite(tmp_path, require="torch")
    assert "1 error" in out and "No module named 'torch'" in out, out
