"""Mooncake writes go out as few descriptors as the bytes allow: runs contiguous on both
sides are one descriptor (a chunk of SGLang's 1-token pages is one run per token and entry,
which Mooncake's TCP transport pays for one by one)."""

from __future__ import annotations

import threading
import time
from typing import Any

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from pdplug import KVConfig, KVLayout, TransferError
from pdplug.testing import require


def _lay() -> KVLayout:
    return KVLayout(page_size=1, entry_bytes_per_token=(128,), dtype="bfloat16", num_layers=1)


def _runs(steps: list[tuple[bool, bool, int]]) -> tuple[list[int], list[int], list[int]]:
    """Runs (source offsets, destination offsets, lengths): each starts where the previous
    ended, or 7 (source) / 5 (destination) further when its step says so."""
    src, dst, ln = [], [], []
    s = d = 0
    for gap_s, gap_d, n in steps:
        s += 7 if gap_s else 0
        d += 5 if gap_d else 0
        src.append(s)
        dst.append(d)
        ln.append(n)
        s, d = s + n, d + n
    return src, dst, ln


@given(
    st.lists(st.tuples(st.booleans(), st.booleans(), st.integers(1, 64)), min_size=0, max_size=40)
)
@settings(max_examples=200, deadline=None)
def test_coalesced_runs_copy_the_same_bytes(steps: list[tuple[bool, bool, int]]) -> None:
    """Whatever the runs, the merged descriptors copy exactly the bytes the runs copy, and
    no two neighbours continue each other on both sides."""
    require("mooncake")
    from pdplug_mooncake.engine import coalesce_runs

    src, dst, ln = _runs(steps)
    a, b, c = (np.array(x, dtype=np.int64) for x in (src, dst, ln))
    ma, mb, mc = coalesce_runs(a, b, c)
    want = {(x + i, y + i) for x, y, n in zip(src, dst, ln) for i in range(n)}
    got = {(int(x) + i, int(y) + i) for x, y, n in zip(ma, mb, mc) for i in range(int(n))}
    assert got == want and int(mc.sum()) == sum(ln)
    if len(mc) > 1:
        assert not np.any((ma[1:] == ma[:-1] + mc[:-1]) & (mb[1:] == mb[:-1] + mc[:-1]))


@given(
    st.lists(st.tuples(st.booleans(), st.booleans(), st.integers(1, 64)), min_size=1, max_size=16),
    st.lists(st.integers(0, 1200), min_size=0, max_size=4),
)
@settings(max_examples=300, deadline=None)
def test_a_short_write_merges_over_lists_exactly_as_over_arrays(
    steps: list[tuple[bool, bool, int]], cuts: list[int]
) -> None:
    """A short write (up to ``SHORT_RUNS`` runs: the send path's usual 64 KiB write) is merged
    over Python lists (issue 24: a dozen numpy calls cost more than a few comparisons); the
    result is the array merge's, registered-region boundaries included."""
    require("mooncake")
    import bisect

    from pdplug_mooncake.engine import coalesce_runs, coalesce_short

    src, dst, ln = _runs(steps)
    starts = sorted({0, *cuts}) if cuts else None  # region starts: a run never spans two
    group = None
    if starts and len(starts) > 1:
        group = np.array([bisect.bisect_right(starts, x) for x in src], dtype=np.int64)
    a, b, c = (np.array(x, dtype=np.int64) for x in (src, dst, ln))
    want = coalesce_runs(a, b, c, group)
    got = coalesce_short(src, dst, ln, starts if starts and len(starts) > 1 else None)
    assert [list(map(int, x)) for x in want] == [list(x) for x in got]


