"""Engine servers as subprocesses with bounded waits and a clean shutdown.

Any spec with a ``name``, a base ``url``, a ``command()`` and an ``environment()``
(:class:`LaunchSpec`, e.g. :class:`pdplug_vllm.engines.EngineSpec`) is started by
:func:`launch` in its own process group, logging to ``<log_dir>/<name>.log``;
:meth:`Engine.wait_ready` polls ``GET /health`` until it answers (or the process dies, or the
timeout passes: both raise with the log's tail), :meth:`Engine.stop` sends SIGTERM to the
whole group and SIGKILL after a grace period, so no engine process (an engine core, a
worker, a scheduler) outlives the harness.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import time
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path
from typing import Protocol

__all__ = [
    "EngineError",
    "LaunchSpec",
    "Engine",
    "launch",
    "running",
    "stop_all",
    "sigterm_as_interrupt",
]


class EngineError(RuntimeError):
    """An engine did not start, died, or answered with an error."""


class LaunchSpec(Protocol):
    """How to start one engine server (what :func:`launch` reads)."""

    @property
    def name(self) -> str:
        """Label in logs and errors (``"single"``, ``"prefill"``, ``"decode"``); the log
        file's name."""

    @property
    def url(self) -> str:
        """Base URL of the server (``http://127.0.0.1:port``); ``/health`` answers 200 once
        it serves."""

    def command(self) -> list[str]:
        """The server's command line."""

    def environment(self, base: Mapping[str, str]) -> dict[str, str]:
        """The server's environment, made from ``base`` (this process's)."""


class Engine:
    """A running engine server's process group.

    :ivar spec: what was started.
    :ivar log_path: where its stdout and stderr go.
    :ivar started: ``time.monotonic()`` at launch (seconds).
    :ivar ready_s: seconds from launch to the first healthy answer (0 until ready).
    """

    def __init__(self, spec: LaunchSpec, proc: subprocess.Popen[bytes], log_path: Path) -> None:
        self.spec = spec
        self.proc = proc
        self.log_path = log_path
        self.started = time.monotonic()
        self.ready_s = 0.0

    def log_tail(self, lines: int = 40) -> str:
        """The last ``lines`` lines of the engine's log."""
        try:
            text = self.log_path.read_text(errors="replace")
        except OSError as e:
            return f"(log {self.log_path} unreadable: {e})"
        return "\n".join(text.splitlines()[-lines:])

    def alive(self) -> bool:
        """Whether the server process still runs."""
        return self.proc.poll() is None

    def wait_ready(self, timeout_s: float = 300.0) -> float:
        """Poll ``GET /health`` every 0.5 s until it answers 200.

        :returns: seconds from launch to ready.
        :raises EngineError: the process exited, or ``timeout_s`` passed (with the log tail).
        """
        import httpx

        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if not self.alive():
                raise EngineError(
                    f"engine {self.spec.name} exited with {self.proc.returncode} before it was "
                    f"ready; log {self.log_path}:\n{self.log_tail()}"
                )
            with contextlib.suppress(httpx.HTTPError):
                if httpx.get(self.spec.url + "/health", timeout=2.0).status_code == 200:
                    self.ready_s = time.monotonic() - self.started
                    return self.ready_s
            time.sleep(0.5)
        raise EngineError(
            f"engine {self.spec.name} not ready after {timeout_s:.0f} s; log {self.log_path}:\n"
            f"{self.log_tail()}"
        )

    def terminate(self) -> None:
        """SIGTERM the process group without waiting (the start of :meth:`stop`)."""
        if self.alive():
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.proc.pid, signal.SIGTERM)

    def stop(self, grace_s: float = 20.0) -> int | None:
        """SIGTERM the process group, SIGKILL it after ``grace_s``; idempotent.

        :returns: the exit status of the server process.
        """
        if self.alive():
            self.terminate()
            try:
                self.proc.wait(timeout=grace_s)
            except subprocess.TimeoutExpired:
                pass
        # children (engine core, workers) may outlive the server: end the whole group
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.proc.pid, signal.SIGKILL)
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.proc.wait(timeout=5.0)
        return self.proc.returncode

    def kill(self) -> None:
        """SIGKILL the whole process group at once (a crashed engine, for failure tests)."""
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.proc.pid, signal.SIGKILL)

    def wait_gone(self, timeout_s: float = 30.0) -> bool:
        """Wait until no process of the engine's group is left (its ports are free again),
        at most ``timeout_s`` seconds.

        :returns: whether the group is gone.
        """
        deadline = time.monotonic() + timeout_s
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.proc.wait(timeout=timeout_s)  # reaped: a zombie leader still counts in the group
        while time.monotonic() < deadline:
            try:
                os.killpg(self.proc.pid, 0)
            except ProcessLookupError:
                return True
            time.sleep(0.05)
        return False


