"""Fault injection for KV sessions: a real engine whose writes arrive late, fail, or wait.

:class:`FaultyEngine` wraps a real :class:`~pdplug.transfer.engine.TransferEngine` (NIXL,
Mooncake) the way a congested network, a slow decode NIC or a stuck peer looks to a sender:
``post`` returns at once, the real post is issued ``delay`` seconds later (or, for a held
peer, only after :meth:`FaultyEngine.release_held`), and ``check`` reports ``"PROC"`` until the
real write is done; a write picked by ``fail`` is never issued and reports ``"ERR"`` (a
write the NIC refused). Like NIXL it cannot withdraw a posted write (``cancel`` is False).
Every call runs on the session's engine thread, as for any engine. Used by the tests, by
``pdplug bench soak`` and (test-only) by PdplugConnector's prefill workers
(:func:`inject_from_env`); install it with ``session.engine =
FaultyEngine(session.engine, ...)`` before the first send.
"""

from __future__ import annotations

import logging
import os
import random
import threading
import time
from collections.abc import Callable
from typing import Any

import numpy as np

from pdplug.transfer.engine import XFER_ERROR, XFER_PENDING, TransferEngine

log = logging.getLogger(__name__)

__all__ = [
    "FAULT_ENV",
    "HOLD",
    "FaultyEngine",
    "failing_writes_switch",
    "holding_writes_switch",
    "inject_from_env",
]

#: test-only: path of a switch file; while it holds an integer a session's writes fail, while
#: it holds ``hold`` they wait (:func:`inject_from_env`, :func:`failing_writes_switch`,
#: :func:`holding_writes_switch`)
FAULT_ENV = "PDPLUG_TEST_FAIL_WRITES"

#: switch file content that holds every write instead of failing some
HOLD = "hold"


class _Write:
    __slots__ = ("args", "due", "err", "held", "inner", "peer")

    def __init__(self, peer: Any, args: tuple[Any, ...], due: float, held: bool) -> None:
        self.peer = peer
        self.args = args
        self.due = due
        self.held = held
        self.inner: Any = None
        self.err: BaseException | None = None


class FaultyEngine:
    """A real engine with late or held writes (see the module docstring).

    :param inner: the real engine.
    :param delay: ``(lo, hi)`` seconds each write waits before its real post (uniform).
    :param seed: seed of the delay draws.
    :param hold: ``hold(peer handle) -> bool``: writes to such peers wait for
        :meth:`release_held` (a peer that stopped answering); ``None`` holds nothing.
    :param stall: ``(probability, seconds)``: each write is, with that probability, late by
        that many more seconds (a write that gets stuck, then recovers).
    :param fail: ``fail() -> bool``, asked once per write: True fails that write (never
        issued; ``check`` reports ``"ERR"``, so the sender fails its room); ``None`` fails none.
    :param hold_while: ``hold_while() -> bool``, asked at most every 20 ms while writes wait:
        while True no write is issued at all (a peer whose writes are stuck, switched from
        outside the process); ``None`` never.
    """

    def __init__(
        self,
        inner: TransferEngine,
        delay: tuple[float, float] = (0.0, 0.0),
        seed: int = 0,
        hold: Callable[[Any], bool] | None = None,
        stall: tuple[float, float] = (0.0, 0.0),
        fail: Callable[[], bool] | None = None,
        hold_while: Callable[[], bool] | None = None,
    ) -> None:
        self.inner = inner
        self.name = inner.name
        self.notifications = inner.notifications
        self.delay = delay
        self.hold = hold
        self.stall = stall
        self.fail = fail
        self.hold_while = hold_while
        self._hold_seen = (0.0, False)  # (when asked, answer): hold_while throttled
        self.failed = 0
        self.stalled = 0
        self._rng = random.Random(seed)
        self._lock = threading.Lock()  # release_held may come from a host thread
        self._waiting: list[_Write] = []
        self.inflight: set[_Write] = set()  # posted and not released
        self.max_inflight = 0
        self.posts = 0

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)

    def prepare_pages(self, peer: Any, grid: Any) -> None:
        """No page lists: every write goes through :meth:`post`, where the faults apply."""
        return None

    def post(
        self, peer: Any, src: np.ndarray, dst: np.ndarray, length: np.ndarray, tag: bytes
    ) -> Any:
        """Record the write; its real post happens later (:meth:`progress`)."""
        lo, hi = self.delay
        late = self._rng.uniform(lo, hi)
        if self.stall[0] and self._rng.random() < self.stall[0]:
            late += self.stall[1]
            self.stalled += 1
        held = self.hold is not None and self.hold(peer)
        w = _Write(
            peer,
            (src.copy(), dst.copy(), length.copy(), tag),
            time.monotonic() + late,
            held,
        )
        if self.fail is not None and self.fail():
            w.err = RuntimeError("injected write failure")
            self.failed += 1
        else:
            with self._lock:
                self._waiting.append(w)
        self.inflight.add(w)
        self.max_inflight = max(self.max_inflight, len(self.inflight))
        self.posts += 1
        return w

    def release_held(self) -> int:
        """Let every held write go (thread-safe); returns how many were held."""
        with self._lock:
            n = sum(w.held for w in self._waiting)
            for w in self._waiting:
                w.held = False
        return n

    def pending(self) -> int:
        """Writes not yet given to the real engine."""
        with self._lock:
            return len(self._waiting)

    def _holding(self, now: float) -> bool:
        if self.hold_while is None or not self._waiting:
            return False
        asked, held = self._hold_seen
        if now - asked >= 0.02:
            held = self.hold_while()
            self._hold_seen = (now, held)
        return held

    def _issue(self) -> None:
        now = time.monotonic()
        if self._holding(now):
            return
        with self._lock:
            due = [w for w in self._waiting if not w.held and w.due <= now]
            self._waiting = [w for w in self._waiting if w.held or w.due > now]
        for w in due:
            try:
                w.inner = self.inner.post(w.peer, *w.args)
            except Exception as e:  # the real post refused it: report ERR
                w.err = e

    def progress(self) -> None:
        """Issue the writes that are due, then progress the real engine."""
        self._issue()
        self.inner.progress()

    def check(self, xfer: Any) -> str:
        """``"PROC"`` until the real write is done, then its state."""
        self._issue()
        if xfer.err is not None:
            return XFER_ERROR
        if xfer.inner is None:
            return XFER_PENDING
        return self.inner.check(xfer.inner)

    def cancel(self, xfer: Any) -> bool:
        """Always False: like NIXL, a posted write cannot be withdrawn."""
        return False

    def release(self, xfer: Any) -> None:
        """Release the real handle (if the write was issued)."""
        self.inflight.discard(xfer)
        if xfer.inner is not None:
            self.inner.release(xfer.inner)


