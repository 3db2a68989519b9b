"""KVPoll lattice (merge/reduce), page-id encoding, KVLayout validation, entry_map and
layout_mismatches."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from pdplug import KVLayout, KVPoll
from pdplug.layout import entry_map, layout_mismatches
from pdplug.testing import fake_layout, fake_layouts
from pdplug.types import merge_poll, pages_from_bytes, pages_to_bytes, reduce_poll

polls = st.sampled_from(list(KVPoll))


def test_kvpoll_order_is_the_contract() -> None:
    assert [p.name for p in sorted(KVPoll)] == [
        "Failed",
        "Bootstrapping",
        "WaitingForInput",
        "Transferring",
        "Success",
    ]
    assert (KVPoll.Failed, KVPoll.Success) == (0, 4)


@settings(max_examples=200)
@given(a=polls, b=polls, c=polls)
def test_merge_is_a_monotone_semilattice_with_failed_absorbing(
    a: KVPoll, b: KVPoll, c: KVPoll
) -> None:
    m = merge_poll(a, b)
    assert m == merge_poll(b, a)
    assert merge_poll(merge_poll(a, b), c) == merge_poll(a, merge_poll(b, c))
    assert merge_poll(a, a) == a
    if KVPoll.Failed in (a, b):
        assert m == KVPoll.Failed
    else:
        assert m == max(a, b) and m >= a and m >= b


@settings(max_examples=200)
@given(history=st.lists(polls, min_size=1, max_size=30))
def test_status_history_never_moves_down_until_failed(history: list[KVPoll]) -> None:
    cur = history[0]
    for p in history[1:]:
        nxt = merge_poll(cur, p)
        assert nxt == KVPoll.Failed or nxt >= cur
        if cur == KVPoll.Failed:
            assert nxt == KVPoll.Failed
        cur = nxt


@given(ranks=st.lists(polls, min_size=1, max_size=16))
def test_reduce_is_min_across_ranks(ranks: list[KVPoll]) -> None:
    got = reduce_poll(ranks)
    assert got == min(ranks) and isinstance(got, KVPoll)
    assert reduce_poll(int(p) for p in ranks) == got


def test_reduce_of_nothing_is_an_error() -> None:
    with pytest.raises(ValueError, match="polls is empty"):
        reduce_poll([])
    assert reduce_poll([KVPoll.Success, KVPoll.Failed, KVPoll.Success]) == KVPoll.Failed


@given(pages=st.lists(st.integers(-(2**63), 2**63 - 1), max_size=200))
def test_pages_roundtrip(pages: list[int]) -> None:
    buf = pages_to_bytes(np.asarray(pages, dtype=np.int64))
    assert len(buf) == 8 * len(pages)
    out = pages_from_bytes(buf)
    assert out.dtype == np.dtype("<i8") and out.tolist() == pages


def test_pages_from_bad_length() -> None:
    with pytest.raises(ValueError, match="byte length 7 is not a multiple of 8"):
        pages_from_bytes(b"\x00" * 7)


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"page_size": 0}, "page_size must be > 0, got 0"),
        ({"entry_bytes_per_token": ()}, "entry_bytes_per_token is empty"),
        ({"entry_bytes_per_token": (8, -1)}, r"entry_bytes_per_token\[1\] must be > 0, got -1"),
        ({"dcp_size": 2, "dcp_rank": 2}, r"dcp_rank=2 not in \[0, dcp_size=2\)"),
        ({"draft_entries": (5,)}, r"draft_entries has 5, outside \[0, 2\)"),
    ],
)
def test_kvlayout_errors_name_field_and_value(kwargs: dict, match: str) -> None:
    base = {"page_size": 16, "entry_bytes_per_token": (8, 8)}
    with pytest.raises(ValueError, match=match):
        KVLayout(**{**base, **kwargs})


def test_entry_map_shifts_pp_slices_by_whole_layers() -> None:
    prefill, decode = fake_layouts(total_layers=6, pp_size=3, dcp_size=2)
    assert entry_map(prefill[0], decode[0]).tolist() == [0, 1, 2, 3]
    assert entry_map(prefill[2], decode[1]).tolist() == [8, 9, 10, 11]
    assert entry_map(decode[0], decode[1]).tolist() == list(range(12))
    with pytest.raises(ValueError, match=r"source layers \[0, 6\) not held by destination"):
        entry_map(decode[0], prefill[1])
    mla = fake_layout(num_layers=6, entries_per_layer=1)
    with pytest.raises(ValueError, match="entries per layer differ: source 2 vs destination 1"):
        entry_map(prefill[0], mla)
    flat = KVLayout(page_size=16, entry_bytes_per_token=(8, 8, 8))
    assert entry_map(flat, flat).tolist() == [0, 1, 2]
    with pytest.raises(ValueError, match="entry count differs: source 3 vs destination 12"):
        entry_map(flat, decode[0])


def test_layout_mismatches_name_each_field_and_both_values() -> None:
    prefill, decode = fake_layouts(total_layers=4, pp_size=2, dcp_size=4)
    assert layout_mismatches(prefill[1], decode[3]) == []  # DCP/PP sizes may differ
    other = fake_layout(num_layers=4, page_size=32, dtype="float8_e4m3fn", bytes_per_token=32)
    got = layout_mismatches(prefill[1], other)
    assert got[:2] == [
        "page_size: local 16 vs remote 32 tokens",
        "dtype: local bfloat16 vs remote float8_e4m3fn",
    ]
    assert "entry_bytes_per_token[0]: local 64 vs remote 32 bytes" in got
    assert len(got) == 2 + prefill[1].num_entries
    draft = fake_layout(num_layers=2, draft_layers=1)
    nodraft = fake_layout(num_layers=3)
    assert layout_mismatches(draft, nodraft) == ["draft_entries: [4, 5] vs [] (source indices)"]
    v2 = KVLayout(page_size=16, entry_bytes_per_token=(64,) * 8, num_layers=4, layout_version=2)
    assert layout_mismatches(decode[0], v2) == ["layout_version: local 1 vs remote 2"]
