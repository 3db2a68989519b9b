"""The per-room KVPoll state machine every KV sender and receiver uses.

One :class:`Rooms` table per rank. A *room* is a request's bootstrap room id; each time a room id
is (re)used the table hands out a new **lease generation** (a process-wide, strictly increasing
integer), and every event about the room carries the generation it was meant for, so a late
completion from a recycled room can never touch the new request (SGLang's receiver lease
generation; vLLM PR #50754 for the negative-twin rule).

Rules (SGLang ``CommonKVManager.update_status``):

* a room's status only moves up the :class:`~pdplug.types.KVPoll` lattice
  (:func:`~pdplug.types.merge_poll`); ``Failed`` is absorbing, and a room that ended
  ``Success`` is not failed afterwards (a late abort does not end it a second time);
* an event for a room that is not leased (never leased, or already cleared) is ignored, so a
  ``Failed`` for a cleared room cannot poison a recycled room id;
* every non-terminal state has a deadline (``bootstrap_timeout_s``, ``waiting_timeout_s``,
  ``transfer_timeout_s`` of :class:`~pdplug.config.KVConfig`); :meth:`Rooms.expire` fails rooms
  past theirs with a reason naming the state and the config field. Progress (:meth:`Rooms.touch`)
  re-arms the deadline: the timeout bounds *silence*, not size — a sender also touches rooms
  whose work waits in its local queue while the queue moves;
* ``Success`` is not published while any chunk of the room is pending on this rank
  (:meth:`Rooms.add_pending` / :meth:`Rooms.done_pending`): it is held and published when the
  last pending chunk completes;
* :meth:`Rooms.fail_all` ends every room at once (the session's engine thread died).

The table is thread-safe (one lock); a host thread polls while an engine thread advances.
"""

from __future__ import annotations

import itertools
import threading
import time
from collections.abc import Callable
from typing import TYPE_CHECKING

import msgspec
import numpy as np

from pdplug.types import KVPoll, Segment, merge_poll

if TYPE_CHECKING:
    from pdplug.config import KVConfig

__all__ = ["ROOM_LIMIT", "Rooms", "RoomView", "check_room_id", "next_generation", "reached"]

#: rooms are ints in ``[0, ROOM_LIMIT)``: a non-negative int64 on every wire
ROOM_LIMIT = 1 << 63


def check_room_id(room: object, where: str) -> int:
    """Refuse a room id that is not an int in ``[0, 2**63)``: rooms are non-negative int64 on
    every wire (a larger or non-integer one would be lost when the engine thread encodes its
    message, long after the host call returned; ``True`` or ``2.0`` would alias room 1 or 2).

    :param where: the API call, named in the error (``KVReceiver.expect``).
    :returns: the room as a Python ``int`` (a NumPy integer cannot be encoded on the wire).
    :raises ValueError: naming ``where`` and the value (booleans are refused too).
    """
    integer = isinstance(room, int | np.integer) and not isinstance(room, bool)
    if not integer or not 0 <= room < ROOM_LIMIT:  # type: ignore[operator]
        raise ValueError(f"{where}: room={room!r} must be an int in [0, 2**63)")
    return int(room)  # type: ignore[call-overload]


_GEN = itertools.count(1)
_GEN_LOCK = threading.Lock()


def reached(status: KVPoll, until: tuple[KVPoll, ...]) -> bool:
    """Whether a wait for ``until`` ends at ``status``: it is in ``until``, or later on the
    lattice when ``until`` is one non-terminal status, or ``Failed`` (absorbing)."""
    if status in until or status == KVPoll.Failed:
        return True
    return len(until) == 1 and until[0] != KVPoll.Failed and status >= until[0]


def next_generation() -> int:
    """A new lease generation: strictly increasing within the process, never 0."""
    with _GEN_LOCK:
        return next(_GEN)


class RoomView(msgspec.Struct, frozen=True, kw_only=True):
    """A read-only snapshot of one room.

    :ivar room/generation/status: identity and current status.
    :ivar reason: why it failed ("" otherwise).
    :ivar pending: chunks still in flight on this rank.
    :ivar success_held: Success was requested but waits for ``pending`` to reach 0.
    :ivar deadline: monotonic time (s) at which the current state expires, 0 if none.
    """

    room: int
    generation: int
    status: KVPoll
    reason: str = ""
    pending: int = 0
    success_held: bool = False
    deadline: float = 0.0


class _Room(msgspec.Struct, kw_only=True):
    generation: int
    status: KVPoll
    reason: str = ""
    pending: int = 0
    success_held: bool = False
    deadline: float = 0.0
    chunks: int = 0  # segments handed to the sender (begin_send), in chunk_id order
    token_end: int = 0  # where the last of them ended (the next one starts there)


