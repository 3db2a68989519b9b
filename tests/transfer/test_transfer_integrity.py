"""Data-plane integrity, one test per kind of field fault, over real engines in this process
(NIXL over UCX, Mooncake over TCP; real sockets on 127.0.0.1), parametrized by backend.

Each test is an instance of a kind: drained means drained; one peer's trouble stays with that
peer; counts must agree; timeouts bound silence, not queueing, and every end reaches the other
side within a round trip; room ids cannot cross requests; nothing dies quietly; the sessions use
the compat and observers they are given; decode TP ranks do not collide.
"""

from __future__ import annotations

import contextlib
import importlib
import time
from typing import Any

import numpy as np
import pytest
import torch
from _rig import (
    BPT,
    LAYERS,
    Decode,
    P,
    Prefill,
    agent_of,
    dst_layout,
    exact,
    exact_kv,
    expected,
    expected_kv,
    kv_config,
    rendezvous,
    rows,
    send_room,
    wait_all,
    wait_true,
    written,
)

import pdplug.transfer
from pdplug import CompatError, KVPoll, PluginManager, get_plugin_manager, hookimpl
from pdplug.transfer import KVReceiverSession
from pdplug.transfer.faults import FaultyEngine
from pdplug.types import PdplugEvent

pytestmark = pytest.mark.timeout(180)

FAILED, OK = KVPoll.Failed, KVPoll.Success


def _pages(start: int, n: int) -> np.ndarray:
    return np.arange(start, start + n, dtype=np.int64)


# ---------------------------------------------------------------- kind 1: drained means drained
def test_drained_waits_for_a_write_the_engine_still_has(backend: str) -> None:
    """B01: the decode aborts while a prefill write is held by the engine for 6 s (transfer
    timeout 2 s). Neither side may say drained before the write landed; the prefill reports it
    stuck; once it landed both drain, and pages reused then are never written again."""
    with rendezvous() as srv:
        pm = PluginManager()
        pre = Prefill(pm, backend, srv.endpoint, pp=1, transfer_timeout_s=2.0)
        dec = Decode(pm, backend, srv.endpoint, dcp=1, transfer_timeout_s=2.0)
        try:
            s, rc = pre.senders[0], dec.recvs[0]
            eng = FaultyEngine(s.engine, delay=(6.0, 6.0))
            s.engine = eng
            room, sp, dp = 5, _pages(0, 4), _pages(10, 4)
            s.start(room)
            rc.expect(room, dp, num_tokens=64)
            send_room(pre, room, sp)
            t_post = time.monotonic()
            time.sleep(0.1)
            rc.abort(room, "client went away")
            assert wait_all([s, rc], room, 5) == [FAILED, FAILED]
            time.sleep(max(0.0, t_post + 3.0 - time.monotonic()))  # past transfer_timeout_s
            assert eng.pending() == 1  # the engine still holds the write
            assert not rc.drained(room) and not s.drained(room)
            assert wait_true(lambda: s.stats()["stuck_writes"] >= 1, 2.5) is not None
            assert rc.stats()["undrained"] == 1
            assert wait_true(lambda: rc.drained(room), 10.0) is not None
            assert eng.pending() == 0 and s.drained(room)
            assert written(dec, [dp])  # the late write landed before "drained"
            for t in dec.kv[0]:
                t.numpy()[rows(dp)] = 0x33  # the next request's KV
            rc.clear(room)
            s.clear(room)
            time.sleep(0.5)
            assert all((t.numpy()[rows(dp)] == 0x33).all() for t in dec.kv[0])
            st = s.stats()
            assert st["writes_stuck"] == 1 and st["stuck_writes"] == 0, st
            assert st["busy_regions"] == 0 and st["xfers"] == 0, st
        finally:
            pre.close()
            dec.close()


