"""Shared test helpers for every tests/<area>/ (see tests/README.md).

* Backends: mark a test ``@pytest.mark.nixl`` / ``mooncake`` / ``triton`` (or set
  ``pytestmark``), or call ``pdplug.testing.require("nixl")`` at module level / use the
  ``require_module`` fixture. A missing backend is a skip with a reason, unless
  ``PDPLUG_REQUIRE=nixl,mooncake,triton`` lists it: then it is a failure.
* ``plugin_manager``: a fresh PluginManager (defaults only, autoload off, strict).
"""

from __future__ import annotations

from collections.abc import Callable
from types import ModuleType

import pytest

from pdplug.testing import (
    BACKEND_MODULES,
    REQUIRE_ENV,
    plugin_manager,  # noqa: F401  (re-exported fixture)
    probe_module,
    require,
    required_modules,
)


def pytest_report_header(config: pytest.Config) -> list[str]:
    """One line per backend: available or why not, and what PDPLUG_REQUIRE demands."""
    lines = []
    for name in BACKEND_MODULES:
        mod, why = probe_module(name)
        lines.append(f"pdplug backend {name}: " + (mod.__name__ if mod else f"missing ({why})"))
    lines.append(f"{REQUIRE_ENV}={','.join(sorted(required_modules())) or '(unset)'}")
    return lines


def pytest_runtest_setup(item: pytest.Item) -> None:
    """Apply the PDPLUG_REQUIRE rule to tests marked with a backend's name."""
    for name in BACKEND_MODULES:
        if item.get_closest_marker(name) is not None:
            require(name)


@pytest.fixture
def require_module() -> Callable[[str], ModuleType]:
    """``require_module("nixl")`` -> the module, or skip/fail per PDPLUG_REQUIRE."""
    return require
