"""pdplug.packing: region tables, run merging, run addressing, segment -> chunk."""

from __future__ import annotations

import itertools

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from pdplug import KVLayout, PlanError
from pdplug.layout import entry_map
from pdplug.packing import (
    merge_runs,
    pack_buffer_nbytes,
    pack_bytes_per_token,
    pack_regions,
    plan_all_ranks,
    region_capacity_tokens,
    region_index,
    run_addresses,
    segment_to_chunk,
    send_capacity_tokens,
)
from pdplug.types import Segment, SendChunk
from pdplug_dcp.planner import make_dcp_planner


@settings(max_examples=100, deadline=None)
@given(
    bpt=st.lists(st.integers(1, 600), min_size=1, max_size=5),
    page=st.integers(1, 64),
    dcp=st.integers(1, 8),
    depth=st.integers(1, 3),
    tokens=st.integers(1, 5000),
    align=st.sampled_from([1, 64, 256]),
)
def test_regions_are_disjoint_aligned_and_hold_their_capacity(
    bpt, page, dcp, depth, tokens, align
) -> None:
    lay = KVLayout(page_size=page, entry_bytes_per_token=tuple(bpt))
    if tokens < page:
        with pytest.raises(ValueError, match="below one page"):
            pack_regions(lay, dst_dcp_size=dcp, depth=depth, region_tokens=tokens)
        return
    regs = pack_regions(lay, dst_dcp_size=dcp, depth=depth, region_tokens=tokens, align=align)
    total = pack_buffer_nbytes(
        lay, region_tokens=tokens, dst_dcp_size=dcp, depth=depth, align=align
    )
    assert len(regs) == dcp * depth and [r.index for r in regs] == list(range(dcp * depth))
    cap = tokens // page * page
    for a, b in itertools.pairwise(regs):
        assert a.offset + a.nbytes <= b.offset  # disjoint
    for r in regs:
        assert r.offset % align == 0 and r.capacity_tokens == cap
        assert cap * sum(bpt) <= r.nbytes
    assert regs[-1].offset + regs[-1].nbytes == total
    # the same buffer split by bytes gives at least the same capacity
    again = pack_regions(lay, dst_dcp_size=dcp, depth=depth, buffer_nbytes=total, align=align)
    assert all(r.capacity_tokens >= cap for r in again)
    assert again[-1].offset + again[-1].nbytes <= total
    assert region_capacity_tokens(lay, regs[0].nbytes) >= cap
    assert send_capacity_tokens(regs[0], dcp) == cap * dcp
    # slots alternate per chunk; ranks own disjoint index ranges
    idx = {region_index(r, c, depth) for r in range(dcp) for c in range(depth)}
    assert idx == set(range(dcp * depth))


def test_region_errors() -> None:
    lay = KVLayout(page_size=4, entry_bytes_per_token=(8, 8), draft_entries=(1,))
    assert pack_bytes_per_token(lay) == 8  # drafts are never packed
    with pytest.raises(ValueError, match="exactly one of region_tokens and buffer_nbytes"):
        pack_regions(lay, dst_dcp_size=2)
    with pytest.raises(ValueError, match="buffer_nbytes=100 gives 0 bytes per region"):
        pack_regions(lay, dst_dcp_size=2, depth=2, buffer_nbytes=100)
    with pytest.raises(ValueError, match="depth must be > 0, got 0"):
        pack_regions(lay, dst_dcp_size=2, depth=0, region_tokens=8)
    with pytest.raises(ValueError, match="region_nbytes must be >= 0, got -1"):
        region_capacity_tokens(lay, -1)


@settings(max_examples=200, deadline=None)
@given(
    src=st.lists(st.integers(0, 30), min_size=0, max_size=40),
    dst=st.lists(st.integers(0, 30), min_size=0, max_size=40),
    page=st.integers(1, 8),
)
def test_merge_runs_matches_a_loop(src, dst, page) -> None:
    m = min(len(src), len(dst))
    s, d = np.array(src[:m], dtype=np.int64), np.array(dst[:m], dtype=np.int64)
    want = []
    for i in range(m):
        if (
            want
            and s[i] == want[-1][0] + want[-1][2]
            and d[i] == want[-1][1] + want[-1][2]
            and (d[i] % page)
        ):
            want[-1][2] += 1
        else:
            want.append([s[i], d[i], 1])
    got = merge_runs(s, d, page)
    assert [list(x) for x in zip(*(a.tolist() for a in got))] == want


