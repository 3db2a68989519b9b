"""The pack thread's work, its ordering and its busy clock.

It waits for the host's KV, packs a whole segment in one call and marks when the pack finished
on the device; the busy clock measures packing against writing.

Ordering of one segment on a prefill rank (what :meth:`pdplug.protocols.KVSender.send`
promises):

1. The host passes ``ready`` with ``send``: anything with ``query() -> bool`` (a
   ``torch.cuda.Event`` recorded after the forward wrote the segment's KV, a ``torch.cuda.Stream``
   whose queued work writes it, as SGLang passes its indices event and vLLM writes KV
   asynchronously). The sender's engine thread polls it (never blocks on it); no plan, pack or
   write of the segment starts before ``query()`` is true. A ``ready`` still false after
   ``KVConfig.transfer_timeout_s`` fails the room (it held no pack region yet).
2. The pack thread plans every destination's job of the segment that needs relayout and packs
   them with :func:`pdplug.packing.pack_segment` (``pack_all``: one launch table, one upload,
   one kernel launch on CUDA), then records a *pack-done* marker
   (:func:`pack_done_marker`: a CUDA event on the pack stream; ``None`` on CPU, where the pack
   is synchronous).
3. The engine thread posts a segment's writes only once the marker's ``query()`` is true.
"""

from __future__ import annotations

import time
from collections import Counter, deque
from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from typing import TYPE_CHECKING, Any

import msgspec

from pdplug.packing import pack_segment, plan_segment
from pdplug.types import KVLayout, PackRegion, TransferPlan

if TYPE_CHECKING:
    import torch

    from pdplug.protocols import Packer, PackPlanner
    from pdplug.transfer.records import Job, Lease, Peer

__all__ = [
    "Ready",
    "Prepared",
    "check_ready",
    "is_ready",
    "pack_done_marker",
    "ReadyGate",
    "prepare_segment",
    "BusyClock",
    "Packing",
    "PackQueue",
]


def check_ready(ready: Any) -> None:
    """Validate what the host passed as ``send(..., ready=)``.

    :raises TypeError: ``ready`` is neither None nor has a callable ``query()``.
    """
    if ready is not None and not callable(getattr(ready, "query", None)):
        raise TypeError(
            f"KVSender.send: ready must have query() (a torch.cuda.Event or Stream), got "
            f"{type(ready).__name__}"
        )


def is_ready(marker: Any) -> bool:
    """Whether the work ``marker`` stands for is complete (``None``: nothing to wait for).

    :raises Exception: whatever ``marker.query()`` raises (a CUDA error fails the room).
    """
    return marker is None or bool(marker.query())


class Ready(msgspec.Struct, kw_only=True):
    """The host's completion marker of one segment's KV, shared by the segment's jobs.

    :ivar marker: the object passed with ``send`` (``query() -> bool``).
    :ivar since: when the segment was submitted (``time.monotonic`` seconds).
    :ivar done: ``query()`` returned true once (not asked again).
    """

    marker: Any
    since: float
    done: bool = False


class ReadyGate:
    """Segments whose host ``ready`` marker has not completed, parked outside the per-peer
    queues so they hold up no other room (engine thread only).

    A room's segments leave in ``send`` order: a segment sent after one still parked waits
    behind it, even with ``ready=None``. A marker still false ``timeout_s`` after its send, or
    whose ``query()`` raises, fails its room.
    """

    def __init__(self) -> None:
        self.parked: deque[tuple[Ready, list[Job]]] = deque()

    def __len__(self) -> int:
        """Jobs parked."""
        return sum(len(jobs) for _, jobs in self.parked)

    def __bool__(self) -> bool:
        return bool(self.parked)

    def admit(self, jobs: list[Job], ready: Any, now: float) -> list[Job]:
        """The jobs of one segment: returned to queue now, or parked (returns ``[]``)."""
        if not jobs:
            return jobs
        lease = jobs[0].lease
        if ready is None and not any(js[0].lease is lease for _, js in self.parked):
            return jobs
        self.parked.append((Ready(marker=ready, since=now), jobs))
        return []

    def release(self, now: float, timeout_s: float) -> tuple[list[Job], list[tuple[Lease, str]]]:
        """Jobs whose marker completed (to queue), and ``(lease, reason)`` of rooms to fail."""
        out: list[Job] = []
        failed: list[tuple[Lease, str]] = []
        blocked: set[int] = set()
        keep: deque[tuple[Ready, list[Job]]] = deque()
        for r, jobs in self.parked:
            lease = jobs[0].lease
            why = (
                "" if id(lease) in blocked else _unready(r, jobs[0].chunk.chunk_id, now, timeout_s)
            )
            if why is None:
                out.extend(jobs)
            elif why:
                failed.append((lease, why))
            else:
                keep.append((r, jobs))
                blocked.add(id(lease))
        self.parked = keep
        return out, failed

    def drop(self, lease: Lease) -> None:
        """Forget the parked segments of ``lease`` (it failed or was cleared)."""
        self.parked = deque(e for e in self.parked if e[1][0].lease is not lease)