def launch(spec: LaunchSpec, log_dir: str | Path) -> Engine:
    """Start ``spec`` in a new process group, logging to ``<log_dir>/<name>.log``.

    :raises OSError: the command could not be started.
    """
    log_dir = Path(log_dir)
    log_dir.mkdir(parents=True, exist_ok=True)
    log_path = log_dir / f"{spec.name}.log"
    with open(log_path, "wb") as log:
        proc = subprocess.Popen(
            spec.command(),
            stdout=log,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            env=spec.environment(os.environ),
            start_new_session=True,
        )
    return Engine(spec, proc, log_path)


@contextlib.contextmanager
def running(
    specs: Sequence[LaunchSpec], log_dir: str | Path, timeout_s: float = 300.0
) -> Iterator[list[Engine]]:
    """Start every engine at once, wait until all are ready, stop all on exit (even on error).

    :raises EngineError: one engine failed to start (the others are stopped).
    """
    engines: list[Engine] = []
    try:
        for s in specs:  # each one kept as it starts: an interrupt between two launches too
            engines.append(launch(s, log_dir))
        deadline = time.monotonic() + timeout_s
        for e in engines:
            e.wait_ready(max(1.0, deadline - time.monotonic()))
        yield engines
    finally:
        stop_all(engines)


def stop_all(engines: Sequence[Engine], grace_s: float = 20.0) -> None:
    """Stop every engine: SIGTERM all groups at once, then wait for each (SIGKILL after
    ``grace_s`` seconds from the start), so they drain in parallel and an interrupt while
    waiting (a second Ctrl-C) still leaves every one signalled, and still stops the rest.

    :raises BaseException: the first exception (an interrupt) raised while stopping, once
        every engine was stopped.
    """
    first: BaseException | None = None
    for e in engines:
        try:
            e.terminate()
        except BaseException as exc:  # stop the rest, then raise it
            first = first or exc
    deadline = time.monotonic() + grace_s
    for e in engines:
        for _ in range(3):  # interrupted while waiting: this one again (it SIGKILLs sooner)
            try:
                e.stop(max(0.0, deadline - time.monotonic()))
                break
            except BaseException as exc:  # stop the rest, then raise it
                first = first or exc
    if first is not None:
        raise first


@contextlib.contextmanager
def sigterm_as_interrupt() -> Iterator[None]:
    """While inside, SIGTERM raises ``KeyboardInterrupt`` in the main thread, so a command
    stopped by ``kill`` or ``timeout`` unwinds its ``running`` blocks and stops its engines as
    Ctrl-C does (the default action would leave them orphaned). Elsewhere than the main thread
    it does nothing."""
    import threading

    if threading.current_thread() is not threading.main_thread():
        yield
        return

    fired = False

    def _terminated(signum: int, frame: object) -> None:
        nonlocal fired
        if fired:  # the first one is unwinding (stopping engines): let it finish
            return
        fired = True
        raise KeyboardInterrupt

    previous = signal.signal(signal.SIGTERM, _terminated)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)
