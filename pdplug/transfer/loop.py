"""The engine thread of a KV session: one thread owns the engine and the control sockets.

The engine's state belongs to whoever holds :attr:`EngineLoop.lock`: the loop thread holds it
while it runs a round, and a host thread may take it to run engine-side work itself
(:meth:`EngineLoop.try_run`, :meth:`EngineLoop.locked`) — a send posted from the host's own
thread, a completion reaped by the host's own ``poll()`` — with no thread hand-off: on a busy
host a hand-off costs more than a small write (a waiting thread gets the GIL only when the
holder yields it). Engines are thus called by one thread at a time (UCX's serialized mode).
Sockets are the loop thread's alone: what a host thread sends while it holds the lock is
queued (:meth:`EngineLoop.defer`) and sent by the loop thread, in order, at the start of its
next round. Otherwise host threads :meth:`EngineLoop.submit` closures (or
:meth:`EngineLoop.call` them and wait, bounded) and read thread-safe state such as
:class:`~pdplug.rooms.Rooms`. An inproc PAIR socket wakes the loop when work is submitted, or
when a host left work behind while the loop was parked (:meth:`EngineLoop.kick`). While
transfers are in flight the loop polls without blocking — hot for ``spin_s``, then with sleeps
of 2% of the elapsed time up to ``backoff_s`` — so completion is seen within a few percent of
the transfer time without a polling thread eating the CPU a loopback copy needs; idle, it
blocks in ``zmq_poll`` for up to ``idle_s``.

A round that raises is logged and counted (``errors``) and the loop goes on; but if the thread
itself dies — an exception that is not an ``Exception``, or ``max_errors`` rounds in a row that
raise — ``on_death`` is called with the cause (the session fails every room with it, so no
``wait`` hangs), and every later call raises :class:`~pdplug.errors.TransferError` naming it.
"""

from __future__ import annotations

import logging
import os
import threading
import time
import weakref
from collections import deque
from collections.abc import Callable
from concurrent.futures import Future
from typing import Any, TypeVar

import zmq

from pdplug.errors import TransferError

__all__ = ["EngineLoop"]

log = logging.getLogger(__name__)

R = TypeVar("R")


def _close_fds(*fds: int) -> None:
    for fd in fds:
        try:
            os.close(fd)
        except OSError:
            pass