def failing_writes_switch(path: str) -> Callable[[], bool]:
    """A ``fail`` predicate for :class:`FaultyEngine` switched from outside the process
    (test-only: an engine under test runs in its own process).

    While the file at ``path`` exists and holds an integer ``k >= 1``, every ``k``-th write
    asked about fails (counting writes asked while the switch is on); without the file, or
    while it holds :data:`HOLD`, no write fails. The file is read once per write.

    :param path: the switch file.
    :returns: the predicate.
    """
    seen = 0

    def fail() -> bool:
        nonlocal seen
        try:
            with open(path) as f:
                text = f.read().strip()
        except OSError:
            return False
        if text == HOLD:
            return False
        try:
            k = max(1, int(text or "1"))
        except ValueError:
            k = 1
        seen += 1
        return (seen - 1) % k == 0

    return fail


def holding_writes_switch(path: str) -> Callable[[], bool]:
    """A ``hold_while`` predicate for :class:`FaultyEngine` (test-only): True while the file at
    ``path`` holds :data:`HOLD`, so a test can keep a real engine's rooms live (their writes
    not issued) for as long as it needs, e.g. to kill their peer while they are.

    :param path: the switch file.
    :returns: the predicate.
    """

    def held() -> bool:
        try:
            with open(path) as f:
                return f.read().strip() == HOLD
        except OSError:
            return False

    return held


def inject_from_env(session: Any) -> bool:
    """Test-only: when the environment names a switch file in :data:`FAULT_ENV`, wrap
    ``session.engine`` in a :class:`FaultyEngine` whose writes fail while that file holds an
    integer (:func:`failing_writes_switch`) and wait while it holds :data:`HOLD`
    (:func:`holding_writes_switch`). Lets a test fail real transfers inside an engine process
    it cannot reach otherwise (vLLM workers); never set it in production.

    :param session: a KV sender with a replaceable ``engine`` (before its first send).
    :returns: whether faults were installed.
    :raises ValueError: :data:`FAULT_ENV` is set and ``session`` has no ``engine``.
    """
    path = os.environ.get(FAULT_ENV, "")
    if not path:
        return False
    if not hasattr(session, "engine"):
        raise ValueError(f"{FAULT_ENV}={path!r}: the KV sender {type(session).__name__} has no "
                         "engine to wrap")  # fmt: skip
    session.engine = FaultyEngine(
        session.engine, fail=failing_writes_switch(path), hold_while=holding_writes_switch(path)
    )
    log.warning("pdplug: %s=%s: writes fail or wait while that file exists (test only)",
                FAULT_ENV, path)  # fmt: skip
    return True