def test_a_write_of_adjacent_runs_is_one_descriptor_on_real_mooncake() -> None:
    """3,000 adjacent 128-byte runs and one after a gap, between two real Mooncake engines:
    two descriptors, every byte lands."""
    require("mooncake")
    from pdplug_mooncake.engine import MooncakeEngine

    a = MooncakeEngine(KVConfig(instance="p", role="prefill", layout=_lay()))
    b = MooncakeEngine(KVConfig(instance="d", role="decode", layout=_lay()))
    try:
        src = np.arange(1 << 20, dtype=np.int64).astype(np.uint8)
        dst = np.zeros(1 << 20, dtype=np.uint8)
        a.register([(src.ctypes.data, src.nbytes)])
        b.register([(dst.ctypes.data, dst.nbytes)])
        from pdplug.types import PeerInfo

        peer = a.connect(
            PeerInfo(
                instance="d", role="decode", layout=_lay(), agent=b.agent(), backend="mooncake"
            )
        )
        n = 3000
        s = src.ctypes.data + 128 * np.arange(n + 1, dtype=np.int64)
        d = dst.ctypes.data + 128 * np.arange(n + 1, dtype=np.int64)
        s[-1] += 4096  # the last run starts after a gap on the source side
        ln = np.full(n + 1, 128, dtype=np.int64)
        xfer = a.post(peer, s, d, ln, b"t")
        deadline = time.monotonic() + 30.0
        while a.check(xfer) == "PROC" and time.monotonic() < deadline:
            time.sleep(0.01)
        assert a.check(xfer) == "DONE", a.failure(xfer)
        assert a.counts["descriptors"] == 2
        assert np.array_equal(dst[: 128 * n], src[: 128 * n])
        assert np.array_equal(
            dst[128 * n : 128 * (n + 1)], src[128 * n + 4096 : 128 * (n + 1) + 4096]
        )
        assert not dst[128 * (n + 1) :].any()
    finally:
        a.close()
        b.close()


def test_runs_of_two_registered_buffers_adjacent_in_memory_stay_apart() -> None:
    """Two source buffers registered separately that touch in memory (and destinations that
    touch too): the engine keeps one descriptor per buffer."""
    require("mooncake")
    from pdplug.types import PeerInfo
    from pdplug_mooncake.engine import MooncakeEngine

    a = MooncakeEngine(KVConfig(instance="p", role="prefill", layout=_lay()))
    b = MooncakeEngine(KVConfig(instance="d", role="decode", layout=_lay()))
    try:
        src = (np.arange(8192) % 251).astype(np.uint8)
        dst = np.zeros(8192, dtype=np.uint8)
        base = src.ctypes.data
        a.register([(base, 4096), (base + 4096, 4096)])
        b.register([(dst.ctypes.data, dst.nbytes)])
        peer = a.connect(
            PeerInfo(
                instance="d", role="decode", layout=_lay(), agent=b.agent(), backend="mooncake"
            )
        )
        s = base + 128 * np.arange(64, dtype=np.int64)  # 32 runs in each buffer
        d = dst.ctypes.data + 128 * np.arange(64, dtype=np.int64)
        xfer = a.post(peer, s, d, np.full(64, 128, dtype=np.int64), b"t")
        deadline = time.monotonic() + 30.0
        while a.check(xfer) == "PROC" and time.monotonic() < deadline:
            time.sleep(0.01)
        assert a.check(xfer) == "DONE", a.failure(xfer)
        assert a.counts["descriptors"] == 2
        assert np.array_equal(dst, src)
    finally:
        a.close()
        b.close()


def _verified(peer: Any) -> None:
    deadline = time.monotonic() + 10.0  # connect() probes the session on the peer's worker
    while not peer.verified and time.monotonic() < deadline:
        time.sleep(0.005)
    assert peer.verified


def _window(peer: Any) -> int:
    return int(peer.asyncs[-1].window if peer.asyncs else peer.window)