# ---------------------------------------------------------------- kind 2: one peer's trouble
def test_rehandshake_keeps_rooms_and_the_agent(backend: str) -> None:
    """B06: a decode rank handshakes again with the same prefill while a room is in flight; that
    room and every later one complete byte-exact (the shared remote agent stays loaded)."""
    with rendezvous() as srv:
        pm = PluginManager()
        pre = Prefill(pm, backend, srv.endpoint, pp=1)
        dec = Decode(pm, backend, srv.endpoint, dcp=1)
        try:
            s, rc = pre.senders[0], dec.recvs[0]
            s.engine = FaultyEngine(s.engine, delay=(0.0, 0.0))
            for i, room in enumerate((1, 2, 3, 4)):
                sp, dp = _pages(4 * i, 4), _pages(8 * i, 4)
                s.start(room)
                rc.expect(room, dp, num_tokens=64)
                if room == 2:
                    s.engine.delay = (1.0, 1.0)
                send_room(pre, room, sp)
                if room == 2:
                    rc.connect(dec.peers)  # re-handshake while the write is in flight
                    s.engine.delay = (0.0, 0.0)
                st = wait_all([rc, s], room, 15)
                assert st == [OK, OK], (room, st, rc.failure_reason(room), s.failure_reason(room))
                assert exact(dec, expected(pre, dec, 64, 0, sp, [dp]), [dp]), room
            assert s.stats()["peers_rehandshake"] == 1
        finally:
            pre.close()
            dec.close()


def test_a_stuck_peer_does_not_hold_up_another(backend: str) -> None:
    """Writes to decode instance A are held by the engine (a peer that stopped answering). The
    rooms of decode instance B, sent after A's, complete at once (A's writes hold no more than
    its share of the pack regions); A's room fails (stuck, not drained) and drains once its
    writes are let go."""
    with rendezvous() as srv:
        pm = PluginManager()
        pre = Prefill(pm, backend, srv.endpoint, pp=1, transfer_timeout_s=8.0)
        a = Decode(pm, backend, srv.endpoint, dcp=2, instance="dec-A", transfer_timeout_s=5.0)
        b = Decode(pm, backend, srv.endpoint, dcp=2, instance="dec-B", transfer_timeout_s=5.0)
        try:
            s = pre.senders[0]
            held = a.agents()
            eng = FaultyEngine(s.engine, hold=lambda h: agent_of(h) in held)
            s.engine = eng
            dpa = [_pages(0, 8)] * 2
            s.start(100)
            for r, rc in enumerate(a.recvs):
                rc.expect(100, dpa[r], num_tokens=256, instance="prefill-0")
            send_room(pre, 100, _pages(0, 16))
            t0 = time.monotonic()
            rooms = {200 + i: [_pages(8 * i, 1)] * 2 for i in range(6)}
            for room, dps in rooms.items():
                s.start(room)
                for r, rc in enumerate(b.recvs):
                    rc.expect(room, dps[r], num_tokens=32)
            for room in rooms:
                send_room(pre, room, _pages(20, 2))
            for room, dps in rooms.items():
                st = wait_all(b.recvs, room, 10)
                assert st == [OK, OK], (room, st, b.recvs[0].failure_reason(room))
                assert exact(b, expected(pre, b, 32, 0, _pages(20, 2), dps), dps)
            # B was served while A's writes were still held and A not yet failed as stuck
            # (a loaded machine may take seconds; what matters is that A did not block B)
            assert s.poll(100) != FAILED, (s.failure_reason(100), time.monotonic() - t0)
            assert wait_all([*a.recvs, s], 100, 20) == [FAILED] * 3
            assert "not done after 8 s" in (s.failure_reason(100) or "")
            assert s.stats()["stuck_writes"] >= 1 and not any(rc.drained(100) for rc in a.recvs)
            assert eng.release_held() >= 1  # A's writes were held all along
            assert wait_true(lambda: all(rc.drained(100) for rc in a.recvs), 10) is not None
            assert s.drained(100) and s.stats()["busy_regions"] == 0
        finally:
            pre.close()
            a.close()
            b.close()


# ---------------------------------------------------------------- kind 3: counts must agree
@pytest.mark.parametrize("sent", [90, 101])
def test_a_token_count_disagreement_fails_both_sides(backend: str, sent: int) -> None:
    """B09, C22: the decode declared 100 tokens; the prefill's last segment ends at 90 or 101.
    Both sides fail, and both reasons name both numbers."""
    with rendezvous() as srv:
        pm = PluginManager()
        pre = Prefill(pm, backend, srv.endpoint, pp=1)
        dec = Decode(pm, backend, srv.endpoint, dcp=1)
        try:
            s, rc = pre.senders[0], dec.recvs[0]
            s.start(1)
            rc.expect(1, _pages(0, 7), num_tokens=100)
            send_room(pre, 1, _pages(0, 7), token_end=sent)
            assert wait_all([s, rc], 1, 10) == [FAILED, FAILED]
            for why in (s.failure_reason(1), rc.failure_reason(1)):
                assert why is not None and str(sent) in why and "num_tokens=100" in why, why
        finally:
            pre.close()
            dec.close()


