"""The decode side's rooms on the engine thread: leases, completion tags and drain state.

A room the host expects becomes a :class:`RecvLease` bound to the prefill sources its DestInfo
was sent to. Tags are validated strictly (:meth:`RecvLeases.on_tag`): the current lease
generation, the source rank the connection or agent belongs to, no duplicate and nothing past a
source's last chunk; anything else is dropped and counted by the codec it came through.

A failed room is *drained* only when every source it was sent to confirmed it stopped writing
its pages (a drained failure notice) or has ended (:meth:`PrefillSources.ended`: its process is
gone; silence alone is not enough, a partition silences a source whose writes still land) —
never by a timer. Until then the decode rank asks again (an ``Abort``) every ``ask_s`` seconds,
so a lost notice cannot pin the pages forever, and the room counts as ``undrained`` in
``stats()``.
"""

from __future__ import annotations

import time
from collections import Counter
from collections.abc import Callable
from typing import Any

import msgspec

from pdplug.rooms import Rooms
from pdplug.transfer.messages import Abort
from pdplug.transfer.sources import PrefillSources, Source
from pdplug.types import ChunkTag, DestInfo, KVPoll

__all__ = ["RecvLease", "RecvLeases"]

_MAX_CHUNKS = 1 << 24  # chunk ids above this are malformed


class RecvLease(msgspec.Struct, kw_only=True):
    """One room on a receiver (engine thread state).

    :ivar srcs: the prefill sources the DestInfo was sent to, by rank (the room waits for
        each); ``got``/``last``: chunk ids received and the last chunk id, per source;
        ``stopped``: sources that confirmed they stopped writing the room's pages.
    :ivar failed_at/asked_at: monotonic seconds of the failure and of the last ``Abort`` sent;
        ``told``: the reason of the first ``Abort`` (sent again with it until drained).
    :ivar parked_at: monotonic seconds it started waiting for a search for its instance;
        ``retried``: a failed search that started before it gave it one more.
    """

    room: int
    generation: int
    instance: str
    dest: DestInfo
    srcs: dict[int, Source] = {}
    got: dict[int, set[int]] = {}
    last: dict[int, int] = {}
    stopped: set[int] = set()
    failed_at: float = 0.0
    asked_at: float = 0.0
    told: str = ""
    parked_at: float = 0.0
    retried: bool = False
    done: bool = False
    reported: bool = False


