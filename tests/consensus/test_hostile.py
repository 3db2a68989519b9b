"""The consensus control plane fails closed (real rank processes, sockets on 127.0.0.1).

A process without the group's key cannot halt consensus (squatting a rank's ZMQ routing id),
evict a peer (replaying a recorded dead-rank report) or get an oversized frame buffered; junk,
forged and foreign frames are dropped and counted by reason; a group refuses to start off
loopback without a key. Both implementations where the attack applies to both.
"""

from __future__ import annotations

import hashlib
import hmac
import time
from typing import Any

import msgspec
import pytest
import zmq
from zmq.utils.monitor import recv_monitor_message

from pdplug import ConsensusConfig, ConsensusError, WireConfig
from pdplug.ports import free_endpoints
from pdplug.wire import Codec
from pdplug_consensus.messages import Heartbeat, identities
from pdplug_consensus.pp0 import make_pp0
from pdplug_consensus.ring import make_ring

from .ranks import Group, Instance, check_agreement, run_group, scenario

KEY = b"shared-secret-for-tests"
MAX = 64 << 10

# generous: votes of one request spread over 0.3 s, but a loaded 2-core box can stall a
# rank process for a while; a clean request must never hit the deadline
DEADLINE = 2.5


def _plans(
    impls: tuple[str, ...], size: int, n: int, seed: int, **kw: Any
) -> tuple[dict, dict, dict[int, list[Instance]]]:
    """Scenario, endpoints and per-rank instances of each implementation (``kw``: per-rank
    overrides as ``{rank: {field: value}}`` under ``per_rank``, the rest for every rank)."""
    per_rank = kw.pop("per_rank", {})
    sc = {
        impl: scenario(size, n, seed=seed + k, span_s=1.0, streams=("bootstrap",))
        for k, impl in enumerate(impls)
    }
    eps = {impl: free_endpoints(size) for impl in impls}
    base = {"vote_deadline_s": DEADLINE, "hmac_key": KEY, "max_message_bytes": MAX} | kw
    plans = {
        r: [
            Instance(
                impl=impl,
                endpoints=eps[impl],
                actions=tuple(sc[impl].actions[r]),
                expect=sc[impl].expect,
                **(base | per_rank.get(r, {})),
            )
            for impl in impls
        ]
        for r in range(size)
    }
    return sc, eps, plans


def _dealer(ctx: zmq.Context, endpoint: str, routing_id: bytes | None = None) -> zmq.Socket:
    s = ctx.socket(zmq.DEALER)
    s.setsockopt(zmq.LINGER, 0)
    s.setsockopt(zmq.RECONNECT_IVL, 10)  # grab the connection as soon as the port is bound
    if routing_id is not None:
        s.setsockopt(zmq.ROUTING_ID, routing_id)
    s.connect(endpoint)
    return s


@pytest.mark.slow  # multi-process; the py310/312/313 core envs skip it
@pytest.mark.timeout(90)
def test_junk_forged_and_foreign_frames_dropped_and_counted() -> None:
    size, impls = 3, ("pp0", "ring")
    sc, eps, plans = _plans(impls, size, 40, seed=5)
    injected: dict[str, float] = {}

    def frames(impl: str) -> list[list[bytes]]:
        def ids_of(endpoints: tuple[str, ...]) -> tuple[str, ...]:
            return identities(ConsensusConfig(pp_rank=0, pp_size=size, endpoints=endpoints), impl)

        ids = ids_of(eps[impl])
        foreign = ids_of(tuple(reversed(eps[impl])))[1]  # rank 1 of another group, same key
        ghost = ids[1].replace(":pp1", ":pp7")

        def sealed(identity: str, key: bytes = KEY) -> bytes:
            return Codec(Heartbeat, hmac_key=key, identity=identity).encode(Heartbeat(rank=1))

        junk = b"\xc1 not msgpack"
        return [
            [junk],  # hmac: no MAC at all
            [sealed(ids[1], key=b"wrong key")],  # hmac: wrong key, a member's identity
            [hmac.new(KEY, junk, hashlib.sha256).digest() + junk],  # malformed: no envelope
            [sealed(foreign)],  # unknown_rank: a member of another group sharing the key
            [sealed(ghost)],  # unknown_rank: no such rank
            [b"a", b"b"],  # malformed: extra frame
        ]

    def during(g: Group) -> None:
        time.sleep(0.2)
        ctx = zmq.Context()
        for impl in impls:
            s = ctx.socket(zmq.DEALER)
            s.setsockopt(zmq.LINGER, 2000)
            s.connect(eps[impl][0])
            for parts in frames(impl):
                s.send_multipart(parts)
            s.close()
            injected[impl] = time.monotonic()
        ctx.term()

    g = run_group(plans, during=during, max_s=20.0)
    want = {"hmac": 2, "malformed": 2, "unknown_rank": 2}
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


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_routing_id_squatter_cannot_halt_consensus() -> None:
    """A keyless process connects to every peer of rank 1 with routing id ``r1`` before rank
    1 starts (the identity the old link trusted) and keeps sending junk; rank 1's votes and
    heartbeats must still count: every clean request decided good, nobody reported dead."""
    size, impls = 3, ("pp0", "ring")
    sc, eps, plans = _plans(
        impls, size, 40, seed=11, peer_timeout_s=4.0, per_rank={1: {"init_delay_s": 1.5}}
    )
    ctx = zmq.Context()
    squat = [_dealer(ctx, eps[impl][r], b"r1") for impl in impls for r in (0, 2)]

    def during(g: Group) -> None:
        for _ in range(20):
            for s in squat:
                s.send(b"\x00junk", zmq.NOBLOCK)
            time.sleep(0.05)

    try:
        g = run_group(plans, during=during, max_s=25.0)
    finally:
        ctx.destroy(linger=0)
    for k, impl in enumerate(impls):
        res = g.instance(k)
        check_agreement(res, sc[impl])
        assert res[0].stats["dropped_hmac"] >= 20, (impl, res[0].stats)


