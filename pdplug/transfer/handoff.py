"""The host side of a send: checking it, handing a step's sends over, reaping completions.

On a host whose own loop runs Python between polls (every serving engine's scheduler), a thread
hand-off costs more than a small write: a thread that must wake another one (or wait for the
GIL) adds tens of microseconds to milliseconds per send (vLLM RFC #50913: hand-off
orchestration, not the wire, set the TTFT of a step). So a send is checked on the host's
thread (:meth:`Handoff.accept`; one send with an int64 page array and no ready marker in one
pass, :meth:`Handoff.send`), and the step's sends are planned and posted on that same
thread when the engine is free (:meth:`Handoff.post`: a segment whose destinations all have a
bound direct template straight to the engine, :meth:`SendLeases.send_direct
<pdplug.transfer.leases.SendLeases.send_direct>`; holding the engine lock of
:class:`~pdplug.transfer.loop.EngineLoop`; socket work is deferred to the loop thread); and a
host that polls or waits reaps its finished writes itself (:meth:`Handoff.poll`,
:meth:`Handoff.wait`), so ``Success`` needs no hand-off either. While a host reaps, the loop
thread only checks back every :data:`WATCH_S` instead of polling beside it; for a host that
neither polls nor waits it is the backstop.
"""

from __future__ import annotations

import os
import time
from collections import Counter
from collections.abc import Sequence
from typing import Any

import numpy as np

from pdplug.rooms import Rooms, reached
from pdplug.transfer.gather import check_ready
from pdplug.transfer.leases import SendLeases
from pdplug.transfer.loop import EngineLoop
from pdplug.transfer.pageids import page_ids
from pdplug.transfer.pipeline import SendPipeline
from pdplug.types import KVPoll, Segment

__all__ = ["Handoff", "Job", "REAP_S", "WATCH_S", "malformed"]

_NO_PAGES = np.zeros(0, dtype=np.int64)
_INT64 = np.dtype(np.int64)
_UMAX = np.maximum.reduce
#: page lists up to this long are range-checked by the builtins over a Python list: a ufunc
#: reduction run cold (after the host's forward or a CPU copy) costs more (issue 24)
_SHORT_IDS = 1024

#: a step's job: (room, generation, segment, source page ids, ready marker)
Job = tuple[int, int, Segment, np.ndarray, Any]
#: seconds between two reaps a polling host runs itself (a host polling many rooms reaps once)
REAP_S = 20e-6
#: a host that reaped within this many seconds watches its writes: the loop thread only checks
#: back this often instead of polling beside it
WATCH_S = 1e-3


def malformed(seg: Segment) -> str:
    """Why ``seg``'s fields disagree (``""`` when they do not): ``num_tokens`` must equal
    ``token_end - token_start`` (the tokens written are counted by it: a segment that says 10 of
    35 would land 10 and complete the room), ``token_start`` and ``chunk_id`` must be >= 0, and
    only the last segment may hold no token (its metadata-only end; :class:`~pdplug.Segment`)."""
    n = seg.num_tokens
    if n != seg.token_end - seg.token_start:
        return (
            f"segment num_tokens={n} but token_end - token_start = {seg.token_end} - "
            f"{seg.token_start} = {seg.token_end - seg.token_start}"
        )
    if seg.token_start < 0 or n < 0:
        return f"segment tokens [{seg.token_start}, {seg.token_end}) must not be negative"
    if seg.chunk_id < 0:
        return f"segment chunk_id={seg.chunk_id} must be >= 0"
    if n == 0 and not seg.is_last:
        return f"segment chunk_id={seg.chunk_id} holds no token but is not the last one"
    return ""


