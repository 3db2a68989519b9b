"""A planned job becomes an engine write, and its end (done, failed, stuck) reaches the room.

Used by :class:`~pdplug.transfer.pipeline.SendPipeline` (which decides *when* a job is
planned and posted) on whichever thread holds the session's engine lock. A plan's runs are
turned into absolute descriptors with per-entry source tables made once per packed entry set
(:func:`pdplug.packing.plan_addresses`) and posted with the chunk's
:class:`~pdplug.types.ChunkTag`; a plan with no run is a notification-only chunk (SGLang
#32837). Every posted write is tracked by :class:`~pdplug.transfer.writes.InFlight` until the
engine says it ended (a write the engine reports ended inside its post call, its optional
``done_at_post``, ends at once without being tracked): ``DONE`` completes the job
(``on_done``; over the control channel for engines without notifications, ``on_written``),
``ERR`` or an exception at post fails the room, a *stuck* write fails its room but keeps its
region and handle until the engine answers. Nothing is ever abandoned while the engine may
still move its bytes.
"""

from __future__ import annotations

import logging
import time
from collections import Counter
from collections.abc import Callable
from typing import Any

import numpy as np

from pdplug.packing import DirectRuns, plan_addresses, source_table
from pdplug.packing.direct import Span
from pdplug.transfer.engine import XFER_DONE, TransferEngine, engine_wakes
from pdplug.transfer.gather import BusyClock
from pdplug.transfer.records import Job, Lease, Peer, describe
from pdplug.transfer.writes import InFlight, Write
from pdplug.types import ChunkTag, KVLayout, SendChunk, TransferPlan
from pdplug.wire import Codec

__all__ = ["WritePoster"]

log = logging.getLogger(__name__)

_SUM = np.add.reduce  # ndarray.sum's Python wrapper costs more than a short array's sum
#: runs summed as a Python list up to this many: a ufunc reduction's set-up (about 1.3 us)
#: costs more than ``sum(tolist())`` of a short array
_SHORT = 32


