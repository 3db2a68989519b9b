"""The engine loop's wake-up: a parked loop wakes for host work, a full wake pipe neither
blocks nor raises, and a stopped loop never writes into a file descriptor reused since."""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Iterator

import pytest

from pdplug.transfer.loop import EngineLoop


@pytest.fixture
def loop() -> Iterator[EngineLoop]:
    lp = EngineLoop("loop-test", lambda now: None, lambda: False, idle_s=5.0)
    lp.start()
    yield lp
    lp.stop()


def _parked(lp: EngineLoop) -> None:
    t_end = time.monotonic() + 5.0
    while not lp._parked:
        assert time.monotonic() < t_end, "the loop never parked"
        time.sleep(0.001)


def test_a_parked_loop_runs_submitted_and_deferred_work_at_once(loop: EngineLoop) -> None:
    _parked(loop)
    t0 = time.monotonic()
    assert loop.submit(lambda: 7).result(timeout=2.0) == 7
    assert time.monotonic() - t0 < 1.0  # woken, not its 5 s idle poll
    _parked(loop)
    ran = threading.Event()
    t0 = time.monotonic()
    loop.defer(ran.set)
    assert ran.wait(2.0)
    assert time.monotonic() - t0 < 1.0


def test_more_wakes_than_the_pipe_holds_neither_block_nor_raise(loop: EngineLoop) -> None:
    with loop.lock:  # the loop cannot drain the pipe meanwhile
        t0 = time.monotonic()
        for _ in range(200_000):  # a pipe holds 64 KiB by default
            loop._wake()
        assert time.monotonic() - t0 < 30.0
    assert loop.submit(lambda: "after").result(timeout=2.0) == "after"


def test_a_stopped_loop_never_writes_into_a_reused_descriptor() -> None:
    lp = EngineLoop("loop-test", lambda now: None, lambda: False, idle_s=5.0)
    lp.start()
    lp.stop()
    r, w = os.pipe()  # likely the numbers the loop's pipe had
    try:
        os.set_blocking(r, False)
        lp._wake()
        lp.kick()
        with pytest.raises(BlockingIOError):
            os.read(r, 1)
    finally:
        os.close(r)
        os.close(w)


def test_a_loop_dropped_without_stop_closes_its_pipe() -> None:
    """A session constructor that fails after building its loop never calls ``stop()``."""
    import gc

    before = len(os.listdir("/proc/self/fd"))
    for _ in range(50):
        EngineLoop("loop-test", lambda now: None, lambda: False)
    gc.collect()
    assert len(os.listdir("/proc/self/fd")) <= before


def test_a_stop_that_cannot_wait_leaves_the_pipe_to_the_thread() -> None:
    """``stop()`` whose join times out (the thread is still in a round: a host interrupted
    mid-send) must not close the wake pipe under that thread, which would read a closed or
    reused descriptor and die with EBADF (seen on Ctrl-C of ``pdplug bench transfer``); the
    thread closes it as it ends. Interpreter exit does not close it either."""
    gate = threading.Event()
    lp = EngineLoop("loop-test", lambda now: gate.wait(5.0), lambda: True, idle_s=5.0)
    lp.start()
    time.sleep(0.05)  # the thread is inside its round, blocked on the gate
    rx = lp._wake_rx
    lp.stop(timeout_s=0.05)
    assert lp._thread.is_alive()
    os.fstat(rx)  # still open while the thread runs
    assert not lp._close_pipe.atexit
    gate.set()
    lp._thread.join(5.0)
    assert not lp._thread.is_alive() and lp.died is None, lp.death()
    assert not lp._wake_open  # closed by the thread as it ended