# ---------------------------------------------------------------- kind 4: silence, not queueing
def test_rooms_queued_behind_others_do_not_time_out(backend: str) -> None:
    """C20: 24 rooms sent at once through an engine whose every write takes 200-300 ms; the last
    rooms wait in the send queue for about two transfer timeouts (5 s), yet every room succeeds
    byte-exact."""
    with rendezvous() as srv:
        pm = PluginManager()
        kw = dict(transfer_timeout_s=5.0, bootstrap_timeout_s=60.0, waiting_timeout_s=60.0)
        pre = Prefill(pm, backend, srv.endpoint, pp=2, pages=24 * 16, **kw)
        dec = Decode(pm, backend, srv.endpoint, dcp=2, pages=24 * 8, **kw)
        try:
            for k, s in enumerate(pre.senders):
                s.engine = FaultyEngine(s.engine, delay=(0.2, 0.3), seed=k)
            rng = np.random.default_rng(3)
            rooms = {}
            for i in range(24):
                total = int(rng.integers(129, 257))
                rooms[300 + i] = (total, _pages(16 * i, 16), [_pages(8 * i, 8)] * 2)
            t0 = time.monotonic()
            for room, (total, _sp, dps) in rooms.items():
                for s in pre.senders:
                    s.start(room)
                for r, rc in enumerate(dec.recvs):
                    rc.expect(room, dps[r], num_tokens=total)
            for room, (_total, sp, _dps) in rooms.items():
                send_room(pre, room, sp)
            for room, (total, sp, dps) in rooms.items():
                st = wait_all(dec.recvs + pre.senders, room, 90)
                assert st == [OK] * 4, (room, st, dec.recvs[0].failure_reason(room))
                assert exact(dec, expected(pre, dec, total, 0, sp, dps), dps), room
            assert time.monotonic() - t0 > 7.5  # the last rooms queued for over a timeout
        finally:
            pre.close()
            dec.close()


def test_an_abort_before_start_ends_the_room_at_once(backend: str) -> None:
    """C13 (b, c): the decode aborts before (or while) the prefill starts the room; the prefill
    fails and drains within a round trip, not after bootstrap_timeout_s (20 s here)."""
    kw = dict(bootstrap_timeout_s=20.0, waiting_timeout_s=20.0)
    with rendezvous() as srv:
        pm = PluginManager()
        pre = Prefill(pm, backend, srv.endpoint, pp=2, **kw)
        dec = Decode(pm, backend, srv.endpoint, dcp=2, **kw)
        try:
            dps = [_pages(0, 4), _pages(4, 4)]
            for room, gap in ((1302, 0.3), (1303, 0.0)):
                for r, rc in enumerate(dec.recvs):
                    rc.expect(room, dps[r], num_tokens=100)
                if gap:
                    time.sleep(0.2)
                    for rc in dec.recvs:
                        rc.abort(room, "client went away")
                    time.sleep(gap)
                t0 = time.monotonic()
                for s in pre.senders:
                    s.start(room)
                if not gap:
                    for rc in dec.recvs:
                        rc.abort(room, "client went away")

                def freed(room: int = room) -> bool:
                    return all(s.poll(room) == FAILED and s.drained(room) for s in pre.senders)

                assert wait_true(freed, 10.0) is not None
                assert time.monotonic() - t0 < 5.0, room
                assert "client went away" in (pre.senders[0].failure_reason(room) or "")
                assert wait_true(lambda room=room: all(rc.drained(room) for rc in dec.recvs), 5)
        finally:
            pre.close()
            dec.close()