@pytest.mark.parametrize("path", ["async", "worker"])
def test_a_refused_write_drains_in_seconds_and_the_window_grows_back(path: str) -> None:
    """A write of 64 separate runs to addresses outside the peer's registered memory: the
    engine refuses them, and because at most the peer's window (4 after a failure) was with
    the engine, the write ends ``"ERR"`` within a few seconds (all 64 submitted at once took
    15 s: the engine ends a failed session's queued runs three or four a second) with most
    runs never submitted. The next write of 1,024 runs lands every byte and widens the
    window again. Both ways a write goes: submitted from the posting thread to a verified
    session, and on the peer's worker (``async_max_runs=0``)."""
    require("mooncake")
    from pdplug.types import PeerInfo
    from pdplug_mooncake.engine import _WINDOW_MIN, MooncakeEngine

    extra = {"async_max_runs": "0"} if path == "worker" else {}
    a = MooncakeEngine(KVConfig(instance="p", role="prefill", layout=_lay(), extra=extra))
    b = MooncakeEngine(KVConfig(instance="d", role="decode", layout=_lay()))
    try:
        src = (np.arange(1 << 19) % 253 + 1).astype(np.uint8)
        dst = np.zeros(1 << 19, dtype=np.uint8)
        a.register([(src.ctypes.data, src.nbytes)])
        b.register([(dst.ctypes.data, dst.nbytes)])
        peer = a.connect(
            PeerInfo(
                instance="d", role="decode", layout=_lay(), agent=b.agent(), backend="mooncake"
            )
        )
        _verified(peer)
        # separate runs (a gap on both sides between neighbours): 64 descriptors
        off = 512 * np.arange(64, dtype=np.int64)
        ln = np.full(64, 256, dtype=np.int64)
        t0 = time.monotonic()
        bad = a.post(peer, src.ctypes.data + off, dst.ctypes.data + (1 << 44) + off, ln, b"x")
        while a.check(bad) in ("PROC", "FAILING") and time.monotonic() - t0 < 60:
            time.sleep(0.005)
        drained_s = time.monotonic() - t0
        assert a.check(bad) == "ERR" and "failed" in (a.failure(bad) or ""), a.failure(bad)
        assert drained_s < 8.0, drained_s
        assert a.counts["runs_not_submitted"] >= 64 - 2 * _WINDOW_MIN, a.counts
        assert _window(peer) == _WINDOW_MIN and not dst.any()
        assert a.counts["async_writes"] == (1 if path == "async" else 0), a.counts

        off = 512 * np.arange(1024, dtype=np.int64)
        good = None
        for _ in range(5):  # the engine reconnects the session after the refusal: retry
            good = a.post(
                peer,
                src.ctypes.data + off,
                dst.ctypes.data + off,
                np.full(1024, 256, dtype=np.int64),
                b"y",
            )
            t0 = time.monotonic()
            while a.check(good) in ("PROC", "FAILING") and time.monotonic() - t0 < 30:
                time.sleep(0.005)
            if a.check(good) == "DONE":
                break
            time.sleep(1.0)
        assert good is not None and a.check(good) == "DONE", a.failure(good)
        rows = off[:, None] + np.arange(256)
        assert np.array_equal(dst[rows], src[rows])
        assert peer.window > 512, peer.window  # the write after a failure probes on the worker
        if path == "async":  # the session is verified again: the next write goes async
            again = a.post(peer, src.ctypes.data + off, dst.ctypes.data + off,
                           np.full(1024, 256, dtype=np.int64), b"z")  # fmt: skip
            _wait_done(a, again)
            assert a.counts["async_writes"] == 2 and _window(peer) > 512, a.counts
    finally:
        a.close()
        b.close()


def _wait_done(eng: Any, xfer: Any) -> None:
    deadline = time.monotonic() + 30.0
    while eng.check(xfer) in ("PROC", "FAILING") and time.monotonic() < deadline:
        time.sleep(0.001)
    assert eng.check(xfer) == "DONE", eng.failure(xfer)


@pytest.mark.parametrize("limit", ["64", "0"])
def test_a_write_to_a_verified_session_is_posted_from_the_caller(limit: str) -> None:
    """Issue 24: a write to a session not yet verified goes through its worker (the session
    is probed first) and so does one posted while the worker has work; once verified and idle,
    writes are submitted from the posting thread, one posted
    while another is in flight too (they are served in post order);
    ``async_max_runs=0`` keeps every write on the worker. Every byte lands either way."""
    require("mooncake")
    from pdplug.types import PeerInfo
    from pdplug_mooncake.engine import MooncakeEngine

    extra = {"async_max_runs": limit}
    a = MooncakeEngine(KVConfig(instance="p", role="prefill", layout=_lay(), extra=extra))
    b = MooncakeEngine(KVConfig(instance="d", role="decode", layout=_lay()))
    try:
        src = (np.arange(1 << 16) % 253).astype(np.uint8)
        dst = np.zeros(1 << 16, dtype=np.uint8)
        a.register([(src.ctypes.data, src.nbytes)])
        b.register([(dst.ctypes.data, dst.nbytes)])
        peer = a.connect(
            PeerInfo(instance="d", role="decode", layout=_lay(), agent=b.agent(),
                     backend="mooncake")
        )  # fmt: skip
        q = 1 << 14  # four quarters: one write each

        def post(i: int) -> Any:
            off = np.array([i * q], dtype=np.int64)
            return a.post(peer, src.ctypes.data + off, dst.ctypes.data + off,
                          np.array([q], dtype=np.int64), b"t")  # fmt: skip

        gate = threading.Event()
        peer.worker.submit(lambda: int(gate.wait(10)))  # the worker is busy (as while probing)
        x0 = post(0)  # behind the worker's work: queued there, so the peer's writes keep order
        gate.set()
        _wait_done(a, x0)
        assert a.counts["async_writes"] == 0
        _verified(peer)
        _wait_done(a, post(1))  # alone on a verified session
        x2, x3 = post(2), post(3)  # x3 while x2 is in flight (or not, when x2 was quick)
        _wait_done(a, x2)
        _wait_done(a, x3)
        got = a.counts["async_writes"]
        assert got == (3 if limit != "0" else 0), a.counts
        assert np.array_equal(dst, src)
    finally:
        a.close()
        b.close()


