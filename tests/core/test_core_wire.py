"""pdplug.wire: Codec fuzzing (nothing raises into the caller, every drop is counted by
reason), sealed frames (sender, replay, members, epochs), and the socket rules (MAXMSGSIZE,
linger, no keyless socket off loopback, one drain loop) on real sockets."""

from __future__ import annotations

import time
from typing import Any

import msgspec
import pytest
import zmq
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from pdplug import WireConfig
from pdplug.types import ChunkTag, Decision, Vote
from pdplug.wire import (
    DROP_REASONS,
    MAC_BYTES,
    MAX_SENDERS,
    Codec,
    Inbound,
    drain,
    endpoint_of,
    is_loopback,
    make_socket,
)

SETTINGS = settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
i64 = st.integers(-(2**63), 2**63 - 1)
ids = st.tuples(*[i64] * 0) | st.lists(i64, max_size=20).map(tuple)
votes = st.builds(Vote, stream=st.text(max_size=20), rank=i64, seq=i64, good=ids, bad=ids)
decisions = st.builds(Decision, stream=st.text(max_size=20), seq=i64, good=ids, bad=ids)
messages = votes | decisions
keys = st.none() | st.binary(min_size=1, max_size=64)
# msgpack-encodable junk: the shapes a confused or hostile peer may send
junk = st.recursive(
    st.none() | st.booleans() | i64 | st.floats() | st.text(max_size=10) | st.binary(max_size=10),
    lambda c: st.lists(c, max_size=5) | st.dictionaries(st.text(max_size=8), c, max_size=5),
    max_leaves=20,
)


def codec(key: bytes | None = None, max_bytes: int = 1 << 16) -> Codec[Any]:
    return Codec(Vote, Decision, hmac_key=key, max_bytes=max_bytes, name="test")


def check_accounting(c: Codec[Any], calls: int) -> None:
    s = c.stats()
    assert s["accepted"] + s["dropped"] == calls
    assert set(c.drops) <= set(DROP_REASONS)
    assert sum(v for k, v in s.items() if k.startswith("dropped_")) == s["dropped"]


@SETTINGS
@given(msg=messages, key=keys)
def test_roundtrip(msg: Vote | Decision, key: bytes | None) -> None:
    c = codec(key)
    frame = c.encode(msg)
    assert c.decode(frame) == msg
    assert c.decode(memoryview(frame)) == msg
    assert c.decode(bytearray(frame)) == msg
    assert c.stats() == {"accepted": 3, "dropped": 0}


@SETTINGS
@given(data=st.binary(max_size=300), key=keys)
def test_random_bytes_never_raise(data: bytes, key: bytes | None) -> None:
    c = codec(key)
    out = c.decode(data)
    assert out is None or isinstance(out, Vote | Decision)
    if key is not None:
        assert out is None and c.drops["hmac"] == 1  # 2**-256 chance of a valid MAC
    check_accounting(c, 1)


@SETTINGS
@given(msg=messages, key=keys, data=st.data())
def test_truncated_frames_are_dropped(msg: Vote | Decision, key: bytes | None, data: Any) -> None:
    c = codec(key)
    frame = c.encode(msg)
    cut = data.draw(st.integers(0, len(frame) - 1))
    assert c.decode(frame[:cut]) is None
    check_accounting(c, 1)
    if key is not None:
        assert c.drops == {"hmac": 1}
    else:
        assert c.drops.keys() <= {"malformed", "wrong_type"}


@SETTINGS
@given(obj=junk, key=keys)
def test_wrong_types_are_dropped(obj: Any, key: bytes | None) -> None:
    sender = codec(key)
    receiver = codec(key)
    payload = msgspec.msgpack.encode(obj)
    frame = payload if key is None else _mac(key, payload)
    assert receiver.decode(frame) is None  # junk never validates as a Vote/Decision
    assert receiver.drops.keys() <= {"unknown_kind", "wrong_type", "malformed"}
    check_accounting(receiver, 1)
    assert sender.stats() == {"accepted": 0, "dropped": 0}