def _unready(r: Ready, chunk_id: int, now: float, timeout_s: float) -> str | None:
    """None when the host's marker ``r`` of segment ``chunk_id`` completed, ``""`` while it
    may still complete, else why the room fails (``query()`` raised, or it is still false
    ``timeout_s`` seconds after the send)."""
    if r.done or r.marker is None:
        return None
    seg = f"KV of segment {chunk_id}"
    try:
        r.done = is_ready(r.marker)
    except Exception as e:
        return f"{seg}: the ready marker passed with send failed: {type(e).__name__}: {e}"
    if r.done:
        return None
    if now - r.since <= timeout_s:
        return ""
    return (
        f"{seg} not ready after {timeout_s:g} s: the ready marker passed with send never "
        "completed (KVConfig.transfer_timeout_s)"
    )


def pack_done_marker(pack_buffer: torch.Tensor | None) -> Any | None:
    """A marker of the pack work just enqueued: a ``torch.cuda.Event`` recorded on the pack
    buffer's current stream, or ``None`` for a CPU buffer (the CPU packers return once the
    bytes are in place)."""
    if pack_buffer is None or not pack_buffer.is_cuda:
        return None
    import torch

    ev = torch.cuda.Event()
    ev.record(torch.cuda.current_stream(pack_buffer.device))
    return ev


class Prepared(msgspec.Struct, kw_only=True):
    """What the pack thread returns for one segment's relayout jobs.

    :ivar plans: one plan per job, in the order given.
    :ivar plan_s/pack_s: seconds planning and packing (host time; on CUDA the launch).
    :ivar t0/t1: ``time.perf_counter`` when the work started and ended.
    :ivar marker: pack-done marker (:func:`pack_done_marker`), ``None`` when nothing was packed.
    :ivar launches: packer calls made (1 when anything was packed, else 0).
    """

    plans: list[TransferPlan]
    plan_s: float
    pack_s: float
    t0: float
    t1: float
    marker: Any = None
    launches: int = 0


def prepare_segment(
    planner: PackPlanner,
    layout: KVLayout,
    items: Sequence[tuple[Job, Peer, PackRegion]],
    packer: Packer | None,
    entries: Sequence[Any],
    pack_buffer: torch.Tensor | None,
    mark: Callable[[Any], Any] = pack_done_marker,
) -> Prepared:
    """Pack thread: plan each ``(job, peer, region)`` of one segment into its region, then pack
    every packed plan with one :func:`pdplug.packing.pack_segment` call.

    :param items: the segment's relayout jobs with the peer and the pack region each took.
    :param mark: makes the pack-done marker from the pack buffer (tests pass a fake event).
    :raises pdplug.PlanError: a plan failed; :raises ValueError: as ``Packer.pack``.
    """
    t0 = time.perf_counter()
    plans = plan_segment(
        planner,
        layout,
        [(job.chunk, peer.info.layout, job.dst_rank, region) for job, peer, region in items],
    )
    t1 = time.perf_counter()
    todo = [p for p in plans if p.packed and p.num_runs]
    marker = None
    if todo:
        assert packer is not None and pack_buffer is not None
        pack_segment(packer, todo, entries, pack_buffer)
        marker = mark(pack_buffer)
    t2 = time.perf_counter()
    return Prepared(
        plans=plans,
        plan_s=t1 - t0,
        pack_s=t2 - t1,
        t0=t0,
        t1=t2,
        marker=marker,
        launches=1 if todo else 0,
    )


class BusyClock:
    """Busy time of the pack thread and of writing, and how much of them overlapped.

    Writing is busy from a post until no write is in flight (``time.perf_counter`` seconds);
    a pack is busy while the pack thread plans and packs a segment. ``overlap_s`` is the pack
    time during which a write was in flight: with double buffering, the gather of segment
    ``k + 1`` runs while segment ``k`` is written, and ``overlap_s`` approaches ``pack_s``.
    Engine thread only. ``keep``: closed busy spans remembered for the overlap (each write that
    ends inside its post adds one; a pack reads back only as far as its own start).
    """

    def __init__(self, keep: int = 4096) -> None:
        self.pack_s = 0.0
        self.write_s = 0.0
        self.overlap_s = 0.0
        self._open: float | None = None
        self._closed: deque[tuple[float, float]] = deque(maxlen=keep)

    def write_started(self, t: float) -> None:
        """A write is being posted at ``t`` (opens a busy period if none is open)."""
        if self._open is None:
            self._open = t

    def wrote(self, t0: float, t1: float) -> None:
        """A write started and ended inside one post call ``[t0, t1]`` (an engine that copies
        in its post): busy over that span unless a busy period is open already (issue 24: one
        call after the post instead of one before it and one after the segment)."""
        if self._open is None:
            self._closed.append((t0, t1))
            self.write_s += t1 - t0

    def writes_idle(self, t: float) -> None:
        """No write is in flight any more at ``t``."""
        if self._open is not None:
            self._closed.append((self._open, t))
            self.write_s += t - self._open
            self._open = None

    def pack_ran(self, a: float, b: float) -> None:
        """The pack thread was busy over ``[a, b]`` (reported after ``b``)."""
        self.pack_s += b - a
        ov = 0.0
        for s, e in reversed(self._closed):  # spans close in time order: newest first
            if e <= a:
                break
            ov += max(0.0, min(b, e) - max(a, s))
        if self._open is not None:
            ov += max(0.0, b - max(a, self._open))
        self.overlap_s += ov

    def totals(self, now: float | None = None) -> dict[str, float]:
        """``pack_busy_s``, ``write_busy_s`` (the open period counted up to ``now``) and
        ``overlap_s``, in seconds."""
        w = self.write_s
        if self._open is not None:
            w += (time.perf_counter() if now is None else now) - self._open
        return {"pack_busy_s": self.pack_s, "write_busy_s": w, "overlap_s": self.overlap_s}


