"""The ``pdplug bench`` command group (registered in the ``pdplug.cli`` entry-point group)."""

from __future__ import annotations

import os
from importlib import import_module
from typing import Any

import click

__all__ = ["bench", "BENCHES"]

BENCHES = (
    "consensus",
    "plan",
    "pack",
    "transfer",
    "e2e",
    "soak",
    "vllm",
    "sglang",
    "cluster",
)


class _Benches(click.Group):
    """Benchmark commands, each module imported only when its command is named."""

    def list_commands(self, ctx: click.Context) -> list[str]:
        return list(BENCHES)

    def get_command(self, ctx: click.Context, name: str) -> click.Command | None:
        if name not in BENCHES:
            return None
        cmd: click.Command = import_module(f"pdplug_bench.{name}").cli
        return cmd

    def invoke(self, ctx: click.Context) -> Any:
        # A configuration the plugin manager refuses is one line and exit 1, not a traceback.
        from pdplug import PdplugError
        from pdplug_engines.procs import sigterm_as_interrupt

        try:
            # kill / timeout unwinds like Ctrl-C: engines, ranks and clusters are stopped
            with sigterm_as_interrupt():
                return super().invoke(ctx)
        except PdplugError as e:
            raise click.ClickException(f"{type(e).__name__}: {e}") from None


@click.group(cls=_Benches)
def bench() -> None:
    """Benchmarks (each prints a ratio measured side by side in one run).

    Sets OMP_WAIT_POLICY=PASSIVE unless already set: torch's OpenMP workers otherwise spin for
    a while after every parallel op (a baseline copy), taking the cores from pdplug's own
    threads (pack threads, engine progress) that run right after; on 2 cores that halved the
    threaded CPU packer (5.1 vs 9.5 GB/s). The value used is printed with the machine.
    Sets MC_LOG_LEVEL=ERROR unless already set, as pdplug demo does: Mooncake logs every
    completed batch at INFO, hundreds of lines around a benchmark's tables.
    """
    os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
    os.environ.setdefault("MC_LOG_LEVEL", "ERROR")
