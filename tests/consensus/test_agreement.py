"""Both implementations reach identical decision sequences on every rank (real processes,
real sockets on 127.0.0.1), with local failures, missing votes (deadline) and a held room."""

from __future__ import annotations

import pytest

from pdplug.ports import free_endpoints

from .ranks import Instance, check_agreement, run_group, scenario

# generous: votes of one request spread over 0.3 s, but a loaded 2-core box can stall a
# rank process for a while; a clean request must never hit the deadline
DEADLINE = 2.5


@pytest.mark.slow  # multi-process; the py310/312/313 core envs skip it
@pytest.mark.timeout(60)
@pytest.mark.parametrize("size", [2, 4, 8])
def test_identical_sequences_pp0_and_ring(size: int) -> None:
    n = 60
    sc = {
        impl: scenario(
            size, n, seed=size * 7 + k, span_s=0.6, hold=True, bad_frac=0.08, missing_frac=0.08
        )
        for k, impl in enumerate(("pp0", "ring"))
    }
    eps = {impl: free_endpoints(size) for impl in sc}
    plans = {
        r: [
            Instance(
                impl=impl,
                endpoints=eps[impl],
                actions=tuple(sc[impl].actions[r]),
                expect=sc[impl].expect,
                vote_deadline_s=DEADLINE,
            )
            for impl in sc
        ]
        for r in range(size)
    }
    g = run_group(plans, max_s=20.0)
    for k, impl in enumerate(sc):
        res = g.instance(k)
        assert len(res) == size
        outcome = check_agreement(res, sc[impl])
        # a rank's failure is bad everywhere; never-voted ids fell to the deadline
        assert sc[impl].bad_voted["bootstrap"] and sc[impl].missing["bootstrap"]
        leader = res[0].stats
        assert leader["deadline_bad"] >= len(
            sc[impl].missing["bootstrap"] - sc[impl].bad_voted["bootstrap"]
        )
        # the held room: good, and applied nowhere before the hold was released
        rid, t_rel = sc[impl].held["bootstrap"]
        assert outcome["bootstrap"][rid] == "good"
        for r, x in res.items():
            t_apply = next(a.t for a in x.applied if rid in a.good)
            assert t_apply >= g.start_t + t_rel, f"{impl} rank {r} admitted held rid early"
        assert res[size - 1].stats["deferred"] == 1
        assert res[0].stats["dropped"] == 0


@pytest.mark.slow
@pytest.mark.timeout(60)
def test_one_rank_fails_locally_is_bad_everywhere() -> None:
    """Rank 2 has no free metadata slot for rid 5 (votes bad) while every other rank is
    ready: rid 5 is bad on every rank, for both implementations; its neighbours are good."""
    size = 4
    plans: dict[int, list[Instance]] = {r: [] for r in range(size)}
    for impl in ("pp0", "ring"):
        eps = free_endpoints(size)
        for r in range(size):
            acts = [("good", 4, 0.0), ("bad" if r == 2 else "good", 5, 0.1 * r), ("good", 6, 0.3)]
            from .ranks import Action

            plans[r].append(
                Instance(
                    impl=impl,
                    endpoints=eps,
                    actions=tuple(Action(t, k, "bootstrap", rid) for k, rid, t in acts),
                    expect={"bootstrap": 3},
                )
            )
    g = run_group(plans, max_s=15.0)
    for k in range(2):
        res = g.instance(k)
        for r, x in res.items():
            assert x.error is None
            good = {i for a in x.applied for i in a.good}
            bad = {i for a in x.applied for i in a.bad}
            assert (good, bad) == ({4, 6}, {5}), (k, r, good, bad)


@pytest.mark.slow
@pytest.mark.timeout(60)
def test_host_relay_carries_pp0_decisions() -> None:
    """A relay over multiprocessing pipes replaces the ZMQ fan-out: same agreement, and every
    decision went through the relay (PP0 published each once; each follower received each)."""
    size = 3
    sc = scenario(size, 40, seed=11, span_s=0.5)
    eps = free_endpoints(size)
    plans = {
        r: [
            Instance(
                impl="pp0",
                endpoints=eps,
                actions=tuple(sc.actions[r]),
                expect=sc.expect,
                vote_deadline_s=DEADLINE,
                relay=True,
            )
        ]
        for r in range(size)
    }
    g = run_group(plans, relay=True, max_s=15.0)
    res = g.instance(0)
    check_agreement(res, sc)
    n_dec = len(res[0].applied)
    assert n_dec > 0
    for r, x in res.items():
        assert x.relay_frames == n_dec, (r, x.relay_frames, n_dec)
