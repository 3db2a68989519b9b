"""One rank's offers, holds and aborts, and what it still has to send (pure; no sockets).

A rank's ``good`` is not voted while it still has a pending chunk for the room (the gap raised
in review of SGLang PR #38959); offers for ids this rank already decided (the "re-poll after
consensus" hazard of SGLang #30476) are ignored and counted.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

from pdplug.types import Decision
from pdplug_consensus.decide import Applier, Recent

__all__ = ["LocalVotes"]


class LocalVotes:
    """One rank's offers, holds and aborts, and what still has to be sent.

    ``good`` offers for a request id with holds (pending chunks) are deferred until the last
    hold is released. ``bad`` beats ``good``. Offers for ids this rank already decided (the
    "re-poll after consensus" hazard) are ignored and counted as ``late_offers``.

    :param streams: stream names.
    :param applier: this rank's :class:`Applier` (source of "already decided").
    :param horizon_s: how long locally aborted ids are remembered.
    """

    def __init__(self, streams: Sequence[str], applier: Applier, horizon_s: float) -> None:
        self.streams = tuple(streams)
        self._applier = applier
        self.ready: dict[str, dict[int, None]] = {s: {} for s in streams}
        self._deferred: dict[str, dict[int, None]] = {s: {} for s in streams}
        self._bad: dict[str, set[int]] = {s: set() for s in streams}
        self._holds: dict[int, int] = {}
        self._aborted = Recent(horizon_s)
        self._new_good: dict[str, list[int]] = {s: [] for s in streams}
        self._new_bad: dict[str, list[int]] = {s: [] for s in streams}
        self._new_aborts: list[int] = []
        self.counters = {"late_offers": 0, "deferred": 0}

    def _stream(self, stream: str) -> None:
        if stream not in self.ready:
            raise ValueError(f"stream={stream!r} is not one of {self.streams}")

    def offer(self, stream: str, good: Iterable[int] = (), bad: Iterable[int] = ()) -> None:
        """Record a vote (see :meth:`pdplug.protocols.Consensus.offer`).

        :raises ValueError: unknown ``stream``, or an id that is not an integer.
        """
        self._stream(stream)
        good_l, bad_l = _ids(good, "good"), _ids(bad, "bad")
        decided = self._applier.decided[stream]
        ready, deferred, bad_s = self.ready[stream], self._deferred[stream], self._bad[stream]
        for rid in bad_l:
            if rid in decided:
                self.counters["late_offers"] += 1
            elif rid not in bad_s:
                ready.pop(rid, None)
                deferred.pop(rid, None)
                bad_s.add(rid)
                self._new_bad[stream].append(rid)
        for rid in good_l:
            if rid in decided:
                self.counters["late_offers"] += 1
            elif rid in bad_s or rid in ready or rid in deferred:
                continue
            elif rid in self._aborted:
                bad_s.add(rid)
                self._new_bad[stream].append(rid)
            elif self._holds.get(rid):
                deferred[rid] = None
                self.counters["deferred"] += 1
            else:
                ready[rid] = None
                self._new_good[stream].append(rid)

    def hold(self, rid: int, n: int = 1) -> None:
        """Add ``n`` holds (pending chunks) on ``rid``.

        :raises ValueError: ``n < 1``.
        """
        if n < 1:
            raise ValueError(f"hold: n={n} must be >= 1")
        rid = _ids((rid,), "rid")[0]
        self._holds[rid] = self._holds.get(rid, 0) + n

    def release_hold(self, rid: int, n: int = 1) -> bool:
        """Release ``n`` holds on ``rid``; returns True when deferred good votes became due.

        :raises ValueError: ``n < 1`` or more holds released than taken.
        """
        rid = _ids((rid,), "rid")[0]
        have = self._holds.get(rid, 0)
        if n < 1 or n > have:
            raise ValueError(f"release_hold: rid={rid} has {have} holds, cannot release n={n}")
        if have > n:
            self._holds[rid] = have - n
            return False
        del self._holds[rid]
        due = False
        for s in self.streams:
            if rid in self._deferred[s]:
                del self._deferred[s][rid]
                self.ready[s][rid] = None
                self._new_good[s].append(rid)
                due = True
        return due

    def abort(self, rid: int, now: float) -> None:
        """Abort ``rid`` locally: drop holds and pending good votes; later goods vote bad."""
        rid = _ids((rid,), "rid")[0]
        self._aborted.add(rid, now)
        self._aborted.prune(now)
        self._holds.pop(rid, None)
        for s in self.streams:
            self.ready[s].pop(rid, None)
            self._deferred[s].pop(rid, None)
        self._new_aborts.append(rid)

    def take(self) -> tuple[list[tuple[str, tuple[int, ...], tuple[int, ...]]], tuple[int, ...]]:
        """New votes since the last call: ``([(stream, good, bad), …], aborted)``."""
        votes = []
        for s in self.streams:
            g, b = self._new_good[s], self._new_bad[s]
            if g or b:
                votes.append((s, tuple(g), tuple(b)))
                g.clear()
                b.clear()
        aborts = tuple(self._new_aborts)
        self._new_aborts.clear()
        return votes, aborts

    def applied(self, d: Decision) -> None:
        """Forget the decided ids of ``d`` (call after :meth:`Applier.apply`)."""
        ready, deferred, bad = self.ready[d.stream], self._deferred[d.stream], self._bad[d.stream]
        for rid in d.good + d.bad:
            ready.pop(rid, None)
            deferred.pop(rid, None)
            bad.discard(rid)

    def held(self) -> int:
        """Request ids with at least one hold."""
        return len(self._holds)


def _ids(rids: Iterable[int], field: str) -> list[int]:
    out = []
    for r in rids:
        try:
            v = int(r)  # accepts numpy integers; rejects floats with a fraction below
        except (TypeError, ValueError):
            raise ValueError(f"{field}: request id {r!r} is not an integer") from None
        if v != r or isinstance(r, bool):
            raise ValueError(f"{field}: request id {r!r} is not an integer")
        out.append(v)
    return out