def test_a_destination_after_the_prefill_gave_up_is_refused_at_once(backend: str) -> None:
    """C13b: the prefill room failed (bootstrap timeout 1 s) before the decode sent its
    destination; the decode learns it within a round trip, not after waiting_timeout_s (30 s)."""
    with rendezvous() as srv:
        pm = PluginManager()
        pre = Prefill(pm, backend, srv.endpoint, pp=2, bootstrap_timeout_s=1.0)
        dec = Decode(pm, backend, srv.endpoint, dcp=2, waiting_timeout_s=30.0)
        try:
            for s in pre.senders:
                s.start(1399)
            assert wait_all(pre.senders, 1399, 10) == [FAILED, FAILED]
            t0 = time.monotonic()
            for rc in dec.recvs:
                rc.expect(1399, _pages(0, 4), num_tokens=100)
            assert wait_all(dec.recvs, 1399, 20) == [FAILED, FAILED]
            assert time.monotonic() - t0 < 5.0
            assert "Bootstrapping" in (dec.recvs[0].failure_reason(1399) or "")
            # each PP rank refuses on its own: the first refusal fails the room, the room drains
            # when the other's notice has come too
            assert wait_true(lambda: all(rc.drained(1399) for rc in dec.recvs), 5)
        finally:
            pre.close()
            dec.close()


class _NoDecline:
    """A receiver written before ``decline``: only the Protocol's calls."""

    def __init__(self, rc: Any) -> None:
        self.expect, self.abort = rc.expect, rc.abort


@pytest.mark.parametrize("own", [True, False], ids=["decline", "expect-abort"])
def test_a_room_declined_before_its_pages_ends_the_prefill_room_at_once(
    backend: str, own: bool
) -> None:
    """SGLang's decode abort before its metadata (``decline_room``): the prefill room fails
    within a round trip, not at its bootstrap deadline (30 s), naming the reason; with the
    receiver's own ``decline`` no DestInfo goes out, so the prefill never sees the room
    ``WaitingForInput`` and the decode room is drained at once. The CI flake it fixes: an
    expect-then-abort let a prefill poll see ``WaitingForInput`` between the two messages."""
    from pdplug.protocols import decline_room

    with rendezvous() as srv:
        pm = PluginManager()
        pre = Prefill(pm, backend, srv.endpoint, pp=2, bootstrap_timeout_s=30.0)
        dec = Decode(pm, backend, srv.endpoint, dcp=2)
        try:
            for room in (1501, 1502):  # declined after the prefill started it, and before
                if room == 1501:
                    for s in pre.senders:
                        s.start(room)
                t0 = time.monotonic()
                for rc in dec.recvs:
                    decline_room(rc if own else _NoDecline(rc), room, "client went away")
                    assert rc.poll(room) == FAILED
                    assert "client went away" in (rc.failure_reason(room) or "")
                    assert not own or rc.drained(room)
                if room == 1502:
                    time.sleep(0.5)  # the aborts wait on the prefill for its start
                    for s in pre.senders:
                        s.start(room)
                seen: set[KVPoll] = set()

                def ended(room: int = room, seen: set[KVPoll] = seen) -> bool:
                    st = [s.poll(room) for s in pre.senders]
                    seen.update(st)
                    return all(x == FAILED for x in st)

                assert wait_true(ended, 5.0) is not None, room
                assert time.monotonic() - t0 < 5.0
                assert "client went away" in (pre.senders[0].failure_reason(room) or "")
                if own:
                    assert KVPoll.WaitingForInput not in seen, (room, seen)
                assert wait_true(lambda room=room: all(rc.drained(room) for rc in dec.recvs), 5)
                for rc in dec.recvs:
                    rc.clear(room)
            n = 2 if own else 0  # counted on the engine thread: the second rank's may lag
            assert wait_true(lambda: all(rc.stats().get("declined", 0) == n for rc in dec.recvs), 5)
            # cleared at once (before the engine thread saw the room): the prefill is told
            for room, how in ((1511, "decline"), (1512, "expect")):
                for s in pre.senders:
                    s.start(room)
                t0 = time.monotonic()
                for rc in dec.recvs:
                    if how == "decline":
                        decline_room(rc if own else _NoDecline(rc), room, "client went away")
                    else:
                        rc.expect(room, _pages(0, 4), num_tokens=100)
                    rc.clear(room)
                assert wait_all(pre.senders, room, 10) == [FAILED, FAILED], (room, how)
                assert time.monotonic() - t0 < 5.0, (room, how)
            with pytest.raises(ValueError, match=r"decline: room 1503 is already leased"):
                dec.recvs[0].expect(1503, _pages(0, 2))
                dec.recvs[0].decline(1503, "twice")
            with pytest.raises(ValueError, match=r"KVReceiver\.decline: prefill instance 'nope'"):
                dec.recvs[0].decline(1504, "x", instance="nope")
            for bad in (-1, 1 << 63, 1 << 64, "12", True):  # rooms are int64 on every wire
                with pytest.raises(ValueError, match=r"room=.* must be an int in \[0, 2\*\*63\)"):
                    dec.recvs[0].decline(bad, "x")  # type: ignore[arg-type]
            with pytest.raises(TypeError, match="decline: reason must be a str, got 123"):
                dec.recvs[0].decline(1505, 123)  # type: ignore[arg-type]
            with pytest.raises(TypeError, match="decline_room: reason must be a str, got None"):
                decline_room(_NoDecline(dec.recvs[0]), 1505, None)  # type: ignore[arg-type]
            assert 1505 not in dec.recvs[0].rooms  # refused before anything was leased
        finally:
            pre.close()
            dec.close()


