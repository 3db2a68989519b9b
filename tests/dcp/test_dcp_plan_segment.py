"""pdplug.packing.plan_segment (the KV sender's planning path) equals one ``plan`` per
destination, for every layout mapping of ``test_dcp_layouts`` (whose ``plan`` calls are checked
byte for byte): the batched path (``plan_all`` over the DCP ranks of one decode TP rank, each
rank with its own layout and page list) must produce the same plans field by field."""

from __future__ import annotations

import itertools

import msgspec
import numpy as np
import pytest
from _layoutsim import DCPS, KINDS, RATIOS, TPS, build
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from pdplug import PlannerConfig, SchedulerConfig
from pdplug.errors import CapacityError
from pdplug.heads import routed_heads
from pdplug.packing import (
    pack_regions,
    plan_segment,
    region_index,
    segment_chunks,
    segment_to_chunk,
    send_capacity_tokens,
)
from pdplug.types import TransferPlan, pages_to_bytes
from pdplug_dcp.planner import make_dcp_planner
from pdplug_scheduler.scheduler import make_scheduler

COMBOS = [c for c in itertools.product(KINDS, TPS, RATIOS, DCPS) if c[3] > 1]
ARRAYS = ("entry", "src_offset", "dst_offset", "length", "pack_src_slots")
SCALARS = ("room", "chunk_id", "is_last", "dst_dcp_rank", "num_tokens", "packed", "region",
           "pack_entries", "pack_row_bytes")  # fmt: skip


def _same(a: TransferPlan, b: TransferPlan) -> None:
    for f in SCALARS:
        assert getattr(a, f) == getattr(b, f), f
    for f in ARRAYS:
        x, y = getattr(a, f), getattr(b, f)
        assert np.array_equal(np.asarray(x if x is not None else []),
                              np.asarray(y if y is not None else [])), f  # fmt: skip
    assert len(a.pack_groups) == len(b.pack_groups)
    for g, h in zip(a.pack_groups, b.pack_groups):
        for f in ("entries", "cols", "row_bytes", "unit", "page_tokens", "first_offset"):
            assert getattr(g, f) == getattr(h, f), f
        assert np.array_equal(g.offsets, h.offsets) and np.array_equal(g.tokens, h.tokens)