class WritePoster:
    """Posts and reaps one sender's writes (engine-lock holder only).

    :param engine: the backend adapter (:attr:`engine` may replace it before the first send).
    :param rank: the source rank id carried in tags; ``tags``: the notification codec.
    :param timeout_s: ``KVConfig.transfer_timeout_s``: when a pending write is stuck.
    :param clock: the sender's busy clock (write spans).
    :param counts/timings: the pipeline's counters and seconds, shared.
    :param on_done: ``(job)`` when a job's write completed (or it was notification-only).
    :param on_fail: ``(lease, reason)`` on a failed post, write or notification, or a stuck
        write.
    :param on_written: ``(job, tag)`` after a completed write, for engines without
        notifications (the session sends the tag over the control channel).
    :param settle: ``(job, peer, region)`` once a job's write ended (its region and
        counters go back).
    :param waker: thread-safe "run a round now", given to engines that complete writes on
        their own threads.
    """

    def __init__(
        self,
        *,
        engine: TransferEngine,
        rank: int,
        tags: Codec[Any],
        timeout_s: float,
        clock: BusyClock,
        counts: Counter[str],
        timings: dict[str, float],
        on_done: Callable[[Job], None],
        on_fail: Callable[[Lease, str], None],
        on_written: Callable[[Job, ChunkTag], None],
        settle: Callable[[Job, Peer, int], None],
        waker: Callable[[], None],
    ) -> None:
        self._waker = waker
        self.engine = engine
        self.rank = rank
        self._tags = tags
        self.timeout_s = timeout_s
        self.clock = clock
        self.counts = counts
        self.timings = timings
        self._on_done = on_done
        self._on_fail = on_fail
        self._on_written = on_written
        self._settle = settle
        self.inflight = InFlight(timeout_s)
        self.progress_at = 0.0  # last write completion (or work arriving at an idle sender)
        self._src_base = np.zeros(0, dtype=np.int64)
        self._pack_base = 0
        self._src_tables: dict[tuple[int, ...], np.ndarray] = {}

    def outcomes(
        self, on_done: Callable[[Job], None], on_written: Callable[[Job, ChunkTag], None]
    ) -> None:
        """Replace ``on_done`` and ``on_written`` (a session passes its lease table's methods
        once the table exists, instead of the closures it had to start with: a frame less on
        every completion)."""
        self._on_done = on_done
        self._on_written = on_written

    @property
    def engine(self) -> TransferEngine:
        """The backend adapter."""
        return self._engine

    @engine.setter
    def engine(self, engine: TransferEngine) -> None:
        self._engine = engine
        self.wakes = engine_wakes(engine, self._waker)
        self._wakes_for = getattr(engine, "wakes", None)  # per write, when the engine says
        self._ended_at_post = getattr(engine, "done_at_post", None)

    def set_memory(self, src_base: np.ndarray, pack_base: int) -> None:
        """int64 base address of every registered source entry, and the pack buffer's."""
        self._src_base = src_base
        self._pack_base = pack_base
        self._src_tables.clear()

    @property
    def src_base(self) -> np.ndarray:
        """int64 base address of every registered source entry."""
        return self._src_base

    def tag(self, job: Job, plan: TransferPlan | None = None) -> ChunkTag:
        """The completion tag of ``job``'s chunk (the destination's lease generation; chunk id
        and last flag from ``plan``, else from the job's chunk)."""
        c: TransferPlan | SendChunk = job.chunk if plan is None else plan
        return ChunkTag(
            generation=job.lease.dests[job.key].generation,
            room=job.lease.room,
            chunk_id=c.chunk_id,
            is_last=c.is_last,
            src_rank=self.rank,
        )

    def notify_only(self, job: Job, peer: Peer, tag: ChunkTag) -> None:
        """A chunk with nothing to write for ``peer``: its tag alone."""
        self.counts["notify_only"] += 1
        if self._engine.notifications:
            try:
                self._engine.notify(peer.handle, self._tags.encode(tag))
            except Exception as e:
                self._on_fail(job.lease, f"notification of chunk {tag.chunk_id} failed: {e}")
                return
        else:
            self._on_written(job, tag)
        self._on_done(job)

    def bind_direct(self, peer: Peer, planner: Any, layout: KVLayout) -> DirectRuns | bool:
        """The planner's direct template for ``peer``'s pair bound to both sides' memory, with
        the engine's page lists when it prepares them (``TransferEngine.prepare_pages``);
        ``False`` when it has none (or the pair is packed): every send to it is planned."""
        fn = getattr(planner, "direct_pages", None)
        if fn is None or peer.relayout:
            return False
        try:
            template = fn(layout, peer.info.layout)
            if template is None:
                return False
            direct = DirectRuns(template, self._src_base, peer.dst_table)
        except Exception as e:  # plan() names the problem at the send itself
            log.debug("%s: no direct template (%s)", describe(peer.key), e)
            return False
        prepare = getattr(self._engine, "prepare_pages", None)
        if prepare is not None:  # descriptors of every page prepared once: sends post page ids
            try:
                direct.lists = prepare(peer.handle, direct.grid())
                direct.lists_of = self._engine
                # the engine's class declares it: a wrapper that forwards attributes to the
                # engine it wraps must not inherit the declaration for a post_pages of its own
                direct.id_lists = getattr(type(self._engine), "page_id_lists", False) is True
            except Exception as e:
                log.debug("%s: no prepared page lists (%s)", describe(peer.key), e)
        return direct

    def post_direct(self, job: Job, peer: Peer, direct: DirectRuns, span: Span, now: float) -> None:
        """Post one job's pages ``span`` from its peer's direct template: by page ids into the
        engine's prepared lists (``TransferEngine.post_pages``) when they hold these pages,
        else as addresses."""
        self.counts["direct_plans"] += 1
        lease, seg = job.lease, job.chunk
        tag = ChunkTag(
            generation=lease.dests[job.key].generation,
            room=lease.room,
            chunk_id=seg.chunk_id,
            is_last=seg.is_last,
            src_rank=self.rank,
        )
        sp, dp, tail = span
        # lists of the engine that prepared them only (an engine replaced since, e.g. wrapped
        # to inject faults, must see every write in its own post)
        if direct.lists is not None and direct.lists_of is self._engine:
            t = direct.template
            t0 = time.perf_counter()
            if not direct.id_lists:  # an engine that reads int64 arrays only
                sp, dp = np.asarray(sp, dtype=np.int64), np.asarray(dp, dtype=np.int64)
            try:
                wire_tag = self._tags.encode(tag) if self._engine.notifications else b""
                post = self._engine.post_pages  # type: ignore[attr-defined]
                handle = post(peer.handle, direct.lists, sp, dp, tail * t.row_bytes, wire_tag)
            except Exception as e:
                self._post_failed(job, peer, -1, tag.chunk_id, e)
                return
            if handle is not None:
                pages = len(sp)
                nbytes = len(t.entries) * ((pages - 1) * t.page_size + tail) * t.row_bytes
                self._posted(job, peer, -1, handle, nbytes, pages * len(t.entries), tag, now, t0)
                return
        src, dst, ln = direct.addresses(sp, dp, tail)
        self.post_runs(job, peer, -1, src, dst, ln, tag, now)

    def post(self, job: Job, peer: Peer, region: int, plan: TransferPlan, now: float) -> None:
        """Post ``plan``'s runs to ``peer`` (reading pack region ``region``, -1: none)."""
        try:
            key = plan.pack_entries if plan.packed else ()
            tab = self._src_tables.get(key)
            if tab is None:  # one per packed entry set (a handful per sender)
                tab = self._src_tables[key] = source_table(self._src_base, self._pack_base, key)
            src, dst, ln = plan_addresses(plan, tab, peer.dst_table)
        except Exception as e:
            self._post_failed(job, peer, region, plan.chunk_id, e)
            return
        self.post_runs(job, peer, region, src, dst, ln, self.tag(job, plan), now)

    def post_runs(
        self,
        job: Job,
        peer: Peer,
        region: int,
        src: np.ndarray,
        dst: np.ndarray,
        ln: np.ndarray,
        tag: ChunkTag,
        now: float,
    ) -> None:
        """Post int64 ``[R]`` absolute runs ``(src, dst, ln)`` of ``job`` to ``peer`` with
        completion ``tag`` (reading pack region ``region``, -1: none)."""
        t0 = time.perf_counter()
        try:
            wire_tag = self._tags.encode(tag) if self._engine.notifications else b""
            handle = self._engine.post(peer.handle, src, dst, ln, wire_tag)
        except Exception as e:
            self._post_failed(job, peer, region, tag.chunk_id, e)
            return
        nbytes = sum(ln.tolist()) if ln.shape[0] <= _SHORT else int(_SUM(ln))
        self._posted(job, peer, region, handle, nbytes, int(ln.shape[0]), tag, now, t0)

    def _posted(
        self, job: Job, peer: Peer, region: int, handle: Any, nbytes: int, runs: int,
        tag: ChunkTag, now: float, t0: float,
    ) -> None:  # fmt: skip
        t1 = time.perf_counter()
        self.timings["post_s"] += t1 - t0
        self.counts["posts"] += 1
        self.counts["runs"] += runs
        done = self._ended_at_post
        if done is not None and done(handle):
            # the engine copied inside its post call (UCX over TCP or shared memory): the job
            # ends here, with no in-flight record to add, poll and take out again, and no busy
            # period left open for the segment's end to close
            self.clock.wrote(t0, t1)
            self.progress_at = now
            if not job.lease.failed:
                self.counts["bytes"] += nbytes
                self._on_done(job)
                if not self._engine.notifications:
                    self._on_written(job, tag)
            self._settle(job, peer, region)
            try:  # _release inline: this is every small write's path
                self._engine.release(handle)
            except Exception:
                pass
            return
        self.clock.write_started(t0)  # busy while a tracked write is in flight
        wakes = self._wakes_for(handle) if self._wakes_for is not None else self.wakes
        self.inflight.add(job, peer, handle, region, nbytes, tag, now, not wakes)

    def _post_failed(self, job: Job, peer: Peer, region: int, chunk_id: int, e: Exception) -> None:
        self.counts["post_failed"] += 1
        self._settle(job, peer, region)
        self._on_fail(
            job.lease,
            f"post of chunk {chunk_id} to dcp {job.dst_rank} failed: {type(e).__name__}: {e}",
        )

    def _why(self, handle: Any) -> str:
        why = getattr(self._engine, "failure", None)
        return (why(handle) if callable(why) else None) or ""

    def reap(self, now: float) -> None:
        """Ask the engine about every write in flight now (finished, failed, stuck)."""
        done, stuck = self.inflight.poll(self._engine, now)
        for w in stuck:  # its region and handle stay reserved until the engine answers
            self.counts["writes_failing" if w.failing else "writes_stuck"] += 1
            self._on_fail(w.job.lease, w.held_reason(self.timeout_s, self._why(w.handle)))
        for w, st in done:
            self._finish(w, st, now)

    def _finish(self, x: Write, st: str, now: float) -> None:
        job, lease = x.job, x.job.lease
        self.progress_at = now
        if st == XFER_DONE:
            self.inflight.completed(x, now)
        if x.stuck:
            self.counts["writes_stuck_ended"] += 1
        ok = st == XFER_DONE and not lease.failed
        if ok:
            self.timings["write_s"] += now - x.t_post
            self.counts["bytes"] += x.nbytes
        elif st != XFER_DONE:
            self.counts["post_failed"] += 1
            reason = f"write of chunk {x.tag.chunk_id} to dcp {job.dst_rank} failed (engine {st})"
            detail = self._why(x.handle)
            reason = f"{reason}: {detail}" if detail else reason
            self._on_fail(lease, reason)
        # the room's outcome first, then free the region: a drained notice must follow the
        # last byte, and the completion must not wait for the release. The room's Success
        # before the tag goes to the control channel: that send (queued for the engine
        # thread, which owns the socket) wakes the engine thread, which would compete with a
        # host thread that is about to see the Success
        if ok:
            self._on_done(job)
            if not self._engine.notifications:
                self._on_written(job, x.tag)
        self._settle(job, x.peer, x.region)
        self._release(x.handle)

    def _release(self, handle: Any) -> None:
        try:
            self._engine.release(handle)
        except Exception:
            pass
