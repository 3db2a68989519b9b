"""A rank process killed mid-run: every surviving rank's poll() raises ConsensusError naming
it within the configured peer timeout (no hang), for both implementations."""

from __future__ import annotations

import pytest

from pdplug.ports import free_endpoints

from .ranks import Instance, run_group, scenario

TIMEOUT, HB = 2.0, 0.2


@pytest.mark.slow  # multi-process; the py310/312/313 core envs skip it
@pytest.mark.timeout(60)
@pytest.mark.parametrize("victim", [2, 0], ids=["follower", "leader"])
def test_killed_rank_is_reported(victim: int) -> None:
    size = 4
    impls = ("pp0", "ring")
    sc = scenario(size, 200, seed=3, span_s=8.0, streams=("bootstrap",))
    plans: dict[int, list[Instance]] = {r: [] for r in range(size)}
    for impl in impls:
        eps = free_endpoints(size)
        for r in range(size):
            plans[r].append(
                Instance(
                    impl=impl,
                    endpoints=eps,
                    actions=tuple(sc.actions[r]),
                    expect=sc.expect,
                    vote_deadline_s=5.0,
                    peer_timeout_s=TIMEOUT,
                    heartbeat_s=HB,
                )
            )
    g = run_group(plans, kill=(victim, 0.8), max_s=20.0)
    assert g.kill_t is not None
    for k, impl in enumerate(impls):
        res = g.instance(k)
        assert sorted(res) == sorted(set(range(size)) - {victim})
        for r, x in res.items():
            assert x.applied, f"{impl} rank {r}: nothing decided before the kill"
            assert x.error is not None, f"{impl} rank {r} never reported the dead rank"
            assert f"[{victim}]" in x.error and "ConsensusError" not in x.error, x.error
            assert x.error_t is not None
            dt = x.error_t - g.kill_t
            # silent for peer_timeout_s since its last heartbeat, reported within the timeout
            assert TIMEOUT - HB - 0.1 <= dt <= TIMEOUT + 1.0, (impl, r, dt, x.error)
