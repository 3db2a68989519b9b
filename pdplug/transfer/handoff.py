"""The host side of a send: checking it, handing a step's sends over, reaping completions.

On a host whose own loop runs Python between polls (every serving engine's scheduler), a thread
hand-off costs more than a small write: a thread that must wake another one (or wait for the
GIL) adds tens of microseconds to milliseconds per send (vLLM RFC #50913: hand-off
orchestration, not the wire, set the TTFT of a step). So a send is checked on the host's
thread (:meth:`Handoff.accept`), and the step's sends are planned and posted on that same
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
from collections.abc import Iterable, Sequence
from typing import Any

import numpy as np

from pdplug.packing.chunks import pages_spanned
from pdplug.packing.pages import PageIds
from pdplug.rooms import ROOM_LIMIT, Rooms, check_room_id, reached
from pdplug.transfer.gather import check_ready
from pdplug.transfer.leases import SendLeases
from pdplug.transfer.loop import EngineLoop
from pdplug.transfer.pageids import page_ids, short_page_ids
from pdplug.transfer.pipeline import SendPipeline
from pdplug.types import KVPoll, Segment

__all__ = ["Handoff", "Job", "REAP_S", "WATCH_S", "malformed"]

_NO_PAGES = np.zeros(0, dtype=np.int64)
_UNORDERED = (str, bytes, dict, set, frozenset)

#: a step's job: (room, generation, segment, source page ids, ready marker); up to 64 ids
#: travel as a list of Python ints as far as the direct lane's post (:data:`PageIds`)
Job = tuple[int, int, Segment, PageIds, Any]
#: seconds between two reaps a polling host runs itself (a host polling many rooms reaps once)
REAP_S = 20e-6
#: a host that reaped within this many seconds watches its writes: the loop thread only checks
#: back this often instead of polling beside it
WATCH_S = 1e-3


def malformed(seg: Segment) -> str:
    """Why ``seg``'s fields disagree (``""`` when they do not): ``num_tokens`` must equal
    ``token_end - token_start`` (the tokens written are counted by it: a segment that says 10 of
    35 would land 10 and complete the room), ``token_start`` and ``chunk_id`` must be >= 0, and
    only the last segment may hold no token (its metadata-only end; :class:`~pdplug.Segment`);
    the token fields and ``chunk_id`` must be Python ints and ``is_last`` a bool."""
    if not isinstance(seg, Segment):  # a dict or a tuple would fail on its first field
        return f"segment must be a pdplug Segment, got {type(seg).__qualname__}"
    if not (
        type(seg.token_start) is int
        and type(seg.token_end) is int
        and type(seg.num_tokens) is int
        and type(seg.chunk_id) is int
        and type(seg.is_last) is bool
    ):
        return _bad_type(seg)
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


def _bad_type(seg: Segment) -> str:
    # msgspec does not check a Struct's field types at construction: a chunk_id of False or
    # an is_last of 1 went out in the tag, and the decode never matched it
    for name in ("token_start", "token_end", "num_tokens", "chunk_id"):
        v = getattr(seg, name)
        if type(v) is not int:
            return f"segment {name} must be an int, got {type(v).__qualname__} {v!r}"
    return f"segment is_last must be a bool, got {type(seg.is_last).__qualname__} {seg.is_last!r}"


def _at_item(e: Exception, i: int) -> Exception:
    """``e`` naming ``send_many``'s item ``i`` (the rooms before it are sent): a KeyError,
    TypeError or ValueError (``KVSender.send``'s own) rebuilt with the item in its message;
    any other error (one a ``ready`` marker raised), or one whose type takes other arguments
    than a message, is ``e`` itself with a note naming the item where Python has notes."""
    if type(e) in (KeyError, TypeError, ValueError):
        msg = str(e.args[0]) if e.args else type(e).__name__
        msg = msg.removeprefix("KVSender.send: ")
        return type(e)(f"KVSender.send_many: item {i}: {msg}")
    note = getattr(e, "add_note", None)  # Python 3.11+
    if note is not None:
        note(f"KVSender.send_many: item {i}")
    return e


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
        #: tokens per source page (a segment's page count is checked; set at ``register_kv``)
        self.page_size = 0
        self._counts = counts
        self.reaped_at = 0.0  # when a host last reaped (monotonic seconds)

    def watched(self) -> bool:
        """Whether a host reaped within :data:`WATCH_S` (the loop thread need not poll)."""
        return time.monotonic() - self.reaped_at < WATCH_S

    def accept(self, room: int, segment: Segment, src_pages: Any, ready: Any = None) -> Job | None:
        """Check one send and count it pending (``KVSender.send``'s errors); ``None`` when it
        is ignored (the room failed)."""
        if type(room) is not int or not 0 <= room < ROOM_LIMIT:  # True: room 1, 2.0: room 2
            room = check_room_id(room, "KVSender.send")
        if ready is not None:
            check_ready(ready)
        try:
            bad = malformed(segment)
            if bad:
                raise ValueError(f"KVSender.send: {bad} (room {room})")
            pages: PageIds | None = short_page_ids(src_pages, self.num_pages)
            if pages is None:
                pages = page_ids(src_pages, "src_pages", self.num_pages, "KVSender.send", room)
            ps = self.page_size
            need = pages_spanned(segment.token_start, segment.num_tokens, ps) if ps else 0
            if len(pages) < need:
                raise ValueError(
                    f"KVSender.send: src_pages holds {len(pages)} pages but segment tokens "
                    f"[{segment.token_start}, {segment.token_end}) span {need} pages of {ps} "
                    f"tokens from its first page on (room {room})"
                )
        except ValueError:
            if self._rooms.status(room) != KVPoll.Failed:  # a failed room ignores the send
                raise
            pages = _NO_PAGES
        try:
            gen, status = self._rooms.begin_send(room, segment)
        except ValueError as e:
            raise ValueError(f"KVSender.send: {e}") from None
        if status == KVPoll.Failed:
            self._counts["send_after_failure"] += 1
            return None
        if gen is None:
            raise ValueError(
                f"KVSender.send: room {room} is {status.name}; send only once it is "
                "WaitingForInput (every decode DestInfo arrived)"
            )
        return room, gen, segment, pages, ready

    def accept_all(self, sends: Sequence[tuple[Any, ...]]) -> None:
        """:meth:`accept` every ``(room, segment, src_pages[, ready])`` and :meth:`post` them in
        one hand-off (the ones before a bad item too, then its error is raised)."""
        jobs: list[Job] = []
        if not isinstance(sends, Iterable) or isinstance(sends, _UNORDERED):
            # a set has no order, and a room's segments must go in chunk_id order
            raise TypeError(
                "KVSender.send_many: sends must be a sequence of (room, segment, src_pages[, "
                f"ready]) tuples, got {type(sends).__name__}"
            )
        try:
            for i, item in enumerate(sends):
                shaped = isinstance(item, (tuple, list))
                if not shaped or not 3 <= len(item) <= 4:
                    got = f"{len(item)} fields" if shaped else type(item).__name__
                    raise TypeError(
                        f"KVSender.send_many: item {i} must be (room, segment, src_pages[, "
                        f"ready]), got {got}"
                    )
                try:
                    job = self.accept(*item)
                except Exception as e:
                    raise _at_item(e, i) from None
                if job is not None:
                    jobs.append(job)
        finally:
            if jobs:
                self.post(jobs)

    def post(self, jobs: Sequence[Job]) -> None:
        """Enqueue a step's jobs and run a pipeline round: on this thread when the engine is
        free (taken with :meth:`EngineLoop.try_hold
        <pdplug.transfer.loop.EngineLoop.try_hold>`, no closure: issue 24) or frees within
        0.5 ms, else as one closure on the engine thread."""
        now = time.monotonic()
        loop = self._loop
        if loop.try_hold():
            try:
                self._start(jobs, now)
            except Exception as e:
                loop.failed(e)
            finally:
                loop.lock.release()
        elif not loop.run_here_or_submit(lambda: self._start(jobs, now)):
            return
        # writes in flight are reaped by whoever polls or waits first, the loop thread at its
        # next round at the latest; work still queued (regions busy, budget spent) needs it now
        if self._pipe.has_queued():
            loop.kick()

    def _start(self, jobs: Sequence[Job], now: float) -> None:
        table = self._table
        for room, gen, seg, pages, ready in jobs:
            # a segment whose KV is complete goes straight out when every destination has a
            # direct template and nothing queued before it; any other goes through a round
            if ready is not None or not table.send_direct(room, gen, seg, pages, now):
                # the planned path reads int64 arrays
                ids = np.array(pages, dtype=np.int64) if isinstance(pages, list) else pages
                table.enqueue(room, gen, seg, ids, now, ready)
        if self._pipe.has_work():
            self._pipe.step(now)

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
