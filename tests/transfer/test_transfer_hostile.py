"""The KV control channel fails closed (issue 10, kind 8), over real engines and real sockets.

A prefill rank (this process) and a decode rank share ``WireConfig.hmac_key``. The decode rank
reaches the prefill's control endpoint through :class:`Tap`, an on-path attacker that records
every frame both ways and can inject frames on the decode's own connection. Nothing without the
key, and no replay of a captured frame, may complete a Hello, evict the decode, abort or bind
one of its rooms, or keep a dead decode alive; an oversized frame never reaches a session; off
loopback without a key a session refuses to start; a restarted decode process re-handshakes
and keeps working.
"""

from __future__ import annotations

import contextlib
import itertools
import secrets
import threading
import time
from collections import deque
from collections.abc import Iterator
from types import SimpleNamespace
from typing import Any

import _kvharness as kh
import msgspec
import numpy as np
import pytest
import torch
import zmq
from _rig import (
    POISON,
    P,
    Prefill,
    dst_layout,
    exact_kv,
    expected_kv,
    kv_config,
    send_room,
    src_layout,
    wait_all,
    wait_true,
)

from pdplug import KVPoll, PluginManager, WireConfig
from pdplug.bootstrap import RendezvousServer, resolve
from pdplug.transfer.messages import Abort, Heartbeat, Hello, HelloAck, control_codec
from pdplug.types import PeerInfo
from pdplug.wire import peer_identity

pytestmark = pytest.mark.timeout(180)

OK, FAILED = KVPoll.Success, KVPoll.Failed
LIMIT = 1 << 20  # max_message_bytes of these tests


def _pages(start: int, n: int = 4) -> np.ndarray:
    return np.arange(start, start + n, dtype=np.int64)


def _body(frame: bytes) -> Any:
    """The payload of a keyed control frame, sealed (``mac + [sender, epoch, seq, ms, body]``)
    or plain (``mac + body``): what an on-path observer reads without the key."""
    obj = msgspec.msgpack.decode(frame[32:])
    return obj[4] if isinstance(obj, list) and len(obj) == 5 else obj


def _room(body: Any) -> int | None:
    if body.get("type") == "done":
        return int(body["chunk"][2])  # ChunkTag is array-like: tag, generation, room, ...
    return body.get("room")


class Tap:
    """A relay between a decode rank and a prefill rank's control endpoint (one backend
    connection per decode connection) that records every frame and injects frames on the
    decode's connection, in either direction."""

    def __init__(self, target: str) -> None:
        self._ctx = zmq.Context.instance()
        self._front = self._ctx.socket(zmq.ROUTER)
        self._front.setsockopt(zmq.LINGER, 0)
        port = self._front.bind_to_random_port("tcp://127.0.0.1")
        self.endpoint = f"tcp://127.0.0.1:{port}"
        self._target = target
        self.backs: dict[bytes, Any] = {}  # decode connection (routing id) -> backend DEALER
        self.up: list[bytes] = []  # decode -> prefill
        self.down: list[bytes] = []  # prefill -> decode
        self._inject: deque[tuple[str, bytes]] = deque()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="tap", daemon=True)
        self._thread.start()

    def frames(self, kind: str, room: int | None = None, up: bool = True) -> list[bytes]:
        """Recorded frames of one message kind (``"hello"``, ``"dest"``, ``"hb"``, …)."""
        out = []
        for f in list(self.up if up else self.down):
            b = _body(f)
            if b.get("type") == kind and (room is None or _room(b) == room):
                out.append(f)
        return out

    def inject(self, frame: bytes, up: bool = True) -> None:
        """Send ``frame`` on the decode's latest connection, to the prefill (``up``) or to the
        decode."""
        self._inject.append(("up" if up else "down", frame))

    def close(self) -> None:
        self._stop.set()
        self._thread.join(5)

    def _run(self) -> None:
        poller = zmq.Poller()
        poller.register(self._front, zmq.POLLIN)
        last = b""
        try:
            while not self._stop.is_set():
                events = dict(poller.poll(10))
                if self._front in events:
                    while True:
                        try:
                            route, frame = self._front.recv_multipart(zmq.NOBLOCK)
                        except zmq.Again:
                            break
                        back = self.backs.get(route)
                        if back is None:
                            back = self.backs[route] = self._ctx.socket(zmq.DEALER)
                            back.setsockopt(zmq.LINGER, 0)
                            back.connect(self._target)
                            poller.register(back, zmq.POLLIN)
                        last = route
                        self.up.append(frame)
                        back.send(frame)
                for route, back in list(self.backs.items()):
                    if back in events:
                        while True:
                            try:
                                frame = back.recv(zmq.NOBLOCK)
                            except zmq.Again:
                                break
                            self.down.append(frame)
                            self._front.send_multipart([route, frame])
                while self._inject:
                    way, frame = self._inject.popleft()
                    if way == "up":
                        self.backs[last].send(frame)
                    else:
                        self._front.send_multipart([last, frame])
        finally:
            for s in (self._front, *self.backs.values()):
                s.close(0)


