"""The ``dcp``/``tp`` planners against a slow, obviously-correct reference (byte simulation).

Every send is split by the default scheduler, planned per destination DCP rank into its own
double-buffered region, packed by a reference gather and written run by run into simulated
destination memories that count writes per byte. The reference walks tokens one by one and
applies the DCP rule (token i -> rank i % D, local offset i // D; drafts whole, in virtual
pages) to build the expected destination bytes.
"""

from __future__ import annotations

import msgspec
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from pdplug import KVLayout, PackPlanner, PlanError, PlannerConfig, SchedulerConfig
from pdplug.errors import CapacityError
from pdplug.layout import entry_map
from pdplug.packing import (
    pack_regions,
    region_index,
    segment_to_chunk,
    send_capacity_tokens,
)
from pdplug.types import PackRegion, SendChunk, TransferPlan
from pdplug_dcp.planner import make_dcp_planner, make_tp_planner
from pdplug_scheduler.scheduler import make_scheduler

# --------------------------------------------------------------------------- reference model


class Mem:
    """Simulated destination KV of one DCP rank: bytes + write counts per destination entry."""

    def __init__(self, dst: KVLayout, num_pages: int) -> None:
        vp = dst.page_size * dst.dcp_size
        self.data, self.count = [], []
        for e, b in enumerate(dst.entry_bytes_per_token):
            slots = num_pages * (vp if e in dst.draft_entries else dst.page_size)
            self.data.append(np.zeros(slots * b, dtype=np.uint8))
            self.count.append(np.zeros(slots * b, dtype=np.int32))


