"""The decode side's rooms on the engine thread: leases, completion tags and drain state.

A room the host expects becomes a :class:`RecvLease` waiting for every connected prefill rank
of its instance. Tags are validated strictly (:meth:`RecvLeases.on_tag`): the current lease
generation, the source rank the connection or agent belongs to, no duplicate and nothing past
a source's last chunk; anything else is dropped and counted by the codec it came through.
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

    :ivar sources: the prefill ranks the room waits for; ``got``/``last``: chunk ids received
        and the last chunk id, per source; ``stopped``: sources that confirmed they stopped
        writing the room's pages.
    """

    room: int
    generation: int
    instance: str
    dest: DestInfo
    sources: tuple[int, ...]
    got: dict[int, set[int]] = {}
    last: dict[int, int] = {}
    stopped: set[int] = set()
    failed_at: float = 0.0
    done: bool = False


class RecvLeases:
    """Every room of one decode rank (engine-thread state; see the module docstring).

    :param rooms: the session's thread-safe room table.
    :param sources: the session's prefill sources.
    :param timeout_s: ``KVConfig.transfer_timeout_s``.
    :param event: ``(kind, lease, **fields)`` observer hook of the session.
    :param counts: the session's counters.
    """

    def __init__(
        self,
        *,
        rooms: Rooms,
        sources: PrefillSources,
        timeout_s: float,
        event: Callable[..., None],
        counts: Counter[str],
    ) -> None:
        self._rooms = rooms
        self._sources = sources
        self._timeout_s = timeout_s
        self._event = event
        self._counts = counts
        self.leases: dict[int, RecvLease] = {}
        self.draining: dict[int, RecvLease] = {}

    def expect(self, instance: str, dest: DestInfo) -> None:
        room, gen = dest.room, dest.generation
        if self._rooms.generation(room) != gen:
            return
        table = self._sources.table(instance)
        lease = RecvLease(
            room=room, generation=gen, instance=instance, dest=dest, sources=tuple(sorted(table))
        )
        self.leases[room] = lease
        self.draining.pop(room, None)
        dead = [s.rank for s in table.values() if not s.alive or s.state != "accepted"]
        if dead or not table:
            self._failed(lease, f"prefill {instance} ranks {dead} are not connected")
            return
        for src in table.values():
            self._sources.send(src, dest)
        self._counts["expected"] += 1

    def abort(self, room: int, gen: int, reason: str) -> None:
        lease = self.leases.get(room)
        if lease is None or lease.generation != gen:
            return
        if not lease.failed_at:
            lease.failed_at = time.monotonic()
        self._tell(lease, reason)
        self._counts["aborted"] += 1

    def _tell(self, lease: RecvLease, reason: str) -> None:
        for src in self._sources.table(lease.instance).values():
            if src.alive:
                msg = Abort(room=lease.room, generation=lease.generation, reason=reason[:512])
                self._sources.send(src, msg)

    def clear(self, room: int, gen: int) -> None:
        lease = self.leases.get(room)
        if lease is None or lease.generation != gen:
            return
        del self.leases[room]
        if not self._lease_drained(lease):
            self.draining[room] = lease

    def drained(self, room: int) -> bool:
        lease = self.leases.get(room) or self.draining.get(room)
        return lease is None or self._lease_drained(lease)

    def _lease_drained(self, lease: RecvLease) -> bool:
        if lease.done:
            return True
        st = (
            self._rooms.status(lease.room)
            if self._rooms.generation(lease.room) == lease.generation
            else KVPoll.Failed
        )
        if st != KVPoll.Failed:
            return False
        table = self._sources.table(lease.instance)
        quiet = all(
            r in lease.stopped or r not in table or not table[r].alive for r in lease.sources
        )
        if not lease.failed_at:
            lease.failed_at = time.monotonic()
        return quiet or time.monotonic() - lease.failed_at > self._timeout_s

    def _failed(self, lease: RecvLease, reason: str, tell: bool = False) -> None:
        if self._rooms.fail(lease.room, reason, lease.generation):
            self._counts["rooms_failed"] += 1
            self._event("transfer_failed", lease, reason=reason)
        if not lease.failed_at:
            lease.failed_at = time.monotonic()
        if tell:
            self._tell(lease, reason)

    def source_dead(self, instance: str, src: Source, reason: str) -> None:
        for lease in self.leases.values():
            if lease.instance == instance and not lease.done:
                self._failed(lease, reason, tell=True)

    def on_tag(self, src: Source, tag: ChunkTag, codec: Any, drained: bool = False) -> None:
        if tag.src_rank != src.rank or src.state != "accepted":
            codec.drop("unknown_rank")
            return
        lease = self.leases.get(tag.room)
        if lease is None or lease.generation != tag.generation:
            lease = None if tag.ok else self.draining.get(tag.room)  # a cleared room's drain
        if lease is None or lease.generation != tag.generation or lease.instance != src.instance:
            codec.drop("stale")
            return
        if not tag.ok:
            if drained:  # this source wrote its last byte into the room's pages
                lease.stopped.add(src.rank)
            self._failed(lease, f"prefill {src.instance} rank {src.rank}: {tag.reason}")
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
        if self._rooms.status(lease.room) == KVPoll.Failed:
            return
        self._rooms.advance(lease.room, KVPoll.Transferring, lease.generation)
        self._rooms.touch(lease.room, lease.generation)
        done = all(
            r in lease.last and len(lease.got.get(r, ())) == lease.last[r] + 1
            for r in lease.sources
        )
        if done:
            lease.done = True
            if self._rooms.advance(lease.room, KVPoll.Success, lease.generation) == KVPoll.Success:
                self._counts["rooms_ok"] += 1
                self._event("transfer_done", lease)

    def expire(self, now: float) -> None:
        """Fail rooms past their deadline (telling the prefill ranks)."""
        for room, gen, reason in self._rooms.expire(now):
            lease = self.leases.get(room)
            if lease is not None and lease.generation == gen:
                self._failed(lease, reason, tell=True)

    def sweep(self) -> None:
        """Forget cleared rooms that drained."""
        if self.draining:
            for room in [r for r, ls in self.draining.items() if self._lease_drained(ls)]:
                del self.draining[room]