def _record_dead_report(eps: tuple[str, ...]) -> list[bytes]:
    """Frames an earlier PP0 of this group (same key, same endpoints) sent to rank 1 while
    ranks 1 and 2 were absent: heartbeats, the last ones reporting ranks 1 and 2 dead."""
    ctx = zmq.Context()
    tap = ctx.socket(zmq.ROUTER)
    tap.setsockopt(zmq.LINGER, 0)
    tap.bind(eps[1])
    cfg = ConsensusConfig(
        pp_rank=0,
        pp_size=len(eps),
        endpoints=eps,
        peer_timeout_s=0.4,
        heartbeat_s=0.1,
        wire=WireConfig(hmac_key=KEY, max_message_bytes=MAX),
    )
    got: list[bytes] = []
    with make_pp0(cfg) as leader:
        t0 = time.monotonic()
        while time.monotonic() - t0 < 1.2:
            try:
                leader.poll()
            except ConsensusError:
                pass
            while tap.poll(0):
                got.append(tap.recv_multipart()[-1])
            time.sleep(0.01)
    tap.close()
    ctx.term()
    return got


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_replayed_dead_report_cannot_evict_a_peer() -> None:
    """A keyless process replays, to rank 1, PP0's recorded dead-rank report from an earlier
    run of the same group (posing as PP0 by routing id, connected before the new PP0)."""
    size = 3
    sc, eps, plans = _plans(("pp0",), size, 40, seed=17, per_rank={0: {"init_delay_s": 1.5}})
    recorded = _record_dead_report(eps["pp0"])
    assert len(recorded) >= 5
    ctx = zmq.Context()
    hostile = _dealer(ctx, eps["pp0"][1], b"r0")

    def during(g: Group) -> None:
        time.sleep(0.3)  # the new PP0 has been heard by now
        for f in recorded:
            hostile.send(f)
        time.sleep(0.5)

    try:
        g = run_group(plans, during=during, max_s=20.0)
    finally:
        ctx.destroy(linger=0)
    res = g.instance(0)
    check_agreement(res, sc["pp0"])  # no rank raised: nobody evicted
    st = res[1].stats
    assert st["dropped_replay"] == len(recorded), st
    assert st["dropped"] == len(recorded), st


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_oversized_frame_is_never_buffered() -> None:
    """A frame above max_message_bytes (but below the old 2x memory guard) is refused by
    libzmq before it is buffered: the sender is disconnected, the codec never sees it and the
    rank's peak memory does not grow by the frame's size."""
    size, big = 2, 12 << 20
    impls = ("pp0", "ring")
    sc, eps, plans = _plans(impls, size, 30, seed=23, max_message_bytes=8 << 20)
    ctx = zmq.Context()
    events: dict[str, list[str]] = {}

    def during(g: Group) -> None:
        time.sleep(0.2)
        for impl in impls:
            s = ctx.socket(zmq.DEALER)
            s.setsockopt(zmq.LINGER, 0)
            mon = s.get_monitor_socket()
            s.connect(eps[impl][0])
            s.send(b"\x01" * big)
            seen: list[str] = []
            t = time.monotonic()
            while "DISCONNECTED" not in seen and time.monotonic() - t < 5:
                if mon.poll(100):
                    seen.append(zmq.Event(recv_monitor_message(mon)["event"]).name)
            events[impl] = seen
            s.disable_monitor()
            mon.close(0)
            s.close(0)

    try:
        g = run_group(plans, during=during, max_s=20.0)
    finally:
        ctx.destroy(linger=0)
    for k, impl in enumerate(impls):
        res = g.instance(k)
        check_agreement(res, sc[impl])
        assert "DISCONNECTED" in events[impl], (impl, events[impl])
        st = res[0].stats
        assert st.get("dropped_oversize", 0) == 0 and st["dropped"] == 0, (impl, st)
        grew_mib = (res[0].rss_end_kib - res[0].rss_start_kib) / 1024
        assert grew_mib < (big >> 20) / 2, (impl, grew_mib)


@pytest.mark.parametrize("make", [make_pp0, make_ring], ids=["pp0", "ring"])
def test_off_loopback_without_a_key_refuses_to_start(make: Any) -> None:
    eps = free_endpoints(2)
    open_wire = WireConfig(bind_host="0.0.0.0")
    with pytest.raises(ValueError, match=r"'0\.0\.0\.0' is off loopback and WireConfig\.hmac_key"):
        make(ConsensusConfig(pp_rank=1, pp_size=2, endpoints=eps, wire=open_wire))
    remote = (eps[0], "tcp://10.255.0.1:5999")
    with pytest.raises(ValueError, match=r"'10\.255\.0\.1' is off loopback"):
        make(ConsensusConfig(pp_rank=0, pp_size=2, endpoints=remote))
    keyed = msgspec.structs.replace(open_wire, hmac_key=KEY)
    make(ConsensusConfig(pp_rank=1, pp_size=2, endpoints=eps, wire=keyed)).close()
