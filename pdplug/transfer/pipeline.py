"""The prefill data path: plan -> pack -> post -> reap, with double-buffered pack regions.

Used by :class:`~pdplug.transfer.sender.KVSenderSession` on its engine thread. One *job* is
one (segment, destination DCP rank). A job whose peer needs relayout takes a free pack region
of its rank (``pack_depth`` per rank, :mod:`pdplug.packing`), is planned and packed on a
dedicated **pack thread** (planners are pure), and posted by the engine thread once packed; the
region stays busy until the engine reports the write done. So while the engine writes segment ``k``
(asynchronously — RDMA; or synchronously inside the post call, as NIXL does over loopback
shared memory, which is why packing cannot stay on the posting thread), the pack thread fills
the other region with segment ``k + 1`` (SGLang #35762's double buffering; prior-art
sglang.md §3.3-3.4). Jobs without relayout are planned and posted directly, at most
``max_inflight`` at once. A plan with no run (a rank that owns no token of the chunk) becomes a
notification-only chunk (SGLang #32837).

Every posted write is checked each round; ``ERR`` or an engine exception fails the room; a
write pending longer than ``timeout_s`` fails the room and is abandoned after ``2 * timeout_s``
(its region freed) so a stuck engine cannot pin memory forever.
"""

from __future__ import annotations

import logging
import time
from collections import Counter, deque
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from typing import TYPE_CHECKING, Any

import msgspec
import numpy as np

from pdplug.packing import run_addresses
from pdplug.transfer.engine import XFER_DONE, XFER_PENDING, TransferEngine, engine_wakes
from pdplug.types import ChunkTag, DestInfo, KVLayout, PackRegion, PeerInfo, TransferPlan
from pdplug.wire import Codec

if TYPE_CHECKING:
    import torch

    from pdplug.protocols import Packer, PackPlanner

__all__ = ["Peer", "Lease", "Job", "SendPipeline"]

log = logging.getLogger(__name__)


class Peer(msgspec.Struct, kw_only=True):
    """A decode rank connected to a sender (engine thread state).

    :ivar key: ``(decode instance, dcp_rank)``; ``emap``: source -> destination entry;
        ``dst_base``: int64 destination entry bases; ``relayout``: sends to it are packed.
    """

    ident: bytes
    info: PeerInfo
    key: tuple[str, int]
    handle: Any
    emap: np.ndarray
    dst_base: np.ndarray
    relayout: bool
    last_seen: float
    alive: bool = True


class Lease(msgspec.Struct, kw_only=True):
    """One room on a sender (engine thread state): its destinations, segments and writes.

    :ivar segments: chunk_id -> jobs of that segment not yet completed.
    :ivar inflight: writes posted (or packing) and not yet done.
    :ivar notified: failure notices sent: 0 none, 1 failed, 2 failed and drained.
    """

    room: int
    generation: int
    instance: str = ""
    expected: int = 0
    dests: dict[int, DestInfo] = {}
    peers: dict[int, Peer] = {}
    segments: dict[int, int] = {}
    inflight: int = 0
    failed: bool = False
    reason: str = ""
    notified: int = 0
    cleared: bool = False


class Job(msgspec.Struct, kw_only=True):
    """One (segment, destination DCP rank); ``chunk`` is the planner's SendChunk."""

    lease: Lease
    dst_rank: int
    chunk: Any


class _Packing(msgspec.Struct, kw_only=True):
    job: Job
    peer: Peer
    region: int
    fut: Future[tuple[TransferPlan, float, float]]


class _Xfer(msgspec.Struct, kw_only=True):
    job: Job
    handle: Any
    region: int
    t_post: float
    nbytes: int
    tag: ChunkTag
    abandoned: bool = False
    cancelled: bool = False