def _ask(endpoint: str, frames: list[bytes], wait_s: float = 1.0) -> list[bytes]:
    """Send ``frames`` from a new connection; return what comes back within ``wait_s``."""
    sock = zmq.Context.instance().socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.connect(endpoint)
    try:
        for f in frames:
            sock.send(f)
        got = []
        t_end = time.monotonic() + wait_s
        while (left := t_end - time.monotonic()) > 0:
            if sock.poll(int(left * 1000) + 1):
                got.append(sock.recv())
        return got
    finally:
        sock.close(0)


def _decode(
    pm: PluginManager, backend: str, srv: str, wire: WireConfig, via: str, **kw: Any
) -> Any:
    """A decode rank (DCP 1, PP 1) whose control connection goes through ``via``."""
    peers = [
        msgspec.structs.replace(p, control_endpoint=via)
        for p in resolve(srv, "prefill-0", timeout_s=20, wire=wire)
    ]
    lay = dst_layout(1, 0)
    rc = pm.make_kv_receiver(
        kv_config("decode", lay, srv, "decode-0", wire=wire, **kw), name=backend
    )
    rc.kv = [torch.full((64 * P, b), POISON, dtype=torch.uint8) for b in lay.entry_bytes_per_token]
    rc.register_kv(rc.kv)
    rc.connect(peers)
    return rc


@contextlib.contextmanager
def keyed(backend: str, **kw: Any) -> Iterator[SimpleNamespace]:
    """Rendezvous, a PP 1 prefill and a decode behind a :class:`Tap`, all sharing a key."""
    wire = WireConfig(hmac_key=secrets.token_bytes(32), max_message_bytes=LIMIT)
    srv = RendezvousServer(wire=wire).start()
    pm = PluginManager()
    pre = tap = rc = None
    try:
        pre = Prefill(pm, backend, srv.endpoint, pp=1, wire=wire, **kw)
        tap = Tap(pre.senders[0].endpoint)
        rc = _decode(pm, backend, srv.endpoint, wire, tap.endpoint, **kw)
        yield SimpleNamespace(wire=wire, srv=srv, pre=pre, s=pre.senders[0], rc=rc, tap=tap)
    finally:
        for x in (rc, pre, tap, srv):
            if x is not None:
                (x.stop if x is srv else x.close)()


def _serve(k: SimpleNamespace, room: int, dp: np.ndarray, start: bool = True) -> None:
    """One request end to end; the decode's pages hold exactly the prefill's KV."""
    sp = _pages(8 * room % 56)
    if start:
        k.s.start(room)
    k.rc.expect(room, dp, num_tokens=64)
    send_room(k.pre, room, sp)
    assert wait_all([k.s, k.rc], room, 30) == [OK, OK], (
        k.s.failure_reason(room),
        k.rc.failure_reason(room),
    )
    want = expected_kv(k.pre.kv, [k.rc.kv], 64, 0, sp, [dp])
    assert exact_kv([k.rc.kv], want, [dp])
    k.s.clear(room)
    k.rc.clear(room)


def _stat(session: Any, key: str) -> int:
    return int(session.stats().get(key, 0))


# ------------------------------------------------------------------------------------ Hello
def test_hello_needs_the_key_its_own_identity_and_a_fresh_frame(backend: str) -> None:
    """No Hello completes from a process without the key (a forged, keyed-wrong one), from a
    replay of the decode's captured Hello on another connection, or from a key holder sealing
    under another identity; the decode stays connected and keeps working."""
    with keyed(backend) as k:
        _serve(k, 1, _pages(0))
        me = k.rc.peer_info()
        target = k.s.endpoint
        outsider = control_codec(WireConfig(hmac_key=b"not the key"), identity=peer_identity(me))
        assert _ask(target, [outsider.encode(Hello(peer=me, nonce=7))]) == []
        (hello,) = k.tap.frames("hello")
        assert _ask(target, [hello]) == []  # a replay from another connection
        pref = peer_identity(k.s.peer_info())
        member = control_codec(k.wire, identity="intruder tp0 pp0", members=(pref,))
        (reply,) = _ask(target, [member.encode(Hello(peer=me, nonce=8))])
        ack = member.decode(reply)
        assert isinstance(ack, HelloAck) and not ack.accepted, ack
        assert ack.mismatches[0].startswith("identity: frames sealed by 'intruder tp0 pp0'"), ack
        st = k.s.stats()
        assert st["peers"] == 1 and st["peers_connected"] == 1 and st["refused"] == 1, st
        assert st.get("peers_rehandshake", 0) == 0 and st.get("peers_restarted", 0) == 0, st
        assert st["control_dropped_hmac"] >= 1 and st["control_dropped_replay"] >= 1, st
        _serve(k, 2, _pages(4))  # the decode was neither evicted nor rebound


