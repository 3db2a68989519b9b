"""pdplug.rooms: the KVPoll lattice, generations, pending-gated Success, deadlines."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from pdplug import KVConfig, KVLayout, KVPoll
from pdplug.rooms import Rooms


class Clock:
    def __init__(self) -> None:
        self.t = 100.0

    def __call__(self) -> float:
        return self.t


def make(clock: Clock | None = None) -> Rooms:
    return Rooms(
        bootstrap_timeout_s=1.0,
        waiting_timeout_s=2.0,
        transfer_timeout_s=3.0,
        clock=clock or Clock(),
    )


def test_lattice_is_monotonic_and_failed_absorbing() -> None:
    r = make()
    g = r.lease(5)
    assert r.status(5) == KVPoll.Bootstrapping
    assert r.advance(5, KVPoll.Transferring) == KVPoll.Transferring
    assert r.advance(5, KVPoll.WaitingForInput) == KVPoll.Transferring  # never down
    assert r.fail(5, "boom", g) is True
    assert r.fail(5, "again", g) is False  # already failed: first reason kept
    assert r.advance(5, KVPoll.Success) == KVPoll.Failed
    assert r.status(5) == KVPoll.Failed
    assert r.reason(5) == "boom"


def test_generations_isolate_leases_and_cleared_rooms_ignore_events() -> None:
    r = make()
    g1 = r.lease(7)
    assert r.clear(7) is True
    assert r.fail(7, "late failure", g1) is False  # cleared room: ignored
    assert 7 not in r
    g2 = r.lease(7)
    assert g2 > g1
    assert r.fail(7, "stale generation", g1) is False
    assert r.advance(7, KVPoll.Success, g1) is None
    assert r.status(7) == KVPoll.Bootstrapping
    assert r.ignored == 3
    assert r.advance(7, KVPoll.WaitingForInput, g2) == KVPoll.WaitingForInput
    with pytest.raises(KeyError, match="room 8 is not leased"):
        r.status(8)


def test_success_held_while_chunks_pending() -> None:
    r = make()
    g = r.lease(1, KVPoll.WaitingForInput)
    r.add_pending(1, 2, g)
    assert r.advance(1, KVPoll.Success, g) == KVPoll.WaitingForInput
    assert r.view(1).success_held  # type: ignore[union-attr]
    assert r.done_pending(1, 1, g) == KVPoll.WaitingForInput
    assert r.done_pending(1, 1, g) == KVPoll.Success
    with pytest.raises(ValueError, match="only 0 pending"):
        r.done_pending(1, 1, g)


def test_failure_while_pending_is_not_overridden_by_held_success() -> None:
    r = make()
    g = r.lease(1, KVPoll.Transferring)
    r.add_pending(1, 1, g)
    r.advance(1, KVPoll.Success, g)
    r.fail(1, "post failed", g)
    assert r.done_pending(1, 1, g) == KVPoll.Failed


@pytest.mark.parametrize(
    ("state", "limit", "field"),
    [
        (KVPoll.Bootstrapping, 1.0, "bootstrap_timeout_s"),
        (KVPoll.WaitingForInput, 2.0, "waiting_timeout_s"),
        (KVPoll.Transferring, 3.0, "transfer_timeout_s"),
    ],
)
def test_each_state_has_a_deadline_naming_its_config_field(
    state: KVPoll, limit: float, field: str
) -> None:
    clock = Clock()
    r = make(clock)
    g = r.lease(3, state)
    clock.t += limit - 0.01
    assert r.expire() == []
    clock.t += 0.02
    out = r.expire()
    assert [(room, gen) for room, gen, _ in out] == [(3, g)]
    assert field in out[0][2] and state.name in out[0][2]
    assert r.status(3) == KVPoll.Failed
    assert r.expire() == []  # once


def test_touch_rearms_transfer_deadline_and_success_has_none() -> None:
    clock = Clock()
    r = make(clock)
    g = r.lease(4, KVPoll.Transferring)
    for _ in range(5):
        clock.t += 2.5
        r.touch(4, g)
        assert r.expire() == []
    r.advance(4, KVPoll.Success, g)
    clock.t += 100
    assert r.expire() == []
    assert r.status(4) == KVPoll.Success


def test_bad_arguments_are_named() -> None:
    with pytest.raises(ValueError, match="waiting_timeout_s must be > 0"):
        Rooms(waiting_timeout_s=0)
    with pytest.raises(ValueError, match="initial status must not be terminal"):
        make().lease(1, KVPoll.Success)


def test_from_config_uses_the_three_timeouts() -> None:
    cfg = KVConfig(
        instance="p",
        role="prefill",
        layout=KVLayout(page_size=4, entry_bytes_per_token=(8,)),
        bootstrap_timeout_s=1.5,
        waiting_timeout_s=2.5,
        transfer_timeout_s=3.5,
    )
    clock = Clock()
    r = Rooms.from_config(cfg, clock=clock)
    r.lease(1, KVPoll.WaitingForInput)
    clock.t += 2.4
    assert r.expire() == []
    clock.t += 0.2
    assert "waiting_timeout_s" in r.expire()[0][2]


OPS = st.lists(
    st.one_of(
        st.tuples(st.just("advance"), st.sampled_from(list(KVPoll)[1:])),
        st.tuples(st.just("fail"), st.just(0)),
        st.tuples(st.just("add"), st.integers(1, 3)),
        st.tuples(st.just("done"), st.integers(1, 3)),
        st.tuples(st.just("stale"), st.sampled_from(list(KVPoll))),
        st.tuples(st.just("tick"), st.floats(0, 2)),
    ),
    max_size=40,
)


@settings(max_examples=300, deadline=None)
@given(OPS)
def test_random_event_sequences_keep_the_invariants(ops: list[tuple[str, object]]) -> None:
    clock = Clock()
    r = make(clock)
    old = r.lease(9)
    r.clear(9)
    g = r.lease(9)
    pending = 0
    prev = r.status(9)
    for op, arg in ops:
        if op == "advance":
            r.advance(9, arg, g)  # type: ignore[arg-type]
        elif op == "fail":
            r.fail(9, "x", g)
        elif op == "add":
            if r.add_pending(9, arg, g):  # type: ignore[arg-type]
                pending += arg  # type: ignore[operator]
        elif op == "done":
            n = min(pending, arg)  # type: ignore[call-overload]
            if n:
                r.done_pending(9, n, g)
                pending -= n
        elif op == "stale":
            # an event of the cleared lease never changes anything
            r.advance(9, arg, old)  # type: ignore[arg-type]
            r.fail(9, "stale", old)
        else:
            clock.t += arg  # type: ignore[operator]
            r.expire()
        cur = r.status(9)
        if prev == KVPoll.Failed:
            assert cur == KVPoll.Failed
        elif cur != KVPoll.Failed:
            assert cur >= prev
        if cur == KVPoll.Success:
            assert pending == 0
        if cur != KVPoll.Failed:
            assert r.pending(9) == pending
        prev = cur
