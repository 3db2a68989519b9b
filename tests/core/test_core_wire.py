"""pdplug.wire.Codec fuzzing: nothing raises into the caller, every drop is counted by reason."""

from __future__ import annotations

from typing import Any

import msgspec
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from pdplug import WireConfig
from pdplug.types import ChunkTag, Decision, Vote
from pdplug.wire import DROP_REASONS, MAC_BYTES, Codec

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
    assert codec(None).decode(frame) is None  # MAC bytes in front: not msgpack of a Vote
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