# ------------------------------------------------------------------------------------ replays
def test_replayed_destinfo_abort_and_done_are_dropped_and_counted(backend: str) -> None:
    """Frames captured on the decode's own connection and injected on it again: a DestInfo of
    a finished request, an Abort of an aborted one and a Done to the decode. None binds a new
    request's room to old pages, fails it, or reaches the decode's rooms; each is counted."""
    with keyed(backend) as k:
        s, rc, tap = k.s, k.rc, k.tap
        _serve(k, 3, _pages(0))
        s.start(4)
        rc.expect(4, _pages(4), num_tokens=64)
        assert wait_all([s], 4, 10, until=(KVPoll.WaitingForInput,)) == [KVPoll.WaitingForInput]
        rc.abort(4, "client went away")
        assert wait_all([s, rc], 4, 10) == [FAILED, FAILED]
        assert wait_true(lambda: s.drained(4) and rc.drained(4), 10) is not None
        s.clear(4)
        rc.clear(4)
        dest3, abort4 = tap.frames("dest", 3)[-1], tap.frames("abort", 4)[-1]
        done4 = tap.frames("done", 4, up=False)[-1]
        p0, d0 = _stat(s, "control_dropped_replay"), _stat(rc, "control_dropped_replay")
        tap.inject(dest3)
        tap.inject(abort4)
        tap.inject(done4, up=False)
        assert wait_true(lambda: _stat(s, "control_dropped_replay") >= p0 + 2, 5) is not None
        assert wait_true(lambda: _stat(rc, "control_dropped_replay") >= d0 + 1, 5) is not None
        # new requests reuse the room ids: the replays neither bind nor fail them
        s.start(3)
        s.start(4)
        time.sleep(0.5)
        assert [s.poll(3), s.poll(4)] == [KVPoll.Bootstrapping] * 2, (
            s.failure_reason(3),
            s.failure_reason(4),
        )
        _serve(k, 3, _pages(8), start=False)
        _serve(k, 4, _pages(12), start=False)
        assert s.stats()["peers_connected"] == 1


def test_replayed_heartbeats_do_not_keep_a_dead_decode_alive(backend: str) -> None:
    """The decode rank dies while the relay keeps its connection open and replays the
    heartbeats it captured: the prefill still calls it silent within the transfer timeout and
    fails its room."""
    with keyed(backend, transfer_timeout_s=2.0) as k:
        s, tap = k.s, k.tap
        assert wait_true(lambda: len(tap.frames("hb")) >= 3, 10) is not None
        s.start(7)
        k.rc.expect(7, _pages(0), num_tokens=64)
        assert wait_all([s], 7, 10, until=(KVPoll.WaitingForInput,)) == [KVPoll.WaitingForInput]
        k.rc.close()  # the decode dies; the relay's connection to the prefill stays up
        beats = itertools.cycle(tap.frames("hb"))
        t_end = time.monotonic() + 8.0
        while _stat(s, "peers_dead") == 0 and time.monotonic() < t_end:
            tap.inject(next(beats))
            time.sleep(0.1)
        st = s.stats()
        assert st.get("peers_dead", 0) == 1 and st["control_dropped_replay"] >= 5, st
        assert s.poll(7) == FAILED and "silent" in (s.failure_reason(7) or ""), s.failure_reason(7)


