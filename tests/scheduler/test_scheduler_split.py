"""Send splitting of the ``default`` scheduler against a token-walking reference."""

from __future__ import annotations

import itertools

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from pdplug import Scheduler, SchedulerConfig
from pdplug.types import Segment
from pdplug_scheduler.scheduler import make_scheduler
from pdplug_scheduler.split import grid_tokens


def reference_split(start, end, prefix, is_last, capacity, page, grid, first_id):
    """Walk tokens one by one; close a segment at every cut point prefix + k*cut."""
    if not is_last:
        end = start + (end - start) // page * page
        if end == start:
            return []
    if capacity is None:
        bounds = [start, end]
    else:
        cut = min(grid, capacity // page * page)
        bounds = [start]
        for t in range(start + 1, end):
            if (t - prefix) % cut == 0:
                bounds.append(t)
        bounds.append(end)
    segs = []
    for i in range(len(bounds) - 1):
        s, e = bounds[i], bounds[i + 1]
        segs.append(
            Segment(
                token_start=s,
                token_end=e,
                page_start=(s - start) // page,
                num_tokens=e - s,
                chunk_id=first_id + i,
                is_last=is_last and i == len(bounds) - 2,
            )
        )
    return segs


@settings(max_examples=300, deadline=None)
@given(
    page=st.integers(1, 16),
    chunk_size=st.integers(1, 300),
    prefix_pages=st.integers(0, 5),
    prefix_off=st.integers(0, 15),
    start_pages=st.integers(0, 20),
    length=st.integers(0, 700),
    is_last=st.booleans(),
    cap_pages=st.one_of(st.none(), st.integers(1, 40)),
    first_id=st.integers(0, 5),
)
def test_split_matches_reference(
    page, chunk_size, prefix_pages, prefix_off, start_pages, length, is_last, cap_pages, first_id
) -> None:
    # a prefix inside a prefill page: the decode virtual page is smaller than the prefill page
    prefix = prefix_pages * page + prefix_off % page
    start = prefix + start_pages * page
    capacity = None if cap_pages is None else cap_pages * page + (cap_pages % 3)  # unaligned too
    sched = make_scheduler(SchedulerConfig(page_size=page, chunk_size=chunk_size))
    grid = grid_tokens(chunk_size, page)
    got = sched.split_send(
        token_start=start,
        token_end=start + length,
        decode_prefix_len=prefix,
        is_last_send=is_last,
        capacity_tokens=capacity,
        first_chunk_id=first_id,
    )
    want = reference_split(start, start + length, prefix, is_last, capacity, page, grid, first_id)
    assert got == want
    # the invariants, stated directly
    sent = length if is_last else length // page * page
    assert sum(s.num_tokens for s in got) == sent
    if is_last:
        assert len(got) >= 1 and got[-1].is_last
    assert all(not s.is_last for s in got[:-1])
    for a, b in itertools.pairwise(got):
        assert a.token_end == b.token_start
        assert a.num_tokens % page == 0  # non-last segments are whole pages
    for s in got:
        assert s.page_start * page == s.token_start - start
        if capacity is not None:
            assert s.num_tokens <= min(grid, capacity // page * page)
    if capacity is None and got:
        assert len(got) == 1


def test_field_send_is_eleven_segments() -> None:
    """83,264 cached + 6,720 new tokens, page 64, grid and capacity 8,192: 11 segments, the
    last one exact (8,064 tokens), state only on it."""
    sched = make_scheduler(SchedulerConfig(page_size=64, chunk_size=8192))
    segs = sched.split_send(
        token_start=0,
        token_end=89_984,
        decode_prefix_len=0,
        is_last_send=True,
        capacity_tokens=8192,
    )
    assert len(segs) == 11
    assert [s.num_tokens for s in segs] == [8192] * 10 + [8064]
    assert [s.page_start for s in segs] == [128 * k for k in range(11)]
    assert [s.is_last for s in segs] == [False] * 10 + [True]


def test_partial_last_page_and_empty_final_segment() -> None:
    sched = make_scheduler(SchedulerConfig(page_size=16, chunk_size=64))
    # a non-last send holds back its partial page
    segs = sched.split_send(
        token_start=32, token_end=32 + 100, decode_prefix_len=32, is_last_send=False,
        capacity_tokens=48,
    )  # fmt: skip
    assert [(s.token_start, s.token_end) for s in segs] == [(32, 80), (80, 128)]
    assert not any(s.is_last for s in segs)
    # the next send continues on the same grid (cuts at 32 + 48k) and carries the exact tail
    segs = sched.split_send(
        token_start=128, token_end=200, decode_prefix_len=32, is_last_send=True,
        capacity_tokens=48, first_chunk_id=2,
    )  # fmt: skip
    assert [(s.token_start, s.token_end, s.chunk_id, s.is_last) for s in segs] == [
        (128, 176, 2, False),
        (176, 200, 3, True),
    ]
    # a last send with nothing left still emits one empty segment (metadata-only chunk)
    segs = sched.split_send(
        token_start=64, token_end=64, decode_prefix_len=0, is_last_send=True, capacity_tokens=48
    )
    assert segs == [Segment(token_start=64, token_end=64, page_start=0, num_tokens=0,
                            chunk_id=0, is_last=True)]  # fmt: skip
    # a non-last send shorter than a page sends nothing yet
    short = sched.split_send(
        token_start=0, token_end=15, decode_prefix_len=0, is_last_send=False, capacity_tokens=None
    )
    assert short == []


def test_plain_tp_peer_is_not_split() -> None:
    sched = make_scheduler(SchedulerConfig(page_size=64, chunk_size=8192))
    segs = sched.split_send(
        token_start=0, token_end=89_984, decode_prefix_len=0, is_last_send=True,
        capacity_tokens=None,
    )  # fmt: skip
    assert len(segs) == 1 and segs[0].num_tokens == 89_984 and segs[0].is_last


@pytest.mark.parametrize(
    ("kw", "part"),
    [
        (dict(token_start=10), "token_start=10"),
        (dict(token_start=0, decode_prefix_len=16), "decode_prefix_len=16"),
        (dict(decode_prefix_len=-16, token_start=0), "decode_prefix_len=-16"),
        (dict(decode_prefix_len=8, token_start=16), "token_start=16"),
        (dict(token_end=-1), "token_end=-1"),
        (dict(capacity_tokens=15), "capacity_tokens=15"),
        (dict(first_chunk_id=-2), "first_chunk_id=-2"),
    ],
)
def test_split_errors_name_the_values(kw, part) -> None:
    sched = make_scheduler(SchedulerConfig(page_size=16, chunk_size=64))
    args = dict(
        token_start=0, token_end=100, decode_prefix_len=0, is_last_send=True, capacity_tokens=64
    )
    args.update(kw)
    with pytest.raises(ValueError, match=part.replace("(", r"\(")):
        sched.split_send(**args)


@pytest.mark.parametrize(
    ("cfg", "part"),
    [
        (dict(page_size=0), "page_size must be > 0, got 0"),
        (dict(page_size=16, chunk_size=0), "chunk_size must be > 0, got 0"),
        (dict(page_size=16, smooth_factor=1.5), "smooth_factor must be in"),
        (dict(page_size=16, max_prefill_tokens=0), "max_prefill_tokens must be > 0, got 0"),
    ],
)
def test_config_errors(cfg, part) -> None:
    with pytest.raises(ValueError, match=part):
        make_scheduler(SchedulerConfig(**cfg))


def test_grid_is_page_floored_and_at_least_one_page() -> None:
    assert grid_tokens(8192, 64) == 8192
    assert grid_tokens(100, 64) == 64
    assert grid_tokens(10, 64) == 64


def test_facade_builds_a_scheduler(plugin_manager) -> None:
    sched = plugin_manager.make_scheduler(SchedulerConfig(page_size=64))
    assert isinstance(sched, Scheduler)
    assert sched.next_chunk_size(0) == 8192


def test_prefix_inside_a_prefill_page_cuts_on_the_shared_pages() -> None:
    """Prefill page 128, decode virtual page 64 (page 32 x DCP 2), 64 tokens cached on decode:
    the send starts inside a prefill page and every cut sits on a multiple of gcd(128, 64) = 64
    tokens; each segment's chunk starts mid-page where it must (rel_start)."""
    from pdplug.packing import segment_to_chunk

    sched = make_scheduler(SchedulerConfig(page_size=128, chunk_size=256))
    segs = sched.split_send(
        token_start=64, token_end=700, decode_prefix_len=64, is_last_send=True,
        capacity_tokens=256,
    )  # fmt: skip
    assert [(s.token_start, s.token_end) for s in segs] == [
        (64, 320), (320, 576), (576, 700)
    ]  # fmt: skip
    assert all(s.token_start % 64 == 0 for s in segs)
    pages = np.arange(6, dtype=np.int64)
    for s in segs:
        c = segment_to_chunk(1, s, pages[s.token_start // 128 :], np.arange(11), 64, 128)
        assert c.rel_start == s.token_start - 64
        assert c.src_pages[0] == s.token_start // 128
    part = sched.split_send(
        token_start=64, token_end=300, decode_prefix_len=64, is_last_send=False,
        capacity_tokens=None,
    )  # fmt: skip
    assert [(s.token_start, s.token_end) for s in part] == [(64, 192)]
