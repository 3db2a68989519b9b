"""What the KV sender and receiver sessions share: room-facing host calls and session ends.

The host calls on rooms (poll, wait, failure reason, drained), the end of a session (closed, or
its engine thread died), and the event queue that keeps observers off the data path (registered
KV entries are checked by :func:`pdplug.registration.resolve_kv`).

Subclasses set ``rooms`` (:class:`pdplug.rooms.Rooms`), ``engine``, ``_loop``
(:class:`~pdplug.transfer.loop.EngineLoop`, built with ``on_death=self._engine_died``),
``_emit`` (observer or ``None``), ``_events``, ``counts`` and ``_closed``, and implement
``_drained(room)``, ``_gauges()`` and ``_shutdown()`` (all run on the engine thread).
"""

from __future__ import annotations

import logging
import math
import numbers
import threading
import time
from collections import Counter
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, TypeVar

from pdplug.errors import TransferError
from pdplug.types import KVPoll, PdplugEvent

if TYPE_CHECKING:
    from pdplug.rooms import Rooms
    from pdplug.transfer.engine import TransferEngine
    from pdplug.transfer.loop import EngineLoop

__all__ = ["RoomSession"]

log = logging.getLogger(__name__)

_S = TypeVar("_S", bound="RoomSession")


def _noop() -> None:
    return None


def _seconds(value: object) -> float | None:
    """``value`` as a timeout in seconds, or ``None`` when it is not a real number in
    ``(0, threading.TIMEOUT_MAX]`` (booleans, NaN, infinities and overflowing ints included)."""
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        return None
    try:
        t = float(value)
    except (OverflowError, ValueError):
        return None
    return t if math.isfinite(t) and 0 < t <= threading.TIMEOUT_MAX else None


class RoomSession:
    """Base of :class:`~pdplug.transfer.sender.KVSenderSession` and
    :class:`~pdplug.transfer.receiver.KVReceiverSession` (see the module docstring)."""

    rooms: Rooms
    engine: TransferEngine
    counts: Counter[str]
    _loop: EngineLoop
    _emit: Callable[[PdplugEvent], None] | None
    _events: list[tuple[str, int, dict[str, Any]]]  # (kind, room, fields), built at flush
    _closed: bool

    def poll(self, room: int) -> KVPoll:
        """Room status on this rank (a receiver: Success once every source rank's last chunk
        arrived).

        :raises KeyError: ``room`` is not leased (never started, or cleared).
        """
        return self.rooms.status(room)

    def wait(
        self,
        room: int,
        until: tuple[KVPoll, ...] = (KVPoll.Success, KVPoll.Failed),
        timeout_s: float | None = None,
    ) -> KVPoll:
        """Block until ``room`` reaches a status in ``until`` — a single non-terminal status
        means "at least" — without polling (:meth:`pdplug.rooms.Rooms.wait`). For hosts and
        tools that would otherwise spin on :meth:`poll` (a spinning host steals the CPU a
        loopback copy needs).

        :param timeout_s: seconds; ``None``: as long as the room's deadlines allow.
        :raises KeyError: ``room`` is not leased.
        """
        return self.rooms.wait(room, until, timeout_s)

    def failure_reason(self, room: int) -> str | None:
        """Why ``room`` failed, ``None`` if it did not (or is not leased)."""
        return self.rooms.reason(room)

    def drained(self, room: int) -> bool:
        """Whether nothing can still touch ``room``'s pages on this rank: a sender has no write
        of it in flight; a receiver's room succeeded, or every source rank that was sent the
        room confirmed it stopped writing (its drained failure notice) or is known dead. Never
        by a timer: a write the engine still reports in flight keeps the room undrained (and
        counted in ``stats()``). Free or reuse the pages only then. ``False`` once the engine
        thread died (nothing can be confirmed any more)."""
        try:
            return self._loop.locked(lambda: self._drained(room), 10.0)
        except TransferError:
            if self._loop.died is None and not self._closed:
                raise
            return False

    def ping(self, timeout_s: float = 5.0) -> float:
        """Seconds for a no-op to run on the session's engine thread and its answer to wake
        the caller: the two thread hand-offs every send pays (host -> engine thread, and the
        completion back to a waiting host), without planning or posting. A health check for
        operators, and the floor ``pdplug bench transfer`` reports.

        :raises ValueError: ``timeout_s`` is not a real number of seconds in
            ``(0, threading.TIMEOUT_MAX]``.
        :raises TransferError: the engine thread did not answer within ``timeout_s`` seconds,
            died, or the session is closed.
        """
        t = _seconds(timeout_s)
        if t is None:
            raise ValueError(
                f"ping: timeout_s must be a finite number of seconds > 0 and at most "
                f"{threading.TIMEOUT_MAX:g}, got {timeout_s!r}"
            )
        t0 = time.perf_counter()
        self._loop.call(_noop, t)
        return time.perf_counter() - t0

    def close(self) -> None:
        """Stop the engine thread, release the engine and sockets; idempotent."""
        if self._closed:
            return
        self._closed = True
        if self._loop.died is not None:  # nobody else touches the engine any more
            try:
                self._shutdown()
            except Exception:
                log.exception("%s: shutdown after the engine thread died", self._loop.name)
        else:
            try:
                self._loop.call(self._shutdown, 10.0)
            except TransferError:
                log.warning("%s: engine thread did not shut down cleanly", self._loop.name)
        self._loop.stop()

    def __enter__(self: _S) -> _S:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # ------------------------------------------------------------------ engine thread
    def _drained(self, room: int) -> bool:  # pragma: no cover - overridden
        raise NotImplementedError

    def _shutdown(self) -> None:  # pragma: no cover - overridden
        raise NotImplementedError

    def _gauges(self) -> dict[str, int]:  # pragma: no cover - overridden
        raise NotImplementedError

    def _engine_died(self, cause: BaseException) -> None:
        """The engine thread died (called on it): every room fails with the cause, so every
        ``wait`` returns and every ``poll`` says ``Failed``."""
        why = f"engine thread died ({type(cause).__name__}: {cause})"
        self.counts["rooms_failed_by_death"] += len(self.rooms.fail_all(why))

    def _common_stats(self, codec: Any, tags: Any) -> dict[str, Any]:
        """Counters every session reports: its own, the control codec's and the tag codec's
        drops by reason, the engine's own counters (``engine_*``, e.g. NIXL notifications lost
        to overflow), the engine loop's errors and death, and what the session holds now
        (:meth:`_gauges`, read on the engine thread)."""
        out: dict[str, Any] = dict(self.counts)
        out.update({f"control_{k}": v for k, v in codec.stats().items()})
        out.update({f"tags_{k}": v for k, v in tags.stats().items()})
        out.update({f"engine_{k}": v for k, v in dict(getattr(self.engine, "counts", {})).items()})
        out["loop_errors"] = self._loop.errors
        out["engine_thread_died"] = self._loop.death()
        if self._loop.running:
            try:
                out.update(self._loop.locked(self._gauges, 10.0))
            except TransferError:
                pass
        return out

    def _queue_event(self, kind: str, room: int, fields: dict[str, Any]) -> None:
        """Queue an event for the observers; they run at the next periodic round, off the
        completion path."""
        if self._emit is None:
            return
        self._events.append((kind, room, fields))  # the event is built at the flush

    def _flush_events(self) -> None:
        events, self._events = self._events, []
        source = self.engine.name
        for kind, room, fields in events:
            try:
                assert self._emit is not None
                self._emit(PdplugEvent(kind=kind, source=source, room=room, fields=fields))
            except Exception:  # an observer must never break the data path
                log.exception("%s: event observer failed", self._loop.name)
