"""Bootstrap room ids: the allocator a proxy or router uses, and the bounds every adapter checks.

A room identifies one request's transfer on every rank of both engines, so two live requests
must never share one. :class:`RoomAllocator` hands out ``allocator_id << 48 | n`` with ``n`` a
per-allocator counter: one allocator never repeats a room for 2**48 requests, and allocators
with different ids (one per proxy replica, set by the operator) never collide. Rooms stay in
``[0, 2**63)``, a non-negative int64 on every wire (msgspec, ZMQ frames, NIXL notifications,
SGLang's ``bootstrap_room``).
"""

from __future__ import annotations

import itertools
import threading

from pdplug.rooms import ROOM_LIMIT

__all__ = ["ROOM_BITS", "ROOM_LIMIT", "MAX_ALLOCATOR_ID", "RoomAllocator", "check_room"]

#: bits of the per-allocator counter in a room
ROOM_BITS = 48
#: largest allocator id (rooms stay below :data:`ROOM_LIMIT`)
MAX_ALLOCATOR_ID = (1 << (63 - ROOM_BITS)) - 1


def check_room(room: int, field: str) -> None:
    """Refuse a room outside ``[0, 2**63)``.

    :param room: the room a request carries.
    :param field: where it came from, named in the error (``kv_transfer_params.pdplug.room``).
    :raises ValueError: ``room`` out of range (names ``field`` and the value).
    """
    if not 0 <= room < ROOM_LIMIT:
        raise ValueError(f"{field}={room} not in [0, 2**63)")


class RoomAllocator:
    """Thread-safe allocator of bootstrap rooms that never collide across allocators.

    :param allocator_id: this allocator's id in ``[0, MAX_ALLOCATOR_ID]``; every proxy replica
        in front of the same engines needs its own.
    :raises ValueError: an id outside the range.
    """

    def __init__(self, allocator_id: int = 0) -> None:
        if not 0 <= allocator_id <= MAX_ALLOCATOR_ID:
            raise ValueError(
                f"RoomAllocator: allocator_id={allocator_id} not in [0, {MAX_ALLOCATOR_ID}]"
            )
        self.allocator_id = allocator_id
        self._base = allocator_id << ROOM_BITS
        self._count = itertools.count(1)
        self._lock = threading.Lock()

    def __call__(self) -> int:
        """The next room (an int in ``[0, 2**63)``).

        :raises OverflowError: this allocator handed out 2**48 rooms.
        """
        with self._lock:
            n = next(self._count)
        if n >= 1 << ROOM_BITS:
            raise OverflowError(f"RoomAllocator {self.allocator_id}: 2**{ROOM_BITS} rooms used")
        return self._base | n
