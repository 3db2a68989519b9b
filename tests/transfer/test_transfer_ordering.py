"""Stream ordering of ``KVSender.send``: the pack reads KV only after the host's ``ready`` marker
completed, a write is posted only after its segment's pack-done marker completed, a marker that
never completes fails the room within ``transfer_timeout_s`` (its regions free) without holding
up other rooms, and a segment is packed with one ``pack_all`` call. Real NIXL / Mooncake
engines over loopback; the markers are fake CUDA events (``query``/``synchronize``) so the
ordering runs on CPU. The GPU variant (a real ``torch.cuda.Event`` behind a ``torch.cuda._sleep``
that delays the KV write) skips without CUDA."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from typing import Any

import numpy as np
import pytest
import torch
from _rig import (
    Decode,
    P,
    Prefill,
    dst_layout,
    exact,
    exact_kv,
    expected,
    expected_kv,
    kv_config,
    rendezvous,
    send_room,
    src_layout,
    wait_all,
    wait_true,
)

from pdplug import KVPoll, PluginManager, SchedulerConfig
from pdplug.bootstrap import resolve
from pdplug.transfer.gather import is_ready
from pdplug.types import Segment

OK, FAILED = KVPoll.Success, KVPoll.Failed


class FakeEvent:
    """A CUDA-event-like marker: ``query()`` is false until :meth:`fire`; ``fire`` first runs
    ``before`` (the host's forward writing the KV). Records the time of every query."""

    def __init__(self, before: Callable[[], None] = lambda: None) -> None:
        self._done = threading.Event()
        self._before = before
        self.queries = 0
        self.fired_at: float | None = None

    def query(self) -> bool:
        self.queries += 1
        return self._done.is_set()

    def synchronize(self) -> None:
        self._done.wait()

    def fire(self) -> None:
        self._before()
        self.fired_at = time.monotonic()
        self._done.set()


class PostLog:
    """The session's real engine, with the time of every ``post`` and the value of ``probe()``
    then noted (all else forwarded)."""

    def __init__(self, inner: Any, probe: Callable[[], int] = lambda: 0) -> None:
        self.inner = inner
        self.probe = probe
        self.posts: list[float] = []
        self.probed: list[int] = []

    def post(self, *args: Any) -> Any:
        self.posts.append(time.monotonic())
        self.probed.append(self.probe())
        return self.inner.post(*args)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)

    def prepare_pages(self, peer: Any, grid: Any) -> None:
        """No page lists: every write goes through :meth:`post`, which this wrapper watches."""
        return None


class CountingPacker:
    """The session's real packer; counts ``pack`` and ``pack_all`` calls (plans per call)."""

    def __init__(self, inner: Any) -> None:
        self.inner = inner
        self.pack_calls = 0
        self.pack_all_plans: list[int] = []

    def pack(self, plan: Any, entries: Sequence[Any], buf: torch.Tensor) -> None:
        self.pack_calls += 1
        self.inner.pack(plan, entries, buf)

    def pack_all(self, plans: Sequence[Any], entries: Sequence[Any], buf: torch.Tensor) -> None:
        self.pack_all_plans.append(len(plans))
        self.inner.pack_all(plans, entries, buf)


def _waiting(s: Any, room: int) -> None:
    """Wait (bounded; the machine may be loaded) until ``room`` is WaitingForInput on ``s``."""
    st = wait_all([s], room, 60, until=(KVPoll.WaitingForInput, KVPoll.Failed))
    assert st == [KVPoll.WaitingForInput], (room, st, s.failure_reason(room))


def _pages(start: int, n: int) -> np.ndarray:
    return np.arange(start, start + n, dtype=np.int64)


def _hide(pre: Prefill, sp: np.ndarray) -> Callable[[], None]:
    """Zero the source pages ``sp`` (the forward has not written them yet); returns the
    function that writes the real bytes back (the forward finishing)."""
    rows = (sp[:, None] * P + np.arange(P)).reshape(-1)
    saved = [t[rows].clone() for t in pre.kv[0]]
    for t in pre.kv[0]:
        t[rows] = 0

    def write() -> None:
        for t, v in zip(pre.kv[0], saved):
            t[rows] = v

    return write


