"""Malformed, oversized, wrong-HMAC and unknown-rank frames sent to the leader's socket from a
raw ZMQ socket are dropped and counted by reason; decisions continue (both implementations)."""

from __future__ import annotations

import hashlib
import hmac
import time

import msgspec
import pytest
import zmq

from pdplug.ports import free_endpoints
from pdplug.wire import Codec
from pdplug_consensus.messages import Heartbeat

from .ranks import Group, Instance, check_agreement, run_group, scenario

KEY = b"shared-secret-for-tests"
MAX = 64 << 10

# generous: votes of one request spread over 0.3 s, but a loaded 2-core box can stall a
# rank process for a while; a clean request must never hit the deadline
DEADLINE = 2.5


def _signed(payload: bytes, key: bytes = KEY) -> bytes:
    return hmac.new(key, payload, hashlib.sha256).digest() + payload


def _inject(endpoint: str) -> None:
    ok = Codec(Heartbeat, hmac_key=KEY, max_bytes=MAX)
    frames = [
        [_signed(b"\xc1 not msgpack")],  # malformed
        [_signed(msgspec.msgpack.encode({"type": "evil", "rank": 1}))],  # unknown_kind
        [Codec(Heartbeat, hmac_key=b"wrong key").encode(Heartbeat(rank=1))],  # hmac
        [b"\x00" * (MAX + 1)],  # oversize
        [ok.encode(Heartbeat(rank=7))],  # unknown_rank: no such rank
        [ok.encode(Heartbeat(rank=1))],  # unknown_rank: identity is not r1
        [b"a", b"b"],  # malformed: extra frame
    ]
    ctx = zmq.Context()
    s = ctx.socket(zmq.DEALER)
    s.setsockopt(zmq.LINGER, 2000)
    s.connect(endpoint)
    for parts in frames:
        s.send_multipart(parts)
    s.close()
    ctx.term()


@pytest.mark.timeout(60)
def test_hostile_frames_dropped_and_counted() -> None:
    size = 3
    impls = ("pp0", "ring")
    sc = {
        impl: scenario(size, 40, seed=5 + k, span_s=1.0, streams=("bootstrap",))
        for k, impl in enumerate(impls)
    }
    eps = {impl: free_endpoints(size) for impl in impls}
    plans = {
        r: [
            Instance(
                impl=impl,
                endpoints=eps[impl],
                actions=tuple(sc[impl].actions[r]),
                expect=sc[impl].expect,
                vote_deadline_s=DEADLINE,
                hmac_key=KEY,
                max_message_bytes=MAX,
            )
            for impl in impls
        ]
        for r in range(size)
    }
    injected: dict[str, float] = {}

    def during(g: Group) -> None:
        time.sleep(0.2)
        for impl in impls:
            _inject(eps[impl][0])
            injected[impl] = time.monotonic()

    g = run_group(plans, during=during, max_s=20.0)
    want = {"malformed": 2, "unknown_kind": 1, "hmac": 1, "oversize": 1, "unknown_rank": 2}
    for k, impl in enumerate(impls):
        res = g.instance(k)
        check_agreement(res, sc[impl])
        st = res[0].stats
        got = {r: st.get(f"dropped_{r}", 0) for r in want}
        assert got == want, (impl, st)
        assert st["dropped"] == sum(want.values())
        for r in (1, 2):  # nothing injected there, nothing legitimate dropped
            assert res[r].stats["dropped"] == 0
        later = [a for a in res[0].applied if a.t > injected[impl] + 0.05]
        assert later, f"{impl}: no decision after the injection"