def reference_send(src, dst, src_kv, src_pages, dst_pages, prefix, rel_start, num_tokens, mems):
    """Write tokens ``prefix + rel_start + [0, num_tokens)`` the slow way into ``mems``."""
    p, d = src.page_size, dst.dcp_size
    emap = entry_map(src, dst)
    for k in range(num_tokens):
        rel = rel_start + k
        pg = src_pages[k // p]
        s_slot = pg * p + k % p
        i = prefix + rel
        for e, b in enumerate(src.entry_bytes_per_token):
            row = src_kv[e][s_slot * b : (s_slot + 1) * b]
            de = emap[e]
            if e in src.draft_entries:
                vp = p * d
                slot = dst_pages[rel // vp] * vp + rel % vp
                for r in range(d):
                    mems[r].data[de][slot * b : (slot + 1) * b] = row
                    mems[r].count[de][slot * b : (slot + 1) * b] += 1
            else:
                r = i % d
                loc = rel // d
                slot = dst_pages[loc // p] * p + loc % p
                mems[r].data[de][slot * b : (slot + 1) * b] = row
                mems[r].count[de][slot * b : (slot + 1) * b] += 1


def apply_plan(plan: TransferPlan, src, dst, src_kv, pack_buf, mem: Mem, regions) -> None:
    """Gather (reference packer) then copy every run; check region and page bounds."""
    emap = entry_map(src, dst)
    if plan.packed:
        reg = plan.region
        assert reg is not None
        n = plan.pack_src_slots.shape[0]
        assert n == plan.num_tokens <= reg.capacity_tokens
        off = reg.offset
        for e, b in zip(plan.pack_entries, plan.pack_row_bytes):
            assert b == src.entry_bytes_per_token[e]
            for k, s in enumerate(plan.pack_src_slots.tolist()):
                pack_buf[off + k * b : off + (k + 1) * b] = src_kv[e][s * b : (s + 1) * b]
            off += n * b
        assert off <= reg.offset + reg.nbytes, "pack overflows its region"
        assert set(plan.pack_entries) == set(range(src.num_entries)) - set(src.draft_entries)
    vp = dst.page_size * dst.dcp_size
    prev = None
    for e, so, do, ln in zip(
        plan.entry.tolist(),
        plan.src_offset.tolist(),
        plan.dst_offset.tolist(),
        plan.length.tolist(),
    ):
        b = src.entry_bytes_per_token[e]
        assert ln > 0 and ln % b == 0 and do % b == 0
        page_bytes = (vp if e in src.draft_entries else dst.page_size) * b
        assert do // page_bytes == (do + ln - 1) // page_bytes, "run crosses a destination page"
        from_pack = plan.packed and e in plan.pack_entries
        if from_pack:
            reg = plan.region
            assert reg.offset <= so and so + ln <= reg.offset + reg.nbytes, "read outside region"
            data = pack_buf[so : so + ln]
        else:
            data = src_kv[e][so : so + ln]
        de = emap[e]
        mem.data[de][do : do + ln] = data
        mem.count[de][do : do + ln] += 1
        # maximal merging: the next run of the same entry cannot continue this one
        if prev is not None and prev[0] == e:
            contiguous = prev[1] == so and prev[2] == do and do % page_bytes != 0
            assert not contiguous, "two runs should have been merged"
        prev = (e, so + ln, do + ln)


# --------------------------------------------------------------------------- strategies


@st.composite
def layouts(draw):
    """(src, dst) with matching geometry; sometimes a PP slice, sometimes a draft entry."""
    p = draw(st.integers(1, 8))
    d = draw(st.integers(1, 8))
    layers = draw(st.integers(1, 3))
    epl = draw(st.sampled_from([1, 2]))
    sizes = st.sampled_from([1, 2, 3, 4, 6, 8, 12, 16, 24])
    per_layer = [tuple(draw(sizes) for _ in range(epl)) for _ in range(layers)]
    bpt = tuple(b for layer in per_layer for b in layer)
    draft = draw(st.booleans())
    if draft:  # one draft layer appended; not PP-sliced
        bpt = (*bpt, *draw(st.lists(sizes, min_size=epl, max_size=epl)))
        drafts = tuple(range(len(bpt) - epl, len(bpt)))
        src = KVLayout(page_size=p, entry_bytes_per_token=bpt, draft_entries=drafts)
        dst = KVLayout(page_size=p, entry_bytes_per_token=bpt, draft_entries=drafts, dcp_size=d)
        return src, dst
    first = draw(st.integers(0, layers - 1))
    count = draw(st.integers(1, layers - first))
    src = KVLayout(
        page_size=p,
        entry_bytes_per_token=bpt[first * epl : (first + count) * epl],
        num_layers=count,
        first_layer=first,
        pp_size=2,
        pp_rank=1 if first else 0,
    )
    dst = KVLayout(page_size=p, entry_bytes_per_token=bpt, num_layers=layers, dcp_size=d)
    return src, dst


def _scenario(data, src, dst):
    p, d = src.page_size, dst.dcp_size
    vp = p * d
    prefix = data.draw(st.integers(0, 2), label="prefix_vpages") * vp
    total = data.draw(st.integers(0, 120), label="send_tokens")
    region_tokens = data.draw(st.integers(1, 5), label="region_pages") * p
    chunk_size = data.draw(st.integers(1, 64), label="chunk_size")
    dst_vpages = -(-total // vp) + data.draw(st.integers(0, 2))
    rng = np.random.default_rng(data.draw(st.integers(0, 2**32 - 1), label="seed"))
    src_pages = rng.permutation(-(-total // p) + 8)[: -(-total // p)].astype(np.int64)
    dst_pages = rng.permutation(dst_vpages + 3)[:dst_vpages].astype(np.int64)
    return prefix, total, region_tokens, chunk_size, src_pages, dst_pages, rng


def _src_kv(src, num_slots, rng):
    return [rng.integers(1, 256, num_slots * b, dtype=np.uint8) for b in src.entry_bytes_per_token]


# --------------------------------------------------------------------------- property tests


@settings(max_examples=250, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(lay=layouts(), data=st.data())
def test_split_plan_pack_matches_reference(lay, data) -> None:
    """Scheduler split + per-rank plans + packing write every token exactly once, at the
    reference destination, from inside its own rank's region; no region overflows."""
    src, dst = lay
    p, d = src.page_size, dst.dcp_size
    prefix, total, region_tokens, chunk_size, src_pages, dst_pages, rng = _scenario(data, src, dst)
    planner = make_dcp_planner(PlannerConfig())
    sched = make_scheduler(SchedulerConfig(page_size=p, chunk_size=chunk_size))
    regions = pack_regions(src, dst_dcp_size=d, depth=2, region_tokens=region_tokens, align=8)
    relayout = planner.needs_relayout(src, dst)
    assert relayout == (d > 1)
    cap = send_capacity_tokens(regions[0], d) if relayout else None
    segs = sched.split_send(
        token_start=prefix,
        token_end=prefix + total,
        decode_prefix_len=prefix,
        is_last_send=True,
        capacity_tokens=cap,
        first_chunk_id=3,
    )
    assert sum(s.num_tokens for s in segs) == total
    assert [s.is_last for s in segs] == [False] * (len(segs) - 1) + [True]
    assert [s.chunk_id for s in segs] == list(range(3, 3 + len(segs)))
    num_slots = (int(src_pages.max()) + 1 if total else 1) * p
    src_kv = _src_kv(src, num_slots, rng)
    ndst = int(dst_pages.max()) + 1 if dst_pages.size else 1
    got = [Mem(dst, ndst) for _ in range(d)]
    want = [Mem(dst, ndst) for _ in range(d)]
    pack_buf = np.full(regions[-1].offset + regions[-1].nbytes, 0xA5, dtype=np.uint8)
    for seg in segs:
        assert cap is None or seg.num_tokens <= cap
        chunk = segment_to_chunk(9, seg, src_pages[seg.page_start :], dst_pages, prefix, p)
        plans = planner.plan_all(
            chunk, src, dst, [regions[region_index(r, seg.chunk_id, 2)] for r in range(d)]
        )
        for r, plan in enumerate(plans):
            single = planner.plan(chunk, src, dst, r, regions[region_index(r, seg.chunk_id, 2)])
            assert np.array_equal(single.src_offset, plan.src_offset)
            assert np.array_equal(single.pack_src_slots, plan.pack_src_slots)
            assert plan.is_last == seg.is_last and plan.chunk_id == seg.chunk_id
            assert plan.dst_dcp_rank == r and plan.packed == relayout
            apply_plan(plan, src, dst, src_kv, pack_buf, got[r], regions)
        reference_send(
            src,
            dst,
            src_kv,
            src_pages[seg.page_start :],
            dst_pages,
            prefix,
            seg.token_start - prefix,
            seg.num_tokens,
            want,
        )
        assert sum(pl.num_tokens for pl in plans) == seg.num_tokens
    for r in range(d):
        for e in range(dst.num_entries):
            assert np.array_equal(got[r].count[e], want[r].count[e]), (r, e)
            assert got[r].count[e].max(initial=0) <= 1, "a byte was written twice"
            assert np.array_equal(got[r].data[e], want[r].data[e]), (r, e)


@settings(max_examples=120, deadline=None)
@given(lay=layouts(), data=st.data())
def test_unpacked_plans_match_reference(lay, data) -> None:
    """``region=None`` (per-token baseline) and the ``tp`` identity planner write the same
    bytes as the reference."""
    src, dst = lay
    p, d = src.page_size, dst.dcp_size
    prefix, total, _, _, src_pages, dst_pages, rng = _scenario(data, src, dst)
    src_kv = _src_kv(src, (int(src_pages.max()) + 1 if total else 1) * p, rng)
    ndst = int(dst_pages.max()) + 1 if dst_pages.size else 1
    chunk = SendChunk(
        room=1, src_pages=src_pages, dst_pages=dst_pages, decode_prefix_len=prefix,
        num_tokens=total,
    )  # fmt: skip
    planners = [make_dcp_planner()]
    if d == 1:
        planners.append(make_tp_planner())
    for planner in planners:
        got, want = [Mem(dst, ndst) for _ in range(d)], [Mem(dst, ndst) for _ in range(d)]
        for r in range(d):
            plan = planner.plan(chunk, src, dst, r, None)
            assert not plan.packed and plan.region is None
            apply_plan(plan, src, dst, src_kv, None, got[r], None)
        reference_send(src, dst, src_kv, src_pages, dst_pages, prefix, 0, total, want)
        for r in range(d):
            for e in range(dst.num_entries):
                assert np.array_equal(got[r].count[e], want[r].count[e])
                assert np.array_equal(got[r].data[e], want[r].data[e])


def test_identity_runs_are_page_runs() -> None:
    """Same layout, DCP 1: one run per page and entry; contiguous source pages still stop at
    each destination page (runs never cross a destination page)."""
    src = KVLayout(page_size=4, entry_bytes_per_token=(8, 8))
    plan = make_tp_planner().plan(
        SendChunk(
            room=5,
            src_pages=np.array([3, 4, 9]),
            dst_pages=np.array([0, 1, 2, 9]),
            decode_prefix_len=4,
            src_page_offset=1,
            num_tokens=10,
        ),
        src,
        src,
        0,
    )
    assert plan.entry.tolist() == [0, 0, 0, 1, 1, 1]
    assert plan.src_offset.tolist() == [3 * 32, 4 * 32, 9 * 32] * 2
    # src_page_offset 1 -> destination page ordinals 1, 2, 3 = pages 1, 2, 9: pages 1 and 2
    # are contiguous on both sides but the runs still stop at the page boundary
    assert plan.dst_offset.tolist() == [1 * 32, 2 * 32, 9 * 32] * 2
    assert plan.length.tolist() == [32, 32, 16] * 2
    assert plan.num_tokens == 10 and not plan.packed


def test_packed_plan_exact_values() -> None:
    """A small DCP 2 plan checked by hand: runs per destination page, region offsets."""
    src = KVLayout(page_size=2, entry_bytes_per_token=(4, 8))
    dst = KVLayout(page_size=2, entry_bytes_per_token=(4, 8), dcp_size=2)
    regions = pack_regions(src, dst_dcp_size=2, depth=1, region_tokens=4, align=16)
    assert [(r.offset, r.nbytes, r.capacity_tokens) for r in regions] == [(0, 48, 4), (48, 48, 4)]
    chunk = SendChunk(
        room=1,
        src_pages=np.array([10, 11, 12]),
        dst_pages=np.array([5, 6]),
        num_tokens=6,
    )
    # tokens 0..5 at source slots 20,21,22,23,24,25; rank 1 owns 1,3,5 -> locals 0,1,2
    plan = make_dcp_planner().plan(chunk, src, dst, 1, regions[1])
    assert plan.pack_src_slots.tolist() == [21, 23, 25]
    assert plan.num_tokens == 3 and plan.packed
    assert plan.entry.tolist() == [0, 0, 1, 1]
    # entry 0 at region 48: tokens 0-1 -> page 5 (slots 10,11), token 2 -> page 6 (slot 12)
    assert plan.src_offset.tolist() == [48, 48 + 8, 48 + 12, 48 + 12 + 16]
    assert plan.dst_offset.tolist() == [10 * 4, 12 * 4, 10 * 8, 12 * 8]
    assert plan.length.tolist() == [8, 4, 16, 8]
    assert plan.pack_entries == (0, 1) and plan.pack_row_bytes == (4, 8)


def test_rank_with_no_tokens_gets_empty_plan() -> None:
    """A one-token last chunk: ranks that own nothing still get a (last) plan with no runs."""
    src = KVLayout(page_size=4, entry_bytes_per_token=(8,))
    dst = KVLayout(page_size=4, entry_bytes_per_token=(8,), dcp_size=4)
    regions = pack_regions(src, dst_dcp_size=4, depth=2, region_tokens=4)
    chunk = SendChunk(room=2, src_pages=np.array([3]), dst_pages=np.array([1]), num_tokens=1)
    plans = make_dcp_planner().plan_all(chunk, src, dst, regions[::2])
    assert [p.num_tokens for p in plans] == [1, 0, 0, 0]
    assert [p.num_runs for p in plans] == [1, 0, 0, 0]
    assert all(p.is_last for p in plans)


# --------------------------------------------------------------------------- field shapes


@pytest.mark.parametrize(
    ("cached", "unique", "segments"),
    [(83_264, 6_720, 11), (163_840, 6_720, 21), (0, 32_768, 4)],
)
def test_field_shapes_fit_after_splitting(cached: int, unique: int, segments: int) -> None:
    """Cached-prefix sends from the field (DCP 4, page 64, regions sized from an 8,192-token
    chunk bound) fit every region after splitting; unsplit, the first one is refused."""
    p, d, bound = 64, 4, 8192
    bpt = (576,) * 4  # entry count does not change the token geometry
    src = KVLayout(page_size=p, entry_bytes_per_token=bpt)
    dst = KVLayout(page_size=p, entry_bytes_per_token=bpt, dcp_size=d)
    regions = pack_regions(src, dst_dcp_size=d, depth=2, region_tokens=-(-bound // d))
    assert regions[0].capacity_tokens == 2048
    cap = send_capacity_tokens(regions[0], d)
    assert cap == bound
    total = cached + unique  # decode is cold: the whole prompt goes out
    rng = np.random.default_rng(total)
    src_pages = rng.permutation(4 * total // p)[: -(-total // p)].astype(np.int64)
    dst_pages = rng.permutation(total // p)[: -(-total // (p * d))].astype(np.int64)
    planner = make_dcp_planner()
    segs = make_scheduler(SchedulerConfig(page_size=p, chunk_size=8192)).split_send(
        token_start=0, token_end=total, decode_prefix_len=0, is_last_send=True, capacity_tokens=cap
    )
    assert len(segs) == segments
    per_rank_tokens = np.zeros(d, dtype=np.int64)
    covered = [[] for _ in range(d)]
    for seg in segs:
        chunk = segment_to_chunk(1, seg, src_pages[seg.page_start :], dst_pages, 0, p)
        plans = planner.plan_all(
            chunk, src, dst, [regions[region_index(r, seg.chunk_id)] for r in range(d)]
        )
        for r, plan in enumerate(plans):
            assert plan.num_tokens <= regions[0].capacity_tokens
            assert plan.src_offset.min(initial=1 << 62) >= plan.region.offset
            assert (plan.src_offset + plan.length).max() <= plan.region.offset + plan.region.nbytes
            per_rank_tokens[r] += plan.num_tokens
            e0 = plan.entry == 0
            starts, lens = plan.dst_offset[e0] // 576, plan.length[e0] // 576
            covered[r].append(
                np.repeat(starts - np.cumsum(lens) + lens, lens) + np.arange(lens.sum())
            )
    # every token lands once at its DCP slot (vectorised check of the whole send)
    tok = np.arange(total)
    for r in range(d):
        loc = tok[tok % d == r] // d
        want = dst_pages[loc // p] * p + loc % p
        got = np.concatenate(covered[r])
        assert np.array_equal(got, want)
    assert per_rank_tokens.sum() == total
    # unsplit, the first field shape overflows its region: an error, never a fallback
    if cached == 83_264:
        chunk = SendChunk(room=77, src_pages=src_pages, dst_pages=dst_pages, num_tokens=total)
        with pytest.raises(CapacityError) as ei:
            planner.plan(chunk, src, dst, 3, regions[6])
        msg = str(ei.value)
        for part in ("room 77", "rank 3", "22496 tokens", "capacity=2048"):
            assert part in msg, msg


# --------------------------------------------------------------------------- errors


def _chunk(**kw) -> SendChunk:
    base = dict(room=4, src_pages=np.arange(4), dst_pages=np.arange(2), num_tokens=16)
    base.update(kw)
    return SendChunk(**base)


SRC = KVLayout(page_size=4, entry_bytes_per_token=(8, 16))
DST = KVLayout(page_size=4, entry_bytes_per_token=(8, 16), dcp_size=2)


@pytest.mark.parametrize(
    ("chunk", "dst", "rank", "parts"),
    [
        (_chunk(), KVLayout(page_size=4, entry_bytes_per_token=(8, 12), dcp_size=2), 0,
         ["geometry differs at source entry 1", "16 vs 12"]),
        (_chunk(), KVLayout(page_size=6, entry_bytes_per_token=(8, 16), dcp_size=2), 0,
         ["page_size: source 4 vs destination 6 tokens: neither divides the other"]),
        (_chunk(decode_prefix_len=4), DST, 0,
         ["decode_prefix_len=4", "page_size*dcp_size=4*2=8"]),
        (_chunk(dst_pages=np.arange(1)), DST, 0,
         ["too few destination pages", "need 2 virtual pages", "dst_pages has 1"]),
        (_chunk(src_pages=np.arange(3)), DST, 0,
         ["num_tokens=16 from in-page offset 0 needs 4 source pages", "has 3"]),
        (_chunk(), DST, 2, ["dst_dcp_rank=2 not in [0, dcp_size=2)"]),
        (_chunk(dst_pages=np.array([0, -3])), DST, 0,
         ["room 4: dst_pages holds page id -3, outside [0, 2**40)"]),
        (_chunk(dst_pages=np.array([1 << 60, 0])), DST, 0,
         [f"dst_pages holds page id {1 << 60}, outside [0, 2**40)"]),
        (_chunk(src_pages=np.array([0, 1, -1, 2])), DST, 1,
         ["src_pages holds page id -1"]),
        (_chunk(src_pages=np.array([[0, 1, 2, 3]])), DST, 0,
         ["room 4: src_pages must be a 1-D array of integer page ids, got shape (1, 4)"]),
        (_chunk(dst_pages=np.array([0.0, 1.5])), DST, 0,
         ["dst_pages must be a 1-D array of integer page ids", "dtype float64"]),
        (_chunk(), KVLayout(page_size=4, entry_bytes_per_token=(8, 16), draft_entries=(1,),
                            dcp_size=2), 0, ["draft_entries do not correspond"]),
    ],
)  # fmt: skip
def test_plan_errors_name_the_values(chunk, dst, rank, parts) -> None:
    with pytest.raises(PlanError) as ei:
        make_dcp_planner().plan(chunk, SRC, dst, rank, None)
    for part in parts:
        assert part in str(ei.value), str(ei.value)


def test_capacity_error_names_room_rank_tokens_capacity() -> None:
    regions = pack_regions(SRC, dst_dcp_size=2, depth=1, region_tokens=4)
    with pytest.raises(CapacityError) as ei:
        make_dcp_planner().plan(_chunk(), SRC, DST, 1, regions[1])
    msg = str(ei.value)
    for part in ("room 4", "rank 1", "8 tokens", "capacity=4", "region 1", "8 tokens"):
        assert part in msg, msg
    # a region whose bytes are smaller than its claimed capacity is refused too
    from pdplug.types import PackRegion

    lying = PackRegion(index=0, offset=0, nbytes=10, capacity_tokens=64)
    with pytest.raises(CapacityError, match="10 bytes"):
        make_dcp_planner().plan(_chunk(), SRC, DST, 0, lying)
    # when the bytes bind first, the advice names the bound the bytes allow (24 B/token, page 4:
    # 100 bytes hold 4 tokens -> split at 4 * 2 = 8), not the claimed 64-token capacity
    short = PackRegion(index=0, offset=0, nbytes=100, capacity_tokens=64)
    with pytest.raises(CapacityError, match=r"capacity=4 tokens.*split the send at .*=8 tokens"):
        make_dcp_planner().plan(_chunk(), SRC, DST, 0, short)


def test_tp_planner_refuses_dcp_and_planner_config() -> None:
    with pytest.raises(PlanError, match="dcp_size 1, got 2"):
        make_tp_planner().plan(_chunk(), SRC, DST, 0)
    assert not make_tp_planner().needs_relayout(SRC, DST)
    with pytest.raises(ValueError, match="'cuda'"):
        make_dcp_planner(PlannerConfig(packer="cuda"))


def test_capacity_tokens_is_per_region_and_page_aligned() -> None:
    planner = make_dcp_planner()
    # 24 bytes/token, page 4: 1000 bytes -> 41 tokens -> 40 (10 pages)
    assert planner.capacity_tokens(SRC, DST, 1000) == 40
    assert planner.capacity_tokens(SRC, DST, 95) == 0


def test_facade_builds_protocol_objects(plugin_manager) -> None:
    """Found through the entry points, the planners satisfy the PackPlanner Protocol."""
    for name in ("dcp", "tp"):
        planner = plugin_manager.make_pack_planner(PlannerConfig(), name=name)
        assert isinstance(planner, PackPlanner)


def test_plan_all_with_per_rank_destination_pages() -> None:
    """Decode ranks may send different page lists: plan_all(dst_pages=...) equals plan() on
    each rank's own chunk, drafts included."""
    src = KVLayout(page_size=2, entry_bytes_per_token=(4, 6), draft_entries=(1,))
    dst = KVLayout(page_size=2, entry_bytes_per_token=(4, 6), draft_entries=(1,), dcp_size=2)
    regions = pack_regions(src, dst_dcp_size=2, depth=1, region_tokens=8)
    chunk = SendChunk(room=8, src_pages=np.array([4, 0, 6]), dst_pages=np.array([0, 0]),
                      num_tokens=5)  # fmt: skip
    per_rank = [np.array([3, 1]), np.array([7, 2])]
    planner = make_dcp_planner()
    plans = planner.plan_all(chunk, src, dst, regions, dst_pages=per_rank)
    for r, plan in enumerate(plans):
        own = msgspec.structs.replace(chunk, dst_pages=per_rank[r])
        want = planner.plan(own, src, dst, r, regions[r])
        for f in ("entry", "src_offset", "dst_offset", "length", "pack_src_slots"):
            assert np.array_equal(getattr(plan, f), getattr(want, f)), (r, f)
    assert not np.array_equal(plans[0].dst_offset, plans[1].dst_offset)
    with pytest.raises(PlanError, match="dst_pages has 1 items, expected dst dcp_size=2"):
        planner.plan_all(chunk, src, dst, regions, dst_pages=per_rank[:1])


def test_draft_only_source_is_not_packed() -> None:
    """A source whose entries are all draft entries has nothing to shard: no relayout, no
    regions; every rank gets the draft tokens whole, straight from the source."""
    lay = dict(page_size=2, entry_bytes_per_token=(4,), draft_entries=(0,))
    src, dst = KVLayout(**lay), KVLayout(**lay, dcp_size=2)
    planner = make_dcp_planner()
    assert not planner.needs_relayout(src, dst)
    chunk = SendChunk(room=2, src_pages=np.array([5, 1, 3]), dst_pages=np.array([7, 2]),
                      num_tokens=6)  # fmt: skip
    region = pack_regions(SRC, dst_dcp_size=2, depth=1, region_tokens=4)[0]
    for r in range(2):
        for reg in (None, region):
            plan = planner.plan(chunk, src, dst, r, reg)
            assert not plan.packed
            # virtual pages of 4 tokens: tokens 0-3 -> page 7, 4-5 -> page 2 (source 5, 1, 3)
            got = sorted(zip(plan.src_offset.tolist(), plan.dst_offset.tolist(),
                             plan.length.tolist()))  # fmt: skip
            assert got == sorted([(5 * 8, 7 * 16, 8), (1 * 8, 7 * 16 + 8, 8), (3 * 8, 2 * 16, 8)])


def test_entry_column_cache_is_bounded() -> None:
    """Packed plans vary their run counts with the chunk; the per-class entry-column cache
    keeps small, read-only columns only, within its byte budget."""
    from pdplug_dcp.pairs import pair_of

    src = KVLayout(page_size=1, entry_bytes_per_token=(8,) * 64)
    dst = KVLayout(page_size=1, entry_bytes_per_token=(8,) * 64, dcp_size=2)
    planner = make_dcp_planner()
    region = PackRegion(index=0, offset=0, nbytes=1 << 30, capacity_tokens=1 << 20)
    for n in range(1, 1200, 7):
        planner.plan(SendChunk(room=1, src_pages=np.arange(n), dst_pages=np.arange(n),
                               num_tokens=n), src, dst, 0, region)  # fmt: skip
    cols = pair_of(src, dst).main[0]._ecols
    assert cols and sum(c.nbytes for c in cols.values()) <= (1 << 20) + (64 << 10)
    assert all(not c.flags.writeable for c in cols.values())