@pytest.mark.parametrize("dcp", [1, 2], ids=["direct", "packed"])
def test_kv_is_read_only_after_the_ready_marker(backend: str, dcp: int) -> None:
    """The source KV is zero until the host's marker fires (which writes the real bytes): no
    write is posted before, and the decode side receives exactly the real bytes, packed
    (DCP 2: relayout) or written directly (DCP 1)."""
    with rendezvous() as srv:
        pm = PluginManager()
        # the marker stays false while the test checks nothing moves: a loaded machine must
        # not time the room out meanwhile (timeouts are tested apart)
        pre = Prefill(pm, backend, srv.endpoint, pp=1, transfer_timeout_s=120.0)
        dec = Decode(pm, backend, srv.endpoint, dcp=dcp)
        try:
            s = pre.senders[0]
            s.engine = log = PostLog(s.engine)
            room, sp = 7, _pages(3, 4)
            dps = [_pages(20 + 2 * r, 4 // dcp) for r in range(dcp)]
            s.start(room)
            for r, rc in enumerate(dec.recvs):
                rc.expect(room, dps[r], num_tokens=64)
            want = expected(pre, dec, 64, 0, sp, dps)  # the bytes the forward will write
            ev = FakeEvent(_hide(pre, sp))
            _waiting(s, room)
            d = s.dest(room)[0]
            for seg in pre.sched.split_send(
                token_start=0,
                token_end=64,
                decode_prefix_len=d.decode_prefix_len,
                is_last_send=True,
                capacity_tokens=s.capacity_tokens(room),
            ):
                s.send(room, seg, sp[seg.token_start // P :], ready=ev)
            assert wait_true(lambda: ev.queries >= 3, 20.0) is not None  # polled, not waited
            time.sleep(0.3)
            assert log.posts == [] and s.poll(room) not in (OK, FAILED)
            st = s.stats()
            assert st["waiting_ready"] == dcp and st["queued"] == st["busy_regions"] == 0, st
            ev.fire()
            st = wait_all([s, *dec.recvs], room, 15)
            assert st == [OK] * (1 + dcp), (st, s.failure_reason(room))
            assert ev.fired_at is not None and min(log.posts) >= ev.fired_at
            assert exact(dec, want, dps)
        finally:
            pre.close()
            dec.close()


@contextmanager
def _pair(backend: str, dcp: int = 2) -> Iterator[tuple[Prefill, Decode]]:
    """A prefill rank and a DCP-``dcp`` decode instance on a fresh rendezvous (closed after)."""
    with rendezvous() as srv:
        pm = PluginManager()
        pre = Prefill(pm, backend, srv.endpoint, pp=1)
        dec = Decode(pm, backend, srv.endpoint, dcp=dcp)
        try:
            yield pre, dec
        finally:
            pre.close()
            dec.close()


def _whole(pre: Prefill, tokens: int = 64) -> Segment:
    """The one segment of an unsplit send of ``tokens`` tokens from token 0."""
    return pre.sched.split_send(
        token_start=0,
        token_end=tokens,
        decode_prefix_len=0,
        is_last_send=True,
        capacity_tokens=None,
    )[0]


def test_a_write_waits_for_its_pack_and_a_segment_is_one_pack_all(backend: str) -> None:
    """The pack-done marker of the segment (a CUDA event on GPU; here a fake one) holds every
    write of the segment until it completes; each segment's two DCP jobs are packed by one
    ``pack_all`` call (never ``pack``), and the bytes arrive exact."""
    with _pair(backend) as (pre, dec):
        s = pre.senders[0]
        marks: list[FakeEvent] = []
        s.engine = log = PostLog(s.engine, lambda: sum(m.fired_at is not None for m in marks))
        packer = CountingPacker(s._pipe.packer)
        s._pipe.packer = packer

        def mark(_buf: Any) -> FakeEvent:
            marks.append(FakeEvent())
            return marks[-1]

        s._pipe._packing.mark = mark
        room, sp = 9, _pages(0, 8)
        dps = [_pages(10, 4), _pages(30, 4)]
        s.start(room)
        for r, rc in enumerate(dec.recvs):
            rc.expect(room, dps[r], num_tokens=128)
        send_room(pre, room, sp)  # region 32 tokens x DCP 2: two segments of 64 tokens
        assert wait_true(lambda: len(marks) >= 1, 20.0) is not None
        time.sleep(0.3)
        assert log.posts == []  # packed, but the device has not finished the pack
        assert s.stats()["packing"] >= 2 and s.stats()["busy_regions"] >= 2
        t_end = time.monotonic() + 15
        while s.poll(room) not in (OK, FAILED) and time.monotonic() < t_end:
            for m in list(marks):  # fire each segment's mark, oldest first
                if m.fired_at is None:
                    m.fire()
                    time.sleep(0.1)
                    break
            time.sleep(0.01)
        st = wait_all([s, *dec.recvs], room, 15)
        assert st == [OK] * 3, (st, s.failure_reason(room))
        assert exact(dec, expected(pre, dec, 128, 0, sp, dps), dps)
        # the i-th write (2 per segment, segments in order) follows its segment's mark
        assert all(f >= i // 2 + 1 for i, f in enumerate(log.probed)), log.probed
        segs = s.stats()["segments"]
        assert packer.pack_calls == 0 and packer.pack_all_plans == [2] * segs, packer.__dict__
        st = s.stats()
        assert st["pack_launches"] == segs == len(marks)
        assert st["pack_busy_s"] > 0 and st["write_busy_s"] > 0, st
        assert 0 <= st["overlap_s"] <= min(st["pack_busy_s"], st["write_busy_s"]) + 1e-6


def test_a_marker_that_never_completes_fails_its_room_only(backend: str) -> None:
    """Room A's ready marker never completes: A fails within ``transfer_timeout_s`` (5 s, plus
    5 s slack) on both sides, naming the marker, and holds no region; room B, sent after A to
    the same decode ranks, completes meanwhile."""
    with rendezvous() as srv:
        pm = PluginManager()
        # only transfer_timeout_s is under test: the others generous for a loaded machine
        kw = dict(transfer_timeout_s=5.0, waiting_timeout_s=120.0, bootstrap_timeout_s=120.0)
        pre = Prefill(pm, backend, srv.endpoint, pp=1, **kw)
        dec = Decode(pm, backend, srv.endpoint, dcp=2, **kw)
        try:
            s = pre.senders[0]
            never = FakeEvent()
            a, b = 21, 22
            sa, sb = _pages(0, 4), _pages(8, 4)
            da, db = [_pages(0, 2), _pages(4, 2)], [_pages(10, 2), _pages(14, 2)]
            for room, dps in ((a, da), (b, db)):
                s.start(room)
                for r, rc in enumerate(dec.recvs):
                    rc.expect(room, dps[r], num_tokens=64)
            _waiting(s, a)
            _waiting(s, b)
            t0 = time.monotonic()
            for seg in pre.sched.split_send(
                token_start=0,
                token_end=64,
                decode_prefix_len=0,
                is_last_send=True,
                capacity_tokens=s.capacity_tokens(a),
            ):
                s.send(a, seg, sa[seg.token_start // P :], ready=never)
            send_room(pre, b, sb)
            assert wait_all([s, *dec.recvs], b, 10) == [OK] * 3, s.failure_reason(b)
            assert s.poll(a) != FAILED, (s.failure_reason(a), time.monotonic() - t0)  # B first
            assert exact(dec, expected(pre, dec, 64, 0, sb, db), db)
            assert wait_all([s, *dec.recvs], a, 6) == [FAILED] * 3
            assert time.monotonic() - t0 < 5.0 + 5.0
            reason = s.failure_reason(a) or ""
            assert "ready marker" in reason and "transfer_timeout_s" in reason, reason
            st = s.stats()
            assert st["busy_regions"] == 0 and st["queued"] == 0 and st["posts"] >= 2, st
            assert s.drained(a)
        finally:
            pre.close()
            dec.close()


def test_send_names_a_ready_without_query_and_a_page_outside_the_kv(backend: str) -> None:
    """``ready`` must have ``query()``, and every source page id must lie in the registered
    KV (negative ids too); anything else is refused naming the value, nothing is queued, and
    the room still sends."""
    with _pair(backend, dcp=1) as (pre, dec):
        s = pre.senders[0]
        s.start(3)
        dec.recvs[0].expect(3, _pages(0, 4), num_tokens=64)
        _waiting(s, 3)
        seg = _whole(pre)
        with pytest.raises(TypeError, match="ready must have query"):
            s.send(3, seg, _pages(0, 4), ready=True)
        n = s._num_pages
        for bad, pages in ((-1, [0, -1, 2, 3]), (n, [0, 1, n, 3]), (-(2**62), [-(2**62)])):
            with pytest.raises(ValueError, match=rf"src_pages has page {bad}, outside \[0, {n}\)"):
                s.send(3, seg, np.array(pages, dtype=np.int64))
        assert s.poll(3) == KVPoll.WaitingForInput and s.stats().get("segments", 0) == 0
        s.send(3, seg, _pages(0, 4))
        assert wait_all([s, *dec.recvs], 3, 30) == [KVPoll.Success] * 2, s.failure_reason(3)


def test_send_and_expect_keep_the_page_ids_they_checked(backend: str) -> None:
    """The engine thread reads a room's page ids after ``expect``/``send`` returned: a host
    that reuses its id buffers at once (here: before the send's ready marker completes, with
    a page id outside the KV and with other valid pages) changes nothing; the bytes go from and
    to the pages passed at call time. Ids that are not integers are refused naming the dtype."""
    with _pair(backend, dcp=1) as (pre, dec):
        s, rc = pre.senders[0], dec.recvs[0]
        for bad in (np.array([0.0, 1.0]), np.array([True, False]), ["0", "1"]):
            with pytest.raises(ValueError, match="dst_pages must hold integer page ids"):
                rc.expect(6, bad, num_tokens=32)
        sp, dp = _pages(0, 4), _pages(4, 4)
        dbuf, sbuf = dp.copy(), sp.copy()
        s.start(5)
        rc.expect(5, dbuf, num_tokens=64)
        dbuf[:] = _pages(20, 4)
        _waiting(s, 5)
        seg = _whole(pre)
        for bad in (np.array([0.0, 1.0, 2.0, 3.0]), np.array([True] * 4), list("0123")):
            with pytest.raises(ValueError, match="src_pages must hold integer page ids"):
                s.send(5, seg, bad)
        ev = FakeEvent()
        s.send(5, seg, sbuf, ready=ev)
        sbuf[:] = [0, 1, s._num_pages + 100, 3]  # a page outside the KV, after the check
        time.sleep(0.05)
        sbuf[:] = _pages(8, 4)  # then other valid pages
        ev.fire()
        assert wait_all([s, rc], 5, 30) == [OK, OK], s.failure_reason(5)
        assert exact(dec, expected(pre, dec, 64, 0, sp, [dp]), [dp])


@pytest.mark.skipif(
    not torch.cuda.is_available(),
    reason="needs CUDA: a real event behind a delayed KV write on the GPU (scripts/gpu_check)",
)
def test_gpu_pack_waits_for_the_forward_event() -> None:
    """On the GPU: the forward's KV write is delayed by ``torch.cuda._sleep`` on a side stream
    and its event is passed with ``send``; the bytes that arrive are the written ones, not the
    zeros there before (NIXL over VRAM, Triton packer, DCP 2 relayout)."""
    with rendezvous() as srv:
        pm = PluginManager()
        planner = pm.make_pack_planner()
        lay = src_layout(1, 0)
        s = pm.make_kv_sender(
            kv_config("prefill", lay, srv.endpoint, "prefill-0", device="cuda"),
            planner,
            name="nixl",
        )
        gen = torch.Generator().manual_seed(5)
        real = [
            torch.randint(1, 256, (64 * P, b), dtype=torch.uint8, generator=gen)
            for b in lay.entry_bytes_per_token
        ]
        src = [torch.zeros_like(t, device="cuda") for t in real]
        s.register_kv(src)
        recvs, dst = [], []
        for r in range(2):
            dl = dst_layout(2, r)
            rc = pm.make_kv_receiver(
                kv_config("decode", dl, srv.endpoint, "decode-0", device="cuda"), name="nixl"
            )
            kv = [
                torch.full((96 * P, b), 0xA5, dtype=torch.uint8, device="cuda")
                for b in dl.entry_bytes_per_token
            ]
            rc.register_kv(kv)
            recvs.append(rc)
            dst.append(kv)
        try:
            peers = resolve(srv.endpoint, "prefill-0", timeout_s=20)
            for rc in recvs:
                rc.connect(peers)
            room, sp = 4, _pages(0, 4)
            dps = [_pages(10, 2), _pages(20, 2)]
            s.start(room)
            for r, rc in enumerate(recvs):
                rc.expect(room, dps[r], num_tokens=64)
            want = expected_kv([real], [[t.cpu() for t in kv] for kv in dst], 64, 0, sp, dps)
            staged = [v.to("cuda") for v in real]  # device copies: the write below is async
            torch.cuda.synchronize()
            fwd = torch.cuda.Stream()
            with torch.cuda.stream(fwd):
                torch.cuda._sleep(500_000_000)  # the forward still runs when send is called
                for t, v in zip(src, staged):
                    t.copy_(v)
                ev = torch.cuda.Event()
                ev.record(fwd)
            _waiting(s, room)
            for seg in pre_split(pm, s, room):
                s.send(room, seg, sp[seg.token_start // P :], ready=ev)
            sent_before_ready = not is_ready(ev)
            st = wait_all([s, *recvs], room, 30)
            assert st == [OK] * 3, (st, s.failure_reason(room))
            got = [[t.cpu() for t in kv] for kv in dst]
            assert exact_kv(got, want, dps)
            assert sent_before_ready  # the send really overtook the forward
        finally:
            s.close()
            for rc in recvs:
                rc.close()


def pre_split(pm: PluginManager, s: Any, room: int) -> list[Any]:
    """The segments of tokens ``[0, 64)`` of ``room`` at the sender's capacity."""
    sched = pm.make_scheduler(SchedulerConfig(page_size=P, chunk_size=96))
    return list(
        sched.split_send(
            token_start=0,
            token_end=64,
            decode_prefix_len=0,
            is_last_send=True,
            capacity_tokens=s.capacity_tokens(room),
        )
    )


class SlowPost(PostLog):
    """The real engine, whose ``post`` returns ``hold_s`` after posting (an engine that copies
    inside its post call, as UCX over shared memory does); notes each post's (start, end)."""

    def __init__(self, inner: Any, hold_s: float) -> None:
        super().__init__(inner)
        self.hold_s = hold_s
        self.spans: list[tuple[float, float]] = []

    def post(self, *args: Any) -> Any:
        t0 = time.monotonic()
        h = super().post(*args)
        time.sleep(self.hold_s)
        self.spans.append((t0, time.monotonic()))
        return h


class TimedPacker(CountingPacker):
    """The real packer; notes when each ``pack_all`` call started."""

    def __init__(self, inner: Any) -> None:
        super().__init__(inner)
        self.starts: list[float] = []

    def pack_all(self, plans: Sequence[Any], entries: Sequence[Any], buf: torch.Tensor) -> None:
        self.starts.append(time.monotonic())
        super().pack_all(plans, entries, buf)


def test_a_freed_region_is_packed_again_before_the_next_segment_is_posted(backend: str) -> None:
    """Double buffering in practice: once segment k's writes are done, the pack of segment
    k + 2 (into k's regions) starts before the engine thread posts segment k + 1, so the gather
    overlaps an engine that copies inside its post call (here each post holds the thread
    0.15 s). Four segments of 64 tokens to DCP 2, two regions per rank; bytes exact."""
    with _pair(backend) as (pre, dec):
        s = pre.senders[0]
        s.engine = log = SlowPost(s.engine, 0.15)
        packer = TimedPacker(s._pipe.packer)
        s._pipe.packer = packer
        room, sp = 11, _pages(0, 16)
        dps = [_pages(10, 8), _pages(30, 8)]
        s.start(room)
        for r, rc in enumerate(dec.recvs):
            rc.expect(room, dps[r], num_tokens=256)
        send_room(pre, room, sp)
        st = wait_all([s, *dec.recvs], room, 30)
        assert st == [OK] * 3, (st, s.failure_reason(room))
        assert exact(dec, expected(pre, dec, 256, 0, sp, dps), dps)
        # 8 writes; a segment whose ranks' regions free in different rounds is packed in
        # more than one call (one pack_all per segment and round)
        assert sum(packer.pack_all_plans) == 8 and len(log.spans) == 8, packer.__dict__
        # posts 2 and 3 are segment 1's: segment 2's pack (into segment 0's regions) starts
        # before the second of them returns (at the latest once the first returned and
        # segment 0's completions were seen); posting first would start it after both
        assert packer.starts[2] < log.spans[3][1], (packer.starts, log.spans)


class FailInPost:
    """The session's real engine, except that the first ``fail`` posts fail inside the post
    call (the handle checks ``"ERR"`` at once, as from an engine that copies synchronously and
    was refused); they never touch memory."""

    def __init__(self, inner: Any, fail: int = 1) -> None:
        self.inner = inner
        self.fail = fail
        self.failed: list[object] = []

    def post(self, *args: Any) -> Any:
        if len(self.failed) < self.fail:
            h = object()
            self.failed.append(h)
            return h
        return self.inner.post(*args)

    def _ours(self, h: Any) -> bool:
        return any(h is f for f in self.failed)

    def check(self, h: Any) -> str:
        return "ERR" if self._ours(h) else self.inner.check(h)

    def failure(self, h: Any) -> str | None:
        return "refused in the post call (test)" if self._ours(h) else self.inner.failure(h)

    def cancel(self, h: Any) -> bool:
        return False if self._ours(h) else self.inner.cancel(h)

    def release(self, h: Any) -> None:
        if not self._ours(h):
            self.inner.release(h)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)

    def prepare_pages(self, peer: Any, grid: Any) -> None:
        """No page lists: every write goes through :meth:`post`, which this wrapper watches."""
        return None


class HeldPacker:
    """The session's real packer; ``pack_all`` waits until ``go`` is set (bounded)."""

    def __init__(self, inner: Any) -> None:
        self.inner = inner
        self.go = threading.Event()
        self.plans: list[int] = []

    def pack(self, plan: Any, entries: Sequence[Any], buf: torch.Tensor) -> None:
        self.go.wait(30)
        self.inner.pack(plan, entries, buf)

    def pack_all(self, plans: Sequence[Any], entries: Sequence[Any], buf: torch.Tensor) -> None:
        self.plans.append(len(plans))
        self.go.wait(30)
        self.inner.pack_all(plans, entries, buf)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)


def test_a_post_failing_in_its_call_with_more_queued_drains_the_room(backend: str) -> None:
    """A room whose first packed write fails inside the post call, while its other DCP rank's
    pack is done in the same round and more segments wait for a region: the failure purges
    the queued segments and the room fails and drains (the engine loop once raised
    ``ZeroDivisionError`` here, dropping the rank's other packed write, so the room never
    drained: seen as a Mooncake failed-post test hanging in CI). The next room, on the same
    sender, completes with exact bytes."""
    with rendezvous() as srv:
        pm = PluginManager()
        # one region of one page per DCP rank: segment k + 1 waits for segment k's regions
        pre = Prefill(pm, backend, srv.endpoint, pp=1, pack_region_tokens=P, pack_depth=1)
        dec = Decode(pm, backend, srv.endpoint, dcp=2)
        try:
            s = pre.senders[0]
            s.engine = eng = FailInPost(s.engine)
            room, sp = 21, _pages(0, 8)
            dps = [_pages(10, 4), _pages(30, 4)]
            s.start(room)
            for r, rc in enumerate(dec.recvs):
                rc.expect(room, dps[r], num_tokens=8 * P)
            _waiting(s, room)
            gate = HeldPacker(s._pipe.packer)
            s._pipe.packer = gate
            d = s.dest(room)[0]
            segs = pre.sched.split_send(
                token_start=0,
                token_end=8 * P,
                decode_prefix_len=d.decode_prefix_len,
                is_last_send=True,
                capacity_tokens=s.capacity_tokens(room),
            )
            assert len(segs) >= 3, segs
            for seg in segs:
                s.send(room, seg, sp[seg.token_start // P :])
            # segment 0's two writes are in the (held) pack, the later segments wait for
            # their regions
            held = wait_true(lambda: gate.plans and s.stats()["queued"] > 0, 10.0)
            assert held is not None, (gate.plans, s.stats())
            assert gate.plans == [2], gate.plans
            gate.go.set()
            st = wait_all([s], room, 15)
            assert st == [FAILED], (st, s.failure_reason(room))
            assert "refused in the post call (test)" in s.failure_reason(room)
            assert wait_true(lambda: s.drained(room), 15.0) is not None, s.stats()
            assert s.stats()["loop_errors"] == 0, s.stats()
            assert len(eng.failed) == 1
            st = wait_all(dec.recvs, room, 15)
            assert st == [FAILED, FAILED], st
            # the session goes on: a second room on the same sender lands exactly
            room2 = 22
            s.start(room2)
            for r, rc in enumerate(dec.recvs):
                rc.expect(room2, dps[r], num_tokens=8 * P)
            dec.poison()
            send_room(pre, room2, sp)
            st = wait_all([s, *dec.recvs], room2, 30)
            assert st == [OK] * 3, (st, s.failure_reason(room2))
            assert exact(dec, expected(pre, dec, 8 * P, 0, sp, dps), dps)
        finally:
            pre.close()
            dec.close()
