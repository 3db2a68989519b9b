"""The version gate every adapter uses: the range, the reason, warn in register(), refuse when
the engine imports the selected module (the vLLM adapter's gate is tested with its params)."""

from __future__ import annotations

import logging

import pytest

from pdplug.adapters.version import VersionGate, installed_distribution, minor_version

GATE = VersionGate(component="Thing", engine="Eng", module="eng", supported=((1, 2), (1, 4)))


def test_range_and_reasons() -> None:
    assert GATE.spec == ">=1.2,<1.4"
    assert GATE.reason(("eng", "1.2.0")) is None and GATE.reason(("eng-cpu", "1.3.9+x")) is None
    assert GATE.reason(("eng", "1.4.0")) == (
        "Thing supports Eng >=1.2,<1.4, found eng 1.4.0: install a supported Eng, or a pdplug "
        "release that supports eng 1.4.0"
    )
    assert (
        GATE.reason(("eng", "dev"))
        == "Thing needs Eng >=1.2,<1.4; cannot read the version of eng dev"
    )
    assert (
        GATE.reason(None) == "Thing needs Eng >=1.2,<1.4; no installed distribution provides `eng`"
    )
    assert minor_version("0.32.3+cu129") == (0, 32) and minor_version("x1.2") is None
    with pytest.raises(ValueError, match="is empty"):
        VersionGate(component="T", engine="E", module="e", supported=((1, 2), (1, 2)))


def test_warn_logs_and_require_refuses(caplog: pytest.LogCaptureFixture) -> None:
    log = logging.getLogger("pdplug.test.gate")
    with caplog.at_level(logging.WARNING, logger=log.name):
        assert GATE.warn(log, ("eng", "2.0")) is not None
        assert GATE.warn(log, ("eng", "1.3")) is None
    assert caplog.text.count("found eng 2.0") == 1
    GATE.require(("eng", "1.2.1"))
    with pytest.raises(ImportError, match=r"found eng 0\.9"):
        GATE.require(("eng", "0.9"))


def test_the_distribution_is_found_from_the_module() -> None:
    assert installed_distribution("msgspec") is not None
    assert installed_distribution("msgspec")[0] == "msgspec"
    assert installed_distribution("pdplug_no_such_engine_module") is None