class Handoff:
    """One sender's host-side send path (host threads; see the module docstring).

    :param rooms: the session's room table; ``loop``: its engine loop.
    :param table: its rooms on the engine side; ``pipe``: its send pipeline.
    :param counts: the session's counters (``send_after_failure``).
    """

    def __init__(
        self,
        *,
        rooms: Rooms,
        loop: EngineLoop,
        table: SendLeases,
        pipe: SendPipeline,
        counts: Counter[str],
    ) -> None:
        self._rooms = rooms
        self._loop = loop
        self._table = table
        self._pipe = pipe
        #: registered pages (source ids are checked against it; set at ``register_kv``)
        self.num_pages = 0
        self._counts = counts
        self.reaped_at = 0.0  # when a host last reaped (monotonic seconds)

    def watched(self) -> bool:
        """Whether a host reaped within :data:`WATCH_S` (the loop thread need not poll)."""
        return time.monotonic() - self.reaped_at < WATCH_S

    def accept(self, room: int, segment: Segment, src_pages: Any, ready: Any = None) -> Job | None:
        """Check one send and count it pending (``KVSender.send``'s errors); ``None`` when it
        is ignored (the room failed)."""
        if ready is not None:
            check_ready(ready)
        try:
            bad = malformed(segment)
            if bad:
                raise ValueError(f"KVSender.send: {bad} (room {room})")
            pages = page_ids(src_pages, "src_pages", self.num_pages, "KVSender.send", room)
        except ValueError:
            if self._rooms.status(room) != KVPoll.Failed:  # a failed room ignores the send
                raise
            pages = _NO_PAGES
        gen, status = self._rooms.begin_send(room, segment.is_last)
        if gen is None:
            self._not_sendable(room, status)
            return None
        return room, gen, segment, pages, ready

    def _not_sendable(self, room: int, status: KVPoll) -> None:
        """A send ``begin_send`` did not count: ignored for a failed room, else refused."""
        if status == KVPoll.Failed:
            self._counts["send_after_failure"] += 1
            return
        raise ValueError(
            f"KVSender.send: room {room} is {status.name}; send only once it is "
            "WaitingForInput (every decode DestInfo arrived)"
        )

    def send(self, room: int, segment: Segment, src_pages: Any, ready: Any = None) -> None:
        """``KVSender.send`` of one segment: :meth:`accept` and :meth:`post` in one pass for
        the usual send (an int64 ``[n]`` page array whose ids are in range, no ready marker),
        posted on this thread when the engine is free (:meth:`EngineLoop.try_hold
        <pdplug.transfer.loop.EngineLoop.try_hold>`). A send's fixed cost is paid in frames
        and first uses after the host's forward (issue 24), so this lane runs the checks
        inline; anything else takes :meth:`accept` + :meth:`post`, which name the problem."""
        pages = None
        v = src_pages
        if (
            ready is None
            and type(v) is np.ndarray
            and v.ndim == 1
            and v.dtype == _INT64
            and not malformed(segment)
        ):
            pages = v.copy()  # checked after the copy: the caller may reuse its array
            n = pages.shape[0]
            if n > _SHORT_IDS:
                if int(_UMAX(pages.view(np.uint64))) >= self.num_pages:
                    pages = None
            elif n:
                ids = pages.tolist()
                if min(ids) < 0 or max(ids) >= self.num_pages:
                    pages = None
        if pages is None:
            job = self.accept(room, segment, src_pages, ready)
            if job is not None:
                self.post((job,))
            return
        gen, status = self._rooms.begin_send(room, segment.is_last)
        if gen is None:
            self._not_sendable(room, status)
            return
        loop = self._loop
        if not loop.try_hold():
            self.post(((room, gen, segment, pages, None),))
            return
        pipe = self._pipe
        try:
            now = time.monotonic()
            table = self._table
            if not table.send_direct(room, gen, segment, pages, now):
                table.enqueue(room, gen, segment, pages, now, None)
            if pipe.has_work():
                pipe.step(now)
        except Exception as e:
            loop.failed(e)
        finally:
            loop.lock.release()
        if pipe.has_queued():
            loop.kick()

    def accept_all(self, sends: Sequence[tuple[Any, ...]]) -> None:
        """:meth:`accept` every ``(room, segment, src_pages[, ready])`` and :meth:`post` them in
        one hand-off (the ones before a bad item too, then its error is raised)."""
        jobs: list[Job] = []
        try:
            for item in sends:
                job = self.accept(*item)
                if job is not None:
                    jobs.append(job)
        finally:
            if jobs:
                self.post(jobs)

    def post(self, jobs: Sequence[Job]) -> None:
        """Enqueue a step's jobs and run a pipeline round: on this thread when the engine is
        free or frees within 0.5 ms, else as one closure on the engine thread."""
        now = time.monotonic()

        def run() -> None:
            table = self._table
            for room, gen, seg, pages, ready in jobs:
                # a segment whose KV is complete goes straight out when every destination has
                # a direct template and nothing queued before it; any other goes through a round
                if ready is not None or not table.send_direct(room, gen, seg, pages, now):
                    table.enqueue(room, gen, seg, pages, now, ready)
            if self._pipe.has_work():
                self._pipe.step(now)

        # writes in flight are reaped by whoever polls or waits first, the loop thread at its
        # next round at the latest; work still queued (regions busy, budget spent) needs it now
        if self._loop.run_here_or_submit(run) and self._pipe.has_queued():
            self._loop.kick()

    def poll(self, room: int) -> KVPoll:
        """The room's status, reaping the session's finished writes first when it is
        ``Transferring`` and the engine is free (at most every :data:`REAP_S`), then yielding
        the GIL once (``os.sched_yield``) if it still is (the engine's own threads may wait
        for it).

        :raises KeyError: ``room`` is not leased.
        """
        st = self._rooms.status(room)
        if st is not KVPoll.Transferring:
            return st
        now = time.monotonic()
        if (
            self._pipe.has_work()
            and now - self.reaped_at >= REAP_S
            and self._loop.try_run(self._reap)
        ):
            st = self._rooms.status(room)
        if st is KVPoll.Transferring:
            # hand the GIL to a thread waiting for it (an engine's worker, the loop thread);
            # time.sleep(0) would also do it, but it is a timed sleep that takes tens of
            # microseconds on virtual machines even when no thread waits
            os.sched_yield()
        return st

    def wait(self, room: int, until: tuple[KVPoll, ...], timeout_s: float | None) -> KVPoll:
        """Block until ``room`` reaches ``until`` (``KVSender.wait``), reaping writes while any
        is in flight (pauses of 20 us growing to 1 ms), else sleeping on the room table."""
        t_end = None if timeout_s is None else time.monotonic() + timeout_s
        pause = 20e-6
        while True:
            busy = self._pipe.has_work()
            if busy and self._loop.try_run(self._reap):
                busy = self._pipe.has_work()
            slice_s = pause if busy else 0.05
            left = None if t_end is None else t_end - time.monotonic()
            st = self._rooms.wait(room, until, slice_s if left is None else min(left, slice_s))
            if reached(st, until) or (left is not None and left <= slice_s):
                return st
            pause = min(2 * pause, 1e-3)

    def _reap(self) -> None:
        now = time.monotonic()
        self.reaped_at = now
        self._pipe.step(now)
