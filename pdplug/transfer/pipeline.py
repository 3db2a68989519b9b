"""The prefill data path: plan -> pack -> post -> reap, with double-buffered pack regions.

Used by :class:`~pdplug.transfer.sender.KVSenderSession` on its engine thread. One *job* is
one (segment, destination decode rank). Jobs wait in one FIFO per destination; destinations
are served round-robin, so a peer that is slow, stuck or waiting for regions never holds up the
others. No job starts before the host's ``ready`` marker of its segment completed
(:mod:`~pdplug.transfer.gather`). A job whose peer needs relayout takes a pack region
(:class:`~pdplug.transfer.regions.RegionPool`); the relayout jobs of one segment that a round
starts are planned and packed together (one ``pack_all`` call) on a dedicated **pack thread**
(planners are pure) and posted by the engine thread once their pack-done marker completed; the
region stays busy until the engine reports the write done. So while the engine writes segment
``k``, the pack thread fills other regions with segment ``k + 1`` (SGLang PR #35762's double
buffering; :class:`~pdplug.transfer.gather.BusyClock` measures the overlap). Jobs without
relayout are planned and posted directly, at most ``max_inflight`` per peer at once. A plan with
no run (a rank that owns no token of the chunk) becomes a notification-only chunk (SGLang
#32837).

A job to a peer without relayout whose queue is empty starts in :meth:`SendPipeline.submit`
itself (planned and posted by the thread that sends, no queue round). A page-aligned job to a
peer whose pair the planner gave a closed form (``PackPlanner.direct_pages``, bound once per
peer: :class:`pdplug.packing.DirectRuns`) is posted from it without a plan (``direct_plans``),
by page ids when the engine prepared the template's pages (``TransferEngine.prepare_pages``). A
segment whose every destination has one skips the jobs' chunks and queues altogether
(:meth:`SendPipeline.send_direct`, the direct lane: ``direct_lane``). Posting
and completion (:class:`~pdplug.transfer.posting.WritePoster`): ``ERR`` or an engine exception
fails the room; a *stuck* write fails its room but keeps its region and handle until the engine
reports it done or failed. Nothing is ever abandoned while the engine may still move its bytes.
"""

from __future__ import annotations

import time
from collections import Counter, deque
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import numpy as np

from pdplug.packing.pages import PageIds
from pdplug.transfer.engine import TransferEngine
from pdplug.transfer.gather import Packing, PackQueue, ReadyGate
from pdplug.transfer.posting import WritePoster
from pdplug.transfer.records import Job, Lease, Peer, PeerKey, describe
from pdplug.transfer.regions import RegionPool
from pdplug.types import ChunkTag, KVLayout, PackRegion, Segment, TransferPlan
from pdplug.wire import Codec

if TYPE_CHECKING:
    import torch

    from pdplug.protocols import Packer, PackPlanner

__all__ = ["SendPipeline"]

_BUDGET = 16  # jobs started per round, so completions are reaped in between


