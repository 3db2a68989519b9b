"""The prefill side's rooms on the engine thread: leases, DestInfo intake, aborts, segments and
failure notices.

A room started by the host becomes a :class:`~pdplug.transfer.pipeline.Lease`. DestInfos that
arrive before ``start`` wait in an inbox for ``bootstrap_timeout_s``. The lease turns
``WaitingForInput`` once every DCP rank of its decode instance sent its DestInfo; each segment
becomes one job per destination for the :class:`~pdplug.transfer.pipeline.SendPipeline`. A
failure is reported to every destination as ``Done(ChunkTag(ok=False))`` at once and again,
``drained``, once no write of the room is in flight (the negative twin of a completion, vLLM
PR #50754).
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable
from typing import Any

import numpy as np

from pdplug.packing import segment_to_chunk, send_capacity_tokens
from pdplug.protocols import PackPlanner
from pdplug.rooms import Rooms
from pdplug.transfer.engine import TransferEngine
from pdplug.transfer.messages import Abort, Done
from pdplug.transfer.peers import DecodePeers
from pdplug.transfer.pipeline import Job, Lease, Peer, SendPipeline
from pdplug.types import ChunkTag, DestInfo, KVLayout, KVPoll, PackRegion, Segment, pages_from_bytes
from pdplug.wire import Codec

__all__ = ["SendLeases"]

_MAX_INBOX = 65536  # rooms whose DestInfo arrived before start(); older than bootstrap expire


class SendLeases:
    """Every room of one prefill rank (engine-thread state; see the module docstring).

    :param rank: this prefill rank's id; ``layout``: its layout; ``planner``: the planner.
    :param rooms: the session's thread-safe room table.
    :param pipe: the session's send pipeline; ``peers``: its decode peers.
    :param engine: returns the current engine; ``codec``/``tags``: the control and tag codecs.
    :param regions: returns the pack regions (set at ``register_kv``).
    :param inbox_ttl_s: ``bootstrap_timeout_s``: how long an early DestInfo is kept.
    :param event: ``(kind, lease, **fields)`` observer hook of the session.
    :param counts: the session's counters.
    """

    def __init__(
        self,
        *,
        rank: int,
        layout: KVLayout,
        planner: PackPlanner,
        rooms: Rooms,
        pipe: SendPipeline,
        peers: DecodePeers,
        engine: Callable[[], TransferEngine],
        codec: Codec[Any],
        tags: Codec[Any],
        regions: Callable[[], list[PackRegion]],
        inbox_ttl_s: float,
        event: Callable[..., None],
        counts: Counter[str],
    ) -> None:
        self._rank = rank
        self._layout = layout
        self._planner = planner
        self._rooms = rooms
        self._pipe = pipe
        self._peers = peers
        self._engine = engine
        self._codec = codec
        self._tags = tags
        self._regions = regions
        self._ttl = inbox_ttl_s
        self._event = event
        self._counts = counts
        self.leases: dict[int, Lease] = {}
        self.draining: list[Lease] = []
        self.inbox: dict[int, dict[tuple[str, int], tuple[DestInfo, float]]] = {}

    # ------------------------------------------------------------------ host calls
    def start(self, room: int, gen: int, now: float) -> None:
        """The host started ``room`` (lease ``gen``); adopt DestInfos that came first."""
        if self._rooms.generation(room) != gen:
            return  # cleared before we got here
        lease = Lease(room=room, generation=gen)
        self.leases[room] = lease
        for key, (d, _t) in sorted(self.inbox.pop(room, {}).items()):
            peer = self._peers.by_position(key)
            if peer is not None:
                self._add_dest(lease, peer, d, now)

    def dest(self, room: int) -> list[DestInfo]:
        """The DestInfos of ``room`` sorted by DCP rank."""
        lease = self.leases.get(room)
        return [] if lease is None else [lease.dests[r] for r in sorted(lease.dests)]

    def capacity(self, room: int) -> int | None:
        """Largest segment of ``room`` in tokens (``None``: no destination needs packing).

        :raises ValueError: no destination yet.
        """
        lease = self.leases.get(room)
        if lease is None or not lease.expected or len(lease.dests) < lease.expected:
            raise ValueError(f"KVSender.capacity_tokens: room {room} has no destination yet")
        cap: int | None = None
        for peer in lease.peers.values():
            if not peer.relayout:
                continue
            region = self._regions()[0]
            per_rank = min(
                region.capacity_tokens,
                self._planner.capacity_tokens(self._layout, peer.info.layout, region.nbytes),
            )
            c = send_capacity_tokens(per_rank, peer.info.layout.dcp_size)
            cap = c if cap is None else min(cap, c)
        return cap

    def enqueue(self, room: int, gen: int, seg: Segment, pages: np.ndarray) -> None:
        """One segment of ``room`` becomes one job per destination."""
        lease = self.leases.get(room)
        if lease is None or lease.generation != gen or lease.failed:
            return
        jobs = []
        try:
            for r in sorted(lease.dests):
                d = lease.dests[r]
                dst = pages_from_bytes(d.dst_pages)
                chunk = segment_to_chunk(
                    room, seg, pages, dst, d.decode_prefix_len, self._layout.page_size
                )
                jobs.append(Job(lease=lease, dst_rank=r, chunk=chunk))
        except ValueError as e:
            self.fail(lease, f"segment {seg.chunk_id}: {e}")
            return
        if seg.chunk_id in lease.segments:
            self.fail(lease, f"segment chunk_id {seg.chunk_id} sent twice")
            return
        lease.segments[seg.chunk_id] = len(jobs)
        self._counts["segments"] += 1
        self._pipe.submit(jobs)

    def abort(self, room: int, gen: int) -> None:
        """The host aborted ``room``."""
        lease = self.leases.get(room)
        if lease is not None and lease.generation == gen:
            self.fail(lease, self._rooms.reason(room) or "aborted")

    def clear(self, room: int, gen: int, done: bool) -> None:
        """The host cleared ``room``; a lease with writes in flight keeps draining."""
        lease = self.leases.get(room)
        if lease is None or lease.generation != gen:
            return
        if not done:
            self.fail(lease, f"cleared on prefill rank {self._rank} before completion")
        del self.leases[room]
        lease.cleared = True
        self._pipe.purge(lease)
        if lease.inflight:
            self.draining.append(lease)

    def drained(self, room: int) -> bool:
        """No write of ``room`` is in flight."""
        lease = self.leases.get(room)
        return lease is None or lease.inflight == 0

    # ------------------------------------------------------------------ outcomes
    def fail(self, lease: Lease, reason: str) -> None:
        """Fail ``lease`` (once), drop its queued work and tell its destinations."""
        if lease.failed:
            return
        lease.failed = True
        lease.reason = reason
        self._rooms.fail(lease.room, reason, lease.generation)
        self._counts["rooms_failed"] += 1
        self._event("transfer_failed", lease, reason=reason)
        self._pipe.purge(lease)
        self.notify_failure(lease)

    def notify_failure(self, lease: Lease) -> None:
        """Tell every destination the room failed: at once, and again (``drained``) once no
        write of the room is in flight here any more."""
        drained = lease.inflight == 0
        if lease.notified >= 1 + drained:
            return
        first = lease.notified == 0
        lease.notified = 1 + drained
        reason = (lease.reason or self._rooms.reason(lease.room) or "failed")[:512]
        engine = self._engine()
        for r, d in lease.dests.items():
            peer = lease.peers[r]
            if not peer.alive:
                continue
            tag = ChunkTag(
                generation=d.generation,
                room=lease.room,
                chunk_id=-1,
                is_last=True,
                src_rank=self._rank,
                ok=False,
                reason=reason,
            )
            self._peers.send(peer, Done(chunk=tag, drained=drained))
            if first and engine.notifications:
                try:
                    engine.notify(peer.handle, self._tags.encode(tag))
                except Exception:
                    self._counts["notify_failed"] += 1

    def job_done(self, job: Job) -> None:
        """A job's write completed; the room succeeds with its last segment's last job."""
        lease = job.lease
        left = lease.segments.get(job.chunk.chunk_id, 0) - 1
        lease.segments[job.chunk.chunk_id] = left
        if left == 0 and not lease.failed and not lease.cleared:
            self._rooms.touch(lease.room, lease.generation)
            st = self._rooms.done_pending(lease.room, 1, lease.generation)
            if st == KVPoll.Success:
                self._counts["rooms_ok"] += 1
                self._event("transfer_done", lease)

    def written(self, peer: Peer, tag: ChunkTag) -> None:
        """A write completed on an engine without notifications: send its tag."""
        self._peers.send(peer, Done(chunk=tag))

    def peer_dropped(self, peer: Peer, reason: str) -> None:
        """Fail every room bound to a dropped peer."""
        for lease in list(self.leases.values()):
            if any(p is peer for p in lease.peers.values()):
                self.fail(lease, f"decode {peer.key[0]} dcp {peer.key[1]}: {reason}")

    def expire(self, now: float) -> None:
        """Fail rooms past their deadline; forget DestInfos nobody started."""
        for room, gen, reason in self._rooms.expire(now):
            lease = self.leases.get(room)
            if lease is not None and lease.generation == gen:
                self.fail(lease, reason)
        if self.draining:
            self.draining[:] = [ls for ls in self.draining if ls.inflight]

    def expire_inbox(self, now: float) -> None:
        """Forget DestInfos older than ``bootstrap_timeout_s`` that no ``start`` claimed."""
        for room in [
            r for r, box in self.inbox.items() if all(now - t > self._ttl for _d, t in box.values())
        ]:
            del self.inbox[room]
            self._counts["dest_expired"] += 1

    # ------------------------------------------------------------------ control messages
    def on_dest(self, peer: Peer, d: DestInfo, now: float) -> None:
        """A decode rank's DestInfo for one room."""
        if (d.decode_instance, d.dcp_rank) != peer.key:
            self._codec.drop("unknown_rank")
            return
        if len(d.dst_pages) % 8 or d.decode_prefix_len < 0 or d.num_tokens < 0:
            self._codec.drop("malformed")
            return
        lease = self.leases.get(d.room)
        if lease is None or lease.failed:
            if d.room not in self.inbox and len(self.inbox) >= _MAX_INBOX:
                self._codec.drop("other")  # a flood of DestInfos nobody starts
                return
            self.inbox.setdefault(d.room, {})[peer.key] = (d, now)
            self._counts["dest_early"] += 1
            return
        self._add_dest(lease, peer, d, now)

    def _add_dest(self, lease: Lease, peer: Peer, d: DestInfo, now: float) -> None:
        if lease.instance and lease.instance != d.decode_instance:
            self._codec.drop("other")
            return
        cur = lease.dests.get(d.dcp_rank)
        if cur is not None:
            if cur.generation == d.generation:
                self._codec.drop("other")  # duplicate
            else:  # a recycled room on decode: keep it for this room's next lease
                self.inbox.setdefault(d.room, {})[peer.key] = (d, now)
                self._counts["dest_next_lease"] += 1
            return
        lease.instance = d.decode_instance
        lease.expected = peer.info.layout.dcp_size
        lease.dests[d.dcp_rank] = d
        lease.peers[d.dcp_rank] = peer
        if len(lease.dests) < lease.expected:
            return
        ds = list(lease.dests.values())
        if len({(x.decode_prefix_len, x.num_tokens) for x in ds}) != 1:
            self.fail(
                lease,
                "DestInfo differs across decode DCP ranks: "
                + ", ".join(
                    f"dcp {x.dcp_rank}: decode_prefix_len={x.decode_prefix_len} "
                    f"num_tokens={x.num_tokens}"
                    for x in ds
                ),
            )
            return
        self._rooms.advance(lease.room, KVPoll.WaitingForInput, lease.generation)

    def on_abort(self, peer: Peer, a: Abort) -> None:
        """A decode rank aborted one room."""
        lease = self.leases.get(a.room)
        mine = None if lease is None else lease.dests.get(peer.key[1])
        if (
            lease is not None
            and mine is not None
            and lease.peers.get(peer.key[1]) is peer
            and mine.generation == a.generation
        ):
            if not lease.failed:
                self._counts["aborted_by_decode"] += 1
                self.fail(lease, f"aborted by decode {peer.key[0]} dcp {peer.key[1]}: {a.reason}")
            return
        box = self.inbox.get(a.room)
        if box is not None and peer.key in box and box[peer.key][0].generation == a.generation:
            del box[peer.key]
            if not box:
                del self.inbox[a.room]
            return
        self._codec.drop("stale")