class SendPipeline:
    """Plan/pack/post/reap for one sender; every method runs on the sender's engine thread.

    :param engine: the backend adapter; ``planner``/``packer``: the Protocol objects.
    :param layout: the source layout; ``rank``: the source rank id carried in tags.
    :param tags: codec of engine notifications (completion tags ride the write).
    :param timeout_s: ``KVConfig.transfer_timeout_s``.
    :param on_done: ``(job)`` when a job's write completed (or it was notification-only).
    :param on_fail: ``(lease, reason)`` on a plan, pack or post failure.
    :param on_written: ``(peer, tag)`` after a completed write, for engines without
        notifications (the session sends the tag over the control channel).
    :param on_drained: ``(lease)`` when a failed lease has no write in flight any more.
    :param waker: thread-safe "run a round now" (the engine loop's ``wake``): finished packs
        and engines that complete writes on their own threads call it, so the loop sleeps
        instead of polling them.
    """

    def __init__(
        self,
        *,
        engine: TransferEngine,
        planner: PackPlanner,
        layout: KVLayout,
        rank: int,
        tags: Codec,
        timeout_s: float,
        max_inflight: int,
        on_done: Callable[[Job], None],
        on_fail: Callable[[Lease, str], None],
        on_written: Callable[[Peer, ChunkTag], None],
        on_drained: Callable[[Lease], None],
        waker: Callable[[], None] = lambda: None,
    ) -> None:
        self._waker = waker
        self._engine = engine
        self.wakes = engine_wakes(engine, waker)
        self.planner = planner
        self.packer: Packer | None = None
        self.layout = layout
        self.rank = rank
        self._tags = tags
        self.timeout_s = timeout_s
        self.max_inflight = max_inflight
        self._on_done = on_done
        self._on_fail = on_fail
        self._on_written = on_written
        self._on_drained = on_drained
        self.depth = 1
        self.regions: list[PackRegion] = []
        self._busy_region = np.zeros(0, dtype=bool)
        self._entries: list[torch.Tensor] = []
        self._src_base = np.zeros(0, dtype=np.int64)
        self._pack: torch.Tensor | None = None
        self._pack_base = 0
        self._queue: deque[Job] = deque()
        self._packing: deque[_Packing] = deque()
        self._xfers: list[_Xfer] = []
        self._pool: ThreadPoolExecutor | None = None
        self._more = False  # dispatch stopped at its per-round budget
        self.counts: Counter[str] = Counter()
        self.timings = dict.fromkeys(("plan_s", "pack_s", "post_s", "write_s"), 0.0)

    @property
    def engine(self) -> TransferEngine:
        """The backend adapter."""
        return self._engine

    @engine.setter
    def engine(self, engine: TransferEngine) -> None:
        self._engine = engine
        self.wakes = engine_wakes(engine, self._waker)

    def set_memory(
        self,
        entries: list[torch.Tensor],
        src_base: np.ndarray,
        pack: torch.Tensor | None,
        regions: list[PackRegion],
        depth: int,
        packer: Packer,
    ) -> None:
        """The registered KV entries, the pack buffer and its region table."""
        self._entries = entries
        self._src_base = src_base
        self._pack = pack
        self._pack_base = 0 if pack is None else int(pack.data_ptr())
        self.regions = regions
        self._busy_region = np.zeros(len(regions), dtype=bool)
        self.depth = depth
        self.packer = packer

    # ------------------------------------------------------------------ queue
    def has_work(self) -> bool:
        """Work queued, packing or in flight (a round must look at it)."""
        return bool(self._queue or self._packing or self._xfers)

    def busy(self) -> bool:
        """Whether the loop must poll rather than sleep until woken: writes on an engine that
        cannot wake it, or dispatch work left over from the last round."""
        return self._more or bool(self._xfers and not self.wakes)

    def submit(self, jobs: list[Job]) -> None:
        """Queue jobs (FIFO per destination rank)."""
        self._queue.extend(jobs)

    def purge(self, lease: Lease) -> None:
        """Drop the lease's queued jobs and withdraw posts the engine has not started (a failed
        room must not keep a single-threaded engine busy with doomed writes)."""
        if self._queue:
            self._queue = deque(j for j in self._queue if j.lease is not lease)
        for x in self._xfers:
            if x.job.lease is lease and not x.cancelled and self.engine.cancel(x.handle):
                x.cancelled = True  # _reap drops it
                self._free(x.region)
                lease.inflight -= 1
                self.counts["cancelled"] += 1

    def drained(self, lease: Lease) -> bool:
        """No write of ``lease`` is packing or in flight."""
        return lease.inflight == 0

    def step(self, now: float) -> None:
        """One round: reap writes, post what finished packing, dispatch queued jobs."""
        if self._xfers:
            self._reap(now)
        posts = self.counts["posts"]
        if self._packing:
            self._post_packed(now)
        if self._queue:
            self._dispatch(now)
        if self.counts["posts"] != posts:
            self._reap(now)  # an engine that copies inside its post call is done already

    def close(self) -> None:
        """Release in-flight handles and stop the pack thread."""
        if self._pool is not None:
            self._pool.shutdown(wait=True, cancel_futures=True)
        for x in self._xfers:
            try:
                self.engine.release(x.handle)
            except Exception:
                pass
        self._xfers.clear()

    # ------------------------------------------------------------------ dispatch
    def _free_region(self, peer: Peer, rank: int) -> int:
        if not peer.relayout:
            return -1
        for i in range(rank * self.depth, rank * self.depth + self.depth):
            if not self._busy_region[i]:
                return i
        return -2

    def _free(self, region: int) -> None:
        if region >= 0:
            self._busy_region[region] = False

    def _dispatch(self, now: float) -> None:
        blocked: set[int] = set()
        keep: deque[Job] = deque()
        budget = 16  # jobs per round, so completions are reaped in between
        self._more = False
        while self._queue:
            job = self._queue.popleft()
            lease = job.lease
            if lease.failed or lease.cleared:
                continue
            peer = lease.peers[job.dst_rank]
            if not peer.alive:
                self._on_fail(lease, f"decode {peer.key[0]} dcp {peer.key[1]} is gone")
                continue
            region = self._free_region(peer, job.dst_rank)
            if budget <= 0:
                self._more = True
            if (
                budget <= 0
                or job.dst_rank in blocked
                or region == -2
                or (region == -1 and len(self._xfers) >= self.max_inflight)
            ):
                blocked.add(job.dst_rank)  # keep each rank's jobs in order
                keep.append(job)
                continue
            budget -= 1
            self._start(job, peer, region, now)
        keep.extend(self._queue)
        self._queue = keep

    def _start(self, job: Job, peer: Peer, region: int, now: float) -> None:
        lease = job.lease
        if region >= 0:  # relayout: plan and pack on the pack thread, post when ready
            self._busy_region[region] = True
            lease.inflight += 1
            if self._pool is None:
                self._pool = ThreadPoolExecutor(1, thread_name_prefix="pdplug-pack")
            fut = self._pool.submit(self._prepare, job, peer, region)
            waker = self._waker
            fut.add_done_callback(lambda _f: waker())
            self._packing.append(_Packing(job=job, peer=peer, region=region, fut=fut))
            return
        t0 = time.perf_counter()
        try:
            plan = self.planner.plan(job.chunk, self.layout, peer.info.layout, job.dst_rank, None)
        except Exception as e:
            self._on_fail(lease, f"plan of chunk {job.chunk.chunk_id} for dcp {job.dst_rank}: {e}")
            return
        self.timings["plan_s"] += time.perf_counter() - t0
        tag = self._tag(job, plan)
        if plan.num_runs == 0:
            self._notify_only(job, peer, tag)
            return
        lease.inflight += 1
        self._post(job, peer, -1, plan, tag, now)

    def _tag(self, job: Job, plan: TransferPlan) -> ChunkTag:
        return ChunkTag(
            generation=job.lease.dests[job.dst_rank].generation,
            room=job.lease.room,
            chunk_id=plan.chunk_id,
            is_last=plan.is_last,
            src_rank=self.rank,
        )

    def _notify_only(self, job: Job, peer: Peer, tag: ChunkTag) -> None:
        self.counts["notify_only"] += 1
        if self.engine.notifications:
            try:
                self.engine.notify(peer.handle, self._tags.encode(tag))
            except Exception as e:
                self._on_fail(job.lease, f"notification of chunk {tag.chunk_id} failed: {e}")
                return
        else:
            self._on_written(peer, tag)
        self._on_done(job)

    def _prepare(self, job: Job, peer: Peer, region: int) -> tuple[TransferPlan, float, float]:
        """Pack thread: plan into the region and gather the rows; returns (plan, plan seconds,
        pack seconds). Planners are pure, so planning here is safe and keeps it off the
        thread that posts."""
        t0 = time.perf_counter()
        plan = self.planner.plan(
            job.chunk, self.layout, peer.info.layout, job.dst_rank, self.regions[region]
        )
        t1 = time.perf_counter()
        if plan.packed and plan.num_runs:
            assert self.packer is not None and self._pack is not None
            self.packer.pack(plan, self._entries, self._pack)
            if self._pack.is_cuda:
                import torch

                torch.cuda.current_stream(self._pack.device).synchronize()
        return plan, t1 - t0, time.perf_counter() - t1

    def _post_packed(self, now: float) -> None:
        while self._packing and self._packing[0].fut.done():
            p = self._packing.popleft()
            lease = p.job.lease
            try:
                plan, plan_s, pack_s = p.fut.result()
            except Exception as e:
                self._free(p.region)
                lease.inflight -= 1
                self._on_fail(
                    lease,
                    f"plan/pack of chunk {p.job.chunk.chunk_id} for dcp {p.job.dst_rank}: {e}",
                )
                self._drain_check(lease)
                continue
            self.timings["plan_s"] += plan_s
            self.timings["pack_s"] += pack_s
            if lease.failed or lease.cleared or not p.peer.alive or plan.num_runs == 0:
                self._free(p.region)
                lease.inflight -= 1
                if plan.num_runs == 0 and not (lease.failed or lease.cleared):
                    self._notify_only(p.job, p.peer, self._tag(p.job, plan))
                self._drain_check(lease)
                continue
            self._post(p.job, p.peer, p.region, plan, self._tag(p.job, plan), now)

    def _post(
        self, job: Job, peer: Peer, region: int, plan: TransferPlan, tag: ChunkTag, now: float
    ) -> None:
        lease = job.lease
        t0 = time.perf_counter()
        try:
            src, dst, ln = run_addresses(
                plan, self._src_base, peer.dst_base, peer.emap, self._pack_base
            )
            wire_tag = self._tags.encode(tag) if self.engine.notifications else b""
            handle = self.engine.post(peer.handle, src, dst, ln, wire_tag)
        except Exception as e:
            self._free(region)
            lease.inflight -= 1
            self.counts["post_failed"] += 1
            self._on_fail(
                lease,
                f"post of chunk {plan.chunk_id} to dcp {job.dst_rank} failed: "
                f"{type(e).__name__}: {e}",
            )
            self._drain_check(lease)
            return
        self.timings["post_s"] += time.perf_counter() - t0
        self._xfers.append(
            _Xfer(job=job, handle=handle, region=region, t_post=now, nbytes=plan.nbytes, tag=tag)
        )
        self.counts["posts"] += 1
        self.counts["runs"] += plan.num_runs

    def _drain_check(self, lease: Lease) -> None:
        if lease.failed and lease.inflight == 0:
            self._on_drained(lease)

    # ------------------------------------------------------------------ completion
    def _reap(self, now: float) -> None:
        keep: list[_Xfer] = []
        limit = self.timeout_s
        for x in self._xfers:
            if x.cancelled:
                continue
            try:
                st = self.engine.check(x.handle)
            except Exception as e:
                st = "ERR"
                log.debug("check raised %s", e)
            lease = x.job.lease
            if st == XFER_PENDING:
                age = now - x.t_post
                if not x.abandoned and age > limit:
                    x.abandoned = True
                    self._on_fail(
                        lease,
                        f"write of chunk {x.tag.chunk_id} to dcp {x.job.dst_rank} not done "
                        f"after {limit:g} s (KVConfig.transfer_timeout_s)",
                    )
                if age <= 2 * limit:
                    keep.append(x)
                    continue
                self.counts["abandoned"] += 1
            self._free(x.region)
            lease.inflight -= 1
            if st == XFER_DONE and not lease.failed:
                self.timings["write_s"] += now - x.t_post
                self.counts["bytes"] += x.nbytes
                if not self.engine.notifications:
                    self._on_written(lease.peers[x.job.dst_rank], x.tag)
                self._on_done(x.job)
            elif st not in (XFER_DONE, XFER_PENDING):
                self.counts["post_failed"] += 1
                self._on_fail(
                    lease,
                    f"write of chunk {x.tag.chunk_id} to dcp {x.job.dst_rank} failed "
                    f"(engine state {st})",
                )
            self._drain_check(lease)
            try:  # after the room's outcome is published: releasing is not on its path
                self.engine.release(x.handle)
            except Exception:
                pass
        self._xfers = keep
