"""pdplug.bootstrap: the rendezvous across real processes and real sockets on 127.0.0.1,
including the fail-closed rules (no replayed or forged registration replaces a live rank, no
oversized frame is buffered, no keyless socket off loopback)."""

from __future__ import annotations

import multiprocessing as mp
import time

import msgspec
import pytest
import zmq
from zmq.utils.monitor import recv_monitor_message

from pdplug import KVLayout, TransferError, WireConfig
from pdplug.bootstrap import (
    Register,
    Registered,
    RendezvousServer,
    Resolve,
    Resolved,
    register,
    resolve,
)
from pdplug.types import PeerInfo
from pdplug.wire import Codec

pytestmark = pytest.mark.timeout(60)


def prefill_peer(pp_rank: int, pp_size: int = 2, role: str = "prefill") -> PeerInfo:
    lay = KVLayout(page_size=16, entry_bytes_per_token=(64, 64), pp_rank=pp_rank, pp_size=pp_size)
    return PeerInfo(
        instance="prefill-0",
        role=role,
        layout=lay,
        control_endpoint=f"tcp://127.0.0.1:{5000 + pp_rank}",
        backend="nixl",
    )


def _register_later(endpoint: str, pp_rank: int, delay_s: float, key: bytes | None) -> None:
    time.sleep(delay_s)
    register(endpoint, prefill_peer(pp_rank), timeout_s=10, wire=WireConfig(hmac_key=key))


def test_resolve_answers_not_ready_until_every_rank_registered() -> None:
    ctx = mp.get_context("spawn")
    with RendezvousServer() as server:
        first = ctx.Process(target=_register_later, args=(server.endpoint, 1, 0.0, None))
        first.start()
        first.join(30)
        assert first.exitcode == 0
        # 2 s, not less: under a loaded suite the first answer can take longer than 0.3 s,
        # and then the error is "no answer", not the "1 of 2 ranks" this checks
        with pytest.raises(TransferError, match=r"not ready after 2 s \(1 of 2 ranks"):
            resolve(server.endpoint, "prefill-0", timeout_s=2.0)
        second = ctx.Process(target=_register_later, args=(server.endpoint, 0, 0.5, None))
        second.start()
        t0 = time.monotonic()
        peers = resolve(server.endpoint, "prefill-0", timeout_s=30)
        assert time.monotonic() - t0 >= 0.3  # it really waited for the late rank
        second.join(30)
        assert second.exitcode == 0
        assert [p.layout.pp_rank for p in peers] == [0, 1]
        assert peers[1].control_endpoint.endswith(":5001")
        st = server.stats()
        # a register retried under load (no answer within 0.25 s) is answered, and counted, again
        assert st["registered"] >= 2 and st["not_ready"] >= 1 and st["resolved"] >= 1


def test_geometry_conflict_and_decode_role_are_refused_with_a_reason() -> None:
    with RendezvousServer() as server:
        register(server.endpoint, prefill_peer(0), timeout_s=5)
        with pytest.raises(TransferError, match=r"has 2 ranks .* says 3 \(pp_size=3"):
            register(server.endpoint, prefill_peer(1, pp_size=3), timeout_s=5)
        with pytest.raises(TransferError, match="role must be 'prefill'"):
            register(server.endpoint, prefill_peer(1, role="decode"), timeout_s=5)
        # re-registering a rank replaces it (a restarted rank)
        register(server.endpoint, prefill_peer(0), timeout_s=5)
        assert len(server.peers("prefill-0")) == 1
        assert server.stats()["refused"] == 2


def _client(key: bytes | None = None, identity: str = "prober") -> Codec:
    """A sealed client codec, as a member holding the key (or none) would build it."""
    return Codec(Register, Resolve, Registered, Resolved, hmac_key=key, identity=identity)