@SETTINGS
@given(msg=messages, fields=st.dictionaries(st.sampled_from(["stream", "seq", "good"]), junk))
def test_known_kind_with_wrong_field_types(msg: Vote | Decision, fields: dict[str, Any]) -> None:
    c = codec()
    raw = msgspec.to_builtins(msg)
    raw.update(fields)
    out = c.decode(msgspec.msgpack.encode(raw))
    if out is None:
        assert c.drops == {"wrong_type": 1}
    else:  # the junk happened to have the right type
        assert isinstance(out, type(msg))


@SETTINGS
@given(msg=messages, kind=st.text(max_size=10).filter(lambda k: k not in ("vote", "decision")))
def test_unknown_kind_is_counted_as_such(msg: Vote | Decision, kind: str) -> None:
    c = codec()
    raw = msgspec.to_builtins(msg)
    raw["type"] = kind
    assert c.decode(msgspec.msgpack.encode(raw)) is None
    assert c.drops == {"unknown_kind": 1}


@SETTINGS
@given(msg=messages, k1=st.binary(min_size=1, max_size=32), k2=st.binary(min_size=1, max_size=32))
def test_wrong_key_is_dropped(msg: Vote | Decision, k1: bytes, k2: bytes) -> None:
    if k1 == k2:
        return
    frame = codec(k1).encode(msg)
    rx = codec(k2)
    assert rx.decode(frame) is None
    # (an unkeyed codec reading a keyed frame is not checked: the MAC's random bytes do, rarely,
    # parse as a message, and an unkeyed rank accepts any well-formed frame anyway)
    assert rx.drops == {"hmac": 1}
    # a valid MAC with a flipped payload bit
    bad = bytearray(frame)
    bad[-1] ^= 1
    rx1 = codec(k1)
    assert rx1.decode(bytes(bad)) is None and rx1.drops == {"hmac": 1}
    # a frame shorter than a MAC
    assert rx1.decode(frame[: MAC_BYTES - 1]) is None and rx1.drops == {"hmac": 2}


@SETTINGS
@given(extra=st.integers(1, 1000), key=keys)
def test_oversize_is_dropped_before_anything_else(extra: int, key: bytes | None) -> None:
    c = codec(key, max_bytes=256)
    assert c.decode(b"\x00" * (256 + extra)) is None
    assert c.drops == {"oversize": 1}
    assert c.decode(b"\x00" * 256) is None and c.drops["oversize"] == 1


@pytest.mark.parametrize("frame", ["a str", 42, None, 3.5, [1, 2], {"type": "vote"}, object()])
def test_non_bytes_frames_are_malformed(frame: Any) -> None:
    c = codec(b"k")
    assert c.decode(frame) is None
    assert c.drops == {"malformed": 1}


def test_encode_rejects_wrong_types_and_oversize() -> None:
    c = codec(max_bytes=64)
    with pytest.raises(TypeError, match="cannot encode ChunkTag; accepted types: Vote, Decision"):
        c.encode(ChunkTag(generation=0, room=1, chunk_id=0, is_last=True, src_rank=0))
    with pytest.raises(ValueError, match="over max_bytes=64"):
        c.encode(Vote(stream="bootstrap", rank=0, seq=0, good=tuple(range(100))))


def test_constructor_errors_name_the_problem() -> None:
    with pytest.raises(ValueError, match="types is empty"):
        Codec()
    with pytest.raises(ValueError, match="max_bytes must be > 0, got 0"):
        Codec(Vote, max_bytes=0)
    with pytest.raises(TypeError, match="hmac_key must be bytes or None, got str"):
        Codec(Vote, hmac_key="secret")  # type: ignore[arg-type]

    class Untagged(msgspec.Struct):
        x: int

    with pytest.raises(TypeError, match=r"\['Untagged'\] have no msgspec tag"):
        Codec(Vote, Untagged)
    with pytest.raises(TypeError, match="cannot decode the union of Vote, ChunkTag"):
        Codec(Vote, ChunkTag)  # array-like and map-like structs cannot share a union