# ------------------------------------------------------------------------- outsiders, size
def _outsider(conn: Any, target: str, me: bytes, room: int, generation: int) -> None:
    """A process without the key: forged Hello, DestInfo, Abort and Heartbeat claiming the
    decode rank (sealed under a wrong key, and plain), then one oversized frame."""
    from pdplug.types import DestInfo

    peer = msgspec.msgpack.decode(me, type=PeerInfo)
    dest = DestInfo(
        room=room,
        generation=generation,
        decode_instance=peer.instance,
        dcp_rank=0,
        dst_pages=np.arange(40, 44, dtype=np.int64).tobytes(),  # pages it does not own
    )
    msgs = [
        Hello(peer=peer, nonce=1),
        dest,
        Abort(room=room, generation=generation),
        Heartbeat(seq=99),
    ]
    frames = []
    for key in (b"a guess", None):
        wire = WireConfig(hmac_key=key, max_message_bytes=LIMIT)
        codec = control_codec(wire, identity=peer_identity(peer))
        frames += [codec.encode(m) for m in msgs]
    answered = _ask(target, frames)
    _ask(target, [b"\x00" * (LIMIT + 16)], wait_s=0.3)  # its own connection: ZMQ cuts it
    kh.send(conn, event="done", answered=len(answered))


def test_an_outsider_without_the_key_changes_nothing(backend: str) -> None:
    """Another process without the key sends a Hello, DestInfo, Abort and Heartbeat claiming
    the decode rank (and its live room), then an oversized frame; a decode connection is also
    sent an oversized frame. Nothing is answered, the room completes, the forgeries are counted
    as failing the HMAC, and neither oversized frame reaches a session's codec
    (``ZMQ_MAXMSGSIZE`` is the wire's limit): the connection is cut before it is buffered."""
    with keyed(backend, waiting_timeout_s=150.0) as k:  # the room waits out a process start
        s, rc = k.s, k.rc
        s.start(5)
        gen = rc.expect(5, _pages(0), num_tokens=64)
        assert wait_all([s], 5, 10, until=(KVPoll.WaitingForInput,)) == [KVPoll.WaitingForInput]
        me = msgspec.msgpack.encode(rc.peer_info())
        child = kh.Child(_outsider, s.endpoint, me, 5, gen)
        try:
            assert child.wait("done", 90)["answered"] == 0
        finally:
            child.stop()
        # an oversized frame on the decode's own connection: libzmq cuts it for good, the
        # session reconnects it
        k.tap.inject(b"\x00" * (LIMIT + 16), up=False)
        assert wait_true(lambda: len(k.tap.backs) == 2, 10) is not None
        assert wait_true(lambda: _stat(rc, "control_reconnected") == 1, 10) is not None
        time.sleep(1.0)  # a heartbeat tells the prefill the decode's new routing id
        assert s.poll(5) == KVPoll.WaitingForInput
        sp = _pages(8)
        send_room(k.pre, 5, sp)
        assert wait_all([s, rc], 5, 30) == [OK, OK], (s.failure_reason(5), rc.failure_reason(5))
        assert exact_kv(
            [rc.kv], expected_kv(k.pre.kv, [rc.kv], 64, 0, sp, [_pages(0)]), [_pages(0)]
        )
        st, dt = s.stats(), rc.stats()
        assert st["control_dropped_hmac"] == 8 and st["control_dropped"] == 8, st
        assert st.get("control_dropped_oversize", 0) == 0, st
        assert dt.get("control_dropped_oversize", 0) == 0 and dt["control_dropped"] == 0, dt
        assert st["peers"] == 1 and st.get("refused", 0) == 0, st


# ------------------------------------------------------------------------------- no key
def test_off_loopback_without_a_key_a_session_refuses_to_start(backend: str) -> None:
    """A prefill session binding off loopback, or a decode session connecting to a prefill rank
    off loopback, without ``WireConfig.hmac_key`` refuses at once, naming it; with a key the
    same prefill session starts."""
    pm = PluginManager()
    lay = src_layout(1, 0)
    open_wire = WireConfig(bind_host="0.0.0.0")
    with pytest.raises(ValueError, match=r"WireConfig\.hmac_key"):
        pm.make_kv_sender(kv_config("prefill", lay, "", "prefill-0", wire=open_wire), name=backend)
    keyed_wire = WireConfig(bind_host="0.0.0.0", hmac_key=secrets.token_bytes(32))
    s = pm.make_kv_sender(kv_config("prefill", lay, "", "prefill-0", wire=keyed_wire), name=backend)
    s.close()
    dlay = dst_layout(1, 0)
    rc = pm.make_kv_receiver(kv_config("decode", dlay, "", "decode-0"), name=backend)
    try:
        rc.register_kv(
            [torch.zeros((64 * P, b), dtype=torch.uint8) for b in dlay.entry_bytes_per_token]
        )
        far = PeerInfo(
            instance="prefill-0",
            role="prefill",
            layout=lay,
            control_endpoint="tcp://192.0.2.10:7001",  # TEST-NET-1: off loopback
            backend=rc.engine.name,
            entry_base=(0,) * lay.num_entries,
        )
        t0 = time.monotonic()
        with pytest.raises(ValueError, match=r"WireConfig\.hmac_key"):
            rc.connect([far], timeout_s=5.0)
        assert time.monotonic() - t0 < 2.0
    finally:
        rc.close()


