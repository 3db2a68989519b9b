"""Shared test helpers for every tests/<area>/ (see tests/README.md).

* Backends: mark a test ``@pytest.mark.nixl`` / ``mooncake`` / ``triton`` / ``torch`` (or set
  ``pytestmark``), or call ``pdplug.testing.require("nixl")`` at module level / use the
  ``require_module`` fixture. A missing backend is a skip with a reason, unless
  ``PDPLUG_REQUIRE=nixl,mooncake,triton,torch`` lists it: then it is a failure.
* torch is an optional dependency (extra ``[torch]``): a test module that cannot even be
  imported without torch is reported as skipped ("needs torch"), under the same rule.
* Network namespaces: mark a test ``@pytest.mark.netns`` (or use the ``netns_cluster``
  fixture, or call ``pdplug.testing.netns.require_netns()``): skips naming why where they
  cannot be made (not root, no ``nft``), fails instead when ``PDPLUG_REQUIRE`` lists ``netns``.
* ``plugin_manager``: a fresh PluginManager (defaults only, autoload off, strict).
* ``netns_cluster``: a factory of started :class:`pdplug.testing.netns.Cluster` (closed at
  teardown; the test fails if any of its namespaces is left).
"""

from __future__ import annotations

from collections.abc import Callable, Generator
from types import ModuleType

import pytest

from pdplug.testing import (
    BACKEND_MODULES,
    REQUIRE_ENV,
    netns_cluster,  # noqa: F401  (re-exported fixture)
    plugin_manager,  # noqa: F401  (re-exported fixture)
    probe_module,
    require,
    required_modules,
)
from pdplug.testing.netns import NETNS, netns_available, require_netns

#: optional modules a test can be marked with: the backends plus torch
OPTIONAL = (*BACKEND_MODULES, "torch")
TORCH_MISSING = "No module named 'torch'"


@pytest.hookimpl(wrapper=True)
def pytest_runtestloop(session: pytest.Session) -> Generator[None, object, object]:
    """SIGTERM (``timeout``, a cancelled CI job) unwinds like Ctrl-C: the engines, workers and
    namespaces a test started are stopped by its ``finally`` blocks; the default action killed
    pytest alone and left each engine's process group running."""
    from pdplug_engines.procs import sigterm_as_interrupt

    with sigterm_as_interrupt():
        return (yield)


def pytest_report_header(config: pytest.Config) -> list[str]:
    """One line per optional module: available or why not, and what PDPLUG_REQUIRE demands."""
    lines = []
    for name in OPTIONAL:
        mod, why = probe_module(name)
        lines.append(f"pdplug backend {name}: " + (mod.__name__ if mod else f"missing ({why})"))
    ok, why = netns_available()
    lines.append(f"pdplug network namespaces: {'available' if ok else f'missing ({why})'}")
    lines.append(f"{REQUIRE_ENV}={','.join(sorted(required_modules())) or '(unset)'}")
    return lines


def pytest_runtest_setup(item: pytest.Item) -> None:
    """Apply the PDPLUG_REQUIRE rule to tests marked with an optional module's name."""
    for name in OPTIONAL:
        if item.get_closest_marker(name) is not None:
            require(name)
    if item.get_closest_marker(NETNS) is not None:
        require_netns()


@pytest.hookimpl(wrapper=True)
def pytest_make_collect_report(
    collector: pytest.Collector,
) -> Generator[None, pytest.CollectReport, pytest.CollectReport]:
    """A test module that fails to import only because torch is missing is skipped with that
    reason (the ``py3XX-core`` envs install no torch), unless PDPLUG_REQUIRE lists torch."""
    report = yield
    if (
        report.failed
        and isinstance(collector, pytest.Module)
        and TORCH_MISSING in str(report.longrepr)
        and "torch" not in required_modules()
    ):
        report.outcome = "skipped"
        report.longrepr = (
            str(collector.path),
            0,
            "Skipped: needs torch (pip install 'pdplug[torch]'; the core envs have none)",
        )
    return report


@pytest.fixture
def require_module() -> Callable[[str], ModuleType]:
    """``require_module("nixl")`` -> the module, or skip/fail per PDPLUG_REQUIRE."""
    return require