def test_malformed_frames_are_dropped_and_counted_and_the_server_goes_on() -> None:
    with RendezvousServer(WireConfig(max_message_bytes=4096)) as server:
        sock = zmq.Context.instance().socket(zmq.DEALER)
        sock.setsockopt(zmq.LINGER, 0)
        sock.connect(server.endpoint)
        enc = msgspec.msgpack.Encoder()
        client = _client()

        def sealed(body: object) -> bytes:  # a well-formed envelope around any payload
            return enc.encode(
                [
                    "hand-made",
                    client.epoch,
                    next(seq),
                    time.time_ns() // 10**6,
                    msgspec.Raw(enc.encode(body)),
                ]
            )

        seq = iter(range(1, 100))
        frames = [
            b"\xc1garbage",  # not msgpack
            enc.encode(Resolve(instance="x")),  # not sealed: no sender envelope
            sealed({"type": "nope", "x": 1}),  # unknown kind
            sealed({"type": "resolve", "instance": 3}),  # wrong field type
            client.encode(Resolved(instance="x", ready=True)),  # a reply sent as a request
        ]
        for f in frames:
            sock.send(f)
        sock.send_multipart([b"two", b"parts"])
        time.sleep(0.3)
        st = server.stats()
        assert st["dropped"] == 6, st
        assert st["dropped_malformed"] == 3 and st["dropped_unknown_kind"] == 1, st
        assert st["dropped_wrong_type"] == 2, st
        # still serving, and a sealed request gets a sealed answer
        sock.send(client.encode(Resolve(instance="prefill-0", ref=7)))
        assert sock.poll(5000)
        got = client.decode_from(sock.recv())
        assert got is not None and got.sender == "rendezvous"
        assert isinstance(got.msg, Resolved) and got.msg.ready is False and got.msg.ref == 7
        register(server.endpoint, prefill_peer(0, pp_size=1), timeout_s=5)
        assert len(resolve(server.endpoint, "prefill-0", timeout_s=5)) == 1
        sock.close()


def test_oversized_frame_never_reaches_the_server() -> None:
    """ZMQ_MAXMSGSIZE: a frame over max_message_bytes disconnects its sender before anything is
    buffered; the codec never sees it and the server goes on."""
    with RendezvousServer(WireConfig(max_message_bytes=64 << 10)) as server:
        ctx = zmq.Context()
        sock = ctx.socket(zmq.DEALER)
        sock.setsockopt(zmq.LINGER, 0)
        mon = sock.get_monitor_socket()
        sock.connect(server.endpoint)
        sock.send(b"\x00" * (4 << 20))
        seen: list[str] = []
        t = time.monotonic()
        while "DISCONNECTED" not in seen and time.monotonic() - t < 5:
            if mon.poll(100):
                seen.append(zmq.Event(recv_monitor_message(mon)["event"]).name)
        assert "DISCONNECTED" in seen, seen
        register(server.endpoint, prefill_peer(0, pp_size=1), timeout_s=5)
        st = server.stats()
        assert st["dropped"] == 0 and st["registered"] == 1, st
        sock.disable_monitor()
        mon.close(0)
        sock.close(0)
        ctx.term()


def _register_to(endpoint: str, control: str, key: bytes, timeout_s: float) -> None:
    """A prefill rank process registering rank 0 with ``control`` as its control endpoint."""
    peer = msgspec.structs.replace(prefill_peer(0), control_endpoint=control)
    try:
        register(endpoint, peer, timeout_s=timeout_s, wire=WireConfig(hmac_key=key))
    except TransferError:
        pass  # the recording tap never answers