class RecvLeases:
    """Every room of one decode rank (engine-thread state; see the module docstring).

    :param rooms: the session's thread-safe room table.
    :param sources: the session's prefill sources.
    :param ask_s: seconds between two ``Abort`` s for a failed room that has not drained.
    :param event: ``(kind, lease, **fields)`` observer hook of the session.
    :param counts: the session's counters.
    :param refind: ``(instance) -> bool``: look ``instance`` up again at its rendezvous and
        reconnect, in the background (True: under way; False: the session cannot); the session
        calls :meth:`unpark` when it ends.
    :param searching: ``(instance) -> bool``: a search for ``instance`` is under way (a
        handshake of it that went unanswered does not fail the rooms parked for it: the
        search's own end does).
    """

    def __init__(
        self,
        *,
        rooms: Rooms,
        sources: PrefillSources,
        ask_s: float,
        event: Callable[..., None],
        counts: Counter[str],
        refind: Callable[[str], bool] = lambda _instance: False,
        searching: Callable[[str], bool] = lambda _instance: False,
    ) -> None:
        self._rooms = rooms
        self._sources = sources
        self._ask_s = ask_s
        self._event = event
        self._counts = counts
        self._refind = refind
        self._searching = searching
        self.leases: dict[int, RecvLease] = {}
        self.draining: dict[int, dict[int, RecvLease]] = {}  # room -> generation -> lease
        self.parked: dict[str, list[RecvLease]] = {}  # instance -> leases waiting for it

    # ------------------------------------------------------------------ host calls
    def expect(self, instance: str, dest: DestInfo, now: float) -> None:
        """Send ``dest`` to every source of ``instance``. When a source is dead or the
        instance is not connected, the room waits while the session finds the instance again
        (``refind``; :meth:`unpark` sends it then), or, when it cannot, fails at once (nothing
        was sent: the room is drained)."""
        room, gen = dest.room, dest.generation
        lease = RecvLease(room=room, generation=gen, instance=instance, dest=dest)
        if self._rooms.generation(room) != gen:
            # the host aborted and cleared it before this thread saw it: nothing was sent,
            # and the lease still ends once; the prefill, which waits for it, is told
            lease.reported = True
            lease.told = "cleared before its DestInfo was sent"
            self._counts["rooms_failed"] += 1
            self._event("transfer_failed", lease, reason=lease.told)
            self._abort_when_found(lease, instance, now)
            return
        self.leases[room] = lease
        dead = self._unusable(instance)
        if dead is None:
            self._send_dest(lease, instance)
        elif dead == "pending" or instance in self.parked or self._refind(instance):
            lease.parked_at = now
            self.parked.setdefault(instance, []).append(lease)  # sent once it answers
            self._counts["expect_parked"] += 1
        else:
            self.failed(lease, f"prefill {instance} ranks {dead} are not connected", now)

    def decline(self, instance: str, dest: DestInfo, reason: str, now: float) -> None:
        """The host leased ``dest``'s room failed (:meth:`KVReceiverSession.decline`): its
        DestInfo is never sent; every source of ``instance`` is told to stop waiting for the
        room, now or when the handshake under way ends (also when the host cleared the room
        meanwhile: the prefill still waits for it)."""
        room = dest.room
        lease = RecvLease(room=room, generation=dest.generation, instance=instance, dest=dest)
        lease.told = reason
        self._counts["declined"] += 1
        if self._rooms.generation(room) == dest.generation:
            self.leases[room] = lease
            self.failed(lease, reason, now)
        self._abort_when_found(lease, instance, now)

    def _abort_when_found(self, lease: RecvLease, instance: str, now: float) -> None:
        """Send ``lease``'s Abort (its DestInfo never went out) to ``instance`` now, or park it
        for the handshake under way; with neither, the prefill's own deadline ends the room."""
        if self._unusable(instance) is None:
            self._abort_unsent(lease, instance)
        elif instance in self.parked or self._refind(instance):
            lease.parked_at = now
            self.parked.setdefault(instance, []).append(lease)

    def _abort_unsent(self, lease: RecvLease, instance: str) -> None:
        """Tell every source of ``instance`` that ``lease``'s room, whose DestInfo was never
        sent, is aborted. Its ``srcs`` stay empty: nothing can land, the room stays drained
        (the sources' confirmations change nothing)."""
        cur = self._rooms.generation(lease.room)
        if cur is not None and cur != lease.generation:
            return  # leased again since: an Abort without a DestInfo would fail the new room
        msg = Abort(room=lease.room, generation=lease.generation, reason=lease.told[:512])
        for src in self._sources.table(instance).values():
            self._sources.send(src, msg)
        self._counts["abort_unsent"] += 1

    def _unusable(self, instance: str) -> list[int] | str | None:
        """``None`` when every source of ``instance`` is alive and accepted; ``"pending"``
        while a handshake with it is under way (none dead); else the ranks that cannot take a
        DestInfo (``[]``: none connected)."""
        table = self._sources.table(instance)
        if table and all(s.alive and s.state in ("accepted", "pending") for s in table.values()):
            return None if all(s.state == "accepted" for s in table.values()) else "pending"
        return [s.rank for s in table.values() if not s.alive or s.state != "accepted"]

    def _send_dest(self, lease: RecvLease, instance: str) -> None:
        table = self._sources.table(instance)
        lease.srcs = dict(table)
        for src in table.values():
            self._sources.send(src, lease.dest)
        self._counts["expected"] += 1

    def unpark(
        self, instance: str, error: str | None, now: float, since: float | None = None
    ) -> None:
        """A handshake with ``instance`` or a search for it ended (``error``: why it failed;
        ``since``: when that search started): send the DestInfos of the rooms that waited for
        it, or fail them naming why. A room that began waiting after the failed search started
        gets one more search (that one may have read the rendezvous before the instance came
        back: a rolling restart's rooms failed 'did not answer the handshake', issue 23
        scenario 5), so it waits at most two searches (2 x ``bootstrap_timeout_s``)."""
        state = self._unusable(instance) if error is None else None
        if state == "pending":
            return  # another handshake is under way: its end unparks them
        if error is None and state is not None and self._searching(instance):
            # one handshake of a search was not answered (a dead process's stale registration):
            # the search looks again, and its end unparks them (issue 23 scenario 5: the rooms
            # of a restarted instance failed "ranks [] are not connected" while it was found)
            return
        again: list[RecvLease] = []
        for lease in self.parked.pop(instance, []):
            if lease.told:  # aborted while it waited: its DestInfo was never sent
                if error is None and state is None:
                    self._abort_unsent(lease, instance)
                continue
            view = self._rooms.view(lease.room)
            if view is None or view.generation != lease.generation:
                continue  # cleared meanwhile (nothing was sent: nothing to drain)
            if view.status == KVPoll.Failed or self.leases.get(lease.room) is not lease:
                continue
            late = since is not None and lease.parked_at > since and not lease.retried
            if error is not None and late:
                lease.retried = True
                again.append(lease)
                continue
            if error is not None or state is not None:
                why = error or f"ranks {state} are not connected"
                self.failed(lease, f"could not connect prefill {instance}: {why}", now)
                continue
            self._send_dest(lease, instance)
        if again and self._refind(instance):
            self.parked.setdefault(instance, []).extend(again)
            self._counts["expect_searched_again"] += 1
        else:
            for lease in again:
                self.failed(lease, f"could not connect prefill {instance}: {error}", now)

    def abort(self, room: int, gen: int, reason: str, now: float) -> None:
        """The host aborted ``room``: tell every source."""
        lease = self.leases.get(room)
        if lease is None or lease.generation != gen:
            return
        lease.failed_at = lease.failed_at or now
        self._tell(lease, reason, now)
        self._counts["aborted"] += 1
        view = self._rooms.view(room)
        if not lease.reported and (view is None or view.status == KVPoll.Failed):
            lease.reported = True  # the host failed (or cleared) it: its one outcome
            self._counts["rooms_failed"] += 1
            why = view.reason if view is not None else reason
            self._event("transfer_failed", lease, reason=why)

    def clear(self, room: int, gen: int) -> None:
        """The host cleared ``room``; an undrained lease stays watched until it drains."""
        lease = self.leases.get(room)
        if lease is None or lease.generation != gen:
            return
        del self.leases[room]
        if not self._lease_drained(lease):
            self.draining.setdefault(room, {})[gen] = lease

    def drained(self, room: int) -> bool:
        """No source can still write into ``room``'s pages (any generation of it)."""
        lease = self.leases.get(room)
        if lease is not None and not self._lease_drained(lease):
            return False
        return all(self._lease_drained(ls) for ls in self.draining.get(room, {}).values())

    # ------------------------------------------------------------------ outcomes
    def failed(self, lease: RecvLease, reason: str, now: float, tell: bool = False) -> None:
        """Fail ``lease`` (the first reason wins); with ``tell``, abort it on every source."""
        moved = self._rooms.fail(lease.room, reason, lease.generation)
        view = None if moved else self._rooms.view(lease.room)
        # a room its deadline failed (Rooms.expire) is reported here too, once
        expired = (
            view is not None
            and view.generation == lease.generation
            and view.status == KVPoll.Failed
        )
        if not lease.reported and (moved or expired):
            lease.reported = True
            self._counts["rooms_failed"] += 1
            self._event("transfer_failed", lease, reason=view.reason if view else reason)
        lease.failed_at = lease.failed_at or now
        if tell:
            self._tell(lease, reason, now)

    def _tell(self, lease: RecvLease, reason: str, now: float) -> None:
        lease.asked_at = now
        lease.told = lease.told or reason
        msg = Abort(room=lease.room, generation=lease.generation, reason=reason[:512])
        for rank, src in lease.srcs.items():
            # the connection that serves the rank now: a failed room keeps the source it was
            # sent to (its drain evidence), the answer may come on a newer connection
            cur = src if src.alive else self._sources.current(lease.instance, rank)
            if cur is not None and rank not in lease.stopped:
                self._sources.send(cur, msg)

    def _lease_drained(self, lease: RecvLease) -> bool:
        if lease.done:
            return True
        view = self._rooms.view(lease.room)  # a snapshot: the host may clear it meanwhile
        live = view is not None and view.generation == lease.generation
        if live and view is not None and view.status != KVPoll.Failed:
            return False  # still live (a cleared lease was aborted, so it failed)
        now = time.monotonic()
        return all(r in lease.stopped or self._sources.ended(s, now) for r, s in lease.srcs.items())

    def source_dead(self, src: Source, reason: str, now: float) -> None:
        """Fail every room that waits for ``src`` (telling the other sources)."""
        for lease in self.leases.values():
            if lease.srcs.get(src.rank) is src and not lease.done:
                self.failed(lease, reason, now, tell=True)

    def stranded(self) -> set[str]:
        """Instances with a failed room that is not drained and waits for a source that is
        not alive: only finding the instance again (the same process answers the room's
        ``Abort``, or another process replaced it) can drain it."""
        out: set[str] = set()
        for lease in self._all():
            if not lease.failed_at or lease.instance in out or self._lease_drained(lease):
                continue
            if any(not s.alive and r not in lease.stopped for r, s in lease.srcs.items()):
                out.add(lease.instance)
        return out

    def keep_alive(self, src: Source, generations: tuple[int, ...]) -> None:
        """``src`` says these rooms' work is moving there (queued or being written): re-arm
        their deadlines."""
        live = set(generations)
        for lease in self.leases.values():
            if lease.generation in live and lease.srcs.get(src.rank) is src:
                self._rooms.touch(lease.room, lease.generation)

    def rebind(self, old: Source, new: Source) -> None:
        """The same prefill process was connected again: its live rooms continue on ``new``
        (a failed one keeps ``old``, the evidence of its drain; its Abort reaches ``new``)."""
        for lease in self._all():
            if lease.srcs.get(old.rank) is old and not lease.failed_at:
                lease.srcs[old.rank] = new

    def _all(self) -> list[RecvLease]:
        return [*self.leases.values(), *(ls for g in self.draining.values() for ls in g.values())]

    def on_tag(self, src: Source, tag: ChunkTag, codec: Any, now: float, drained: bool) -> None:
        """A completion tag (or a failure notice, ``ok=False``) from ``src``."""
        if tag.src_rank != src.rank or src.state != "accepted":
            codec.drop("unknown_rank")
            return
        lease = self.leases.get(tag.room)
        if lease is None or lease.generation != tag.generation:
            # a cleared room's drain notice
            lease = None if tag.ok else self.draining.get(tag.room, {}).get(tag.generation)
        if lease is None or lease.instance != src.instance:
            codec.drop("stale")
            return
        if not tag.ok:
            if drained:  # this source wrote its last byte into the room's pages
                lease.stopped.add(src.rank)
            self.failed(lease, f"prefill {src.instance} rank {src.rank}: {tag.reason}", now)
            return
        if not 0 <= tag.chunk_id < _MAX_CHUNKS:
            codec.drop("malformed")
            return
        got = lease.got.setdefault(src.rank, set())
        last = lease.last.get(src.rank)
        if tag.chunk_id in got or (last is not None and (tag.is_last or tag.chunk_id > last)):
            codec.drop("other")  # duplicate, or past this source's last chunk
            return
        if tag.is_last and got and max(got) > tag.chunk_id:
            codec.drop("malformed")
            return
        got.add(tag.chunk_id)
        if tag.is_last:
            lease.last[src.rank] = tag.chunk_id
        self._counts["chunks"] += 1
        view = self._rooms.view(lease.room)
        if view is None or view.generation != lease.generation or view.status == KVPoll.Failed:
            return  # failed, or cleared by the host meanwhile: a late completion changes nothing
        self._rooms.advance(lease.room, KVPoll.Transferring, lease.generation)
        self._rooms.touch(lease.room, lease.generation)
        done = all(
            r in lease.last and len(lease.got.get(r, ())) == lease.last[r] + 1 for r in lease.srcs
        )
        if done:
            lease.done = True
            if self._rooms.advance(lease.room, KVPoll.Success, lease.generation) == KVPoll.Success:
                lease.reported = True
                self._counts["rooms_ok"] += 1
                self._event("transfer_done", lease)

    # ------------------------------------------------------------------ periodic
    def expire(self, now: float) -> None:
        """Fail rooms past their deadline (telling the prefill ranks)."""
        for room, gen, reason in self._rooms.expire(now):
            lease = self.leases.get(room)
            if lease is not None and lease.generation == gen:
                self.failed(lease, reason, now, tell=True)

    def sweep(self, now: float) -> None:
        """Forget cleared rooms that drained; ask again about failed ones that did not."""
        for room in list(self.draining):
            gens = self.draining[room]
            for gen in [g for g, ls in gens.items() if self._lease_drained(ls)]:
                del gens[gen]
            if not gens:
                del self.draining[room]
        for lease in self._all():
            due = lease.failed_at and now - lease.asked_at >= self._ask_s
            if due and not self._lease_drained(lease):
                self._counts["abort_resent"] += 1
                # the first reason again: a prefill that missed the first Abort learns why
                self._tell(lease, lease.told or "aborted", now)

    def gauges(self) -> dict[str, int]:
        """What the table holds now: leases, cleared rooms still draining, failed rooms not
        drained yet (live or cleared)."""
        return {
            "leases": len(self.leases),
            "draining": sum(len(g) for g in self.draining.values()),
            "undrained": sum(
                1 for ls in self._all() if ls.failed_at and not self._lease_drained(ls)
            ),
        }