# ------------------------------------------------------------------------------- restart
def _decode_child(conn: Any, srv: str, backend: str, key: str) -> None:
    """A decode rank in its own process (DCP 1, the test's key); serves ``expect`` commands
    and checks the bytes against the prefill's seeded KV (``_rig.Prefill``: seed ``e``)."""
    wire = WireConfig(hmac_key=bytes.fromhex(key), max_message_bytes=LIMIT)
    pm = PluginManager()
    lay = dst_layout(1, 0)
    rc = pm.make_kv_receiver(kv_config("decode", lay, srv, "decode-0", wire=wire), name=backend)
    kv = [torch.full((64 * P, b), POISON, dtype=torch.uint8) for b in lay.entry_bytes_per_token]
    rc.register_kv(kv)
    rc.connect(resolve(srv, "prefill-0", timeout_s=20, wire=wire))
    src = [
        torch.randint(
            1, 256, (64 * P, b), dtype=torch.uint8, generator=torch.Generator().manual_seed(e)
        )
        for e, b in enumerate(lay.entry_bytes_per_token)
    ]
    kh.send(conn, event="ready")
    while True:
        cmd = msgspec.json.decode(conn.recv_bytes())
        if cmd["op"] == "quit":
            rc.close()
            kh.send(conn, event="stats", stats=rc.stats())
            return
        room, sp, dp = cmd["room"], np.asarray(cmd["sp"]), np.asarray(cmd["dp"])
        rc.expect(room, dp, num_tokens=64)
        kh.send(conn, event="expecting", room=room)
        if cmd.get("wait", True):
            st = rc.wait(room, timeout_s=30)
            rows = lambda pages: (pages[:, None] * P + np.arange(P)).reshape(-1)  # noqa: E731
            ok = all(torch.equal(d[rows(dp)], s[rows(sp)]) for d, s in zip(kv, src))
            kh.send(conn, event="done", room=room, status=int(st), bytes_ok=ok)


def test_a_restarted_decode_rehandshakes_and_keeps_working(backend: str) -> None:
    """A decode process is killed with a room in flight and started again (same identity, the
    key, a new engine agent): the prefill fails the old process's room at the new Hello (not
    after a timeout) and serves the new process."""
    wire = WireConfig(hmac_key=secrets.token_bytes(32), max_message_bytes=LIMIT)
    srv = RendezvousServer(wire=wire).start()
    pm = PluginManager()
    # long timeouts: only the new process's Hello may fail the old one's room
    pre = Prefill(
        pm,
        backend,
        srv.endpoint,
        pp=1,
        wire=wire,
        transfer_timeout_s=150.0,
        waiting_timeout_s=150.0,
    )
    s, kids = pre.senders[0], []
    try:

        def serve(child: Any, room: int, wait: bool = True) -> None:
            sp, dp = _pages(4 * room % 56), _pages(4 * room % 60)
            s.start(room)
            child.cmd(op="expect", room=room, sp=sp.tolist(), dp=dp.tolist(), wait=wait)
            child.wait("expecting", 30, room=room)
            if wait:
                send_room(pre, room, sp)
                d = child.wait("done", 60, room=room)
                assert d["status"] == int(OK) and d["bytes_ok"], d

        for _ in range(2):
            kids.append(kh.Child(_decode_child, srv.endpoint, backend, wire.hmac_key.hex()))
            kids[-1].wait("ready", 90)
            serve(kids[-1], 20 + len(kids))
            if len(kids) == 1:
                serve(kids[0], 30, wait=False)
                assert wait_all([s], 30, 10, until=(KVPoll.WaitingForInput,)) == [
                    KVPoll.WaitingForInput
                ]
                kids[0].proc.kill()
                kids[0].proc.join(10)
        assert wait_all([s], 30, 5) == [FAILED]  # failed by the new Hello, not by silence
        assert "reconnected as a new process" in (s.failure_reason(30) or ""), s.failure_reason(30)
        st = s.stats()
        assert st["peers"] == 2 and st["peers_connected"] == 1 and st.get("peers_dead", 0) == 0, st
        assert st.get("control_dropped_replay", 0) == 0, st
    finally:
        for c in kids:
            c.stop()
        pre.close()
        srv.stop()
