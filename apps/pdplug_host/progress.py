"""What ``pdplug demo`` shows while it works: rich progress bars on a terminal, and one plain
line per finished phase everywhere (the only progress output when stdout is a pipe or a CI
log)."""

from __future__ import annotations

import time
from types import TracebackType
from typing import Any

__all__ = ["DemoProgress", "PHASES"]

#: phase -> (label, unit) of the ``progress(phase, done, total, note)`` calls of ``run_demo``
PHASES: dict[str, tuple[str, str]] = {
    "reference": ("reference run (one process, all layers)", "requests"),
    "start": ("starting workers", "workers ready"),
    "replay": ("replaying the trace", "requests ended"),
}


class DemoProgress:
    """The ``progress`` callback of :func:`pdplug_host.driver.run_demo` for a console.

    On a terminal each phase gets a bar (count, elapsed time, what it waits for); whether or not
    stdout is a terminal, a phase that completes prints one line with its count and duration
    (e.g. ``workers: 4 of 4 ready in 8.1 s``).

    The ``"load"`` phase (the trace is loaded, ``note`` names it) prints the run's first line,
    ``"{prefix}{done} requests of {note}{suffix}"``.

    :param console: a ``rich.console.Console`` (its ``is_terminal`` picks bars or lines only).
    :param prefix, suffix: the first line around the request count and the trace's name.
    """

    def __init__(self, console: Any, prefix: str = "", suffix: str = "") -> None:
        self.prefix, self.suffix = prefix, suffix
        from rich.progress import (
            BarColumn,
            MofNCompleteColumn,
            Progress,
            SpinnerColumn,
            TextColumn,
            TimeElapsedColumn,
        )

        self.console = console
        self.live = bool(console.is_terminal)
        self._bars = Progress(
            SpinnerColumn(),
            TextColumn("{task.description}"),
            BarColumn(),
            MofNCompleteColumn(),
            TextColumn("{task.fields[unit]}"),
            TimeElapsedColumn(),
            TextColumn("[dim]{task.fields[note]}"),
            console=console,
            transient=True,
            disable=not self.live,
        )
        self._tasks: dict[str, Any] = {}
        self._t0: dict[str, float] = {}
        self._ended: set[str] = set()

    def __enter__(self) -> DemoProgress:
        self._bars.__enter__()
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self._bars.__exit__(exc_type, exc, tb)

    def line(self, text: str) -> None:
        """Print one plain line (above the bars on a terminal)."""
        self.console.print(text, highlight=False, markup=False, soft_wrap=True)

    def __call__(self, phase: str, done: int, total: int, note: str = "") -> None:
        """Record ``done`` of ``total`` for ``phase``; ``note`` says what it waits for."""
        if phase in self._ended:
            return
        if phase == "load":
            self._ended.add(phase)
            self.line(f"{self.prefix}{done} requests of {note}{self.suffix}")
            return
        label, unit = PHASES.get(phase, (phase, ""))
        if phase not in self._tasks:
            self._t0[phase] = time.monotonic()
            self._tasks[phase] = self._bars.add_task(label, total=total, unit=unit, note=note)
        self._bars.update(self._tasks[phase], completed=done, total=total, note=note)
        if done >= total:
            self._ended.add(phase)
            self._bars.update(self._tasks[phase], visible=False)
            took = time.monotonic() - self._t0[phase]
            self.line(f"{label}: {done} of {total} {unit} in {took:.1f} s")
