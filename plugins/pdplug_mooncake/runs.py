"""A peer's asynchronous Mooncake writes: runs submitted by whoever posts or checks, no thread.

Mooncake's ``batch_transfer_async_write`` hands a batch to the engine's own threads and
returns; ``transfer_check_status`` says whether it landed. So a write to a session whose
segment is open (a probe answered, no write failed since) needs no Python thread of its own:
the thread that posts it submits its first runs, and every :meth:`AsyncRuns.check` (the KV
session's reap, on the host's ``poll()`` or the engine thread) sees runs end and submits more.
That saves the two thread hand-offs a worker costs per write (issue 24: on a busy host a thread
waiting for the GIL costs more than a small write).

Rules, each measured on mooncake 0.3.13 (see :mod:`pdplug_mooncake.engine`):

* one run per batch: ``transfer_check_status`` of a multi-run batch reports done before all of
  its runs landed;
* a window: at most ``window`` runs of the peer are with the engine at once, four at first and
  after a failed run, one more per run that lands (up to ``max_batch``). After a refused run
  the engine ends the session's other queued runs three or four a second, so a write the peer
  refuses holds its room undrained for about ``window / 4`` s, not ``runs / 4`` s;
* writes are served in post order (FIFO): a later write submits runs only once every earlier
  one submitted all of its own;
* after a failed run the binding has dropped the session and its next write would open it
  again with a handshake under the mutex every write takes (unbounded on a peer that stopped
  answering): nothing more is submitted to the session from here. The failed write, and every
  pending write of the peer with runs not yet submitted, end ``ERR`` (``FAILING`` while some
  of their runs are still with the engine); later writes go through the peer's worker, which
  probes the session first.
"""

from __future__ import annotations

from collections import Counter, deque
from collections.abc import Callable
from typing import Any

import msgspec

__all__ = ["WINDOW_MIN", "DONE", "IN_FLIGHT", "AsyncWrite", "AsyncRuns"]

#: runs a peer keeps with the engine at first and after a failed run
WINDOW_MIN = 4
#: ``transfer_check_status``: 1 done; 0 in flight, -2 past the engine's own timeout and held
DONE, IN_FLIGHT = 1, (0, -2)


class AsyncWrite(msgspec.Struct, kw_only=True):
    """One write of ``len(ln)`` runs (addresses and byte lengths) to ``session``.

    :ivar ids: batch ids submitted and not yet seen ended, in submission order.
    :ivar sent: runs submitted so far; ``error``: why it failed (``""``: not failed).
    :ivar ended: no run of it is with the engine and none will be submitted.
    :ivar owner: the :class:`AsyncRuns` serving it (its :meth:`AsyncRuns.check` answers).
    """

    session: str
    src: list[int]
    dst: list[int]
    ln: list[int]
    owner: Any = None  # the AsyncRuns serving it
    ids: deque[int] = msgspec.field(default_factory=deque)
    sent: int = 0
    error: str = ""
    ended: bool = False

    def state(self) -> str:
        """``"PROC"``, ``"FAILING"`` (failed, runs still with the engine), ``"DONE"`` or
        ``"ERR"``."""
        if self.ended:
            return "ERR" if self.error else "DONE"
        return "FAILING" if self.error else "PROC"


class AsyncRuns:
    """The asynchronous writes of one peer session (one thread at a time: the KV session's
    engine lock holder).

    :param engine: the Mooncake ``TransferEngine``.
    :param max_batch: the largest window (runs).
    :param on_failure: called once with the reason when a run fails or is refused (the owner
        marks the session unverified).
    :param counts: the engine's counters (``runs_not_submitted``: runs of failed writes that
        never went to the engine).
    """

    def __init__(
        self,
        engine: Any,
        max_batch: int,
        on_failure: Callable[[str], None],
        counts: Counter[str] | None = None,
    ) -> None:
        self._engine = engine
        self._max = max_batch
        self._on_failure = on_failure
        self._counts: Counter[str] = Counter() if counts is None else counts
        self.window = min(WINDOW_MIN, max_batch)
        self.runs = 0  # runs with the engine now
        self.live: deque[AsyncWrite] = deque()  # writes not ended, post order
        self._unsent: deque[AsyncWrite] = deque()  # writes with runs not yet submitted
        self.dropped = False  # a run failed: nothing more is submitted to the session

    def post(self, session: str, src: list[int], dst: list[int], ln: list[int]) -> AsyncWrite:
        """Queue a write and submit what the window allows now."""
        w = AsyncWrite(session=session, src=src, dst=dst, ln=ln, owner=self)
        if self.dropped:  # the owner makes a new one after a failure; never submit here
            w.error = f"mooncake write to {session} not posted: the engine dropped the session"
            w.ended = True
            self._counts["runs_not_submitted"] += len(ln)
            return w
        self.live.append(w)
        self._unsent.append(w)
        self._submit()
        if not w.ids and w.sent == len(ln):  # nothing to write (an empty write)
            self._end(w)
        return w

    def check(self, w: AsyncWrite) -> str:
        """See ``w``'s runs that ended, submit more of the peer's runs, and return its state."""
        if not w.ended:
            self._reap(w)
            if self._unsent:
                self._submit()
            if not w.ids and (w.error or w.sent == len(w.ln)):
                self._end(w)
        return w.state()

    # ------------------------------------------------------------------ internals
    def _reap(self, w: AsyncWrite) -> None:
        ids, status = w.ids, self._engine.transfer_check_status
        while ids:
            rc = int(status(ids[0]))
            if rc in IN_FLIGHT:
                return
            ids.popleft()
            self.runs -= 1
            if rc == DONE:
                if self.window < self._max:
                    self.window += 1
            else:
                self._fail(w, f"mooncake write to {w.session} failed ({rc})")

    def _submit(self) -> None:
        submit = self._engine.batch_transfer_async_write
        while self._unsent and self.runs < self.window:
            w = self._unsent[0]
            i = w.sent
            bid = submit(w.session, [w.src[i]], [w.dst[i]], [w.ln[i]])
            if not bid:
                self._fail(w, f"mooncake write to {w.session} was refused")
                return
            w.ids.append(bid)
            w.sent = i + 1
            self.runs += 1
            if w.sent == len(w.ln):
                self._unsent.popleft()

    def _fail(self, w: AsyncWrite, why: str) -> None:
        """A run of ``w`` failed: the session is dropped, so no write of the peer submits
        another run (each ends once its submitted runs did)."""
        self.window = min(WINDOW_MIN, self._max)
        if not w.error:
            w.error = why
        for x in self._unsent:
            self._counts["runs_not_submitted"] += len(x.ln) - x.sent
            if not x.error:
                x.error = (
                    f"mooncake write to {x.session} not completed: another write to the "
                    f"session failed ({why}) and the engine dropped the session"
                )
            if not x.ids:
                self._end(x)
        self._unsent.clear()
        if not self.dropped:
            self.dropped = True
            self._on_failure(why)

    def _end(self, w: AsyncWrite) -> None:
        w.ended = True
        try:
            self.live.remove(w)
        except ValueError:
            pass
