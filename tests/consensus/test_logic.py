"""Unit and property tests of the decide / apply logic (pure, no sockets) and of the
factories' validation and Protocol conformance."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from pdplug import Consensus, ConsensusConfig, ConsensusError
from pdplug.ports import free_endpoints
from pdplug.types import Decision, Vote
from pdplug.wire import Codec
from pdplug_consensus.common import check_config
from pdplug_consensus.decide import Applier, Tally
from pdplug_consensus.messages import Abort, Heartbeat, RingCandidate, StreamCandidate
from pdplug_consensus.pp0 import make_pp0
from pdplug_consensus.ring import make_ring
from pdplug_consensus.votes import LocalVotes

S = ("bootstrap", "release")


def _tally(p: int = 3, deadline: float = 10.0) -> Tally:
    return Tally(p, S, deadline, 60.0)


def test_good_needs_every_rank_bad_wins() -> None:
    t = _tally()
    t.vote("bootstrap", 0, [1, 2], [], 0.0)
    t.vote("bootstrap", 1, [1, 2], [], 0.0)
    assert t.decide(0.1) == []
    t.vote("bootstrap", 2, [1], [2], 0.2)
    assert t.decide(0.3) == [Decision(stream="bootstrap", seq=0, good=(1,), bad=(2,))]
    # late votes for decided ids are ignored, never a second decision
    t.vote("bootstrap", 2, [2], [1], 0.4)
    assert t.decide(0.5) == []
    assert t.counters["late_votes"] == 2


def test_streams_have_independent_gap_free_sequences() -> None:
    t = _tally(p=1)
    out = []
    for i in range(3):
        t.vote("bootstrap", 0, [i], [], float(i))
        t.vote("release", 0, [], [100 + i], float(i))
        out += t.decide(float(i))
    assert [(d.stream, d.seq) for d in out] == [
        ("bootstrap", 0),
        ("release", 0),
        ("bootstrap", 1),
        ("release", 1),
        ("bootstrap", 2),
        ("release", 2),
    ]


def test_abort_before_and_after_votes() -> None:
    t = _tally(p=2)
    t.vote("bootstrap", 0, [7], [], 0.0)
    t.abort([7, 8], 0.1)  # 7 pending: bad now; 8 unknown yet: bad on its first vote
    t.vote("release", 1, [8], [], 0.2)
    ds = t.decide(0.3)
    assert ds == [
        Decision(stream="bootstrap", seq=0, good=(), bad=(7,)),
        Decision(stream="release", seq=0, good=(), bad=(8,)),
    ]
    assert t.counters["abort_bad"] == 2


def test_deadline_decides_bad_and_not_before() -> None:
    t = _tally(p=3, deadline=1.0)
    t.vote("bootstrap", 0, [5], [], 10.0)
    t.vote("bootstrap", 1, [5], [], 10.5)
    assert t.decide(10.99) == []
    assert t.decide(11.01) == [Decision(stream="bootstrap", seq=0, good=(), bad=(5,))]
    assert t.counters["deadline_bad"] == 1 and t.pending("bootstrap") == 0


def test_ring_complete_and_see() -> None:
    t = _tally(p=4, deadline=1.0)
    t.see("bootstrap", [1, 2], 0.0)
    t.complete("bootstrap", [1], 0.1)
    assert t.decide(0.1) == [Decision(stream="bootstrap", seq=0, good=(1,), bad=())]
    assert t.decide(1.2) == [Decision(stream="bootstrap", seq=1, good=(), bad=(2,))]


# ------------------------------------------------------------------ property: Tally


ops = st.lists(
    st.one_of(
        st.tuples(
            st.just("vote"), st.integers(0, 2), st.sampled_from(S), st.integers(0, 5), st.booleans()
        ),
        st.tuples(st.just("abort"), st.integers(0, 5)),
        st.tuples(st.just("tick"), st.floats(0.0, 0.6)),
    ),
    max_size=60,
)


@settings(max_examples=300, deadline=None)
@given(ops)
def test_tally_properties(seq: list[tuple]) -> None:
    """Each id is decided at most once per stream; good only if every rank voted good and no
    bad vote / abort came first; bad only with a bad vote, an abort or an expired deadline;
    after the deadline nothing voted is left undecided; seqs are gap-free."""
    p, deadline = 3, 1.0
    t = Tally(p, S, deadline, 60.0)
    now = 0.0
    good_by: dict[tuple[str, int], set[int]] = {}
    bad_voted: set[tuple[str, int]] = set()
    first: dict[tuple[str, int], float] = {}
    aborted: set[int] = set()
    decided: dict[tuple[str, int], str] = {}
    decisions: list[Decision] = []

    def check(ds: list[Decision]) -> None:
        for d in ds:
            for rid in d.good:
                k = (d.stream, rid)
                assert k not in decided
                assert good_by.get(k, set()) == set(range(p))
                assert k not in bad_voted and rid not in aborted
                decided[k] = "good"
            for rid in d.bad:
                k = (d.stream, rid)
                assert k not in decided
                assert k in bad_voted or rid in aborted or now - first[k] >= deadline
                decided[k] = "bad"
        decisions.extend(ds)

    for op in seq:
        if op[0] == "vote":
            _, rank, s, rid, good = op
            k = (s, rid)
            first.setdefault(k, now)
            if k not in decided:
                if good:
                    good_by.setdefault(k, set()).add(rank)
                else:
                    bad_voted.add(k)
            t.vote(s, rank, [rid] if good else [], [] if good else [rid], now)
        elif op[0] == "abort":
            t.abort([op[1]], now)
            aborted.add(op[1])
        else:
            now += op[1]
        check(t.decide(now))
    now += deadline + 0.01
    check(t.decide(now))
    assert set(first) == set(decided), "ids left undecided after the deadline"
    for s in S:
        assert [d.seq for d in decisions if d.stream == s] == list(
            range(sum(d.stream == s for d in decisions))
        )


# ------------------------------------------------------------------ Applier


def test_applier_rejects_gap_duplicate_and_repeats() -> None:
    a = Applier(S, 60.0)
    a.apply(Decision(stream="bootstrap", seq=0, good=(1,)), 0.0)
    with pytest.raises(
        ConsensusError, match=r"gap on stream='bootstrap': got seq=2, expected seq=1"
    ):
        a.apply(Decision(stream="bootstrap", seq=2, good=(2,)), 0.0)
    with pytest.raises(ConsensusError, match="duplicate"):
        a.apply(Decision(stream="bootstrap", seq=0, good=(3,)), 0.0)
    with pytest.raises(ConsensusError, match=r"already decided: \[1\]"):
        a.apply(Decision(stream="bootstrap", seq=1, bad=(1,)), 0.0)
    with pytest.raises(ConsensusError, match=r"good and bad: \[4\]"):
        a.apply(Decision(stream="bootstrap", seq=1, good=(4,), bad=(4,)), 0.0)
    with pytest.raises(ConsensusError, match="stream='nope'"):
        a.apply(Decision(stream="nope", seq=0), 0.0)
    a.apply(Decision(stream="release", seq=0, good=(1,)), 0.0)  # other stream: independent
    assert a.next_seq == {"bootstrap": 1, "release": 1}


@settings(max_examples=100, deadline=None)
@given(st.lists(st.integers(0, 40), min_size=2, max_size=40, unique=True), st.data())
def test_applier_accepts_in_order_rejects_any_swap(rids: list[int], data: st.DataObject) -> None:
    ds = [Decision(stream="bootstrap", seq=i, good=(r,)) for i, r in enumerate(rids)]
    a = Applier(S, 60.0)
    for d in ds:
        a.apply(d, 0.0)
    i = data.draw(st.integers(0, len(ds) - 2))
    b = Applier(S, 60.0)
    for d in ds[:i]:
        b.apply(d, 0.0)
    with pytest.raises(ConsensusError):
        b.apply(ds[i + 1], 0.0)


# ------------------------------------------------------------------ LocalVotes


def test_local_votes_hold_defers_good_until_released() -> None:
    a = Applier(S, 60.0)
    v = LocalVotes(S, a, 60.0)
    v.hold(9, n=2)
    v.offer("release", good=[9, 10])
    assert v.take() == ([("release", (10,), ())], ())
    assert v.release_hold(9) is False
    assert v.take() == ([], ())
    assert v.release_hold(9) is True
    assert v.take() == ([("release", (9,), ())], ())
    with pytest.raises(ValueError, match="rid=9 has 0 holds, cannot release n=1"):
        v.release_hold(9)
    assert v.counters["deferred"] == 1


def test_local_votes_dedup_late_abort_and_validation() -> None:
    a = Applier(S, 60.0)
    v = LocalVotes(S, a, 60.0)
    v.offer("bootstrap", good=[1, 2, 1])
    v.offer("bootstrap", good=[1])  # re-offer: no-op
    v.offer("bootstrap", bad=[2])  # failure after readiness: bad wins
    assert v.take() == ([("bootstrap", (1, 2), (2,))], ())
    d = Decision(stream="bootstrap", seq=0, good=(1,), bad=(2,))
    a.apply(d, 0.0)
    v.applied(d)
    v.offer("bootstrap", good=[1], bad=[2])  # re-poll after consensus: ignored
    assert v.counters["late_offers"] == 2 and v.take() == ([], ())
    v.abort(3, 0.0)
    v.offer("release", good=[3])  # an aborted id can only be voted bad
    assert v.take() == ([("release", (), (3,))], (3,))
    with pytest.raises(
        ValueError, match=r"stream='prefill' is not one of \('bootstrap', 'release'\)"
    ):
        v.offer("prefill", good=[1])
    with pytest.raises(ValueError, match=r"good: request id 'x' is not an integer"):
        v.offer("bootstrap", good=["x"])  # type: ignore[list-item]


# ------------------------------------------------------------------ config, factories, wire


def _cfg(**kw: object) -> ConsensusConfig:
    base: dict = {"pp_rank": 0, "pp_size": 1, "endpoints": free_endpoints(1)}
    base.update(kw)
    return ConsensusConfig(**base)


@pytest.mark.parametrize(
    ("kw", "msg"),
    [
        ({"endpoints": ("127.0.0.1:5000",)}, r"endpoints\[0\]='127.0.0.1:5000'"),
        ({"endpoints": ("tcp://127.0.0.1:0",)}, "port in 1..65535"),
        ({"peer_timeout_s": 0.5, "heartbeat_s": 0.5}, "peer_timeout_s=0.5 must exceed"),
        ({"vote_deadline_s": 0.0}, "vote_deadline_s=0.0"),
        ({"streams": ("a", "a")}, "duplicates"),
    ],
)
def test_config_errors_name_field_and_value(kw: dict, msg: str) -> None:
    with pytest.raises(ValueError, match=msg):
        check_config(_cfg(**kw))
    for make in (make_pp0, make_ring):
        with pytest.raises(ValueError, match=msg):
            make(_cfg(**kw))


@pytest.mark.parametrize("make", [make_pp0, make_ring])
def test_single_rank_decides_and_satisfies_protocol(make) -> None:
    import time

    with make(_cfg()) as c:
        assert isinstance(c, Consensus)
        c.offer("bootstrap", good=[1, 2], bad=[3])
        c.abort(2)
        got: list[Decision] = []
        t = time.monotonic()
        while not got and time.monotonic() - t < 5:
            got += c.poll()
            time.sleep(0.005)
        # the abort reaches the tally before or after the vote was decided
        assert len(got) == 1 and (got[0].stream, got[0].seq) == ("bootstrap", 0)
        assert (set(got[0].good), set(got[0].bad)) in [({1}, {2, 3}), ({1, 2}, {3})]
        assert c.stats()["decisions_applied"] == 1
        with pytest.raises(ValueError, match="stream='x'"):
            c.offer("x", good=[1])
    c.close()  # idempotent
    with pytest.raises(ConsensusError, match="closed"):
        c.poll()


def test_manager_builds_both_by_name() -> None:
    from pdplug import get_plugin_manager

    pm = get_plugin_manager()
    for name, cls in (("pp0", "PP0Consensus"), ("ring", "RingConsensus")):
        c = pm.make_consensus(_cfg(), name=name)
        try:
            assert type(c).__name__ == cls
        finally:
            c.close()


def test_pp0_rejects_a_relay_without_the_protocol() -> None:
    with pytest.raises(TypeError, match="DecisionRelay"):
        make_pp0(_cfg(), relay=object())  # type: ignore[arg-type]


def test_wire_messages_roundtrip_strictly() -> None:
    c = Codec(Vote, Decision, Abort, Heartbeat, RingCandidate, hmac_key=b"k")
    msgs = [
        Vote(stream="bootstrap", rank=1, seq=0, good=(1,), bad=(2,)),
        Abort(rank=2, seq=3, rids=(4, 5)),
        Heartbeat(rank=1, dead=(3,)),
        RingCandidate(rank=1, round=7, streams=(StreamCandidate(stream="x", good=(1,)),)),
    ]
    for m in msgs:
        assert c.decode(c.encode(m)) == m
    import msgspec

    bad = msgspec.msgpack.encode({"type": "abort", "rank": "one", "seq": 0})
    import hashlib
    import hmac

    assert c.decode(hmac.new(b"k", bad, hashlib.sha256).digest() + bad) is None
    assert c.drops["wrong_type"] == 1


def test_ring_wait_blocks_until_the_next_candidate_is_queued() -> None:
    import time

    eps = free_endpoints(2)
    cfg = [ConsensusConfig(pp_rank=r, pp_size=2, endpoints=eps) for r in range(2)]
    with make_ring(cfg[0]) as r0, make_ring(cfg[1]) as r1:
        t = time.monotonic()
        assert r1.wait(0.2) is False  # nothing sent yet: bounded by the timeout
        assert 0.15 <= time.monotonic() - t < 2.0
        r0.poll()  # starts round 1 (queued for the end of this iteration)
        assert r1.wait(0.5) is False
        r0.poll()  # end of the iteration: round 1 leaves for rank 1
        assert r1.wait(5.0) is True
        assert r1.poll() == [] and r1.stats()["candidates_forwarded"] == 1