def test_array_like_single_type_and_from_config() -> None:
    c = Codec.from_config(WireConfig(hmac_key=b"s", max_message_bytes=128), ChunkTag, name="tags")
    tag = ChunkTag(generation=3, room=7, chunk_id=2, is_last=False, src_rank=1)
    assert c.decode(c.encode(tag)) == tag
    plain = Codec(ChunkTag)
    assert plain.decode(msgspec.msgpack.encode(["vote", 1])) is None
    assert plain.decode(msgspec.msgpack.encode(["chunk", "x"])) is None
    assert plain.drops == {"unknown_kind": 1, "wrong_type": 1}
    assert c.max_bytes == 128 and c.name == "tags"


def test_semantic_drops_are_counted_by_the_caller() -> None:
    c = codec()
    c.drop("unknown_rank")
    c.drop("stale")
    assert c.stats() == {
        "accepted": 0,
        "dropped": 2,
        "dropped_unknown_rank": 1,
        "dropped_stale": 1,
    }
    assert c.dropped == 2


def _mac(key: bytes, payload: bytes) -> bytes:
    import hashlib
    import hmac

    return hmac.new(key, payload, hashlib.sha256).digest() + payload


# ------------------------------------------------------------------ sealed frames (envelope)


def sealed(identity: str, key: bytes | None = None, **kw: Any) -> Codec[Any]:
    return Codec(Vote, Decision, hmac_key=key, identity=identity, name=identity, **kw)


def _envelope(
    sender: str, epoch: int, seq: int, sent_ms: int, msg: Any, key: bytes | None
) -> bytes:
    """A frame built by hand from the documented layout ``mac + [sender, epoch, seq, sent_ms,
    payload]``."""
    enc = msgspec.msgpack.Encoder()
    env = enc.encode([sender, epoch, seq, sent_ms, msgspec.Raw(enc.encode(msg))])
    return env if key is None else _mac(key, env)


@SETTINGS
@given(msgs=st.lists(messages, min_size=1, max_size=5), key=keys)
def test_sealed_roundtrip_names_the_sender(msgs: list[Vote | Decision], key: bytes | None) -> None:
    tx, rx = sealed("pp1", key), sealed("pp0", key, members={"pp1"})
    for m in msgs:
        got = rx.decode_from(tx.encode(m), b"route")
        assert got is not None
        assert (got.route, got.sender, got.epoch, got.msg) == (b"route", "pp1", tx.epoch, m)
    assert rx.stats() == {"accepted": len(msgs), "dropped": 0}


@pytest.mark.parametrize("key", [None, b"k"], ids=["keyless", "keyed"])
def test_replayed_and_reordered_frames_are_dropped(key: bytes | None) -> None:
    tx, rx = sealed("pp1", key), sealed("pp0", key, members={"pp1"})
    f1, f2, f3 = (tx.encode(Vote(stream="s", rank=1, seq=i)) for i in range(3))
    assert rx.decode(f1) is not None and rx.decode(f3) is not None
    assert rx.decode(f2) is None  # overtaken by f3: reordered
    assert rx.decode(f1) is None and rx.decode(f3) is None  # replayed
    assert rx.drops == {"replay": 3}


def test_senders_outside_the_members_are_unknown_ranks() -> None:
    rx = sealed("pp0", b"k", members={"pp1", "pp2"})
    assert rx.decode(sealed("pp3", b"k").encode(Vote(stream="s", rank=3, seq=0))) is None
    assert rx.decode(sealed("pp1", b"k").encode(Vote(stream="s", rank=1, seq=0))) is not None
    assert rx.drops == {"unknown_rank": 1}
    anyone = sealed("server", b"k")  # members=None: any sender holding the key
    assert anyone.decode(sealed("whoever", b"k").encode(Vote(stream="s", rank=1, seq=0)))


def test_a_restarted_sender_is_adopted_and_its_old_epoch_is_a_replay() -> None:
    rx = sealed("pp0", b"k", members={"pp1"})
    old = sealed("pp1", b"k")
    late = old.encode(Vote(stream="s", rank=1, seq=9))
    assert rx.decode(old.encode(Vote(stream="s", rank=1, seq=0))) is not None
    new = sealed("pp1", b"k")  # the restarted process: a later, larger epoch
    assert new.epoch > old.epoch
    assert rx.decode(new.encode(Vote(stream="s", rank=1, seq=0))) is not None
    assert rx.decode(late) is None  # the old incarnation's frames are replays now
    assert rx.drops == {"replay": 1}


