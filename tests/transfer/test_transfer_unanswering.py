"""One peer that stops answering costs its own rooms only (field case C17: SGLang users with a
multi-homed host or an unreachable advertised address), over real engines on 127.0.0.1.

Two shapes of "accepts TCP, never answers": a decode whose advertised Mooncake session is a
listener that accepts and never replies (the case as reported: a wrong ``extra['host']``, a
NAT or firewall that swallows the answer), and a decode process frozen with SIGSTOP right after
its handshake (a host that hangs: the kernel still completes TCP handshakes, nothing above it
answers). In both, rooms to a healthy decode instance sent afterwards succeed byte-exact and at
once, and the rooms of the unanswering peer fail within the configured timeouts.
"""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import threading
import time
from collections.abc import Iterator
from typing import Any

import msgspec
import numpy as np
import pytest
from _rig import Decode, P, Prefill, dst_layout, exact, expected, rendezvous, send_room, wait_all

from pdplug import KVPoll, PluginManager

pytestmark = [pytest.mark.timeout(180), pytest.mark.slow]

FAILED, OK = KVPoll.Failed, KVPoll.Success


def _pages(start: int, n: int) -> np.ndarray:
    return np.arange(start, start + n, dtype=np.int64)


@contextlib.contextmanager
def _silent_listener() -> Iterator[tuple[str, int]]:
    """A TCP listener on 127.0.0.1 that accepts every connection and never sends a byte."""
    lst = socket.socket()
    lst.bind(("127.0.0.1", 0))
    lst.listen(16)
    held: list[Any] = []

    def accept() -> None:
        while True:
            try:
                held.append(lst.accept())
            except OSError:
                return

    threading.Thread(target=accept, daemon=True).start()
    try:
        yield lst.getsockname()
    finally:
        lst.close()
        for conn, _ in held:
            conn.close()


def _healthy_rooms(pre: Prefill, good: Decode, first: int, n: int) -> float:
    """Send ``n`` one-page rooms to ``good`` and check them; returns the seconds they took."""
    t0 = time.monotonic()
    for room in range(first, first + n):
        dps = [_pages(room % 64, 1)] * good.dcp
        pre.senders[0].start(room)
        for r, rc in enumerate(good.recvs):
            rc.expect(room, dps[r], num_tokens=P * good.dcp, instance="prefill-0")
        send_room(pre, room, _pages(20, good.dcp))
        st = wait_all(good.recvs, room, 10)
        assert st == [OK] * good.dcp, (room, st, good.recvs[0].failure_reason(room))
        assert exact(good, expected(pre, good, P * good.dcp, 0, _pages(20, good.dcp), dps), dps)
    return time.monotonic() - t0


@pytest.mark.mooncake
def test_an_unanswering_mooncake_session_costs_its_own_rooms_only() -> None:
    """C17 as reported: decode ``dec-bad`` advertises a Mooncake session whose address accepts
    TCP and never answers. Its room fails naming the probe; rooms to ``dec-good`` sent right
    after it, 2 s and 6 s later succeed byte-exact (before the fix, every one failed for as
    long as the process lived: the binding's handshake held the lock every write takes)."""
    pytest.importorskip("mooncake.engine")
    with rendezvous() as srv:
        pm = PluginManager()
        pre = Prefill(pm, "mooncake", srv.endpoint, pp=1, transfer_timeout_s=3.0)
        bad = Decode(pm, "mooncake", srv.endpoint, dcp=1, instance="dec-bad",
                     transfer_timeout_s=3.0)  # fmt: skip
        good = Decode(pm, "mooncake", srv.endpoint, dcp=1, instance="dec-good",
                      transfer_timeout_s=3.0)  # fmt: skip
        try:
            with _silent_listener() as (host, port):
                rc = bad.recvs[0]
                rc.connect(bad.peers)  # connect once more, advertising the silent address
                rc._info = msgspec.structs.replace(rc.peer_info(), agent=f"{host}:{port}".encode())
                rc.connect(bad.peers)
                assert _healthy_rooms(pre, good, 1, 1) < 10
                pre.senders[0].start(500)
                rc.expect(500, _pages(0, 4), num_tokens=4 * P, instance="prefill-0")
                send_room(pre, 500, _pages(0, 4))
                for pause in (0.0, 2.0, 4.0):
                    time.sleep(pause)
                    assert _healthy_rooms(pre, good, 10 + int(pause), 1) < 10
                assert wait_all([pre.senders[0], rc], 500, 15) == [FAILED, FAILED]
                assert "handshake probe" in (pre.senders[0].failure_reason(500) or "")
                assert pre.senders[0].drained(500)
                assert pre.senders[0].stats()["engine_probe_failed"] >= 1
        finally:
            for x in (pre, bad, good):
                x.close()


def test_a_frozen_decode_process_costs_its_own_rooms_only(backend: str) -> None:
    """A decode process (instance ``dec-frozen``, DCP 1) handshakes, then is frozen with
    SIGSTOP. Its room ends on the prefill within the timeouts: failed and drained (or held as a
    stuck write, never reported drained early), or, on NIXL, a success when UCX wrote it over
    shared memory without the stopped process; eight rooms to a healthy in-process decode
    (DCP 2) sent meanwhile all succeed byte-exact within seconds."""
    from pdplug_bench._kvpeer import DecodeInstance, DecodePeer

    with rendezvous() as srv:
        pm = PluginManager()
        pre = Prefill(pm, backend, srv.endpoint, pp=1, transfer_timeout_s=3.0)
        good = Decode(pm, backend, srv.endpoint, dcp=2, instance="dec-good",
                      transfer_timeout_s=3.0)  # fmt: skip
        lay = msgspec.structs.replace(dst_layout(1, 0), dcp_size=1)
        frozen = DecodePeer(
            backend, srv.endpoint, "prefill-0",
            [DecodeInstance(name="dec-frozen", layout=lay, rows=64 * P)],
        )  # fmt: skip
        stopped = False
        try:
            frozen.wait_ready(120)
            assert _healthy_rooms(pre, good, 1, 1) < 10
            frozen.expect("dec-frozen", 900, [list(range(4))], 4 * P)
            pre.senders[0].start(900)
            wait_all(pre.senders, 900, 20, until=(KVPoll.WaitingForInput, FAILED))
            assert pre.senders[0].poll(900) == KVPoll.WaitingForInput
            pid = frozen.proc.pid
            assert pid is not None
            os.kill(pid, signal.SIGSTOP)
            stopped = True
            send_room(pre, 900, _pages(0, 4))
            took = _healthy_rooms(pre, good, 20, 8)
            assert took < 20, took
            st = wait_all(pre.senders, 900, 15)
            # UCX over shared memory writes into a stopped process's pages without its CPU: a
            # NIXL room to it may succeed (its bytes did land); it must end either way
            want = ([FAILED], [KVPoll.Success]) if backend == "nixl" else ([FAILED],)
            assert st in want, (st, pre.senders[0].failure_reason(900))
            # after the healthy rooms, and with the frozen peer still frozen: more healthy rooms
            assert _healthy_rooms(pre, good, 40, 4) < 10
        finally:
            if stopped and frozen.proc.pid is not None:
                os.kill(frozen.proc.pid, signal.SIGCONT)
            frozen.close()
            for x in (pre, good):
                x.close()
