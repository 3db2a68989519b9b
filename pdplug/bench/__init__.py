"""``pdplug bench …``: benchmarks. Each prints a ratio measured side by side in one run, the
machine and the sizes. Sub-modules define a click command ``cli`` and import heavy libraries
only inside it."""

from __future__ import annotations

from importlib import import_module
from typing import Any

BENCHES = ("consensus", "plan", "pack", "transfer", "e2e")


def register(main: Any, bench: Any) -> None:
    """Attach every available benchmark command to the ``bench`` group."""
    for name in BENCHES:
        try:
            mod = import_module(f"pdplug.bench.{name}")
        except ModuleNotFoundError as e:
            if e.name != f"pdplug.bench.{name}":
                raise
            continue
        bench.add_command(mod.cli, name)