@pytest.mark.parametrize(
    ("kind", "tps", "ratio", "dcp"),
    COMBOS,
    ids=[f"{k}-{t[0]}:{t[1]}-r{r}-d{d}" for k, t, r, d in COMBOS],
)
@settings(max_examples=3, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(data=st.data())
def test_plan_segment_equals_one_plan_per_destination(data, kind, tps, ratio, dcp) -> None:
    ptp, dtp, heads = tps
    pd = data.draw(st.sampled_from([2, 4]), label="decode_page")
    ps = int(pd * ratio)
    vd = pd * dcp
    prefix = data.draw(st.integers(0, 2), label="prefix_vpages") * vd
    total = data.draw(st.integers(1, 6 * vd + 3), label="send_tokens")
    region_pages = data.draw(st.integers(1, 3), label="region_pages")
    own_pages = data.draw(st.booleans(), label="one_rank_sends_other_pages")
    shuffle = data.draw(st.booleans(), label="items_out_of_rank_order")
    as_sender = data.draw(st.booleans(), label="chunks_built_by_segment_chunks")
    rng = np.random.default_rng(data.draw(st.integers(0, 2**32 - 1), label="seed"))
    pages = -(-(prefix + total) // ps) + -(-total // vd) + 4
    req = rng.permutation(pages)[: -(-(prefix + total) // ps)]
    dpages = rng.permutation(pages)[: -(-total // vd)]
    planner = make_dcp_planner(PlannerConfig())
    for prank in range(ptp):
        lay = build(kind, ps, ptp, prank, heads, 1, 4, pages).layout
        dsts = [[build(kind, pd, dtp, d, heads, 1, 4, pages, dcp=dcp, dcp_rank=r).layout
                 for r in range(dcp)] for d in range(dtp)]  # fmt: skip
        dsts = [ranks for ranks in dsts if routed_heads(lay, ranks[0]) is not None]
        if not dsts:  # a replica prefill rank: another rank sends its heads
            continue
        regions = pack_regions(lay, dst_dcp_size=dcp, depth=2, region_tokens=region_pages * ps)
        relayout = planner.needs_relayout(lay, dsts[0][0])
        cap = send_capacity_tokens(regions[0], dcp) if relayout else None
        # the scheduler splits on the pages both sides share when the prefix is inside a page
        split_page = ps if prefix % ps == 0 else int(np.gcd(ps, vd))
        sched = make_scheduler(SchedulerConfig(page_size=split_page, chunk_size=24))
        segs = sched.split_send(token_start=prefix, token_end=prefix + total,
                                decode_prefix_len=prefix, is_last_send=True,
                                capacity_tokens=cap)  # fmt: skip
        for seg in segs:
            items = []
            wire = []  # what each decode rank declared: its own bytes object
            for ranks in dsts:
                for r, dl in enumerate(ranks):
                    dp = dpages.copy()  # each decode rank sends its own list
                    if own_pages and r == dcp - 1:
                        dp = dp[::-1].copy()
                    chunk = segment_to_chunk(7, seg, req[seg.token_start // ps :], dp, prefix, ps)
                    rg = regions[region_index(r, seg.chunk_id, 2)] if relayout else None
                    items.append((chunk, dl, r, rg))
                    wire.append((pages_to_bytes(dp), prefix))
            if as_sender:  # chunks as the KV sender builds them: equal pages share one object
                shared = segment_chunks(7, seg, req[seg.token_start // ps :], wire, ps)
                assert (shared[0] is shared[-1]) == (wire[0] == wire[-1])
                items = [(c, dl, r, rg) for c, (_, dl, r, rg) in zip(shared, items)]
            if shuffle:
                items = [items[i] for i in rng.permutation(len(items))]
            try:
                want = [planner.plan(c, lay, dl, r, rg) for c, dl, r, rg in items]
            except CapacityError:
                with pytest.raises(CapacityError):
                    plan_segment(planner, lay, items)
                continue
            got = plan_segment(planner, lay, items)
            assert len(got) == len(want)
            for a, b in zip(got, want):
                _same(a, b)


def test_shared_plan_arrays_are_read_only() -> None:
    """The DCP and TP ranks of one decode instance share destination and token offset arrays:
    no consumer may write them."""
    lay = build("hnd", 8, 1, 0, 8, 2, 8, 64).layout
    dsts = [[build("hnd", 4, 2, d, 8, 2, 8, 64, dcp=4, dcp_rank=r).layout for r in range(4)]
            for d in range(2)]  # fmt: skip
    regions = pack_regions(lay, dst_dcp_size=4, depth=2, region_tokens=64)
    seg = make_scheduler(SchedulerConfig(page_size=8, chunk_size=64)).split_send(
        token_start=0, token_end=128, decode_prefix_len=0, is_last_send=True,
        capacity_tokens=send_capacity_tokens(regions[0], 4),
    )[0]  # fmt: skip
    chunk = segment_to_chunk(3, seg, np.arange(16), np.arange(16), 0, 8)
    items = [(msgspec.structs.replace(chunk), dl, r, regions[2 * r]) for ranks in dsts
             for r, dl in enumerate(ranks)]  # fmt: skip
    plans = plan_segment(make_dcp_planner(), lay, items)
    assert plans[0].dst_offset is plans[1].dst_offset  # shared across DCP ranks
    for p in plans:
        assert not p.dst_offset.flags.writeable
        assert not p.pack_groups[0].tokens.flags.writeable
        with pytest.raises(ValueError, match="read-only"):
            p.dst_offset[0] = 1


def test_segment_chunks_share_one_chunk_per_distinct_pages() -> None:
    """Destinations that declared equal pages and prefix get the very same SendChunk (what
    lets the planner skip comparing page lists); any difference gets its own, equal to
    ``segment_to_chunk``; bad page bytes are refused by name."""
    seg = make_scheduler(SchedulerConfig(page_size=4, chunk_size=64)).split_send(
        token_start=8, token_end=40, decode_prefix_len=8, is_last_send=True, capacity_tokens=None,
    )[0]  # fmt: skip
    src = np.arange(3, 20)
    a, b = np.arange(10), np.arange(10)[::-1].copy()
    dests = [(pages_to_bytes(a), 8), (pages_to_bytes(a.copy()), 8), (pages_to_bytes(b), 8),
             (pages_to_bytes(a), 0)]  # fmt: skip
    got = segment_chunks(5, seg, src, dests, 4)
    assert got[0] is got[1] and got[2] is not got[0] and got[3] is not got[0]
    for c, (buf, prefix) in zip(got, dests):
        want = segment_to_chunk(5, seg, src, np.frombuffer(buf, dtype=np.int64), prefix, 4)
        assert msgspec.structs.asdict(c).keys() == msgspec.structs.asdict(want).keys()
        for f in ("room", "chunk_id", "num_tokens", "decode_prefix_len", "src_page_offset",
                  "rel_start", "is_last"):  # fmt: skip
            assert getattr(c, f) == getattr(want, f), f
        assert np.array_equal(c.src_pages, want.src_pages)
        assert np.array_equal(c.dst_pages, want.dst_pages)
    with pytest.raises(ValueError, match="multiple of 8"):
        segment_chunks(5, seg, src, [(b"1234567", 8)], 4)