def test_close_destroys_the_engine_at_once_unless_a_thread_still_uses_it() -> None:
    """A Mooncake engine's teardown holds the GIL for about 0.6 s, so ``close`` destroys it
    there and then (a weak reference dies without a garbage collection), never leaving it to
    the cyclic collector, which would stall every thread at a random later moment (NIXL rooms
    of other sessions failed while closed Mooncake sessions were collected). An engine whose
    peer's write is still on its worker is kept in ``RETIRED`` instead; closing twice is a
    no-op."""
    require("mooncake")
    import gc
    import threading
    import weakref

    from pdplug.types import PeerInfo
    from pdplug_mooncake import engine as mc

    gc.disable()  # the weak reference must die by reference counting alone
    try:
        a = mc.MooncakeEngine(KVConfig(instance="p", role="prefill", layout=_lay()))
        native = weakref.ref(a._engine)
        a.close()
        assert native() is None
        a.close()

        b = mc.MooncakeEngine(KVConfig(instance="d", role="decode", layout=_lay()))
        peer = b.connect(
            PeerInfo(instance="x", role="decode", layout=_lay(), agent=b"127.0.0.1:9",
                     backend="mooncake")
        )  # fmt: skip
        gate = threading.Event()
        peer.worker.submit(lambda: int(gate.wait(10)))  # a write still on the worker
        native = weakref.ref(b._engine)
        before = len(mc.RETIRED)
        b.close()
        gate.set()
        assert native() is not None and mc.RETIRED[before:] == [native()]
        one = np.array([1], dtype=np.int64)
        with pytest.raises(TransferError, match="is closed"):
            b.post(peer, one, one, one, b"t")  # never queued to a stopped worker
    finally:
        gc.enable()


_EXIT_AFTER_A_PROBE = """
import numpy as np
from pdplug import KVConfig, KVLayout
from pdplug.types import PeerInfo
from pdplug_mooncake.engine import MooncakeEngine
lay = KVLayout(page_size=1, entry_bytes_per_token=(128,), dtype="bfloat16", num_layers=1)
a = MooncakeEngine(KVConfig(instance="p", role="prefill", layout=lay))
mem = np.zeros(1 << 20, np.uint8)
a.register([(mem.ctypes.data, mem.size)])
a.connect(PeerInfo(instance="d", role="decode", layout=lay, backend="mooncake",
                   agent=b"127.0.0.1:9"))
a.close()  # the probe of the dead session is still running: the interpreter exits now
"""


def test_a_process_exiting_right_after_closing_mid_probe_exits_0() -> None:
    """A probe thread that returns from Mooncake's native code while the interpreter finalizes
    is ended by CPython with a forced unwind through C++ frames: the process aborted (exit code
    134, 9 runs in 10) when it exited right after closing an engine whose probe of a dead
    session had not returned. Live probes are joined (bounded) at exit."""
    require("mooncake")
    import subprocess
    import sys

    for _ in range(2):
        out = subprocess.run([sys.executable, "-c", _EXIT_AFTER_A_PROBE], capture_output=True,
                             text=True, timeout=60)  # fmt: skip
        assert out.returncode == 0, (out.returncode, out.stderr[-2000:])


def test_the_exit_join_skips_a_probe_not_yet_started_and_stops_new_probes(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The exit's join met a probe thread its worker had added but not yet started: ``join``
    raised "cannot join thread before it is started" and the process aborted (CI, stop 51).
    Probes are now added and started under one lock, the snapshot skips a thread that never
    started, and no probe starts after the snapshot (it would not be joined)."""
    import threading

    from pdplug_mooncake import engine as mc

    monkeypatch.setattr(mc, "_EXITING", False)
    monkeypatch.setattr(mc, "_PROBES", {threading.Thread(target=lambda: None)})
    mc._wait_for_probes(0.1)
    assert mc._EXITING