def test_a_room_aborted_while_its_prefill_is_being_found_ends_the_prefill_room_at_once(
    backend: str,
) -> None:
    """A decode rank that knows the prefill by its rendezvous only (``find``): its first
    rooms wait while the instance is looked up and connected. One aborted and one declined
    meanwhile never had a DestInfo sent; the prefill is told when the handshake ends, so its
    rooms fail within a round trip, not at their bootstrap deadline (30 s), and a room
    expected after them still succeeds."""
    with rendezvous() as srv:
        pm = PluginManager()
        pre = Prefill(pm, backend, srv.endpoint, pp=2, bootstrap_timeout_s=30.0)
        lay = dst_layout(1, 0)
        rc = pm.make_kv_receiver(kv_config("decode", lay, srv.endpoint, "decode-0"), name=backend)
        try:
            rc.register_kv([torch.zeros((96 * P, b), dtype=torch.uint8) for b in BPT * LAYERS])
            rc.find("prefill-0", srv.endpoint)
            for s in pre.senders:
                for room in (1601, 1602, 1603):
                    s.start(room)
            t0 = time.monotonic()
            rc.expect(1601, _pages(0, 8), num_tokens=100, instance="prefill-0")
            rc.abort(1601, "client went away")
            rc.decline(1602, "client went away", instance="prefill-0")
            assert rc.poll(1601) == rc.poll(1602) == FAILED
            for room in (1601, 1602):
                assert wait_all(pre.senders, room, 10) == [FAILED, FAILED], room
                assert "client went away" in (pre.senders[1].failure_reason(room) or "")
            assert time.monotonic() - t0 < 5.0
            assert wait_true(lambda: rc.drained(1601) and rc.drained(1602), 5)
            rc.expect(1603, _pages(8, 8), num_tokens=64, instance="prefill-0")
            assert (
                wait_all(pre.senders, 1603, 10, (KVPoll.WaitingForInput,))
                == [KVPoll.WaitingForInput] * 2
            )
        finally:
            rc.close()
            pre.close()


