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
reason and, per decode rank, the newest lease generation that rank has been told failed (its
DestInfo was taken before the failure, or refused after it): a DestInfo of that lease or an
older one that comes later is refused at once (or dropped, when the rank was told already); one
of a newer lease is for the room's next lease here (a recycled room id whose DestInfo outran the
prefill's next ``start``) and waits like any early DestInfo, also while the failed lease is not
cleared yet (field case C22: the decode cleared and leased the room again first).
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
    :ivar dests: room -> decode rank -> (early DestInfo, the sending process's engine agent
        blob, arrival monotonic time): a DestInfo is adopted only for the process that sent it.
    :ivar aborts: room -> decode rank -> (generation, reason, arrival time) of early aborts.
    :ivar failed: room -> (reason, clear time, decode rank -> newest generation told).
    """

    def __init__(self, ttl_s: float) -> None:
        self.ttl_s = ttl_s
        self.dests: dict[int, dict[PeerKey, tuple[DestInfo, bytes, float]]] = {}
        self.aborts: dict[int, dict[PeerKey, tuple[int, str, float]]] = {}
        self.failed: dict[int, tuple[str, float, dict[PeerKey, int]]] = {}

    def full(self, room: int) -> bool:
        """A DestInfo for a room not held yet would pass :data:`MAX_ROOMS`."""
        return room not in self.dests and len(self.dests) >= MAX_ROOMS

    def remember_failed(self, room: int, reason: str, lease: Lease) -> None:
        """``room`` failed here and its host cleared ``lease``; the ranks whose DestInfo it had
        were told at the failure, and those whose DestInfo it refused after it (the newest
        generation told per rank is kept)."""
        if room not in self.failed and len(self.failed) >= MAX_ROOMS:
            del self.failed[next(iter(self.failed))]
        told = {key: d.generation for key, d in lease.dests.items()}
        for key, gen in lease.refused.items():
            told[key] = max(told.get(key, 0), gen)
        self.failed[room] = (reason, time.monotonic(), told)

    def arrive(self, key: PeerKey, agent: bytes, d: DestInfo, now: float) -> tuple[str, str]:
        """A DestInfo of decode rank ``key`` (engine agent ``agent``) for a room with no lease
        here: ``("refuse",
        reason)`` for a late one of a cleared failed lease the rank was not told of yet,
        ``("drop", "")`` for one it was told of, one older than the early one the same process sent
        (or a flood beyond :data:`MAX_ROOMS`), else
        ``("early", "")``: kept for the room's next lease."""
        failed = self.failed.get(d.room)
        if failed is not None:
            why, _t, told = failed
            seen = told.get(key)
            if seen is None:  # it failed here and the host cleared it: the rank learns it now
                told[key] = d.generation
                return "refuse", why
            if d.generation <= seen:  # a repeat (a newer lease: early for the next one here)
                return "drop", ""
        tomb = self.aborts.get(d.room, {})
        if key in tomb and tomb[key][0] < d.generation:
            del tomb[key]  # a newer lease of that decode rank
        held = self.dests.get(d.room, {}).get(key)
        if held is not None and held[1] == agent and held[0].generation > d.generation:
            return "drop", ""  # that process sent a newer one already
        if self.full(d.room):
            return "drop", ""
        self.hold(key, agent, d, now)
        return "early", ""

    def hold(self, key: PeerKey, agent: bytes, d: DestInfo, now: float) -> None:
        """Keep ``d`` of decode rank ``key`` (engine agent ``agent``) for the room's next lease
        here (it replaces one that rank sent before)."""
        self.dests.setdefault(d.room, {})[key] = (d, agent, now)

    def keep_for_next(
        self, lease: Lease, key: PeerKey, agent: bytes, d: DestInfo, now: float
    ) -> bool:
        """A DestInfo of decode rank ``key`` reaching ``lease`` after it failed: ``True``, kept
        for the room's next lease here, when it is for a newer decode lease than the one
        ``lease`` took or refused from that rank (the decode cleared and leased the room again
        first); else ``False`` and counted in ``lease.refused`` (the caller refuses it)."""
        cur = lease.dests.get(key)
        known = lease.refused.get(key, 0) if cur is None else cur.generation
        if known and d.generation > known:
            self.hold(key, agent, d, now)
            return True
        lease.refused[key] = max(lease.refused.get(key, 0), d.generation)
        return False

    def expire(self, now: float, counts: Counter[str]) -> list[tuple[PeerKey, DestInfo]]:
        """Forget early DestInfos and aborts and cleared failed rooms older than
        :attr:`ttl_s` (counted ``dest_expired`` / ``abort_expired``); returns the expired
        DestInfos with their decode rank (the caller refuses each)."""
        for room in [r for r, (_w, t, _k) in self.failed.items() if now - t > self.ttl_s]:
            del self.failed[room]
        expired: list[tuple[PeerKey, DestInfo]] = []
        for room in self._old(self.dests, now):
            expired.extend((key, d) for key, (d, _a, _t) in self.dests.pop(room).items())
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
