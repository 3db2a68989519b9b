"""What reaches a prefill rank for a room outside its lease: early and late messages.

Early DestInfos and aborts, late DestInfos of failed rooms. A decode rank's DestInfo or abort
may come before the prefill host starts the room (a request queued on the prefill engine; a
vLLM TP 2 engine's first forward on CPU, about 10 s): each waits here for the time the decode
waits for it (``max(bootstrap_timeout_s, waiting_timeout_s)``) and is adopted by the room's
lease. An early DestInfo whose room did not start by then is refused, so the decode rank fails
the room now, naming why (it was once dropped silently after ``bootstrap_timeout_s``: the room
started later, failed in ``Bootstrapping`` and the decode waited ``waiting_timeout_s`` for
bytes no rank would send). A room that failed here and that the host cleared at once (the vLLM
worker reports a failed room and forgets it in the same step) is remembered as long, with its
reason and, per decode rank, the newest lease generation that rank has been told failed: a
DestInfo of that lease or an older one that comes later is refused at once (or dropped, when the
rank was told already); one of a newer lease is for the room's next lease here (a recycled
room id whose DestInfo outran the prefill's next ``start``) and waits like any early DestInfo.
"""

from __future__ import annotations

import time
from collections import Counter
from typing import Any

from pdplug.transfer.records import Lease, PeerKey
from pdplug.types import DestInfo

__all__ = ["RoomInbox"]

MAX_ROOMS = 65536  # rooms held per table; a flood beyond this is dropped (oldest failed first)


class RoomInbox:
    """The three tables of one prefill rank (engine-thread state).

    :param ttl_s: how long an early DestInfo or abort, or a cleared failed room, is kept
        (seconds; the sender gives ``max(bootstrap_timeout_s, waiting_timeout_s)``).
    :ivar dests: room -> decode rank -> (early DestInfo, arrival monotonic time).
    :ivar aborts: room -> decode rank -> (generation, reason, arrival time) of early aborts.
    :ivar failed: room -> (reason, clear time, decode rank -> newest generation told).
    """

    def __init__(self, ttl_s: float) -> None:
        self.ttl_s = ttl_s
        self.dests: dict[int, dict[PeerKey, tuple[DestInfo, float]]] = {}
        self.aborts: dict[int, dict[PeerKey, tuple[int, str, float]]] = {}
        self.failed: dict[int, tuple[str, float, dict[PeerKey, int]]] = {}

    def full(self, room: int) -> bool:
        """A DestInfo for a room not held yet would pass :data:`MAX_ROOMS`."""
        return room not in self.dests and len(self.dests) >= MAX_ROOMS

    def remember_failed(self, room: int, reason: str, lease: Lease) -> None:
        """``room`` failed here and its host cleared ``lease``; the ranks whose DestInfo it had
        were told at the failure (their generations are kept)."""
        if room not in self.failed and len(self.failed) >= MAX_ROOMS:
            del self.failed[next(iter(self.failed))]
        told = {key: d.generation for key, d in lease.dests.items()}
        self.failed[room] = (reason, time.monotonic(), told)

    def expire(self, now: float, counts: Counter[str]) -> list[tuple[PeerKey, DestInfo]]:
        """Forget early DestInfos and aborts and cleared failed rooms older than
        :attr:`ttl_s` (counted ``dest_expired`` / ``abort_expired``); returns the expired
        DestInfos with their decode rank (the caller refuses each)."""
        for room in [r for r, (_w, t, _k) in self.failed.items() if now - t > self.ttl_s]:
            del self.failed[room]
        expired: list[tuple[PeerKey, DestInfo]] = []
        for room in self._old(self.dests, now):
            expired.extend((key, d) for key, (d, _t) in self.dests.pop(room).items())
            counts["dest_expired"] += 1
        for room in self._old(self.aborts, now):
            del self.aborts[room]
            counts["abort_expired"] += 1
        return expired

    def _old(self, table: dict[int, dict[PeerKey, Any]], now: float) -> list[int]:
        ttl = self.ttl_s
        return [r for r, box in table.items() if all(now - v[-1] > ttl for v in box.values())]

    def gauges(self) -> dict[str, int]:
        """Rooms each table holds."""
        return {
            "inbox": len(self.dests),
            "early_aborts": len(self.aborts),
            "failed_cleared": len(self.failed),
        }