def test_run_addresses_reads_drafts_from_the_source_entry() -> None:
    """In a packed plan, sharded entries read from the pack buffer, draft entries from KV."""
    src = KVLayout(page_size=2, entry_bytes_per_token=(4, 4), draft_entries=(1,))
    dst = KVLayout(page_size=2, entry_bytes_per_token=(4, 4), draft_entries=(1,), dcp_size=2)
    regs = pack_regions(src, dst_dcp_size=2, depth=1, region_tokens=2)
    chunk = SendChunk(room=1, src_pages=np.array([3]), dst_pages=np.array([5]), num_tokens=2)
    plan = make_dcp_planner().plan(chunk, src, dst, 1, regs[1])
    srca, dsta, ln = run_addresses(plan, [1000, 2000], [50_000, 60_000], entry_map(src, dst), 9000)
    # entry 0 (sharded): token 1 packed at region 1 -> dst page 5 slot 10; entry 1 (draft):
    # both tokens, source slots 6-7, into virtual page 5 of 4 tokens -> slot 20
    assert plan.entry.tolist() == [0, 1]
    assert srca.tolist() == [9000 + regs[1].offset, 2000 + 6 * 4]
    assert dsta.tolist() == [50_000 + 10 * 4, 60_000 + 20 * 4]
    assert ln.tolist() == [4, 8]


def test_segment_to_chunk() -> None:
    seg = Segment(token_start=96, token_end=150, page_start=2, num_tokens=54, chunk_id=4,
                  is_last=True)  # fmt: skip
    pages = np.arange(10, 20)
    ch = segment_to_chunk(7, seg, pages[seg.page_start :], np.arange(5), 32, 32)
    assert ch.src_pages.tolist() == [12, 13] and ch.src_page_offset == 2
    assert (ch.num_tokens, ch.chunk_id, ch.is_last, ch.room) == (54, 4, True, 7)
    assert ch.rel_start == -1  # page-aligned: the original fields say it all
    with pytest.raises(ValueError, match="token_start=96 must be >= decode_prefix_len=128"):
        segment_to_chunk(7, seg, pages, np.arange(5), 128, 32)
    with pytest.raises(ValueError, match=r"needs 2 source pages .* got 1"):
        segment_to_chunk(7, seg, pages[:1], np.arange(5), 32, 32)
    # a prefill page larger than the decode virtual page: a segment may start mid-page
    mid = Segment(token_start=80, token_end=150, page_start=1, num_tokens=70, chunk_id=1,
                  is_last=True)  # fmt: skip
    ch = segment_to_chunk(7, mid, pages[80 // 64 :], np.arange(9), 16, 64)
    assert (ch.rel_start, ch.src_pages.tolist()) == (64, [11, 12])  # tokens 80..149: 2 pages
    with pytest.raises(ValueError, match=r"in-page offset 16 needs 2 source pages"):
        segment_to_chunk(7, mid, pages[1:2], np.arange(9), 16, 64)


def test_plan_all_ranks_batched_and_fallback_agree() -> None:
    """A planner without ``plan_all`` is called per rank; results equal the batched ones."""
    src = KVLayout(page_size=4, entry_bytes_per_token=(8, 4))
    dst = KVLayout(page_size=4, entry_bytes_per_token=(8, 4), dcp_size=3)
    regs = pack_regions(src, dst_dcp_size=3, depth=2, region_tokens=8)
    chunk = SendChunk(
        room=2, src_pages=np.array([5, 1, 8, 3]), dst_pages=np.array([2, 0]), num_tokens=14
    )
    dcp = make_dcp_planner()

    class PerRank:
        def plan(self, *args):
            return dcp.plan(*args)

    mine = [regs[region_index(r, 1)] for r in range(3)]
    batched = plan_all_ranks(dcp, chunk, src, dst, mine)
    single = plan_all_ranks(PerRank(), chunk, src, dst, mine)  # type: ignore[arg-type]
    assert [p.dst_dcp_rank for p in single] == [0, 1, 2]
    for a, b in zip(batched, single):
        assert a.region == b.region and a.region.index % 2 == 1
        for f in ("entry", "src_offset", "dst_offset", "length", "pack_src_slots"):
            assert np.array_equal(getattr(a, f), getattr(b, f))
    with pytest.raises(PlanError, match="regions has 2 items, expected dst dcp_size=3"):
        plan_all_ranks(dcp, chunk, src, dst, mine[:2])