class SendPipeline:
    """Plan/pack/post/reap for one sender; every method runs on the sender's engine thread.

    :param engine: the backend adapter; ``planner``: the pack planner.
    :param layout: the source layout; ``rank``: the source rank id carried in tags.
    :param tags: codec of engine notifications (completion tags ride the write).
    :param timeout_s: ``KVConfig.transfer_timeout_s``: when a pending write is stuck.
    :param max_inflight: unpacked writes in flight per peer.
    :param on_done: ``(job)`` when a job's write completed (or it was notification-only).
    :param on_fail: ``(lease, reason)`` on a plan, pack or post failure or a stuck write.
    :param on_written: ``(job, tag)`` after a completed write, for engines without
        notifications (the session sends the tag over the control channel).
    :param on_drained: ``(lease)`` when a failed lease has no write in flight any more.
    :param on_idle: ``(peer)`` when a gone peer has no write left (release its handle).
    :param waker: thread-safe "run a round now" (the engine loop's ``wake``).
    """

    def __init__(
        self,
        *,
        engine: TransferEngine,
        planner: PackPlanner,
        layout: KVLayout,
        rank: int,
        tags: Codec[Any],
        timeout_s: float,
        max_inflight: int,
        on_done: Callable[[Job], None],
        on_fail: Callable[[Lease, str], None],
        on_written: Callable[[Job, ChunkTag], None],
        on_drained: Callable[[Lease], None],
        on_idle: Callable[[Peer], None],
        waker: Callable[[], None] = lambda: None,
    ) -> None:
        self.planner = planner
        self.packer: Packer | None = None
        self.layout = layout
        self.rank = rank
        self.timeout_s = timeout_s
        self.max_inflight = max_inflight
        self._on_fail = on_fail
        self._on_drained = on_drained
        self._on_idle = on_idle
        self.regions: list[PackRegion] = []
        self.pool = RegionPool(0, 1)
        self._entries: list[Any] = []
        self._pack: torch.Tensor | None = None
        self._queues: dict[PeerKey, deque[Job]] = {}
        self._turn = 0
        self._packing = PackQueue(waker)
        self._unpacked: Counter[PeerKey] = Counter()
        self._more = False  # dispatch stopped at its per-round budget
        self._waiting = False  # a packed segment waits for its pack-done marker
        self._gate = ReadyGate()  # segments whose host ready marker has not completed
        self.clock = self._packing.clock
        self.counts: Counter[str] = Counter()
        self.timings = dict.fromkeys(("plan_s", "pack_s", "post_s", "write_s"), 0.0)
        #: posts and reaps the writes (:class:`~pdplug.transfer.posting.WritePoster`)
        self.poster = WritePoster(
            engine=engine,  # also whether (and for which writes) it wakes the loop
            rank=rank,
            tags=tags,
            timeout_s=timeout_s,
            clock=self.clock,
            counts=self.counts,
            timings=self.timings,
            on_done=on_done,
            on_fail=on_fail,
            on_written=on_written,
            settle=self._settle,
            waker=waker,
        )
        self._inflight = self.poster.inflight

    @property
    def engine(self) -> TransferEngine:
        """The backend adapter."""
        return self.poster.engine

    @engine.setter
    def engine(self, engine: TransferEngine) -> None:
        self.poster.engine = engine

    @property
    def progress_at(self) -> float:
        """Last write completion, or work arriving at an idle pipeline (monotonic seconds)."""
        return self.poster.progress_at

    def set_memory(
        self,
        entries: list[Any],
        src_base: np.ndarray,
        pack: torch.Tensor | None,
        regions: list[PackRegion],
        depth: int,
        packer: Packer,
    ) -> None:
        """The registered KV entries (tensors, or raw addresses of regions), the pack buffer
        and its region table."""
        self._entries = entries
        self._pack = pack
        self.poster.set_memory(src_base, 0 if pack is None else int(pack.data_ptr()))
        self.regions = regions
        self.pool = RegionPool(len(regions), depth)
        self.packer = packer

    # ------------------------------------------------------------------ state
    def has_work(self) -> bool:
        """Work queued, packing or in flight (a round must look at it)."""
        return bool(
            self._queues or self._packing.items or self._inflight.writes or self._gate.parked
        )

    def has_queued(self) -> bool:
        """Jobs queued or parked that a round must start."""
        return bool(self._queues or self._gate.parked or self._more)

    def busy(self, watched: bool = False) -> bool:
        """Whether the loop must poll rather than sleep: left-over dispatch, a pack or ready
        marker, or writes an engine cannot wake it for (unless a host reaps them: ``watched``)."""
        return (
            self._more
            or self._waiting
            or bool(self._gate)
            or (not watched and self._inflight.silent())
        )

    def gauges(self) -> dict[str, int]:
        """What the pipeline holds now: queued jobs, packing, writes in flight, stuck writes,
        busy pack regions."""
        return {
            "queued": sum(len(q) for q in self._queues.values()),
            "waiting_ready": len(self._gate),
            "packing": len(self._packing),
            "xfers": len(self._inflight),
            "stuck_writes": self._inflight.stuck(),
            "busy_regions": int(self.pool.busy.sum()),
        }

    def active(self, now: float) -> set[int]:
        """``id`` of every lease whose work is moving: queued behind other work while this
        sender keeps completing writes (and its peer has no stuck write), packing, or a write
        whose own time (module docstring) is under ``timeout_s``. Its room deadline is re-armed:
        time spent queued locally is not silence."""
        stuck = self._inflight.stuck_keys()
        out = self._packing.leases()
        out.update(self._inflight.moving(now))
        # parked behind the host's ready marker is not silence (the gate fails it, naming it)
        out.update(id(jobs[0].lease) for _, jobs in self._gate.parked)
        if now - self.progress_at <= self.timeout_s:
            for key, q in self._queues.items():
                if key not in stuck:
                    out.update(id(j.lease) for j in q)
        return out

    def waits_for_ready(self, lease: Lease) -> bool:
        """Whether a segment of ``lease`` is parked behind the host's ready marker."""
        return any(jobs[0].lease is lease for _, jobs in self._gate.parked)

    def submit(self, jobs: list[Job], now: float, ready: Any = None) -> None:
        """Start or queue one segment's jobs once ``ready.query()`` is true
        (:class:`~pdplug.transfer.gather.ReadyGate`; waiting holds up no other room).

        A job to a peer without relayout whose queue is empty and that has room for another
        write starts at once (planned and posted on this thread: the direct lane, no queue
        round trip); every other job waits in its destination's FIFO for :meth:`step`."""
        if not self.has_work():
            self.poster.progress_at = now
        if ready is not None or self._gate.parked:
            jobs = self._gate.admit(jobs, ready, now)
        queues, unpacked = self._queues, self._unpacked
        for job in jobs:
            key, lease = job.key, job.lease
            peer = lease.peers.get(key)
            if (
                key in queues
                or peer is None
                or peer.relayout
                or not peer.alive
                or lease.failed
                or lease.cleared
                or unpacked[key] >= self.max_inflight
            ):
                queues.setdefault(key, deque()).append(job)
            else:
                self._start(job, peer, -1, now)

    def _queue(self, jobs: list[Job]) -> None:
        for job in jobs:
            self._queues.setdefault(job.key, deque()).append(job)

    def purge(self, lease: Lease) -> None:
        """Drop the lease's queued jobs and withdraw posts the engine has not started (a failed
        room must not keep the engine busy with doomed writes)."""
        for key in list(self._queues):
            q = self._queues[key]
            if any(j.lease is lease for j in q):
                q = deque(j for j in q if j.lease is not lease)
                if q:
                    self._queues[key] = q
                else:
                    del self._queues[key]
        self._gate.drop(lease)
        for w in self._inflight.withdraw(lease, self.engine):
            self._settle(w.job, w.peer, w.region)
            self.counts["cancelled"] += 1

    def step(self, now: float) -> None:
        """One round: reap writes, post what finished packing, dispatch queued jobs."""
        if self._inflight.writes:
            self.reap(now)
        posts = self.counts["posts"]
        self._waiting = False
        if self._gate.parked:
            ready, failed = self._gate.release(now, self.timeout_s)
            self._queue(ready)
            for lease, why in failed:
                self._on_fail(lease, why)
        # dispatch first: regions freed by the writes just reaped go to the pack thread before
        # this thread posts the packed segments (an engine may copy inside its post call, as
        # UCX over shared memory does), so the gather of segment k + 2 overlaps the post of k + 1
        if self._queues:
            self._dispatch(now)
        if self._packing.items:
            self._post_packed(now)
        if self.counts["posts"] != posts:
            self.reap(now)  # an engine that copies inside its post call is done already
        if not self._inflight.writes:
            self.clock.writes_idle(time.perf_counter())

    def close(self) -> None:
        """Release in-flight handles (the engine is closing) and stop the pack thread."""
        self._packing.close()
        self._inflight.release_all(self.engine)

    # ------------------------------------------------------------------ dispatch
    def _settle(self, job: Job, peer: Peer, region: int) -> None:
        """A job's work ended (done, failed, cancelled or never posted)."""
        if region >= 0:
            self.pool.give_back(region, job.key, job.key[0])
        elif not peer.relayout:
            self._unpacked[job.key] -= 1
        job.lease.inflight -= 1
        peer.inflight -= 1
        if job.lease.failed and job.lease.inflight == 0:
            self._on_drained(job.lease)
        if peer.gone and peer.inflight == 0:
            self._on_idle(peer)

    def _dispatch(self, now: float) -> None:
        budget = _BUDGET
        self._more = False
        wanting = len(self.pool.groups() | {k[0] for k in self._queues})
        keys = list(self._queues)
        if not keys:
            return
        self._turn = (self._turn + 1) % len(keys)
        for key in keys[self._turn :] + keys[: self._turn]:
            q = self._queues[key]
            while q and budget > 0:
                job = q[0]
                lease = job.lease
                if lease.failed or lease.cleared:
                    q.popleft()
                    continue
                peer = lease.peers.get(key)
                if peer is None or not peer.alive:
                    q.popleft()
                    self._on_fail(lease, f"{describe(key)} is gone")
                    q = self._queues.get(key, deque())  # the failure purged the lease's jobs
                    continue
                region = -1
                if peer.relayout:
                    region = self.pool.take(key, key[0], wanting)
                    if region < 0:
                        break  # this peer waits for a region; the others go on
                elif self._unpacked[key] >= self.max_inflight:
                    break
                q.popleft()
                budget -= 1
                self._start(job, peer, region, now)
            if not q:
                self._queues.pop(key, None)
            elif budget <= 0:
                self._more = True
        self._packing.flush(
            self.planner, self.layout, self.regions, self.packer, self._entries, self._pack
        )

    def _start(self, job: Job, peer: Peer, region: int, now: float) -> None:
        lease = job.lease
        lease.posted = True
        lease.inflight += 1
        peer.inflight += 1
        if region >= 0:  # relayout: planned and packed with its segment on the pack thread
            self._packing.add(job, peer, region)
            return
        if not peer.relayout:
            self._unpacked[job.key] += 1
        t0 = time.perf_counter()
        direct = peer.direct
        if direct is None:  # bound at the peer's first send (the planner's, off the send path)
            direct = peer.direct = self.poster.bind_direct(peer, self.planner, self.layout)
        span = direct.chunk_pages(job.chunk) if direct else None
        if span is not None:  # the planner's closed form: no plan, no gather per run
            self.timings["plan_s"] += time.perf_counter() - t0
            self.poster.post_direct(job, peer, direct, span, now)
            return
        try:
            plan = self.planner.plan(job.chunk, self.layout, peer.info.layout, job.dst_rank, None)
        except Exception as e:
            self._settle(job, peer, region)
            self._on_fail(lease, f"plan of chunk {job.chunk.chunk_id} for dcp {job.dst_rank}: {e}")
            return
        self.timings["plan_s"] += time.perf_counter() - t0
        if plan.num_runs == 0:
            self._settle(job, peer, region)
            self.poster.notify_only(job, peer, self.poster.tag(job, plan))
            return
        self.poster.post(job, peer, region, plan, now)

    def send_direct(
        self, lease: Lease, keys: list[PeerKey], seg: Segment, pages: PageIds, now: float
    ) -> bool:
        """Post ``seg`` (its KV complete now) to every destination ``keys`` of ``lease`` from
        its peer's direct template, one job each, counting the segment's jobs in
        ``lease.segments``; ``False``, with nothing changed, when one must go through
        :meth:`submit`: a peer without a bound template (its first send binds it), packed,
        gone, at ``max_inflight``, or with work queued or parked before this segment; a
        segment the template does not cover."""
        if self._gate.parked:
            return False
        spans = []
        for key in keys:
            peer = lease.peers.get(key)
            if (
                peer is None
                or not peer.direct
                or not peer.alive
                or key in self._queues
                or self._unpacked[key] >= self.max_inflight
            ):
                return False
            span = peer.direct.segment_pages(
                seg.token_start, seg.num_tokens, pages, lease.dst_ids[key],
                lease.dests[key].decode_prefix_len,
            )  # fmt: skip
            if span is None:
                return False
            spans.append((key, peer, span))
        if not (self._inflight.writes or self._queues):
            self.poster.progress_at = now
        lease.segments[seg.chunk_id] = len(spans)
        lease.posted = True
        for key, peer, span in spans:
            if lease.failed:  # an earlier post of the segment failed: nothing more may land
                break
            lease.inflight += 1
            peer.inflight += 1
            self._unpacked[key] += 1
            job = Job(lease=lease, key=key, dst_rank=key[2], chunk=seg)
            self.poster.post_direct(job, peer, peer.direct, span, now)
        # a write that ended inside its post opened no busy period (BusyClock.wrote); a
        # tracked one's is closed by the round that reaps it
        return True

    def _post_packed(self, now: float) -> None:
        """Post every job whose segment is packed and whose pack-done marker completed."""
        done, failed, self._waiting = self._packing.take(self.timings, self.counts)
        for p, reason in failed:
            self._settle(p.job, p.peer, p.region)
            self._on_fail(p.job.lease, reason)
        for i, (p, plan) in enumerate(done):
            self._post_one(p, plan, now)
            if i + 1 < len(done) and self._queues and self._inflight:
                # writes that completed while this one was posted (an engine copying inside
                # its post call) hand their regions to the pack thread before the next post
                self.reap(now)  # a failed one may purge its lease's queues
                if self._queues:
                    self._dispatch(now)

    def _post_one(self, p: Packing, plan: TransferPlan, now: float) -> None:
        job, lease = p.job, p.job.lease
        peer = lease.peers.get(job.key, p.peer)  # a re-handshake may have replaced it
        if lease.failed or lease.cleared or not peer.alive or plan.num_runs == 0:
            self._settle(job, p.peer, p.region)
            if lease.failed or lease.cleared:
                return
            if not peer.alive:
                self._on_fail(lease, f"{describe(job.key)} is gone")
            else:
                self.poster.notify_only(job, peer, self.poster.tag(job, plan))
            return
        if peer is not p.peer:  # the write uses the current connection's handle
            peer.inflight += 1
            p.peer.inflight -= 1
            if p.peer.gone and p.peer.inflight == 0:
                self._on_idle(p.peer)
        self.poster.post(job, peer, p.region, plan, now)

    def reap(self, now: float) -> None:
        """Ask the engine about every write in flight now (finished, failed, stuck)."""
        self.poster.reap(now)