# ---------------------------------------------------------------- kind 5: room ids
@pytest.mark.parametrize("first", ["A", "B"])
def test_two_decodes_claiming_one_room_are_told_at_once(backend: str, first: str) -> None:
    """B05: decode instances A and B both claim room 777 while the prefill serves A's request.
    Whoever is not served learns it within a round trip (timeouts 20 s) and its pages are never
    written; at most one is served, byte-exact (never the second claimant)."""
    kw = dict(transfer_timeout_s=5.0, waiting_timeout_s=20.0, bootstrap_timeout_s=20.0)
    with rendezvous() as srv:
        pm = PluginManager()
        pre = Prefill(pm, backend, srv.endpoint, pp=2, **kw)
        a = Decode(pm, backend, srv.endpoint, dcp=2, instance="dec-A", **kw)
        b = Decode(pm, backend, srv.endpoint, dcp=2, instance="dec-B", **kw)
        try:
            room, total, sp = 777, 150, _pages(0, 10)
            da, db = [_pages(0, 5)] * 2, [_pages(10, 5)] * 2
            for s in pre.senders:
                s.start(room)
            t0 = time.monotonic()
            order = ((a, da), (b, db)) if first == "A" else ((b, db), (a, da))
            for d, dps in order:
                for r, rc in enumerate(d.recvs):
                    rc.expect(room, dps[r], num_tokens=total)
                time.sleep(0.05)
            st = wait_all(pre.senders, room, 5, until=(KVPoll.WaitingForInput, KVPoll.Failed))
            if all(x == KVPoll.WaitingForInput for x in st):
                send_room(pre, room, sp)
            sa, sb = wait_all(a.recvs, room, 25), wait_all(b.recvs, room, 25)
            assert time.monotonic() - t0 < 6.0, (sa, sb)
            # the prefill cannot know whose room it is: at most one claimant is served (the one
            # whose claim completed before the conflict showed, e.g. B under load when B is
            # first), byte-exact; every other one is told, and its pages are never written
            assert not (sa == [OK, OK] and sb == [OK, OK]), (sa, sb)
            told = []
            for d, dps, st_ in ((a, da, sa), (b, db, sb)):
                if st_ == [OK, OK]:
                    assert exact(d, expected(pre, d, total, 0, sp, dps), dps)
                else:
                    assert st_ == [FAILED, FAILED] and not written(d, dps), st_
                    told.append(d.recvs[0].failure_reason(room) or "")
            assert any("claimed by two decode instances" in r for r in told), told
            if first == "A":  # B's claim came second: B is never served
                assert sb == [FAILED, FAILED], sb
            assert all(s.stats()["room_conflicts"] >= 1 for s in pre.senders)
        finally:
            pre.close()
            a.close()
            b.close()


# ---------------------------------------------------------------- kind 9: nothing dies quietly
class _Fatal(BaseException):
    """What kills an engine thread (not an ``Exception``: no round survives it)."""


class _DyingEngine(FaultyEngine):
    armed = False

    def progress(self) -> None:
        if self.armed:
            raise _Fatal("engine driver crashed")
        super().progress()


def test_a_dead_engine_thread_fails_every_room(backend: str) -> None:
    """When a session's engine thread dies, every room fails naming the cause and wait()
    returns at once; stats() says so; close() still returns."""
    with rendezvous() as srv:
        pm = PluginManager()
        pre = Prefill(pm, backend, srv.endpoint, pp=1)
        dec = Decode(pm, backend, srv.endpoint, dcp=1)
        try:
            s, rc = pre.senders[0], dec.recvs[0]
            eng = _DyingEngine(s.engine)
            s.engine = eng
            for room in (1, 2):
                s.start(room)
            rc.expect(1, _pages(0, 4), num_tokens=64)
            eng.armed = True
            t0 = time.monotonic()
            for room in (1, 2):
                assert s.wait(room, timeout_s=10) == FAILED
                assert "engine thread died (_Fatal: engine driver crashed)" in (
                    s.failure_reason(room) or ""
                )
            assert time.monotonic() - t0 < 5.0
            assert "engine driver crashed" in s.stats()["engine_thread_died"]
            assert s.drained(1) is False
        finally:
            pre.close()
            dec.close()


def test_lost_nixl_notifications_show_in_stats() -> None:
    """A decode rank whose NIXL notifications are lost (a buffer of 0 here) fails the room by
    its timeout (waiting_timeout_s 1 s) and says why in stats(): ``engine_notifs_lost``."""
    from pdplug.testing import require

    require("nixl")
    with rendezvous() as srv:
        pm = PluginManager()
        pre = Prefill(pm, "nixl", srv.endpoint, pp=1, transfer_timeout_s=1.0)
        dec = Decode(
            pm,
            "nixl",
            srv.endpoint,
            dcp=1,
            transfer_timeout_s=1.0,
            waiting_timeout_s=1.0,
            extra={"max_notifs": "0"},
        )
        try:
            s, rc = pre.senders[0], dec.recvs[0]
            s.start(1)
            rc.expect(1, _pages(0, 4), num_tokens=64)
            send_room(pre, 1, _pages(0, 4))
            st = rc.wait(1, timeout_s=10)
            # both sides' counters on failure: what kept the room alive, or the loop from ending it
            assert st == FAILED, (st, s.poll(1), rc.stats(), s.stats())
            assert rc.stats()["engine_notifs_lost"] >= 1
        finally:
            pre.close()
            dec.close()


