"""Every import points down: applications -> plugins -> library (issue 14).

Reads the installed sources (``ast``, nothing imported): the library (``pdplug``) imports no
plugin and no application; a plugin imports the library only (never another plugin or an
application); an application imports the library and other applications, never a plugin's
internals, with no cycle between applications.
"""

from __future__ import annotations

import ast
import importlib.metadata
import importlib.util
from pathlib import Path

import pytest

TOP_LEVEL = sorted(importlib.metadata.distribution("pdplug").read_text("top_level.txt").split())
PLUGINS = sorted(
    ep.value.split(".")[0]
    for ep in importlib.metadata.distribution("pdplug").entry_points
    if ep.group == "pdplug"
)
APPS = sorted(set(TOP_LEVEL) - set(PLUGINS) - {"pdplug"})


def _imports(top: str) -> dict[str, set[str]]:
    """``{module path: top-level packages of this distribution it imports}`` for ``top``."""
    spec = importlib.util.find_spec(top)  # locates the package without importing it
    assert spec is not None and spec.submodule_search_locations, top
    found: dict[str, set[str]] = {}
    for root in spec.submodule_search_locations:
        for path in sorted(Path(root).rglob("*.py")):
            names: set[str] = set()
            for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
                if isinstance(node, ast.Import):
                    names |= {a.name.split(".")[0] for a in node.names}
                elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                    names.add(node.module.split(".")[0])
            found[str(path)] = (names & set(TOP_LEVEL)) - {top}
    return found


def test_the_distribution_has_the_library_plugins_and_apps() -> None:
    assert "pdplug" in TOP_LEVEL
    assert {"pdplug_consensus", "pdplug_dcp", "pdplug_nixl"} <= set(PLUGINS), PLUGINS
    assert {"pdplug_host", "pdplug_bench"} <= set(APPS), APPS


def test_the_library_imports_no_plugin_and_no_app() -> None:
    bad = {f: sorted(n) for f, n in _imports("pdplug").items() if n}
    assert bad == {}


@pytest.mark.parametrize("plugin", PLUGINS)
def test_a_plugin_imports_the_library_only(plugin: str) -> None:
    bad = {f: sorted(n - {"pdplug"}) for f, n in _imports(plugin).items() if n - {"pdplug"}}
    assert bad == {}


def test_applications_import_no_plugin_and_form_no_cycle() -> None:
    graph: dict[str, set[str]] = {}
    for app in APPS:
        uses = set().union(*_imports(app).values())
        assert not uses & set(PLUGINS), (app, sorted(uses & set(PLUGINS)))
        graph[app] = uses & set(APPS)
    done: set[str] = set()

    def visit(app: str, path: tuple[str, ...]) -> None:
        assert app not in path, f"import cycle: {' -> '.join((*path, app))}"
        if app not in done:
            for dep in graph[app]:
                visit(dep, (*path, app))
            done.add(app)

    for app in APPS:
        visit(app, ())
