"""The prefill side's rooms on the engine thread: leases, intake, aborts and failure notices.

A room started by the host becomes a :class:`~pdplug.transfer.records.Lease`. DestInfos that
arrive before ``start`` wait in a :class:`~pdplug.transfer.inbox.RoomInbox`. The lease turns
``WaitingForInput`` once every decode rank this prefill rank feeds sent its DestInfo: every DCP
rank of every decode TP rank the head routing gives it (:func:`pdplug.heads.fed_ranks`); each
segment becomes one job per destination for the :class:`~pdplug.transfer.pipeline.SendPipeline`,
planned with exactly the heads that decode rank takes from this one.

Every way a room ends reaches the decode side within one round trip:

* a failure is sent to every destination as ``Done(ChunkTag(ok=False))`` at once, and again,
  ``drained``, once no write of the room is in flight (the negative twin of a completion,
  vLLM PR #50754);
* an ``Abort`` is always answered: by failing the lease, or — when nothing of the room is in
  flight to that decode rank (not started yet, unknown, already drained) — by a drained failure
  notice at once. An abort that comes before ``start`` is remembered, so ``start`` fails the
  room at once instead of waiting for ``bootstrap_timeout_s``;
* a DestInfo for a room that already failed here is refused at once with the room's reason,
  also after the host cleared the room, unless it is for that decode rank's next lease of the
  room (it waits for the next lease here); one whose room did not start while the decode waits
  is refused then (:class:`~pdplug.transfer.inbox.RoomInbox`);
* two decode instances claiming one room are both told: the room fails if nothing was sent
  yet, else the later claimant is refused; one request's KV never goes to another's pages;
* a segment that ends past, or a last segment that ends short of, the ``num_tokens`` the
  decode rank declared fails the room naming both numbers.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable
from typing import Any

import numpy as np

from pdplug.packing import segment_chunks, send_capacity_tokens
from pdplug.packing.pages import PageIds
from pdplug.protocols import PackPlanner
from pdplug.rooms import Rooms
from pdplug.transfer.engine import TransferEngine
from pdplug.transfer.inbox import RoomInbox
from pdplug.transfer.messages import Abort, Done
from pdplug.transfer.peers import DecodePeers
from pdplug.transfer.pipeline import SendPipeline
from pdplug.transfer.records import Job, Lease, Peer, PeerKey, describe, failure_tag
from pdplug.types import ChunkTag, DestInfo, KVLayout, KVPoll, PackRegion, Segment
from pdplug.wire import Codec

__all__ = ["SendLeases"]


class SendLeases:
    """Every room of one prefill rank (engine-thread state; see the module docstring).

    :param rank: this prefill rank's id; ``layout``: its layout; ``planner``: the planner.
    :param rooms: the session's thread-safe room table.
    :param pipe: the session's send pipeline; ``peers``: its decode peers.
    :param engine: returns the current engine; ``tags``: the engine-notification codec.
    :param codec: the control codec (counts semantic drops).
    :param regions: returns the pack regions (set at ``register_kv``).
    :param inbox_ttl_s: how long an early DestInfo or abort is kept (seconds): as long as the
        decode waits for the room, ``max(bootstrap_timeout_s, waiting_timeout_s)``.
    :param event: ``(kind, lease, reason=None)`` observer hook of the session (room outcomes).
    :param counts: the session's counters.
    :param after: runs a closure once the engine thread's round released the engine lock
        (:meth:`~pdplug.transfer.loop.EngineLoop.after_round`): a room turns
        ``WaitingForInput`` then, when the host it wakes can post at once.
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
        after: Callable[[Callable[[], object]], object] = lambda fn: fn(),
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
        self._event = event
        self._counts = counts
        self._after = after
        self.leases: dict[int, Lease] = {}
        self.draining: list[Lease] = []
        self.box = RoomInbox(inbox_ttl_s)

    # ------------------------------------------------------------------ host calls
    def start(self, room: int, gen: int, now: float) -> None:
        """The host started ``room`` (lease ``gen``); adopt what came first."""
        lease = Lease(room=room, generation=gen)
        if self._rooms.generation(room) != gen:
            # the host aborted and cleared it before this thread saw it: it still ends once
            # (early DestInfos stay in the inbox: they may be for the room's next lease)
            why = f"cleared on prefill rank {self._rank} before it started"
            lease.failed, lease.reason = True, why
            self._counts["rooms_failed"] += 1
            self._event("transfer_failed", lease, reason=why)
            return
        self.leases[room] = lease
        old = self.box.failed.pop(room, None)  # a new lease: the room's DestInfos are for it
        if old is not None:  # an abort of those decode leases, arriving late, is not for it
            lease.stale = dict(old[2])
        early = sorted(self.box.dests.pop(room, {}).items())
        tomb = self.box.aborts.pop(room, None)
        if tomb:
            key, (_g, why, _t) = min(tomb.items())
            self._counts["aborted_before_start"] += 1
            self.fail(lease, f"aborted by {describe(key)} before start: {why}")
        for key, (d, agent, _t) in early:
            peer = self._peers.by_position(key)
            if peer is not None and peer.info.agent == agent:
                self.on_dest(peer, d, now)
            else:  # its decode process is gone (another one holds the position: other pages)
                self._counts["dest_process_gone"] += 1

    def dest(self, room: int) -> list[DestInfo]:
        """The DestInfos of ``room`` sorted by destination position."""
        lease = self.leases.get(room)
        return [] if lease is None else [lease.dests[k] for k in sorted(lease.dests)]

    def capacity(self, room: int) -> int | None:
        """Largest segment of ``room`` in tokens (``None``: no destination needs packing).

        :raises ValueError: no destination yet."""
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

    def enqueue(
        self, room: int, gen: int, seg: Segment, pages: np.ndarray, now: float, ready: Any = None
    ) -> None:
        """One segment of ``room`` becomes one job per destination (after the count check);
        none starts before ``ready.query()`` is true."""
        lease = self.leases.get(room)
        if lease is None or lease.generation != gen or lease.failed:
            return
        keys = lease.order or sorted(lease.dests)
        why = lease.segment_error(keys, seg)
        if why:
            self.fail(lease, why)
            return
        try:
            # destinations with equal pages share one chunk (planners compare by identity)
            dst = lease.dst_pages
            chunks = segment_chunks(
                room, seg, pages,
                [(dst[k] if dst else lease.dests[k].dst_pages, lease.dests[k].decode_prefix_len)
                 for k in keys],
                self._layout.page_size,
            )  # fmt: skip
            jobs = [
                Job(lease=lease, key=key, dst_rank=key[2], chunk=chunk)
                for key, chunk in zip(keys, chunks)
            ]
        except ValueError as e:
            self.fail(lease, f"segment {seg.chunk_id}: {e}")
            return
        if seg.chunk_id in lease.segments:
            self.fail(lease, f"segment chunk_id {seg.chunk_id} sent twice")
            return
        lease.segments[seg.chunk_id] = len(jobs)
        self._counts["segments"] += 1
        self._pipe.submit(jobs, now, ready)

    def send_direct(self, room: int, gen: int, seg: Segment, pages: PageIds, now: float) -> bool:
        """Post one segment of ``room`` (its KV complete now) straight from every destination's
        direct template (:meth:`SendPipeline.send_direct`): no chunk, no job queue, no pipeline
        round. ``False``, with nothing changed, wherever :meth:`enqueue` must take it (a
        destination without a template or with work queued, a count or chunk id it must
        report, a start off a page boundary)."""
        lease = self.leases.get(room)
        if lease is None or lease.generation != gen or lease.failed or not lease.order:
            return False
        keys = lease.order
        if seg.chunk_id in lease.segments or lease.segment_error(keys, seg):
            return False
        if not self._pipe.send_direct(lease, keys, seg, pages, now):
            return False
        self._counts["segments"] += 1
        self._counts["direct_lane"] += 1
        return True

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
        if lease.failed:
            self.box.remember_failed(room, lease.reason or "failed on the prefill rank", lease)
        lease.cleared = True
        self._pipe.purge(lease)
        if lease.inflight:
            self.draining.append(lease)

    def close(self, reason: str) -> None:
        """The session closes: fail every room not ended, refuse each early DestInfo."""
        for lease in list(self.leases.values()):
            self.fail(lease, reason)
        self.expire_inbox(float("inf"), reason)

    def drained(self, room: int) -> bool:
        """No write of ``room`` is in flight."""
        lease = self.leases.get(room)
        return lease is None or lease.inflight == 0

    # ------------------------------------------------------------------ outcomes
    def fail(self, lease: Lease, reason: str) -> None:
        """Fail ``lease`` (once), drop its queued work and tell its destinations."""
        if lease.failed or lease.succeeded:
            return  # it ended already: a room ends once
        moved = self._rooms.fail(lease.room, reason, lease.generation)
        view = None if moved else self._rooms.view(lease.room)
        if (
            view is not None
            and view.generation == lease.generation
            and view.status == KVPoll.Success
        ):
            return
        lease.failed = True
        lease.reason = reason
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
        reason = lease.reason or self._rooms.reason(lease.room) or "failed"
        engine = self._engine()
        for key, d in lease.dests.items():
            peer = lease.peers[key]
            if not peer.alive:
                continue
            tag = failure_tag(d.room, d.generation, self._rank, reason)
            self._peers.send(peer, Done(chunk=tag, drained=drained))
            if first and engine.notifications:
                try:
                    engine.notify(peer.handle, self._tags.encode(tag))
                except Exception:
                    self._counts["notify_failed"] += 1

    def _refuse(self, peer: Peer, d: DestInfo, reason: str) -> None:
        """Tell one decode rank at once that ``d``'s room ended here with nothing of it in
        flight to that rank (its pages are not written by this rank)."""
        tag = failure_tag(d.room, d.generation, self._rank, reason)
        self._peers.send(peer, Done(chunk=tag, drained=True))

    def job_done(self, job: Job) -> None:
        """A job's write completed; the room succeeds with its last segment's last job."""
        lease = job.lease
        left = lease.segments.get(job.chunk.chunk_id, 0) - 1
        lease.segments[job.chunk.chunk_id] = left
        if left == 0 and not lease.failed and not lease.cleared:
            st = self._rooms.done_pending(lease.room, 1, lease.generation, touch=True)
            if st == KVPoll.Success and not lease.succeeded:
                lease.succeeded = True
                self._counts["rooms_ok"] += 1
                self._event("transfer_done", lease)

    def written(self, job: Job, tag: ChunkTag) -> None:
        """A write completed on an engine without notifications: its tag goes by control."""
        peer = job.lease.peers.get(job.key)
        if peer is not None and peer.alive:
            self._peers.send(peer, Done(chunk=tag))

    def peer_dropped(self, peer: Peer, reason: str) -> None:
        """Fail every room bound to a dropped peer."""
        for lease in list(self.leases.values()):
            if lease.peers.get(peer.key) is peer:
                self.fail(lease, f"{describe(peer.key)}: {reason}")

    def rebind(self, old: Peer, new: Peer) -> None:
        """The same decode process handshook again: its rooms continue on the new peer."""
        for lease in [*self.leases.values(), *self.draining]:
            if lease.peers.get(old.key) is old:
                lease.peers[old.key] = new

    def keep_alive(self, active: set[int]) -> dict[PeerKey, list[int]]:
        """Re-arm the deadline of rooms whose work is moving (:meth:`SendPipeline.active`);
        returns, per destination, the decode lease generations of those rooms (sent with the
        next heartbeat so the decode side re-arms them too)."""
        live: dict[PeerKey, list[int]] = {}
        for lease in self.leases.values():
            if id(lease) in active and not lease.failed:
                self._rooms.touch(lease.room, lease.generation)
                for key, d in lease.dests.items():
                    live.setdefault(key, []).append(d.generation)
        return live

    def expire(self, now: float) -> None:
        """Fail rooms past their deadline; forget drained cleared rooms."""
        for room, gen, reason in self._rooms.expire(now):
            lease = self.leases.get(room)
            if lease is not None and lease.generation == gen:
                if self._pipe.waits_for_ready(lease):  # name the cause, whichever clock fired
                    reason = (
                        f"{reason}: waiting for the host's KV ready marker (send(ready=)), "
                        "which never completed"
                    )
                self.fail(lease, reason)
        if self.draining:
            self.draining[:] = [ls for ls in self.draining if ls.inflight]

    def expire_inbox(self, now: float, reason: str = "") -> None:
        """Forget what :class:`~pdplug.transfer.inbox.RoomInbox` holds past its time; refuse
        each expired early DestInfo (its decode rank fails the room now, nothing was sent)."""
        why = reason or f"prefill rank {self._rank} did not start it in {self.box.ttl_s:g} s"
        for key, d in self.box.expire(now, self._counts):
            if (peer := self._peers.by_position(key)) is not None and peer.alive:
                self._refuse(peer, d, why)

    def gauges(self) -> dict[str, int]:
        """What the table holds now."""
        return {"leases": len(self.leases), "draining": len(self.draining), **self.box.gauges()}

    # ------------------------------------------------------------------ control messages
    def on_dest(self, peer: Peer, d: DestInfo, now: float) -> None:
        """A decode rank's DestInfo for one room."""
        if d.decode_instance != peer.key[0] or d.dcp_rank != peer.key[2]:
            self._codec.drop("unknown_rank")
            return
        if len(d.dst_pages) % 8 or d.decode_prefix_len < 0 or d.num_tokens < 0:
            self._codec.drop("malformed")
            return
        lease = self.leases.get(d.room)
        if lease is None:  # before start, or a failed lease the host cleared
            kind, why = self.box.arrive(peer.key, peer.info.agent, d, now)
            if kind == "refuse":
                self._counts["dest_after_failure"] += 1
                self._refuse(peer, d, why)
            elif kind == "drop":
                self._codec.drop("other")
            else:
                self._counts["dest_early"] += 1
            return
        if lease.failed:  # the decode rank learns it now, not after its own timeout
            if self.box.keep_for_next(lease, peer.key, peer.info.agent, d, now):
                self._counts["dest_next_lease"] += 1
                return
            self._counts["dest_after_failure"] += 1
            self._refuse(peer, d, lease.reason or "failed on the prefill rank")
            return
        if lease.instance and lease.instance != d.decode_instance:
            self._counts["room_conflicts"] += 1
            reason = (
                f"room {d.room} is claimed by two decode instances ({lease.instance!r} and "
                f"{d.decode_instance!r}); a room id must name one request (see KVSender)"
            )
            if not lease.posted:  # nothing moved yet: neither claim can be trusted
                self.fail(lease, reason)
            self._refuse(peer, d, reason)
            return
        cur = lease.dests.get(peer.key)
        if cur is not None:
            if d.generation <= cur.generation:
                self._codec.drop("other")  # a duplicate, or older than the one the lease took
            else:  # a recycled room on decode: keep it for this room's next lease
                self.box.hold(peer.key, peer.info.agent, d, now)
                self._counts["dest_next_lease"] += 1
            return
        lease.instance = d.decode_instance
        lease.expected = peer.fed * peer.info.layout.dcp_size
        lease.dests[peer.key] = d
        lease.peers[peer.key] = peer
        if len(lease.dests) < lease.expected:
            return
        why = lease.complete()
        if why:
            self.fail(lease, why)
            return
        room, gen = lease.room, lease.generation
        self._after(lambda: self._rooms.advance(room, KVPoll.WaitingForInput, gen))

    def on_abort(self, peer: Peer, a: Abort, now: float) -> None:
        """A decode rank aborted (or asks again about) one room; always answered."""
        key = peer.key
        why = f"aborted by {describe(key)}: {a.reason}"
        lease = self.leases.get(a.room)
        if lease is not None and lease.inflight:
            self._pipe.reap(now)  # a write of it that already failed names its own failure
        if lease is not None:
            d = lease.dests.get(key)
            if d is not None and d.generation == a.generation:
                if not lease.failed:
                    self._counts["aborted_by_decode"] += 1
                    self.fail(lease, why)  # a room that succeeded stays so
                if lease.inflight == 0:  # confirm nothing of it is in flight (or asked again)
                    self._refuse(peer, d, lease.reason or f"{why} (the room had ended)")
                return
            if (
                d is None
                and not lease.failed
                and lease.instance in ("", key[0])
                and a.generation > lease.stale.get(key, -1)
            ):
                self._counts["aborted_by_decode"] += 1
                self.fail(lease, why)  # its DestInfo never came (or was lost)
        for ls in self.draining:
            d = ls.dests.get(key)
            if d is not None and d.generation == a.generation:
                if ls.inflight == 0:
                    self._refuse(peer, d, ls.reason)
                return
        box = self.box.dests.get(a.room)
        if box is not None and key in box and box[key][0].generation == a.generation:
            del box[key]
            if not box:
                del self.box.dests[a.room]
        if lease is None:  # remembered, so a later start() fails at once
            self.box.aborts.setdefault(a.room, {})[key] = (a.generation, a.reason, now)
        self._counts["abort_confirmed"] += 1
        why = f"{why} (nothing in flight on prefill rank {self._rank})"
        tag = failure_tag(a.room, a.generation, self._rank, why)
        self._peers.send(peer, Done(chunk=tag, drained=True))