class Packing(msgspec.Struct, kw_only=True):
    """One relayout job on the pack thread: its peer, pack region, the future of its
    segment's :class:`Prepared` and the index of its plan there."""

    job: Job
    peer: Peer
    region: int
    fut: Future[Prepared]
    index: int


class PackQueue:
    """The jobs being planned and packed, one pack-thread call per segment (engine thread).

    A round :meth:`add` s the relayout jobs it starts; :meth:`flush` hands each segment's jobs
    to the pack thread as one :func:`prepare_segment`; :meth:`take` returns the jobs whose
    segment is packed on the device (pack-done marker complete), in order.

    :param waker: thread-safe "run a round now" (called when a pack-thread call ends).
    """

    def __init__(self, waker: Callable[[], None]) -> None:
        self._waker = waker
        self._pool: ThreadPoolExecutor | None = None
        self._batch: dict[tuple[int, int], list[tuple[Job, Peer, int]]] = {}
        self.items: deque[Packing] = deque()
        #: makes the pack-done marker (:func:`pack_done_marker`; tests pass a fake event)
        self.mark: Callable[[Any], Any] = pack_done_marker
        self.clock = BusyClock()

    def __len__(self) -> int:
        return len(self.items)

    def __bool__(self) -> bool:
        return bool(self.items)

    def leases(self) -> set[int]:
        """``id`` of every lease with a job here."""
        return {id(p.job.lease) for p in self.items}

    def add(self, job: Job, peer: Peer, region: int) -> None:
        """A relayout job took ``region``; it is packed with its segment at :meth:`flush`."""
        seg = (id(job.lease), int(job.chunk.chunk_id))
        self._batch.setdefault(seg, []).append((job, peer, region))

    def flush(
        self,
        planner: PackPlanner,
        layout: KVLayout,
        regions: Sequence[PackRegion],
        packer: Packer | None,
        entries: Sequence[Any],
        pack_buffer: torch.Tensor | None,
    ) -> None:
        """Submit each segment added since the last flush to the pack thread (one call)."""
        for items in self._batch.values():
            if self._pool is None:
                self._pool = ThreadPoolExecutor(1, thread_name_prefix="pdplug-pack")
            work = [(j, p, regions[r]) for j, p, r in items]
            fut = self._pool.submit(
                prepare_segment, planner, layout, work, packer, entries, pack_buffer, self.mark
            )
            fut.add_done_callback(self._woken)
            for i, (job, peer, region) in enumerate(items):
                self.items.append(Packing(job=job, peer=peer, region=region, fut=fut, index=i))
        self._batch.clear()

    def _woken(self, _fut: Future[Prepared]) -> None:
        self._waker()

    def take(
        self, timings: dict[str, float], counts: Counter[str]
    ) -> tuple[list[tuple[Packing, TransferPlan]], list[tuple[Packing, str]], bool]:
        """Jobs ready to post with their plan, jobs whose plan or pack failed with the reason,
        and whether a finished pack call waits for its device marker (poll again). A job of a
        failed or cleared room is returned as ready once its pack call ended (its region may
        be reused: later packs are ordered after it on the same stream).

        :param timings: ``plan_s``/``pack_s`` are added to (once per segment).
        :param counts: ``pack_launches`` is added to.
        """
        done: list[tuple[Packing, TransferPlan]] = []
        failed: list[tuple[Packing, str]] = []
        waiting = False
        keep: deque[Packing] = deque()
        for p in self.items:
            job, lease = p.job, p.job.lease
            if not p.fut.done():
                keep.append(p)
                continue
            try:
                res = p.fut.result()
                packed = is_ready(res.marker)
            except Exception as e:
                failed.append(
                    (p, f"plan/pack of chunk {job.chunk.chunk_id} for dcp {job.dst_rank}: {e}")
                )
                continue
            if not packed and not (lease.failed or lease.cleared):
                keep.append(p)  # the device has not finished the pack: no write reads it yet
                waiting = True
                continue
            if p.index == 0:  # a segment's times count once
                timings["plan_s"] += res.plan_s
                timings["pack_s"] += res.pack_s
                counts["pack_launches"] += res.launches
                self.clock.pack_ran(res.t0, res.t1)
            done.append((p, res.plans[p.index]))
        self.items = keep
        return done, failed, waiting

    def close(self) -> None:
        """Stop the pack thread (waits for the call in progress)."""
        if self._pool is not None:
            self._pool.shutdown(wait=True, cancel_futures=True)