class Rooms:
    """Thread-safe table of room leases with a monotonic status, deadlines and pending counts.

    :param bootstrap_timeout_s: seconds a room may stay ``Bootstrapping`` (> 0).
    :param waiting_timeout_s: seconds a room may stay ``WaitingForInput`` (> 0).
    :param transfer_timeout_s: seconds a room may stay ``Transferring`` without progress (> 0).
    :param clock: monotonic clock in seconds (tests inject a fake one).
    :raises ValueError: a timeout that is not > 0 (named).
    """

    def __init__(
        self,
        *,
        bootstrap_timeout_s: float = 30.0,
        waiting_timeout_s: float = 60.0,
        transfer_timeout_s: float = 30.0,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        for name, v in (
            ("bootstrap_timeout_s", bootstrap_timeout_s),
            ("waiting_timeout_s", waiting_timeout_s),
            ("transfer_timeout_s", transfer_timeout_s),
        ):
            if not v > 0:
                raise ValueError(f"Rooms: {name} must be > 0 seconds, got {v}")
        self._timeouts = {
            KVPoll.Bootstrapping: (float(bootstrap_timeout_s), "bootstrap_timeout_s"),
            KVPoll.WaitingForInput: (float(waiting_timeout_s), "waiting_timeout_s"),
            KVPoll.Transferring: (float(transfer_timeout_s), "transfer_timeout_s"),
        }
        self._clock = clock
        self._lock = threading.Lock()
        self._changed = threading.Condition(self._lock)
        self._rooms: dict[int, _Room] = {}
        self._waiting = 0  # threads inside wait(): a change notifies only when one waits
        self.ignored = 0  # events for unknown rooms or other generations

    @classmethod
    def from_config(cls, config: KVConfig, clock: Callable[[], float] = time.monotonic) -> Rooms:
        """A table with the three timeouts of a :class:`~pdplug.config.KVConfig`."""
        return cls(
            bootstrap_timeout_s=config.bootstrap_timeout_s,
            waiting_timeout_s=config.waiting_timeout_s,
            transfer_timeout_s=config.transfer_timeout_s,
            clock=clock,
        )

    # ------------------------------------------------------------------ leases
    def lease(self, room: int, status: KVPoll = KVPoll.Bootstrapping) -> int:
        """Lease ``room`` (replacing any previous lease of the same id) and return its generation.

        :param status: initial status; not ``Failed`` or ``Success``.
        :raises ValueError: a terminal initial status.
        """
        if status in (KVPoll.Failed, KVPoll.Success):
            raise ValueError(f"Rooms.lease: initial status must not be terminal, got {status.name}")
        gen = next_generation()
        with self._lock:
            self._rooms[room] = _Room(
                generation=gen, status=status, deadline=self._deadline(status)
            )
            self._notify()
        return gen

    def clear(self, room: int, generation: int | None = None) -> bool:
        """Forget ``room``; later events for it are ignored.

        :returns: whether it was leased.
        """
        with self._lock:
            r = self._rooms.get(room)
            if r is None or (generation is not None and generation != r.generation):
                return False
            del self._rooms[room]
            self._notify()
            return True

    def __contains__(self, room: object) -> bool:
        with self._lock:
            return room in self._rooms

    def __len__(self) -> int:
        with self._lock:
            return len(self._rooms)

    def rooms(self) -> list[int]:
        """Leased room ids."""
        with self._lock:
            return list(self._rooms)

    # ------------------------------------------------------------------ reads
    def status(self, room: int) -> KVPoll:
        """Current status.

        :raises KeyError: ``room`` is not leased on this rank (never, or cleared).
        """
        with self._lock:
            r = self._rooms.get(room)
            if r is None:
                raise KeyError(f"room {room} is not leased on this rank (never leased or cleared)")
            return r.status

    def generation(self, room: int) -> int | None:
        """Generation of the current lease, ``None`` if not leased."""
        with self._lock:
            r = self._rooms.get(room)
            return None if r is None else r.generation

    def reason(self, room: int) -> str | None:
        """Failure reason, ``None`` if the room is not leased or has not failed."""
        with self._lock:
            r = self._rooms.get(room)
            return r.reason if r is not None and r.status == KVPoll.Failed else None

    def view(self, room: int) -> RoomView | None:
        """A snapshot of ``room`` or ``None``."""
        with self._lock:
            r = self._rooms.get(room)
            if r is None:
                return None
            return RoomView(
                room=room,
                generation=r.generation,
                status=r.status,
                reason=r.reason,
                pending=r.pending,
                success_held=r.success_held,
                deadline=r.deadline,
            )

    def wait(
        self,
        room: int,
        until: tuple[KVPoll, ...] = (KVPoll.Success, KVPoll.Failed),
        timeout_s: float | None = None,
    ) -> KVPoll:
        """Block until ``room`` reaches a status in ``until`` (or a later one on the lattice
        when ``until`` is a single non-terminal status), without polling.

        :param timeout_s: seconds; ``None`` waits for as long as the room's own deadlines
            allow (a non-terminal room always ends by them).
        :returns: the status when woken (it may still be outside ``until`` on timeout).
        :raises KeyError: ``room`` is not leased, or was cleared while waiting.
        """
        t_end = None if timeout_s is None else self._clock() + timeout_s
        with self._changed:
            while True:
                r = self._rooms.get(room)
                if r is None:
                    raise KeyError(f"room {room} is not leased on this rank (never or cleared)")
                if reached(r.status, until):
                    return r.status
                left = None if t_end is None else t_end - self._clock()
                if left is not None and left <= 0:
                    return r.status
                # wake at least every 50 ms: deadlines are enforced by another thread
                self._waiting += 1
                try:
                    self._changed.wait(0.05 if left is None else min(left, 0.05))
                finally:
                    self._waiting -= 1

    # ------------------------------------------------------------------ transitions
    def advance(self, room: int, status: KVPoll, generation: int | None = None) -> KVPoll | None:
        """Merge ``status`` into the room (monotonic; Failed absorbing).

        A ``Success`` while chunks are pending is held and published by :meth:`done_pending`.
        Use :meth:`fail` for ``Failed`` (it records a reason).

        :param generation: the lease the event belongs to; ``None`` = the current one.
        :returns: the status after the merge, or ``None`` when the event was ignored (room not
            leased, or another generation).
        """
        if status == KVPoll.Failed:
            return KVPoll.Failed if self.fail(room, "failed", generation) else None
        with self._lock:
            r = self._get(room, generation)
            if r is None:
                return None
            if status == KVPoll.Success and r.pending > 0 and r.status != KVPoll.Failed:
                r.success_held = True
                return r.status
            self._set(r, merge_poll(r.status, status))
            return r.status

    def fail(self, room: int, reason: str, generation: int | None = None) -> bool:
        """Fail the room with ``reason`` (a room that ended ``Success`` stays ``Success``: a
        room ends once).

        :returns: True if this call moved the room to ``Failed`` (False if it already ended,
            or the event was ignored: a cleared room or another generation).
        """
        with self._lock:
            r = self._get(room, generation)
            if r is None or r.status in (KVPoll.Failed, KVPoll.Success):
                return False
            r.status = KVPoll.Failed
            r.reason = reason
            r.deadline = 0.0
            r.success_held = False
            self._notify()
            return True

    def fail_all(self, reason: str) -> list[tuple[int, int]]:
        """Fail every room that is not terminal yet with ``reason``.

        :returns: ``(room, generation)`` of each room failed by this call.
        """
        out: list[tuple[int, int]] = []
        with self._lock:
            for room, r in self._rooms.items():
                if r.status not in (KVPoll.Success, KVPoll.Failed):
                    r.status = KVPoll.Failed
                    r.reason = reason
                    r.deadline = 0.0
                    r.success_held = False
                    out.append((room, r.generation))
            if out:
                self._notify()
        return out

    def touch(self, room: int, generation: int | None = None) -> None:
        """Record progress: re-arm the deadline of the current (non-terminal) state."""
        with self._lock:
            r = self._get(room, generation)
            if r is not None and r.deadline:
                r.deadline = self._deadline(r.status)

    def add_pending(self, room: int, n: int = 1, generation: int | None = None) -> bool:
        """Count ``n`` chunks of ``room`` as in flight on this rank.

        :returns: False (nothing counted) when the event is ignored or the room is already
            terminal (``Success``/``Failed``: nothing more may be sent for it).
        """
        with self._lock:
            r = self._get(room, generation)
            if r is None or r.status in (KVPoll.Success, KVPoll.Failed):
                return False
            r.pending += n
            return True

    def begin_send(self, room: int, seg: Segment) -> tuple[int | None, KVPoll]:
        """One segment of ``room`` is handed to the sender, in one step (the send path's
        ``status`` + ``add_pending`` + ``advance(Transferring)`` [+ ``advance(Success)``, held
        until nothing is pending when ``is_last``]).

        Segments go in ``chunk_id`` order, ``0, 1, ...``, each starting at the token where the
        one before ended, none after the last (:meth:`pdplug.KVSender.send`): a decode
        completes a room once chunks ``0..last`` all arrived and drops a chunk after the last,
        so a gap or repeat in chunk ids, or a segment after the last, would leave this rank
        ``Success`` and the decode waiting until its timeout, and a token gap between two
        segments would leave tokens unwritten in a room both sides call ``Success``.

        :returns: ``(generation, Transferring)`` when it was counted pending; ``(None,
            status)`` when nothing was counted because the room is not ``WaitingForInput`` or
            ``Transferring`` (its current status says why).
        :raises KeyError: ``room`` is not leased.
        :raises ValueError: ``seg.chunk_id`` out of order or after the last segment, or
            ``seg.token_start`` not where the previous segment ended (named; the room is
            unchanged).
        """
        with self._lock:
            r = self._rooms.get(room)
            if r is None:
                raise KeyError(f"room {room} is not leased on this rank (never leased or cleared)")
            if r.status not in (KVPoll.WaitingForInput, KVPoll.Transferring):
                return None, r.status
            if (
                r.success_held
                or seg.chunk_id != r.chunks
                or (r.chunks and seg.token_start != r.token_end)
            ):
                raise ValueError(_out_of_order(room, r, seg))
            r.chunks += 1
            r.token_end = seg.token_end
            r.pending += 1
            if r.status != KVPoll.Transferring:
                self._set(r, KVPoll.Transferring)
            if seg.is_last:
                r.success_held = True
            return r.generation, r.status

    def done_pending(
        self, room: int, n: int = 1, generation: int | None = None, touch: bool = False
    ) -> KVPoll | None:
        """``n`` pending chunks completed; publishes a held ``Success`` when none remain.

        :param touch: also record progress (:meth:`touch`), in the same lock round.
        :returns: the status after the update, ``None`` if ignored.
        :raises ValueError: more chunks completed than were pending.
        """
        with self._lock:
            r = self._get(room, generation)
            if r is None:
                return None
            if n > r.pending:
                raise ValueError(f"room {room}: done_pending({n}) but only {r.pending} pending")
            r.pending -= n
            if r.pending == 0 and r.success_held and r.status != KVPoll.Failed:
                r.success_held = False
                self._set(r, KVPoll.Success)  # with its own deadline
            elif touch and r.deadline:
                r.deadline = self._deadline(r.status)
            return r.status

    def pending(self, room: int) -> int:
        """Chunks of ``room`` in flight on this rank (0 if not leased)."""
        with self._lock:
            r = self._rooms.get(room)
            return 0 if r is None else r.pending

    def expire(self, now: float | None = None) -> list[tuple[int, int, str]]:
        """Fail every room past its state's deadline.

        :returns: ``(room, generation, reason)`` of each room failed by this call.
        """
        t = self._clock() if now is None else now
        out: list[tuple[int, int, str]] = []
        with self._lock:
            for room, r in self._rooms.items():
                if r.deadline and t >= r.deadline:
                    limit, field = self._timeouts[r.status]
                    r.reason = (
                        f"room {room}: no progress in {r.status.name} for {limit:g} s "
                        f"(KVConfig.{field})"
                    )
                    r.status = KVPoll.Failed
                    r.deadline = 0.0
                    r.success_held = False
                    out.append((room, r.generation, r.reason))
            if out:
                self._notify()
        return out

    # ------------------------------------------------------------------ internals
    def _get(self, room: int, generation: int | None) -> _Room | None:
        r = self._rooms.get(room)
        if r is None or (generation is not None and generation != r.generation):
            self.ignored += 1
            return None
        return r

    def _notify(self) -> None:
        if self._waiting:  # Condition.notify_all costs a few calls even with no waiter
            self._changed.notify_all()

    def _set(self, r: _Room, status: KVPoll) -> None:
        if status != r.status:
            r.status = status
            r.deadline = self._deadline(status)
            self._notify()

    def _deadline(self, status: KVPoll) -> float:
        spec = self._timeouts.get(status)
        return 0.0 if spec is None else self._clock() + spec[0]


def _out_of_order(room: int, r: _Room, seg: Segment) -> str:
    chunk_id = seg.chunk_id
    if r.success_held:
        return (
            f"room {room}: segment chunk_id={chunk_id} comes after the room's last segment "
            f"(chunk_id={r.chunks - 1}); nothing follows the last"
        )
    if chunk_id != r.chunks:
        sent = "no segment" if not r.chunks else f"chunk_id 0..{r.chunks - 1}"
        return (
            f"room {room}: segment chunk_id={chunk_id} out of order: {sent} sent so far, so "
            f"the next one is chunk_id={r.chunks} (segments go in chunk_id order 0, 1, ...)"
        )
    return (
        f"room {room}: segment chunk_id={chunk_id} starts at token_start={seg.token_start} but "
        f"chunk_id={r.chunks - 1} ended at token {r.token_end}: segments must follow each "
        "other without a gap or an overlap"
    )