class EngineLoop:
    """A daemon thread running ``step`` between socket events and submitted closures.

    :param name: thread name.
    :param step: called every round with the monotonic time (seconds); must not block.
    :param busy: True while work is in flight (then the loop does not block in poll).
    :param idle_s: longest block in ``zmq_poll`` when idle (seconds), or a callable returning
        it each round (a receiver polling engine notifications shortens it while rooms wait).
    :param spin_s: while busy, poll again at once (yielding the GIL) for this long (seconds):
        engines without a progress thread (NIXL as configured here) move data only while
        polled, and most completions arrive within it.
    :param backoff_s: then sleep between rounds 2% of the time the work has been in flight,
        at most this long (seconds).
    :param on_death: called on the dying thread with the exception that ended it.
    :param max_errors: consecutive rounds whose ``step`` raised after which the thread gives
        up (a data plane that cannot make progress must not pretend to be alive).
    """

    def __init__(
        self,
        name: str,
        step: Callable[[float], None],
        busy: Callable[[], bool],
        *,
        idle_s: float | Callable[[], float] = 0.005,
        spin_s: float = 0.0002,
        backoff_s: float = 0.001,
        on_death: Callable[[BaseException], None] | None = None,
        max_errors: int = 100,
    ) -> None:
        self.name = name
        self._step = step
        self._busy = busy
        self._idle = idle_s
        self._spin_s = spin_s
        self._backoff_s = backoff_s
        # wake-up: a non-blocking pipe in the poller. A byte written to it costs one syscall;
        # an inproc zmq send took three times as long on the host's completion path
        # (issue 24), where a Mooncake write's tag is handed to this thread
        self._wake_rx, self._wake_tx = os.pipe()
        os.set_blocking(self._wake_rx, False)
        os.set_blocking(self._wake_tx, False)
        self._wake_open = True  # under _wake_lock: a closed fd number may be reused
        # a loop dropped without stop() (a session constructor failing after building it)
        self._close_pipe = weakref.finalize(self, _close_fds, self._wake_rx, self._wake_tx)
        # not at interpreter exit: a loop thread still running then (a host interrupted before
        # stop()) would read a closed, maybe reused, descriptor and die with EBADF
        self._close_pipe.atexit = False
        self._wake_lock = threading.Lock()
        self._poller = zmq.Poller()
        self._poller.register(self._wake_rx, zmq.POLLIN)
        self._handlers: dict[zmq.Socket, Callable[[zmq.Socket], None]] = {}
        self._todo: deque[tuple[Callable[[], Any], Future[Any]]] = deque()
        self._todo_lock = threading.Lock()
        #: held by whoever runs engine-side work (the loop thread's rounds, host fast paths)
        self.lock = threading.Lock()
        self._deferred: deque[Callable[[], None]] = deque()  # socket work of host threads
        self._deferred_woken = False  # a wake for deferred work is on its way (one per round)
        self._after: list[Callable[[], object]] = []  # run once the round released the lock
        self._parked = False  # the loop thread is (about to be) blocked in zmq_poll
        self._stop = threading.Event()
        self._stopping = False  # _stop.is_set(), read on the send path without a call
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._ident: int | None = None  # the loop thread's id once started
        self._on_death = on_death
        self._max_errors = max_errors
        self._in_a_row = 0
        self.errors = 0
        self._last_error = ""
        self.died: BaseException | None = None

    # ------------------------------------------------------------------ lifecycle
    def start(self) -> None:
        """Start the thread."""
        self._thread.start()
        self._ident = self._thread.ident

    def stop(self, timeout_s: float = 5.0) -> None:
        """Stop the thread (after the current round) and close the wake sockets; idempotent."""
        self._stopping = True
        self._stop.set()
        self._wake()
        if self._thread.is_alive() and threading.current_thread() is not self._thread:
            self._thread.join(timeout_s)
        if self._thread.is_alive():
            return  # still in its last round (or this is it): it closes the pipe as it ends
        self._close_wake()

    def _close_wake(self) -> None:
        with self._wake_lock:
            if self._wake_open:
                self._wake_open = False
                self._close_pipe()

    @property
    def running(self) -> bool:
        """Whether the thread is alive and not stopping."""
        return self._thread.is_alive() and not self._stop.is_set()

    def on_thread(self) -> bool:
        """Whether the caller runs on the engine thread."""
        return threading.get_ident() == self._ident

    # ------------------------------------------------------------------ sockets (engine thread)
    def add_socket(self, sock: zmq.Socket, handler: Callable[[zmq.Socket], None]) -> None:
        """Call ``handler(sock)`` whenever ``sock`` is readable (engine thread or before start)."""
        self._handlers[sock] = handler
        self._poller.register(sock, zmq.POLLIN)

    def remove_socket(self, sock: zmq.Socket) -> None:
        """Stop polling ``sock`` (engine thread)."""
        if self._handlers.pop(sock, None) is not None:
            self._poller.unregister(sock)

    # ------------------------------------------------------------------ host-side API
    def submit(self, fn: Callable[[], R]) -> Future[R]:
        """Run ``fn`` on the engine thread soon; its result or exception lands in the future.

        :raises TransferError: the loop is stopped.
        """
        fut: Future[R] = Future()
        if self.died is not None:
            raise TransferError(f"{self.name}: {self.death()}")
        if self._stop.is_set():
            raise TransferError(f"{self.name}: closed")
        if self.on_thread():
            try:
                fut.set_result(fn())
            except BaseException as e:
                fut.set_exception(e)
            return fut
        with self._todo_lock:
            self._todo.append((fn, fut))
        self._wake()
        return fut

    def call(self, fn: Callable[[], R], timeout_s: float) -> R:
        """Run ``fn`` on the engine thread and wait for its result (at most ``timeout_s``).

        :raises TransferError: no result within ``timeout_s`` seconds.
        """
        fut = self.submit(fn)
        try:
            return fut.result(timeout=timeout_s)
        except TimeoutError as e:
            raise TransferError(
                f"{self.name}: no answer from the engine thread in {timeout_s:g} s"
            ) from e

    def try_hold(self) -> bool:
        """Take :attr:`lock` for a host thread if the engine is free now (non-blocking): the
        send path's :meth:`try_run` without a closure (issue 24). ``False`` on the loop
        thread, once the loop stopped or died, or while a round holds the lock. The caller
        releases the lock and passes an exception of its work to :meth:`failed`."""
        if self.died is not None or self._stopping or threading.get_ident() == self._ident:
            return False
        return self.lock.acquire(blocking=False)

    def failed(self, e: Exception) -> None:
        """Count and log ``e`` from work run under :meth:`try_hold` as a round's error."""
        self._error(e)

    def try_run(self, fn: Callable[[], None]) -> bool:
        """Run ``fn`` on the calling thread if the engine is free now (non-blocking; on the
        loop thread: at once). Returns whether it ran; then ``fn`` held :attr:`lock`, as a
        round would. An exception in ``fn`` is logged and counted like a round's, never raised
        into the caller. Call :meth:`kick` after it when ``fn`` left work in flight."""
        if self.died is not None or self._stopping:
            return False
        if threading.get_ident() == self._ident:
            self._call(fn)
            return True
        if not self.lock.acquire(blocking=False):
            return False
        try:
            self._call(fn)
        finally:
            self.lock.release()
        return True

    def run_here_or_submit(
        self, fn: Callable[[], None], wait_s: float = 0.0005, in_order: bool = False
    ) -> bool:
        """Run ``fn`` on the calling thread as :meth:`try_run` does, waiting up to ``wait_s``
        seconds for the round under way to end (the wait releases the GIL, so that round can
        end); else :meth:`submit` it. ``in_order``: work that must follow what was submitted
        before it (a room's abort after its start) runs here only when no submitted closure is
        still queued, else behind them. Returns whether it ran here."""
        if not in_order and self.try_run(fn):
            return True
        if (
            self.died is None
            and not self._stopping
            and threading.get_ident() != self._ident
            and self.lock.acquire(timeout=wait_s)
        ):
            try:
                if not (in_order and self._todo):  # read under the lock: no round takes one
                    self._call(fn)
                    return True
            finally:
                self.lock.release()
        self.submit(fn)
        return False

    def locked(self, fn: Callable[[], R], timeout_s: float) -> R:
        """Run ``fn`` on the calling thread holding :attr:`lock` (waiting at most ``timeout_s``
        for the round under way), for host calls that read engine-side state without a
        thread hand-off. ``fn`` must not touch a socket (use :meth:`defer`).

        :raises TransferError: the loop is stopped or died, or the engine stayed busy for
            ``timeout_s`` seconds.
        """
        if self.on_thread():
            return fn()
        if self.died is not None:
            raise TransferError(f"{self.name}: {self.death()}")
        if self._stop.is_set():
            raise TransferError(f"{self.name}: closed")
        if not self.lock.acquire(timeout=timeout_s):
            raise TransferError(f"{self.name}: engine busy for {timeout_s:g} s")
        try:
            return fn()
        finally:
            self.lock.release()

    def defer(self, fn: Callable[[], None]) -> None:
        """Have the loop thread run ``fn`` (socket work) at the start of its next round, in
        the order deferred; on the loop thread, at once (after what was deferred before)."""
        if self.on_thread():
            self._flush_deferred()
            fn()
            return
        self._deferred.append(fn)
        if not self._deferred_woken:  # a step's deferred sends cost one wake, not one each
            self._deferred_woken = True
            self._wake()

    def after_round(self, fn: Callable[[], object]) -> None:
        """Run ``fn`` once the current round has released :attr:`lock` (at once when not
        called from the loop thread): a change that wakes a host thread (a room it waits on
        turning ``WaitingForInput``) is published when the host can take the lock, so the
        host does not wake only to wait for the rest of the round."""
        if threading.get_ident() == self._ident:
            self._after.append(fn)
        else:
            fn()

    def _run_after(self) -> None:
        todo, self._after = self._after, []
        for fn in todo:
            self._call(fn)

    def kick(self) -> None:
        """Wake the loop thread if it is parked in ``zmq_poll``: a host thread left writes in
        flight that the loop must watch (if the host does not reap them itself first)."""
        if self._parked:
            self._wake()

    def _flush_deferred(self) -> None:
        while self._deferred:
            fn = self._deferred.popleft()
            try:
                fn()
            except Exception:  # a failed send is the session's timeouts' business
                log.exception("%s: deferred socket work failed", self.name)

    def death(self) -> str:
        """Why the thread died (``""`` while it has not)."""
        d = self.died
        return "" if d is None else f"engine thread died ({type(d).__name__}: {d})"

    def wake(self) -> None:
        """Wake the loop now (thread-safe); engines whose writes complete on their own threads
        call it so the loop need not poll them."""
        self._wake()

    def _wake(self) -> None:
        with self._wake_lock:
            if self._wake_open:
                try:
                    os.write(self._wake_tx, b"\0")
                except BlockingIOError:  # the pipe is full: a wake is pending anyway
                    pass

    # ------------------------------------------------------------------ the loop
    def _run(self) -> None:
        self._ident = threading.get_ident()  # before the first round (start() sets it too)
        try:
            self._rounds()
        except BaseException as e:  # the thread ends: say so, so nothing waits for it
            self.died = e
            log.critical("%s: %s", self.name, self.death(), exc_info=e)
            if self._on_death is not None:
                try:
                    self._on_death(e)
                except Exception:
                    log.exception("%s: on_death failed", self.name)
        finally:
            # fail whatever is still queued so no caller waits forever
            with self._todo_lock:
                todo, self._todo = list(self._todo), deque()
            why = self.death() or "closed"
            for _fn, fut in todo:
                if fut.set_running_or_notify_cancel():
                    fut.set_exception(TransferError(f"{self.name}: {why}"))
            if self._stop.is_set():  # a stop() that could not wait for this thread left it
                self._close_wake()

    def _rounds(self) -> None:
        busy_since = 0.0
        while not self._stop.is_set():
            busy = self._busy() or bool(self._todo or self._deferred or self._after)
            if not busy:
                # parked first, then look again: a host that adds work after this sees
                # _parked and wakes us (kick); work added before is seen here
                self._parked = True
                busy = self._busy() or bool(self._todo or self._deferred or self._after)
            try:
                idle = self._idle() if callable(self._idle) else self._idle
                events = self._poller.poll(0 if busy else max(1, int(idle * 1000)))
            except zmq.ZMQError:
                if self._stop.is_set():
                    break
                raise
            finally:
                self._parked = False
            with self.lock:
                self._round(events)
            if self._after:
                self._run_after()
            now = time.monotonic()
            if not busy:
                busy_since = 0.0
            elif not events:
                busy_since = busy_since or now
                # poll hot right after work was posted (fast completions), then back off in
                # proportion to how long the work has run (detection adds <= 2% to a long
                # write) so a polling thread does not take the CPU the transfer needs
                busy_for = now - busy_since
                time.sleep(
                    20e-6 if busy_for < self._spin_s else min(self._backoff_s, busy_for / 50)
                )

    def _round(self, events: list[tuple[Any, int]]) -> None:
        """One round's work (holding :attr:`lock`): deferred socket work, readable sockets,
        submitted closures, ``step``."""
        self._deferred_woken = False  # before the flush: work deferred after it wakes again
        self._flush_deferred()
        for sock, _ in events:
            if sock == self._wake_rx:
                try:
                    while os.read(sock, 4096):
                        pass
                except BlockingIOError:
                    pass
                continue
            handler = self._handlers.get(sock)
            if handler is not None:
                self._guard(handler, sock)
        while True:
            with self._todo_lock:
                if not self._todo:
                    break
                fn, fut = self._todo.popleft()
            if fut.set_running_or_notify_cancel():
                try:
                    fut.set_result(fn())
                except BaseException as e:
                    fut.set_exception(e)
        now = time.monotonic()
        if self._guard(self._step, now):
            self._in_a_row = 0
        else:
            self._in_a_row += 1
            if self._in_a_row >= self._max_errors:
                raise TransferError(
                    f"{self._in_a_row} rounds in a row failed; last: {self._last_error}"
                )

    def _guard(self, fn: Callable[[Any], None], arg: Any) -> bool:
        try:
            fn(arg)
        except Exception as e:  # a bug in one round must not kill the rank's data plane
            self._error(e)
            return False
        return True

    def _call(self, fn: Callable[[], object]) -> None:
        """``fn()`` run as a round runs its work (:meth:`_guard` without an argument)."""
        try:
            fn()
        except Exception as e:
            self._error(e)

    def _error(self, e: Exception) -> None:
        self.errors += 1
        self._last_error = f"{type(e).__name__}: {e}"
        log.exception("%s: error in the engine loop", self.name)
