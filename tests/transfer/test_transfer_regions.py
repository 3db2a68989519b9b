"""Pack regions shared by a prefill rank's decode peers (pdplug.transfer.regions.RegionPool):
the bounds that keep one decode peer or instance from starving the others."""

from __future__ import annotations

from pdplug.transfer.regions import RegionPool


def test_a_peer_holds_at_most_depth_regions() -> None:
    pool = RegionPool(8, 2)
    assert [pool.take(("a", 0), "a", 1) >= 0 for _ in range(3)] == [True, True, False]
    assert pool.held(("a", 0)) == 2


def test_a_group_is_held_to_its_share_while_another_wants_regions() -> None:
    pool = RegionPool(8, 2)
    for r in range(2):  # instance a (DCP 2) alone: 4 regions
        for _ in range(2):
            assert pool.take(("a", r), "a", 1) >= 0
    # instance b arrives: a may not take more than ceil(8 / 2) = 4; b gets its share
    got = [pool.take(("b", r), "b", 2) >= 0 for r in range(2) for _ in range(2)]
    assert got == [True] * 4
    assert pool.take(("a", 2), "a", 2) == -1
    region = next(i for i in range(8) if pool.busy[i])
    pool.give_back(region, ("a", 0), "a")
    assert pool.held(("a", 0)) == 1


def test_a_stuck_instance_that_took_every_region_leaves_another_instance_one() -> None:
    # (max_dst_dcp 2 + 1) x pack_depth 2, as make_pack_buffer sizes it for a DCP 2 decode
    pool = RegionPool(6, 2)
    for r in range(2):  # instance a (DCP 2), alone, fills the pool; then its writes stick
        for _ in range(2):
            assert pool.take(("a", r), "a", 1) >= 0
    assert pool.take(("b", 0), "b", 2) >= 0  # instance b (healthy) must get a region


def test_a_group_alone_leaves_depth_regions_free() -> None:
    pool = RegionPool(6, 2)
    got = [pool.take(("a", r), "a", 1) >= 0 for r in range(3) for _ in range(2)]
    assert got == [True] * 4 + [False] * 2  # 6 - depth 2: every rank of a DCP 2 decode, twice
    assert pool.take(("b", 0), "b", 2) >= 0 and pool.take(("b", 0), "b", 2) >= 0
    assert pool.take(("b", 1), "b", 2) == -1  # the pool is empty now


def test_a_pool_of_depth_regions_still_serves_one_peer() -> None:
    pool = RegionPool(2, 2)  # total - depth = 0: the depth bound alone applies
    assert [pool.take(("a", 0), "a", 1) >= 0 for _ in range(3)] == [True, True, False]