# ---------------------------------------------------------------- kind 7: the host's manager
def _dst_kv() -> list[torch.Tensor]:
    return [torch.zeros((32 * P, b), dtype=torch.uint8) for b in BPT * LAYERS]


class _Veto:
    @hookimpl
    def pdplug_check_compat(self, local: Any, remote: Any) -> list[str]:
        """Refuse every peer."""
        return ["veto: refused by the test"]


def test_sessions_use_the_compat_and_emit_they_are_given(backend: str) -> None:
    """No process-wide default: a session built without ``compat`` checks layouts only (a veto
    on the process-wide manager is not consulted) and emits nothing; one built with them uses
    them; a host's PluginManager passes its own."""
    assert not hasattr(pdplug.transfer, "default_compat")
    assert not hasattr(pdplug.transfer, "default_emit")
    glob = get_plugin_manager()
    glob.pm.register(_Veto(), name="test-global-veto")
    try:
        with rendezvous() as srv:
            pm = PluginManager(env={}, plugins=[])
            pre = Prefill(pm, backend, srv.endpoint, pp=1)
            factory = importlib.import_module(f"pdplug_{backend}.receiver").make_receiver
            events: list[PdplugEvent] = []
            memory: list[list[torch.Tensor]] = []  # registered KV must outlive the sessions

            def recv(name: str, **kw: Any) -> KVReceiverSession:
                cfg = kv_config("decode", dst_layout(1, 0), srv.endpoint, name)
                rc: KVReceiverSession = factory(cfg, **kw)
                memory.append(_dst_kv())
                rc.register_kv(memory[-1])
                return rc

            plain = recv("plain")
            vetoed = recv("vetoed", compat=lambda local, remote: ["veto: given"])
            observed = recv("observed", emit=events.append)
            try:
                plain.connect([pre.senders[0].peer_info()])  # the global veto is not asked
                with pytest.raises(CompatError, match="veto: given"):
                    vetoed.connect([pre.senders[0].peer_info()])
                observed.connect([pre.senders[0].peer_info()])
                pre.senders[0].start(1)
                observed.expect(1, _pages(0, 4), num_tokens=64)
                send_room(pre, 1, _pages(0, 4))
                assert observed.wait(1, timeout_s=10) == OK
                assert wait_true(lambda: [e.kind for e in events] == ["transfer_done"], 5)
            finally:
                for rc in (plain, vetoed, observed):
                    rc.close()
            host = PluginManager(env={}, plugins=[("veto", _Veto())])
            cfg = kv_config("decode", dst_layout(1, 0), srv.endpoint, "h")
            rc = host.make_kv_receiver(cfg, name=backend)
            try:
                memory.append(_dst_kv())
                rc.register_kv(memory[-1])
                with pytest.raises(CompatError, match="veto: refused by the test"):
                    rc.connect([pre.senders[0].peer_info()])
            finally:
                rc.close()
                pre.close()
    finally:
        glob.pm.unregister(name="test-global-veto")


# ---------------------------------------------------------------- peers keyed by position
def test_decode_tp_ranks_each_get_their_own_prefill_tp_rank(backend: str) -> None:
    """Prefill TP 2 -> decode TP 2 (peers keyed by instance, TP, DCP and PP rank): each decode TP
    rank receives exactly its prefill TP rank's KV; TP 2 -> TP 1 is refused at the handshake."""
    with rendezvous() as srv:
        pm = PluginManager()
        pre = Prefill(pm, backend, srv.endpoint, pp=1, tp=2)
        dec = Decode(pm, backend, srv.endpoint, dcp=1, tp=2)
        try:
            sp, dp = _pages(0, 7), _pages(3, 7)
            for s in pre.senders:
                s.start(9)
            for rc in dec.recvs:
                rc.expect(9, dp, num_tokens=100)
            send_room(pre, 9, sp)
            for t, rc in enumerate(dec.recvs):
                assert rc.wait(9, timeout_s=10) == OK, rc.failure_reason(9)
                want = expected_kv([pre.kv[t]], [dec.kv[t]], 100, 0, sp, [dp])
                assert exact_kv([dec.kv[t]], want, [dp]), t
            cfg = kv_config("decode", dst_layout(1, 0), srv.endpoint, "dec-tp1")
            tp1 = pm.make_kv_receiver(cfg, name=backend)
            kv = _dst_kv()
            try:
                tp1.register_kv(kv)
                with pytest.raises(CompatError, match="tp_size: prefill 2 vs decode 1"):
                    tp1.connect(dec.peers)
            finally:
                tp1.close()
        finally:
            pre.close()
            dec.close()


