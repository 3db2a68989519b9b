"""`pdplug plugins [--json]` through click's CliRunner, plus one real subprocess."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from _core_fakes import consensus_hook, install_module
from click.testing import CliRunner

import pdplug
import pdplug.manager.discovery
from pdplug import ConsensusSpec
from pdplug.cli import main
from pdplug.testing import fake_entry_point

SELECTED = {"consensus": "pp0", "kv_sender": "nixl", "pack_planner": "dcp", "scheduler": "default"}
DEFAULTS = {"pdplug-consensus", "pdplug-dcp", "pdplug-nixl", "pdplug-mooncake", "pdplug-scheduler"}


def run(*args: str, env: dict[str, str] | None = None) -> Any:
    return CliRunner().invoke(main, list(args), env=env, catch_exceptions=False)


def add_plugins(monkeypatch: pytest.MonkeyPatch, *eps: Any) -> None:
    real = pdplug.manager.discovery.discover_entry_points
    monkeypatch.setattr(pdplug.manager.discovery, "discover_entry_points", lambda: [*real(), *eps])


def broken(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Any:
    (tmp_path / "broken_cli_plugin.py").write_text("import no_such_dependency_xyz\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    return fake_entry_point("broken-plugin", "broken_cli_plugin", dist="broken-dist", version="2.0")


def check_schema(doc: dict[str, Any]) -> None:
    assert set(doc) == {"plugins", "selected", "conflicts"}
    assert set(doc["selected"]) == set(SELECTED)
    for p in doc["plugins"]:
        assert set(p) == {"name", "distribution", "version", "status", "provides"}
        assert set(p["provides"]) == {"consensus", "kv_senders", "pack_planners", "schedulers"}
        assert all(isinstance(v, list) for v in p["provides"].values())


def test_json_lists_the_five_defaults_and_the_selection() -> None:
    res = run("plugins", "--json")
    assert res.exit_code == 0, res.output
    doc = json.loads(res.stdout)
    check_schema(doc)
    by = {p["name"]: p for p in doc["plugins"]}
    assert set(by) >= DEFAULTS
    for name in DEFAULTS:
        assert (by[name]["distribution"], by[name]["status"]) == ("pdplug", "loaded")
        assert by[name]["version"] == pdplug.__version__
    assert by["pdplug-consensus"]["provides"]["consensus"] == ["pp0", "ring"]
    assert by["pdplug-nixl"]["provides"]["kv_senders"] == ["nixl"]
    assert by["pdplug-dcp"]["provides"]["pack_planners"] == ["dcp", "tp"]
    assert by["pdplug-scheduler"]["provides"]["schedulers"] == ["default"]
    assert doc["selected"] == SELECTED


def test_table_stars_the_selected_names() -> None:
    res = run("plugins")
    assert res.exit_code == 0, res.output
    for text in ("pdplug-consensus", "pp0*", "nixl*", "dcp*", "default*", "mooncake"):
        assert text in res.stdout
    assert "selected: consensus=pp0, kv_sender=nixl, pack_planner=dcp, scheduler=default" in (
        res.stdout
    )


def test_a_failed_plugin_is_listed_and_the_cli_still_works(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    add_plugins(monkeypatch, broken(tmp_path, monkeypatch))
    res = run("plugins", "--json")
    assert res.exit_code == 0, res.output
    doc = json.loads(res.stdout)
    check_schema(doc)
    rec = {p["name"]: p for p in doc["plugins"]}["broken-plugin"]
    assert rec["distribution"] == "broken-dist" and rec["version"] == "2.0"
    assert rec["status"].startswith("failed:")
    assert "ModuleNotFoundError" in rec["status"] and "no_such_dependency_xyz" in rec["status"]
    assert doc["selected"] == SELECTED
    assert run("plugins").exit_code == 0


def test_strict_mode_exits_non_zero_naming_the_plugin(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    add_plugins(monkeypatch, broken(tmp_path, monkeypatch))
    for args, env in (
        (("plugins", "--json"), {"PDPLUG_STRICT_PLUGINS": "1"}),
        (("plugins", "--strict"), {}),
    ):
        res = run(*args, env=env)
        assert res.exit_code == 2
        assert "plugin 'broken-plugin' from broken-dist 2.0 failed" in res.stderr
        assert res.stdout == ""


def test_duplicate_exits_non_zero_naming_both_distributions(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    install_module(
        monkeypatch,
        "dup_cli_mod",
        pdplug_register_consensus=consensus_hook(ConsensusSpec(name="pp0", factory="a:b")),
    )
    add_plugins(monkeypatch, fake_entry_point("dup-cli", "dup_cli_mod", dist="dup-cli-dist"))
    res = run("plugins", "--json")
    assert res.exit_code == 1
    assert "pdplug (plugin 'pdplug-consensus')" in res.stderr
    assert "dup-cli-dist (plugin 'dup-cli')" in res.stderr
    by = {p["name"]: p for p in json.loads(res.stdout)["plugins"]}
    assert by["dup-cli"]["provides"]["consensus"] == ["pp0"]
    # blocking the duplicate from the command line resolves it
    res = run("plugins", "--json", "--no-plugin", "dup_cli")
    assert res.exit_code == 0, res.stderr
    assert {p["name"]: p for p in json.loads(res.stdout)["plugins"]}["dup-cli"]["status"] == (
        "blocked"
    )


def test_selection_precedence_on_the_command_line() -> None:
    res = run("plugins", "--json", env={"PDPLUG_CONSENSUS": "ring", "PDPLUG_KV_SENDER": "mooncake"})
    assert res.exit_code == 0
    sel = json.loads(res.stdout)["selected"]
    assert (sel["consensus"], sel["kv_sender"]) == ("ring", "mooncake")
    res = run("plugins", "--json", "--consensus", "pp0", env={"PDPLUG_CONSENSUS": "ring"})
    assert json.loads(res.stdout)["selected"]["consensus"] == "pp0"
    res = run("plugins", "--json", "--scheduler", "fifo")
    assert res.exit_code == 1
    assert "no scheduler named 'fifo' (set by explicit selection). Available: default" in res.stderr
    res = run("plugins", "--no-plugin", "pdplug-mooncake", "--kv-sender", "mooncake")
    assert res.exit_code == 1
    assert "no kv_sender named 'mooncake'" in res.stderr and "Available: nixl" in res.stderr


def test_autoload_switches_on_the_command_line(monkeypatch: pytest.MonkeyPatch) -> None:
    install_module(
        monkeypatch,
        "extra_cli_mod",
        pdplug_register_consensus=consensus_hook(ConsensusSpec(name="extra", factory="a:b")),
    )
    add_plugins(monkeypatch, fake_entry_point("extra-cli", "extra_cli_mod", dist="extra-cli"))

    def status(*args: str, env: dict[str, str] | None = None) -> str:
        res = run("plugins", "--json", *args, env=env)
        assert res.exit_code == 0, res.stderr
        return str({p["name"]: p for p in json.loads(res.stdout)["plugins"]}["extra-cli"]["status"])

    assert status() == "loaded"
    assert status("--disable-plugin-autoload") == "skipped: autoload off"
    assert status(env={"PDPLUG_DISABLE_PLUGIN_AUTOLOAD": "1"}) == "skipped: autoload off"
    assert status("--disable-plugin-autoload", "--plugin", "extra-cli") == "loaded"
    assert status("--plugin", "extra-cli", "--no-plugin", "extra-cli") == "blocked"


def test_demo_and_bench_commands_exist() -> None:
    assert run("--help").exit_code == 0
    for cmd in ("plugins", "demo", "bench"):
        assert cmd in run("--help").stdout
    assert run("bench", "--help").exit_code == 0
    assert run("demo", "--help").exit_code == 0
    assert pdplug.__version__ in run("--version").stdout


def test_console_entry_point_in_a_fresh_process() -> None:
    env = {k: v for k, v in os.environ.items() if not k.startswith("PDPLUG_")}
    out = subprocess.run(
        [sys.executable, "-m", "pdplug.cli", "plugins", "--json"],
        capture_output=True,
        text=True,
        timeout=120,
        env=env,
    )
    assert out.returncode == 0, out.stderr
    doc = json.loads(out.stdout)
    check_schema(doc)
    assert {p["name"] for p in doc["plugins"] if p["distribution"] == "pdplug"} >= DEFAULTS
    assert doc["selected"] == SELECTED


def test_the_cli_imports_nothing_heavy() -> None:
    """`pdplug plugins` must stay instant: bench and host commands import torch lazily."""
    code = (
        "import sys, pdplug.cli; "
        "print(sorted(m for m in ('torch', 'triton', 'nixl_cu12', 'nixl', 'mooncake') "
        "if m in sys.modules))"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True
    )
    assert out.stdout.strip() == "[]"


def test_no_entry_points_hints_at_installing(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(pdplug.manager.discovery, "discover_entry_points", lambda: [])
    res = run("plugins", "--json")
    assert res.exit_code == 1  # nothing can serve the selected names
    assert "no pdplug entry points found" in res.stderr
    assert json.loads(res.stdout) == {"plugins": [], "selected": SELECTED, "conflicts": []}


def test_the_table_fits_the_terminal_width() -> None:
    """Not always 160 columns: $COLUMNS (a terminal's width) bounds every line."""
    for cols in (80, 100):
        res = run("plugins", env={"COLUMNS": str(cols)})
        assert res.exit_code == 0, res.output
        lines = res.stdout.splitlines()
        assert max(len(line) for line in lines) <= cols, res.stdout
        assert any("pp0*" in line for line in lines)
    # piped without $COLUMNS: one row per plugin, never wrapped, no trailing blanks
    res = run("plugins")
    rows = [line for line in res.stdout.splitlines() if line.startswith("pdplug-consensus")]
    assert len(rows) == 1 and "pp0*, ring" in rows[0]
    assert all(line == line.rstrip() for line in res.stdout.splitlines())


def test_a_duplicate_is_marked_in_the_table_not_only_on_stderr(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    install_module(
        monkeypatch,
        "dup_table_mod",
        pdplug_register_consensus=consensus_hook(ConsensusSpec(name="pp0", factory="a:b")),
    )
    add_plugins(monkeypatch, fake_entry_point("dup-table", "dup_table_mod", dist="dup-table"))
    res = run("plugins")
    assert res.exit_code == 1
    rows = {line.split()[0]: line for line in res.stdout.splitlines() if line.strip()}
    for plugin in ("pdplug-consensus", "dup-table"):
        assert "pp0* (conflict)" in rows[plugin], res.stdout
        assert "loaded; conflict" in rows[plugin], res.stdout
    assert "selected: consensus=pp0 (conflict)" in res.stdout
    assert "conflict: consensus name 'pp0' is provided by pdplug" in res.stdout
    doc = json.loads(run("plugins", "--json").stdout)
    assert doc["conflicts"] == [
        {
            "point": "consensus",
            "name": "pp0",
            "plugins": ["pdplug-consensus", "dup-table"],
            "message": doc["conflicts"][0]["message"],
        }
    ]
    assert "dup-table (plugin 'dup-table')" in doc["conflicts"][0]["message"]