def test_a_new_epoch_is_adopted_only_from_a_fresh_frame() -> None:
    rx = sealed("pp0", b"k", members={"pp1"}, replay_window_s=5.0)
    now_ms = time.time_ns() // 10**6
    vote = Vote(stream="s", rank=1, seq=0)
    epoch = (now_ms * 1000 - 60_000_000) << 12  # a process started a minute ago
    recorded = _envelope("pp1", epoch, 1, now_ms - 60_000, vote, b"k")
    assert rx.decode(recorded) is None  # recorded a minute ago: not adopted
    future = _envelope("pp1", epoch, 2, now_ms + 60_000, vote, b"k")
    assert rx.decode(future) is None  # a clock a minute ahead: not adopted either
    assert rx.decode(_envelope("pp1", epoch, 3, now_ms, vote, b"k")) == vote
    assert rx.decode(recorded) is None  # same epoch, older seq
    assert rx.drops == {"replay": 3}


def test_tampered_envelopes_fail_the_mac_and_plain_frames_are_not_sealed() -> None:
    tx = sealed("pp1", b"k")
    frame = bytearray(tx.encode(Vote(stream="s", rank=1, seq=0)))
    i = frame.index(b"pp1")
    frame[i + 2 : i + 3] = b"2"  # claim to be pp2
    rx = sealed("pp0", b"k")
    assert rx.decode(bytes(frame)) is None and rx.drops == {"hmac": 1}
    plain = codec(b"k").encode(Vote(stream="s", rank=1, seq=0))
    assert rx.decode(plain) is None and rx.drops["malformed"] == 1
    assert codec(b"k").decode(tx.encode(Vote(stream="s", rank=1, seq=0))) is None


def test_forgotten_senders_are_bounded() -> None:
    rx = sealed("server")
    vote = Vote(stream="s", rank=0, seq=0)
    first = sealed("c0")
    assert rx.decode(first.encode(vote))
    for i in range(1, MAX_SENDERS + 1):
        assert rx.decode(sealed(f"c{i}").encode(vote))
    assert len(rx._peers) == MAX_SENDERS and "c0" not in rx._peers


def test_sealed_constructor_errors() -> None:
    with pytest.raises(ValueError, match=r"members=.* needs identity="):
        Codec(Vote, members={"pp1"})
    with pytest.raises(ValueError, match="replay_window_s must be > 0, got 0"):
        Codec(Vote, identity="a", replay_window_s=0)


@pytest.mark.parametrize(
    ("kw", "msg"),
    [
        ({"max_message_bytes": 0}, "WireConfig.max_message_bytes must be > 0, got 0"),
        ({"hmac_key": b""}, "WireConfig.hmac_key is empty"),
        ({"bind_host": ""}, "WireConfig.bind_host is empty"),
        ({"replay_window_s": -1.0}, "WireConfig.replay_window_s must be > 0, got -1.0"),
    ],
)
def test_wire_config_errors_name_field_and_value(kw: dict[str, Any], msg: str) -> None:
    with pytest.raises(ValueError, match=msg):
        WireConfig(**kw)


# ------------------------------------------------------------------ sockets


@pytest.mark.parametrize(
    ("host", "loop"),
    [
        ("127.0.0.1", True),
        ("127.3.2.1", True),
        ("::1", True),
        ("[::1]", True),
        ("localhost", True),
        ("0.0.0.0", False),
        ("*", False),
        ("10.0.0.5", False),
        ("myhost", False),
    ],
)
def test_is_loopback(host: str, loop: bool) -> None:
    assert is_loopback(host) is loop


