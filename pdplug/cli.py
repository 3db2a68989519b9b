"""The ``pdplug`` command: ``pdplug plugins | demo | bench …``."""

from __future__ import annotations

import json
import sys

import click

from pdplug.errors import PdplugError
from pdplug.manager import EXTENSION_POINTS, PROVIDES_KEY, PluginManager


@click.group()
def main() -> None:
    """pdplug: prefill/decode disaggregation plugins for LLM serving engines."""


@main.command()
@click.option("--json", "as_json", is_flag=True, help="Print machine-readable JSON.")
def plugins(as_json: bool) -> None:
    """List every plugin: distribution, version, status, names per extension point."""
    try:
        pm = PluginManager()
    except PdplugError as e:
        click.echo(f"error: {e}", err=True)
        sys.exit(2)
    data = pm.listing()
    if as_json:
        click.echo(json.dumps(data, indent=2))
    else:
        from rich.console import Console
        from rich.table import Table

        t = Table(title="pdplug plugins")
        for col in ("plugin", "distribution", "version", "status", *PROVIDES_KEY.values()):
            t.add_column(col)
        sel = data["selected"]
        for p in data["plugins"]:
            cells = []
            for point in EXTENSION_POINTS:
                names = p["provides"][PROVIDES_KEY[point]]
                cells.append(", ".join(n + ("*" if n == sel[point] else "") for n in names))
            t.add_row(p["name"], p["distribution"], p["version"], p["status"], *cells)
        Console().print(t)
        click.echo("selected: " + ", ".join(f"{k}={v}" for k, v in sel.items()))
        if not data["plugins"]:
            click.echo("no pdplug entry points found: is pdplug installed (pip install -e .)?")
    bad = [p for p in data["served_by"].values() if "error" in p]
    for c in data["conflicts"]:
        click.echo(f"conflict: {c}", err=True)
    if bad:
        for b in bad:
            click.echo(f"error: {b['error']}", err=True)
        sys.exit(1)


@main.group()
def bench() -> None:
    """Benchmarks (each prints a ratio measured side by side in one run)."""


def _register_late_commands() -> None:
    """Commands filled by later modules register themselves here (kept import-light)."""
    from importlib import import_module

    for mod in ("pdplug.bench", "pdplug.host.cli"):
        try:
            m = import_module(mod)
        except ModuleNotFoundError as e:
            if e.name != mod:
                raise
            continue
        m.register(main, bench)


_register_late_commands()

if "demo" not in main.commands:

    @main.command()
    def demo() -> None:
        """Replay a trace through PP prefill -> DCP decode (the reference host, issue 6)."""
        click.echo("pdplug demo: the reference host (issue 6) is not implemented yet", err=True)
        sys.exit(2)


if __name__ == "__main__":  # pragma: no cover
    main()
