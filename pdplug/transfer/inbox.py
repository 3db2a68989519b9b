"""What reaches a prefill rank for a room outside its lease: early and late messages.

Early DestInfos and aborts, late DestInfos of failed rooms. A decode rank's DestInfo or abort
may come before the prefill host starts the room: each waits here for ``bootstrap_timeout_s``
and is adopted by the room's lease. A room that failed here and that the host cleared at once
(the vLLM worker reports a failed room and forgets it in the same step) is remembered for two
``bootstrap_timeout_s``, with its reason and the decode ranks it already told: a DestInfo for
it that comes later (a prefill rank that gave up in ``Bootstrapping`` while its process was
busy, e.g. a vLLM TP 2 engine's first forward on CPU, about 10 s) is refused at once instead
of waiting in the inbox while the decode waits ``waiting_timeout_s`` for bytes that never come.
"""

from __future__ import annotations

import time
from collections import Counter

from pdplug.transfer.records import PeerKey
from pdplug.types import DestInfo

__all__ = ["RoomInbox"]

MAX_ROOMS = 65536  # rooms held per table; a flood beyond this is dropped (oldest failed first)


class RoomInbox:
    """The three tables of one prefill rank (engine-thread state).

    :param ttl_s: ``bootstrap_timeout_s`` (seconds): how long an early DestInfo or abort is
        kept; a cleared failed room is kept twice as long.
    :ivar dests: room -> decode rank -> (early DestInfo, arrival monotonic time).
    :ivar aborts: room -> decode rank -> (generation, reason, arrival time) of early aborts.
    :ivar failed: room -> (reason, clear time, decode ranks told at the failure).
    """

    def __init__(self, ttl_s: float) -> None:
        self.ttl_s = ttl_s
        self.dests: dict[int, dict[PeerKey, tuple[DestInfo, float]]] = {}
        self.aborts: dict[int, dict[PeerKey, tuple[int, str, float]]] = {}
        self.failed: dict[int, tuple[str, float, frozenset[PeerKey]]] = {}

    def full(self, room: int) -> bool:
        """A DestInfo for a room not held yet would pass :data:`MAX_ROOMS`."""
        return room not in self.dests and len(self.dests) >= MAX_ROOMS

    def remember_failed(self, room: int, reason: str, told: frozenset[PeerKey]) -> None:
        """``room`` failed here and its host cleared it; ``told``: ranks already told."""
        if room not in self.failed and len(self.failed) >= MAX_ROOMS:
            del self.failed[next(iter(self.failed))]
        self.failed[room] = (reason, time.monotonic(), told)

    def expire(self, now: float, counts: Counter[str]) -> None:
        """Forget early DestInfos and aborts older than :attr:`ttl_s` (counted
        ``dest_expired`` / ``abort_expired``) and failed rooms cleared over 2 x ago."""
        for room in [r for r, (_w, t, _k) in self.failed.items() if now - t > 2 * self.ttl_s]:
            del self.failed[room]
        for table, counter in ((self.dests, "dest_expired"), (self.aborts, "abort_expired")):
            for room in [
                r for r, box in table.items() if all(now - v[-1] > self.ttl_s for v in box.values())
            ]:
                del table[room]
                counts[counter] += 1

    def gauges(self) -> dict[str, int]:
        """Rooms each table holds."""
        return {
            "inbox": len(self.dests),
            "early_aborts": len(self.aborts),
            "failed_cleared": len(self.failed),
        }