def test_make_socket_applies_the_wire_rules() -> None:
    ctx = zmq.Context()
    try:
        w = WireConfig(max_message_bytes=12345)
        s = make_socket(ctx, zmq.ROUTER, w, bind=0, hwm=0)
        assert s.getsockopt(zmq.MAXMSGSIZE) == 12345 and s.getsockopt(zmq.LINGER) == 0
        assert s.getsockopt(zmq.RCVHWM) == 0 and s.getsockopt(zmq.SNDHWM) == 0
        assert endpoint_of(s).startswith("tcp://127.0.0.1:")
        s.close()
        with pytest.raises(ValueError, match=r"bind: host '0\.0\.0\.0' is off loopback and "):
            make_socket(ctx, zmq.ROUTER, WireConfig(bind_host="0.0.0.0"), bind=0, name="bind")
        with pytest.raises(ValueError, match=r"WireConfig\.hmac_key is None"):
            make_socket(ctx, zmq.DEALER, w, connect="tcp://10.1.2.3:5555")
        with pytest.raises(ValueError, match=r"'tcp://nohost' is not 'tcp://host:port'"):
            make_socket(ctx, zmq.DEALER, w, connect="tcp://nohost")
        keyed = WireConfig(bind_host="0.0.0.0", hmac_key=b"k")
        s = make_socket(ctx, zmq.ROUTER, keyed, bind=0)
        assert endpoint_of(s).startswith("tcp://0.0.0.0:")
        s.close()
        s = make_socket(ctx, zmq.DEALER, keyed, connect="tcp://10.1.2.3:5555")  # no wait
        s.close()
    finally:
        ctx.destroy(linger=0)


def test_drain_yields_authenticated_frames_and_counts_the_rest() -> None:
    ctx = zmq.Context()
    try:
        w = WireConfig(max_message_bytes=4096, hmac_key=b"k")
        router = make_socket(ctx, zmq.ROUTER, w, bind=0)
        ep = endpoint_of(router)
        rx = Codec.from_config(w, Vote, Decision, identity="pp0", members={"pp1"})
        tx = Codec.from_config(w, Vote, Decision, identity="pp1")
        good = make_socket(ctx, zmq.DEALER, w, connect=ep)
        raw = ctx.socket(zmq.DEALER)  # a raw peer: no wire rules
        raw.setsockopt(zmq.LINGER, 0)
        raw.setsockopt(zmq.ROUTING_ID, b"pp1")  # a chosen routing id means nothing
        raw.connect(ep)
        votes = [Vote(stream="s", rank=1, seq=i) for i in range(3)]
        for v in votes:
            good.send(tx.encode(v))
        raw.send_multipart([b"a", b"b"])  # malformed
        raw.send(Codec(Vote, hmac_key=b"k", identity="pp2").encode(votes[0]))  # not a member
        raw.send(b"junk")  # hmac
        got: list[Inbound] = []
        t = time.monotonic()
        while len(got) < 3 or rx.dropped < 3:
            assert time.monotonic() - t < 5, (got, rx.stats())
            router.poll(100)
            got += drain(router, rx)
        assert [g.msg for g in got] == votes and {g.sender for g in got} == {"pp1"}
        assert len({g.route for g in got}) == 1 and got[0].route != b"pp1"
        assert rx.drops == {"malformed": 1, "unknown_rank": 1, "hmac": 1}
        # MAXMSGSIZE: an oversized frame never arrives, not even as a counted drop
        raw.send(b"\x00" * 8192)
        time.sleep(0.3)
        assert list(drain(router, rx)) == [] and rx.dropped == 3
    finally:
        ctx.destroy(linger=0)


def test_rank_identities_name_instance_and_ranks() -> None:
    from pdplug import KVLayout
    from pdplug.types import PeerInfo
    from pdplug.wire import peer_identity, rank_identity

    lay = KVLayout(
        page_size=16, entry_bytes_per_token=(8,), tp_size=2, tp_rank=1, pp_size=4, pp_rank=3
    )
    assert rank_identity("prefill-0", lay) == "prefill-0 tp1 pp3"
    dcp = msgspec.structs.replace(
        lay, tp_size=1, tp_rank=0, pp_size=1, pp_rank=0, dcp_size=4, dcp_rank=2
    )
    assert rank_identity("decode-1", dcp) == "decode-1 tp0 pp0 dcp2"
    peer = PeerInfo(instance="prefill-0", role="prefill", layout=lay)
    assert peer_identity(peer) == "prefill-0 tp1 pp3"
