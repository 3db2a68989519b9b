"""The direct plan of the commonest pair (same layout, equal page size, no DCP) takes a short
path (:func:`pdplug_dcp.direct.whole_page_runs`, issue 24): it must give exactly the runs the
general path gives, and leave every chunk it cannot take (and every error) to it."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from pdplug import KVLayout, PlanError
from pdplug.types import PackRegion, SendChunk
from pdplug_dcp.direct import whole_page_runs
from pdplug_dcp.pairs import pair_of
from pdplug_dcp.planner import make_dcp_planner, make_tp_planner


def _general(planner, chunk, lay):  # a region on a pair without relayout: the general path
    region = PackRegion(index=0, offset=0, nbytes=1 << 30, capacity_tokens=1 << 20)
    return planner.plan(chunk, lay, lay, 0, region)


#: a layout of one or more entries and a page-aligned chunk of it (both tests below)
_CHUNKS = dict(
    page=st.sampled_from([1, 2, 16, 64]),
    bpt=st.lists(st.sampled_from([2, 64, 576, 2048]), min_size=1, max_size=4),
    prefix_pages=st.integers(0, 3),
    offset_pages=st.integers(0, 3),
    n=st.integers(1, 300),
    seed=st.integers(0, 2**16),
    tp=st.booleans(),
)


@given(**_CHUNKS)
@settings(max_examples=300, deadline=None)
def test_whole_page_runs_equal_the_general_plan(
    page: int,
    bpt: list[int],
    prefix_pages: int,
    offset_pages: int,
    n: int,
    seed: int,
    tp: bool,
) -> None:
    lay = KVLayout(page_size=page, entry_bytes_per_token=tuple(bpt), dtype="uint8")
    rng = np.random.default_rng(seed)
    pages = -(-n // page)
    chunk = SendChunk(
        room=1,
        src_pages=rng.permutation(4096)[:pages].astype(np.int64),
        dst_pages=rng.permutation(4096)[: offset_pages + pages + 1].astype(np.int64),
        decode_prefix_len=prefix_pages * page,
        src_page_offset=offset_pages,
        num_tokens=n,
        chunk_id=0,
        is_last=True,
    )
    planner = make_tp_planner() if tp else make_dcp_planner()
    short = whole_page_runs(chunk, pair_of(lay, lay))
    assert (short is not None) == (len(set(bpt)) == 1)  # one class of entries
    fast, slow = planner.plan(chunk, lay, lay, 0), _general(planner, chunk, lay)
    assert (fast.num_tokens, fast.packed, fast.is_last) == (slow.num_tokens, False, True)
    for f in ("entry", "src_offset", "dst_offset", "length"):
        assert np.array_equal(getattr(fast, f), getattr(slow, f)), f


def test_what_the_short_path_does_not_take_goes_the_general_way() -> None:
    lay = KVLayout(page_size=4, entry_bytes_per_token=(8,), dtype="uint8")
    pair = pair_of(lay, lay)
    base = dict(room=7, src_pages=np.arange(3), dst_pages=np.arange(3), decode_prefix_len=0,
                src_page_offset=0, num_tokens=10, chunk_id=0, is_last=True)  # fmt: skip
    for change in (
        {"rel_start": 2},  # starts inside a page
        {"decode_prefix_len": 2},  # an unaligned prefix: the general path names it
        {"num_tokens": 0},
        {"dst_pages": np.arange(2)},  # too few pages: the general path names them
        {"src_pages": np.array([0, -1, 2])},
    ):
        assert whole_page_runs(SendChunk(**{**base, **change}), pair) is None, change
    planner = make_dcp_planner()
    with pytest.raises(PlanError, match="decode_prefix_len=2"):
        planner.plan(SendChunk(**{**base, "decode_prefix_len": 2}), lay, lay, 0)
    with pytest.raises(PlanError, match="too few destination pages"):
        planner.plan(SendChunk(**{**base, "dst_pages": np.arange(2)}), lay, lay, 0)
    with pytest.raises(PlanError, match="page id -1"):
        planner.plan(SendChunk(**{**base, "src_pages": np.array([0, -1, 2])}), lay, lay, 0)
    dcp = KVLayout(page_size=4, entry_bytes_per_token=(8,), dtype="uint8", dcp_size=2)
    assert whole_page_runs(SendChunk(**base), pair_of(lay, dcp)) is None


def test_a_planner_reuses_size_arrays_read_only_and_plans_each_send_from_its_own_pages() -> None:
    """Entry ids and lengths depend on the send's size alone and are cached read-only on the
    pair (issue 24: fewer array operations per send); the offsets come from each send's pages,
    so a later send of the same size with other pages still gets its own runs."""
    lay = KVLayout(page_size=4, entry_bytes_per_token=(8, 8, 8), dtype="uint8")
    planner = make_dcp_planner()
    rng = np.random.default_rng(5)
    plans = []
    for _ in range(3):
        chunk = SendChunk(room=3, src_pages=rng.permutation(64)[:3].astype(np.int64),
                          dst_pages=rng.permutation(64)[:3].astype(np.int64),
                          decode_prefix_len=0, src_page_offset=0, num_tokens=10, chunk_id=0,
                          is_last=True)  # fmt: skip
        plan = planner.plan(chunk, lay, lay, 0)
        slow = _general(planner, chunk, lay)
        for f in ("entry", "src_offset", "dst_offset", "length"):
            assert np.array_equal(getattr(plan, f), getattr(slow, f)), f
        plans.append(plan)
    assert plans[0].entry is plans[2].entry and plans[0].length is plans[2].length
    assert not np.array_equal(plans[0].src_offset, plans[1].src_offset)
    for a in (plans[0].entry, plans[0].length):
        with pytest.raises(ValueError, match="read-only"):
            a[0] = 1


@given(**_CHUNKS, extra_dst=st.integers(-1, 2))
@settings(max_examples=300, deadline=None)
def test_the_direct_template_gives_the_plans_descriptors(
    page: int,
    bpt: list[int],
    prefix_pages: int,
    offset_pages: int,
    n: int,
    extra_dst: int,
    seed: int,
    tp: bool,
) -> None:
    """``direct_pages`` bound to both sides' bases (:class:`pdplug.packing.DirectRuns`, what a
    KV sender uses instead of planning each send) gives exactly the absolute descriptors of
    ``plan`` + ``run_addresses``, and ``None`` wherever it cannot (then ``plan`` runs and names
    any error): a pair of several entry classes, too few destination pages."""
    from pdplug.layout import entry_map
    from pdplug.packing import DirectRuns, run_addresses

    lay = KVLayout(page_size=page, entry_bytes_per_token=tuple(bpt), dtype="uint8")
    rng = np.random.default_rng(seed)
    pages = -(-n // page)
    chunk = SendChunk(
        room=1,
        src_pages=rng.permutation(4096)[:pages].astype(np.int64),
        dst_pages=rng.permutation(4096)[: offset_pages + pages + extra_dst].astype(np.int64),
        decode_prefix_len=prefix_pages * page,
        src_page_offset=offset_pages,
        num_tokens=n,
        chunk_id=3,
        is_last=False,
    )
    planner = make_tp_planner() if tp else make_dcp_planner()
    template = planner.direct_pages(lay, lay)
    assert (template is not None) == (len(set(bpt)) == 1)  # one class of entries
    if template is None:
        return
    src_base = np.array([(e + 1) << 40 for e in range(len(bpt))], dtype=np.int64)
    dst_base = np.array([(e + 9) << 40 for e in range(len(bpt))], dtype=np.int64)
    emap = entry_map(lay, lay)
    got = DirectRuns(template, src_base, dst_base[emap]).runs(chunk)
    if extra_dst < 0:  # the planner names the missing pages
        assert got is None
        with pytest.raises(PlanError, match="too few destination pages"):
            planner.plan(chunk, lay, lay, 0)
        return
    assert got is not None
    want = run_addresses(planner.plan(chunk, lay, lay, 0), src_base, dst_base, emap)
    for g, w in zip(got, want):
        assert g.dtype == np.int64 and np.array_equal(g, w)


def test_no_direct_template_where_the_plan_is_not_whole_pages() -> None:
    """A DCP destination, other page sizes and a packed pair get none; an unaligned chunk
    bound to a template gets ``None`` (planned as before)."""
    from pdplug.packing import DirectRuns

    lay = KVLayout(page_size=4, entry_bytes_per_token=(8, 8), dtype="uint8")
    planner = make_dcp_planner()
    assert planner.direct_pages(lay, KVLayout(page_size=4, entry_bytes_per_token=(8, 8),
                                              dtype="uint8", dcp_size=2)) is None  # fmt: skip
    assert planner.direct_pages(lay, KVLayout(page_size=8, entry_bytes_per_token=(8, 8),
                                              dtype="uint8")) is None  # fmt: skip
    template = planner.direct_pages(lay, lay)
    assert template is not None and template.entries == (0, 1)
    runs = DirectRuns(template, np.array([1 << 30, 1 << 31]), np.array([1 << 32, 1 << 33]))
    base = dict(room=7, src_pages=np.arange(3), dst_pages=np.arange(3), decode_prefix_len=0,
                src_page_offset=0, num_tokens=10, chunk_id=0, is_last=True)  # fmt: skip
    for change in ({"rel_start": 2}, {"decode_prefix_len": 2}, {"num_tokens": 0}):
        assert runs.runs(SendChunk(**{**base, **change})) is None, change
    with pytest.raises(ValueError, match="outside the 1 registered entries"):
        DirectRuns(template, np.array([0]), np.array([0]))