def test_replayed_registration_cannot_replace_a_live_rank() -> None:
    """A keyless process replays rank 0's registration recorded from its earlier run; the live
    registration stays. A restarted rank (new process, the key) does replace it; a keyless or
    wrong-key process cannot."""
    key = b"k" * 32
    ctx = mp.get_context("spawn")
    zctx = zmq.Context()
    tap = zctx.socket(zmq.ROUTER)
    tap.setsockopt(zmq.LINGER, 0)
    tap_port = tap.bind_to_random_port("tcp://127.0.0.1")
    old = ctx.Process(
        target=_register_to, args=(f"tcp://127.0.0.1:{tap_port}", "tcp://127.0.0.1:1", key, 0.6)
    )
    old.start()
    old.join(30)
    recorded = []
    while tap.poll(0):
        recorded.append(tap.recv_multipart()[-1])
    tap.close()
    assert recorded, "the earlier run sent nothing"
    with RendezvousServer(WireConfig(hmac_key=key)) as server:
        live = ctx.Process(
            target=_register_to, args=(server.endpoint, "tcp://127.0.0.1:2", key, 10)
        )
        live.start()
        live.join(30)
        assert server.peers("prefill-0")[0].control_endpoint == "tcp://127.0.0.1:2"
        hostile = zctx.socket(zmq.DEALER)
        hostile.setsockopt(zmq.LINGER, 0)
        hostile.connect(server.endpoint)
        for f in recorded:
            hostile.send(f)
        time.sleep(0.5)
        assert server.peers("prefill-0")[0].control_endpoint == "tcp://127.0.0.1:2"
        assert server.stats()["dropped_replay"] == len(recorded), server.stats()
        forged = Codec(Register, hmac_key=b"not the key", identity="prefill-0 tp0 pp0")
        hostile.send(forged.encode(Register(peer=prefill_peer(0))))
        time.sleep(0.3)
        st = server.stats()
        assert server.peers("prefill-0")[0].control_endpoint == "tcp://127.0.0.1:2"
        assert st["dropped_hmac"] == 1 and st["registered"] == 1, st
        restarted = ctx.Process(
            target=_register_to, args=(server.endpoint, "tcp://127.0.0.1:3", key, 10)
        )
        restarted.start()
        restarted.join(30)
        assert server.peers("prefill-0")[0].control_endpoint == "tcp://127.0.0.1:3"
        hostile.close()
    zctx.term()


def test_registering_another_ranks_identity_is_refused() -> None:
    with RendezvousServer() as server:
        sock = zmq.Context.instance().socket(zmq.DEALER)
        sock.setsockopt(zmq.LINGER, 0)
        sock.connect(server.endpoint)
        client = _client(identity="prefill-0 tp0 pp1")  # rank 1 posing as rank 0
        sock.send(client.encode(Register(peer=prefill_peer(0), ref=5)))
        assert sock.poll(5000)
        got = client.decode(sock.recv())
        assert isinstance(got, Registered) and not got.ok and got.ref == 5
        assert "'prefill-0 tp0 pp1' cannot register 'prefill-0 tp0 pp0'" in got.reason
        assert server.peers("prefill-0") == {}
        sock.close()


def test_off_loopback_without_a_key_refuses_to_start() -> None:
    with pytest.raises(ValueError, match=r"'0\.0\.0\.0' is off loopback and WireConfig\.hmac_key"):
        RendezvousServer(WireConfig(bind_host="0.0.0.0"))
    with pytest.raises(ValueError, match=r"'10\.255\.0\.1' is off loopback"):
        register("tcp://10.255.0.1:5999", prefill_peer(0), timeout_s=1)
    with RendezvousServer(WireConfig(bind_host="0.0.0.0", hmac_key=b"k")) as server:
        assert server.endpoint.startswith("tcp://0.0.0.0:")


def test_hmac_keyed_server_ignores_unauthenticated_clients() -> None:
    key = b"k" * 32
    ctx = mp.get_context("spawn")
    with RendezvousServer(WireConfig(hmac_key=key)) as server:
        with pytest.raises(TransferError, match="no answer to register"):
            register(server.endpoint, prefill_peer(0, pp_size=1), timeout_s=0.5)
        assert server.stats()["dropped_hmac"] >= 1
        p = ctx.Process(target=_register_later, args=(server.endpoint, 0, 0.0, key))
        p.start()
        p.join(30)
        assert p.exitcode == 0
        register(server.endpoint, prefill_peer(1), timeout_s=5, wire=WireConfig(hmac_key=key))
        peers = resolve(server.endpoint, "prefill-0", timeout_s=5, wire=WireConfig(hmac_key=key))
        assert [p.layout.pp_rank for p in peers] == [0, 1]
