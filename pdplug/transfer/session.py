"""What the KV sender and receiver sessions share: the room-facing host calls (poll, wait,
failure reason, drained, close) and the event queue that keeps observers off the data path.

Subclasses set ``rooms`` (:class:`pdplug.rooms.Rooms`), ``engine``, ``_loop``
(:class:`~pdplug.transfer.loop.EngineLoop`), ``_emit`` (observer or ``None``), ``_events`` and
``_closed``, and implement ``_drained(room)`` and ``_shutdown()`` (both run on the engine
thread).
"""

from __future__ import annotations

import logging
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


class RoomSession:
    """Base of :class:`~pdplug.transfer.sender.KVSenderSession` and
    :class:`~pdplug.transfer.receiver.KVReceiverSession` (see the module docstring)."""

    rooms: Rooms
    engine: TransferEngine
    _loop: EngineLoop
    _emit: Callable[[PdplugEvent], None] | None
    _events: list[PdplugEvent]
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
        of it in flight; a receiver's room succeeded, or every source rank acknowledged the
        failure (its ``ok=False`` tag), died, or ``transfer_timeout_s`` passed since it. Free or
        reuse the pages only then."""
        return self._loop.call(lambda: self._drained(room), 10.0)

    def close(self) -> None:
        """Stop the engine thread, release the engine and sockets; idempotent."""
        if self._closed:
            return
        self._closed = True
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

    def _queue_event(self, kind: str, room: int, fields: dict[str, Any]) -> None:
        """Queue an event for the observers; they run at the next periodic round, off the
        completion path."""
        self._events.append(
            PdplugEvent(kind=kind, source=self.engine.name, room=room, fields=fields)
        )

    def _flush_events(self) -> None:
        events, self._events = self._events, []
        for ev in events:
            try:
                assert self._emit is not None
                self._emit(ev)
            except Exception:  # an observer must never break the data path
                log.exception("%s: event observer failed", self._loop.name)
