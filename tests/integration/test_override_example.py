"""Integration: the example third-party distributions, installed for real (tox -e integration).

The ``integration`` tox env installs ``examples/override-consensus`` into its venv and sets
``PDPLUG_INTEGRATION=1``; this module then drives the real ``pdplug`` console script. The
undeclared duplicate (``examples/duplicate-consensus``) is pip-installed into a temporary
``--target`` directory put on ``PYTHONPATH``, so the env itself stays clean.
"""

from __future__ import annotations

import json
import logging
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest

from pdplug.ports import free_endpoints

ROOT = Path(__file__).resolve().parents[2]
OVERRIDE = "pdplug-logging-consensus"
DUPLICATE = "pdplug-duplicate-consensus"

pytestmark = pytest.mark.skipif(
    os.environ.get("PDPLUG_INTEGRATION") != "1",
    reason="needs examples/override-consensus installed: run `tox -e integration`",
)


def pdplug_cli(*args: str, **env: str) -> subprocess.CompletedProcess[str]:
    exe = Path(sys.executable).with_name("pdplug")
    base = {k: v for k, v in os.environ.items() if not k.startswith("PDPLUG_")}
    return subprocess.run(
        [str(exe), *args],
        capture_output=True,
        text=True,
        timeout=120,
        env={**base, **env},
    )


def plugins_json(**env: str) -> tuple[int, dict[str, Any], str]:
    out = pdplug_cli("plugins", "--json", **env)
    doc = json.loads(out.stdout) if out.stdout.strip() else {}
    return out.returncode, doc, out.stderr


@pytest.fixture(scope="module")
def duplicate_path(tmp_path_factory: pytest.TempPathFactory) -> str:
    target = tmp_path_factory.mktemp("dup-site")
    subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "install",
            "--quiet",
            "--no-deps",
            "--no-build-isolation",
            "--target",
            str(target),
            str(ROOT / "examples" / "duplicate-consensus"),
        ],
        check=True,
        timeout=300,
    )
    return str(target)


def test_the_override_is_selected_for_pp0() -> None:
    rc, doc, err = plugins_json()
    assert rc == 0, err
    by = {p["name"]: p for p in doc["plugins"]}
    rec = by[OVERRIDE]
    assert (rec["distribution"], rec["version"], rec["status"]) == (OVERRIDE, "0.1.0", "loaded")
    assert rec["provides"]["consensus"] == ["pp0"]
    assert by["pdplug-consensus"]["provides"]["consensus"] == ["ring"]
    assert doc["selected"]["consensus"] == "pp0"
    table = pdplug_cli("plugins")
    assert table.returncode == 0
    assert f"override: consensus 'pp0' from {OVERRIDE} replaces the one from pdplug" in (
        table.stdout
    )


@pytest.mark.parametrize("name", [OVERRIDE, "PDPLUG_Logging.Consensus"])
def test_blocking_it_restores_the_default(name: str) -> None:
    rc, doc, err = plugins_json(PDPLUG_DISABLE_PLUGINS=name)
    assert rc == 0, err
    by = {p["name"]: p for p in doc["plugins"]}
    assert by[OVERRIDE]["status"] == "blocked"
    assert by[OVERRIDE]["provides"]["consensus"] == []
    assert by["pdplug-consensus"]["provides"]["consensus"] == ["pp0", "ring"]


def test_autoload_off_drops_it_unless_allowed() -> None:
    rc, doc, _ = plugins_json(PDPLUG_DISABLE_PLUGIN_AUTOLOAD="1")
    assert rc == 0
    assert {p["name"]: p for p in doc["plugins"]}[OVERRIDE]["status"] == "skipped: autoload off"
    rc, doc, _ = plugins_json(PDPLUG_DISABLE_PLUGIN_AUTOLOAD="1", PDPLUG_PLUGINS=OVERRIDE)
    assert rc == 0
    assert {p["name"]: p for p in doc["plugins"]}[OVERRIDE]["status"] == "loaded"


def test_an_undeclared_duplicate_fails_naming_both_distributions(duplicate_path: str) -> None:
    rc, doc, err = plugins_json(PYTHONPATH=duplicate_path)
    assert rc == 1
    assert f"{OVERRIDE} (plugin '{OVERRIDE}', declares overrides=True)" in err
    assert f"{DUPLICATE} (plugin '{DUPLICATE}')" in err
    assert {p["name"] for p in doc["plugins"]} >= {OVERRIDE, DUPLICATE}

    # against the default alone (override blocked): pdplug and the duplicate are named
    rc, _, err = plugins_json(PYTHONPATH=duplicate_path, PDPLUG_DISABLE_PLUGINS=OVERRIDE)
    assert rc == 1
    assert "pdplug (plugin 'pdplug-consensus')" in err and DUPLICATE in err

    # strict mode refuses to start at all
    rc, _, err = plugins_json(PYTHONPATH=duplicate_path, PDPLUG_STRICT_PLUGINS="1")
    assert rc == 2 and OVERRIDE in err and DUPLICATE in err

    # blocking the duplicate brings the override back
    rc, doc, err = plugins_json(PYTHONPATH=duplicate_path, PDPLUG_DISABLE_PLUGINS=DUPLICATE)
    assert rc == 0, err
    assert {p["name"]: p for p in doc["plugins"]}[OVERRIDE]["provides"]["consensus"] == ["pp0"]


def test_the_override_wraps_the_default_and_logs_decisions(
    caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    for key in [k for k in os.environ if k.startswith("PDPLUG_")]:
        monkeypatch.delenv(key)
    from pdplug import ConsensusConfig, get_plugin_manager

    pm = get_plugin_manager(refresh=True)
    assert pm.describe("consensus")["distribution"] == OVERRIDE
    cfg = ConsensusConfig(pp_rank=0, pp_size=1, endpoints=free_endpoints(1))
    caplog.set_level(logging.INFO, logger="pdplug_logging_consensus")
    cons: Any = pm.make_consensus(cfg)
    try:
        assert type(cons).__name__ == "LoggingConsensus"
        assert type(cons.inner).__module__.startswith("pdplug_consensus")
        cons.offer("bootstrap", good=[7, 8])
        cons.offer("bootstrap", bad=[9])
        got: list[Any] = []
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline and {7, 8, 9} - {
            r for d in got for r in (*d.good, *d.bad)
        }:
            got += cons.poll()
            time.sleep(0.01)
        assert {r for d in got for r in d.good} == {7, 8}
        assert {r for d in got for r in d.bad} == {9}
        assert [d.seq for d in got] == list(range(len(got)))
        logged = [r.getMessage() for r in caplog.records if "decision bootstrap#" in r.getMessage()]
        assert len(logged) == len(got) >= 1
        assert cons.stats()["decisions_logged"] == len(got)
    finally:
        cons.close()
    get_plugin_manager(refresh=True)
