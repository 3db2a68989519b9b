"""The ``pdplug`` command: ``pdplug plugins``, plus the commands applications register in the
``pdplug.cli`` entry-point group (``demo``, ``bench`` ...).

Command-line switches beat the environment (``--no-plugin`` joins ``PDPLUG_DISABLE_PLUGINS``;
the block list still beats the allow list). Exit status of ``pdplug plugins``: 0 when every
selected component can be built, 1 when one cannot (unknown name, duplicate, failed plugin),
2 when the manager refused to start (strict mode).
"""

from __future__ import annotations

import json
import os
import sys
from collections.abc import Callable
from typing import Any

import click

from pdplug.errors import PdplugError
from pdplug.manager import EXTENSION_POINTS, PluginManager

__all__ = ["main", "COMMANDS_GROUP"]

#: Entry-point group of commands contributed by applications built on the library (the
#: reference host's ``demo``, ``bench``, ...); each entry point is a click command.
COMMANDS_GROUP = "pdplug.cli"


class _Commands(click.Group):
    """The ``pdplug`` group: its own commands plus those found in the ``pdplug.cli`` entry-point
    group, imported only when named (``pdplug plugins`` never imports the applications)."""

    def _found(self) -> dict[str, Any]:
        from importlib.metadata import entry_points

        return {ep.name: ep for ep in entry_points(group=COMMANDS_GROUP)}

    def list_commands(self, ctx: click.Context) -> list[str]:
        return sorted({*super().list_commands(ctx), *self._found()})

    def get_command(self, ctx: click.Context, name: str) -> click.Command | None:
        cmd = super().get_command(ctx, name)
        if cmd is not None:
            return cmd
        ep = self._found().get(name)
        if ep is None:
            return None
        loaded = ep.load()
        if not isinstance(loaded, click.Command):
            raise click.ClickException(
                f"entry point {ep.name} = {ep.value} in group {COMMANDS_GROUP} is not a click "
                f"command ({type(loaded).__name__})"
            )
        return loaded


@click.group(cls=_Commands)
@click.version_option(package_name="pdplug")
def main() -> None:
    """pdplug: prefill/decode disaggregation plugins for LLM serving engines."""


def _select_options(f: Callable[..., None]) -> Callable[..., None]:
    """One ``--<point>`` option per extension point, from the table."""
    for p in reversed(list(EXTENSION_POINTS.values())):
        f = click.option(
            p.option,
            p.name,
            metavar="NAME",
            help=f"Select a {p.label} (beats {p.env}; default {p.default}).",
        )(f)
    return f


@main.command()
@click.option("--json", "as_json", is_flag=True, help="Print machine-readable JSON.")
@click.option(
    "--plugin",
    "allow",
    multiple=True,
    metavar="NAME",
    help="Allow this third-party plugin (repeatable; replaces PDPLUG_PLUGINS).",
)
@click.option(
    "--no-plugin",
    "block",
    multiple=True,
    metavar="NAME",
    help="Block this plugin (repeatable; added to PDPLUG_DISABLE_PLUGINS).",
)
@click.option(
    "--disable-plugin-autoload",
    is_flag=True,
    default=None,
    help="Load only the defaults and --plugin names (like PDPLUG_DISABLE_PLUGIN_AUTOLOAD=1).",
)
@click.option("--strict", is_flag=True, default=None, help="Like PDPLUG_STRICT_PLUGINS=1.")
@_select_options
def plugins(
    as_json: bool,
    allow: tuple[str, ...],
    block: tuple[str, ...],
    disable_plugin_autoload: bool | None,
    strict: bool | None,
    **select: str | None,
) -> None:
    """List every plugin: distribution, version, status, names per extension point.

    The selected name of each extension point is starred in the table; a name that several
    plugins claim is marked "(conflict)" there and explained below it.
    """
    try:
        pm = PluginManager(
            strict=strict,
            autoload=None if disable_plugin_autoload is None else not disable_plugin_autoload,
            allow=allow or None,
            block=block,
            select={k: v for k, v in select.items() if v},
        )
    except PdplugError as e:
        click.echo(f"error: {e}", err=True)
        sys.exit(2)
    data = pm.listing()
    if as_json:
        click.echo(json.dumps(data, indent=2))
    else:
        _print_table(pm, data)
    if not data["plugins"]:
        click.echo(
            "no pdplug entry points found: is pdplug installed (pip install -e .)? "
            "A source tree on PYTHONPATH has no entry-point metadata.",
            err=True,
        )
    problems = pm.problems()
    for c in pm.conflicts():
        if not any(c in p for p in problems):
            click.echo(f"conflict: {c}", err=True)
    for p in problems:
        click.echo(f"error: {p}", err=True)
    if problems or pm.conflicts():
        sys.exit(1)


def _render(table: Any) -> str:
    """``table`` as plain text as wide as the terminal (or ``$COLUMNS``); piped output is never
    wrapped. Trailing blanks are stripped."""
    import io

    from rich.console import Console

    term = Console()
    fits = term.is_terminal or os.environ.get("COLUMNS", "").isdigit()
    buf = io.StringIO()
    Console(file=buf, width=term.width if fits else 1000).print(table)
    return "\n".join(line.rstrip() for line in buf.getvalue().splitlines())


def _print_table(pm: PluginManager, data: dict[str, Any]) -> None:
    from rich.table import Table

    sel = data["selected"]
    clash = {(c["point"], c["name"]) for c in data["conflicts"]}
    claimants = {p for c in data["conflicts"] for p in c["plugins"]}
    t = Table(box=None, pad_edge=False, padding=(0, 2, 0, 0))
    for col in ("plugin", "distribution", "version", "status"):
        t.add_column(col, overflow="fold")
    for pt in EXTENSION_POINTS.values():
        t.add_column(pt.listing, overflow="fold")
    for p in data["plugins"]:
        cells = []
        for point, pt in EXTENSION_POINTS.items():
            names = p["provides"][pt.listing]
            cells.append(
                ", ".join(
                    n
                    + ("*" if n == sel[point] else "")
                    + (" (conflict)" if (point, n) in clash else "")
                    for n in names
                )
            )
        status = p["status"] + ("; conflict" if p["name"] in claimants else "")
        t.add_row(p["name"], p["distribution"], p["version"], status, *cells)
    click.echo(_render(t))
    click.echo(
        "selected: "
        + ", ".join(f"{k}={v}" + (" (conflict)" if (k, v) in clash else "") for k, v in sel.items())
    )
    for point, name, new, old in pm.overrides():
        click.echo(f"override: {point} {name!r} from {new} replaces the one from {old}")
    for c in data["conflicts"]:
        click.echo(f"conflict: {c['message']}")


if __name__ == "__main__":  # pragma: no cover
    main()