@contextlib.contextmanager
def _switched_pair(backend: str, switch: Any, monkeypatch: pytest.MonkeyPatch) -> Any:
    """A prefill and a decode rank whose prefill engine is wrapped by the test-only switch
    file ``switch`` (``PDPLUG_TEST_FAIL_WRITES``): yields ``(pre, dec, sender, receiver)``."""
    from pdplug.transfer.faults import FAULT_ENV, inject_from_env

    monkeypatch.setenv(FAULT_ENV, str(switch))
    with rendezvous() as srv:
        pm = PluginManager()
        pre = Prefill(pm, backend, srv.endpoint, pp=1)
        dec = Decode(pm, backend, srv.endpoint, dcp=1)
        try:
            s = pre.senders[0]
            assert inject_from_env(s)
            yield pre, dec, s, dec.recvs[0]
        finally:
            pre.close()
            dec.close()


def test_failing_writes_switch_fails_rooms_only_while_on(
    backend: str, tmp_path: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The test-only ``PDPLUG_TEST_FAIL_WRITES`` switch (what the vLLM engine tests inject):
    while its file exists a write reports an error, the room fails on both sides and drains;
    once it is gone the next room completes byte-exact on the same session."""
    switch = tmp_path / "fail-writes"
    with _switched_pair(backend, switch, monkeypatch) as (pre, dec, s, rc):
        for room, on in ((1, True), (2, False)):
            if on:
                switch.write_text("1")
            elif switch.exists():
                switch.unlink()
            sp, dp = _pages(4 * room, 4), _pages(8 * room, 4)
            s.start(room)
            rc.expect(room, dp, num_tokens=64)
            send_room(pre, room, sp)
            st = wait_all([rc, s], room, 15)
            if on:
                assert st == [FAILED, FAILED], st
                assert "failed (engine ERR)" in (rc.failure_reason(room) or ""), room
                deadline = time.monotonic() + 10
                while not (s.drained(room) and rc.drained(room)):
                    assert time.monotonic() < deadline, "failed room never drained"
                    time.sleep(0.01)
            else:
                assert st == [OK, OK], (st, rc.failure_reason(room))
                assert exact(dec, expected(pre, dec, 64, 0, sp, [dp]), [dp])
        assert s.engine.failed >= 1


def test_hold_switch_keeps_room_live_until_released(
    backend: str, tmp_path: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The switch holding ``hold`` (what the vLLM kill phase uses to kill a decode while its
    rooms are live): no write is issued and the room stays live on both sides however long it
    is held; once the switch is gone the same room completes byte-exact."""
    from pdplug.transfer.faults import HOLD

    switch = tmp_path / "fail-writes"
    with _switched_pair(backend, switch, monkeypatch) as (pre, dec, s, rc):
        switch.write_text(HOLD)
        room, sp, dp = 1, _pages(4, 4), _pages(8, 4)
        s.start(room)
        rc.expect(room, dp, num_tokens=64)
        send_room(pre, room, sp)
        time.sleep(0.5)  # held: nothing may finish, whatever the host's speed
        assert s.poll(room) not in (OK, FAILED) and rc.poll(room) not in (OK, FAILED)
        assert s.engine.pending() >= 1 and s.engine.failed == 0
        switch.unlink()
        st = wait_all([rc, s], room, 15)
        assert st == [OK, OK], (st, rc.failure_reason(room))
        assert exact(dec, expected(pre, dec, 64, 0, sp, [dp]), [dp])
