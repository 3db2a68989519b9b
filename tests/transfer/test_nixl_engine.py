"""The NIXL engine's general path and its regions: a write of addresses lands exactly its bytes
(whole, merged and partial pages, runs off a page boundary), a rank's registered regions
round-trip through their text form, ended transfer handles are released off the send path, and
the removed ``page_lists`` option is refused by name. Real NIXL agents over UCX."""

from __future__ import annotations

import time
from typing import Any

import numpy as np
import pytest
import torch
from _nixlpair import NixlPair, nixl_engine
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from pdplug import KVLayout
from pdplug.testing import require
from pdplug_nixl.regions import format_regions, parse_regions


def test_regions_round_trip_and_refusals() -> None:
    regions = [(4096, 1 << 20), (1 << 30, 12345)]
    assert parse_regions(format_regions(regions)) == regions
    assert parse_regions("") == []
    with pytest.raises(ValueError, match="'12x:3' is not address:nbytes"):
        parse_regions("1:2,12x:3")
    # only what format_regions writes: int()'s leniencies are refused, each named
    for item in ("-5:3", "+1:2", " 1:2", "1:2 ", "1_0:2", "1:", ":2", "1", "1:2:3", "\u0661:2",
                 "", "04096:512"):  # fmt: skip
        with pytest.raises(ValueError, match="is not address:nbytes"):
            parse_regions(f"1:2,{item}")
    with pytest.raises(ValueError, match="is not address:nbytes"):
        parse_regions("4096:512,")  # a trailing empty item
    with pytest.raises(ValueError, match="ends past 2"):
        parse_regions(f"{1 << 63}:{(1 << 63) + 1}")  # ends one byte past
    assert parse_regions(f"0:0,{(1 << 64) - 1}:1") == [(0, 0), ((1 << 64) - 1, 1)]
    # from a fresh user: a size of 2**64 passed (it ends at 2**64), and a 5,000-digit number
    # raised int()'s own error without the item, in a message as long as the number
    for item in (f"0:{1 << 64}", f"{1 << 64}:0"):
        with pytest.raises(ValueError, match="must fit 64 bits"):
            parse_regions(item)
    with pytest.raises(ValueError, match="is not address:nbytes") as err:
        parse_regions("1" * 5000 + ":1")
    assert "'111" in str(err.value) and "(5002 characters)" in str(err.value)
    assert len(str(err.value)) < 120
    with pytest.raises(ValueError, match="is not address:nbytes"):
        parse_regions(f"{10**20}:1")  # 21 digits


# ------------------------------------------------------------------ the engine, over NIXL
PAGE, BPT = 8, (64, 32)  # page bytes 512 and 256: unit 256
PAGES = 24


_LAYOUT = KVLayout(page_size=PAGE, entry_bytes_per_token=BPT, dtype="uint8")


def _pair() -> NixlPair:
    """A prefill engine over two entries of ``PAGES`` pages and a decode engine over the
    same, which publishes its regions."""
    return NixlPair(_LAYOUT, PAGES, PAGES, seed=1)


@pytest.fixture(scope="module")
def pair() -> Any:
    got = _pair()
    yield got
    got.close()


@st.composite
def _page_writes(draw: Any) -> list[tuple[int, int, int, int]]:
    """Runs ``(entry, src page, dst page, bytes)``: whole pages, two adjacent pages merged, a
    partial last page, and sometimes a run that starts inside a page (general path)."""
    n = draw(st.integers(1, 5))
    # even pages: a two-page run never meets another run
    sp = [2 * x for x in draw(st.permutations(range(PAGES // 2)))[:n]]
    dp = [2 * x for x in draw(st.permutations(range(PAGES // 2)))[:n]]
    runs = []
    for i in range(n):
        e = draw(st.integers(0, 1))
        pb = PAGE * BPT[e]
        nbytes = draw(st.sampled_from([pb, pb, 2 * pb, BPT[e] * draw(st.integers(2, PAGE - 1))]))
        runs.append((e, sp[i], dp[i], nbytes))
    return runs


@pytest.mark.nixl
@settings(
    max_examples=25, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(runs=_page_writes(), off=st.sampled_from([0, 0, 0, 32]))
def test_a_write_of_addresses_lands_exactly_its_bytes(pair: Any, runs: Any, off: int) -> None:
    """Whole pages, merged pages, partial last pages and runs off a page boundary, posted as
    addresses (``initialize_xfer``): every run's bytes land, nothing past them moves."""
    for t in pair.dst:
        t.fill_(0xA5)  # poison: any byte past a run shows
    src = np.array([pair.src[e].data_ptr() + s * PAGE * BPT[e] + off for e, s, _, _ in runs])
    dst = np.array([pair.dst[e].data_ptr() + d * PAGE * BPT[e] for e, _, d, _ in runs])
    ln = np.array([n - off for *_, n in runs], dtype=np.int64)
    pair.finish(pair.a.post(pair.peer, src.astype(np.int64), dst.astype(np.int64), ln, b"tag"))
    want = [torch.full_like(t, 0xA5) for t in pair.dst]
    for e, s, d, n in runs:
        pb = PAGE * BPT[e]
        want[e][d * pb : d * pb + n - off] = pair.src[e][s * pb + off : s * pb + n]
    assert all(torch.equal(g, w) for g, w in zip(pair.dst, want))


@pytest.mark.nixl
def test_the_removed_page_lists_option_is_refused_by_name() -> None:
    require("nixl")
    from pdplug import TransferError

    with pytest.raises(TransferError, match=r"extra\['page_lists'\]='1'.*removed"):
        nixl_engine(_LAYOUT, "prefill", page_lists="1")
    a = nixl_engine(_LAYOUT, "prefill", page_lists="0")  # the old default still starts
    a.close()


@pytest.mark.nixl
def test_ended_handles_are_released_off_the_send_path_and_at_close() -> None:
    """``release`` of an ended write defers NIXL's release to the next progress round (neither
    the host that reaped it nor the next send waits for it); every handle is released by then,
    and ``close`` releases what is left; a write that ended inside its post reads ``DONE`` with
    no status call."""
    pair = _pair()
    try:
        a = pair.a
        base = [t.data_ptr() for t in pair.src], [t.data_ptr() for t in pair.dst]
        one = (np.array([base[0][0]], dtype=np.int64), np.array([base[1][0]], dtype=np.int64),
               np.array([PAGE * BPT[0]], dtype=np.int64))  # fmt: skip
        handles = []
        for _ in range(2):
            h = a.post(pair.peer, *one, b"t")
            t_end = time.monotonic() + 10
            while a.check(h) == "PROC" and time.monotonic() < t_end:
                pair.b.poll_notifications()
            assert a.check(h) == "DONE"
            a.release(h)
            handles.append(h)
        # neither the second post nor the reap released them: the next progress round does
        assert not handles[0]._released and not handles[1]._released
        a.progress()
        assert handles[0]._released and handles[1]._released
        h = a.post(pair.peer, *one, b"t")
        t_end = time.monotonic() + 10
        while a.check(h) == "PROC" and time.monotonic() < t_end:
            pair.b.poll_notifications()
        a.release(h)
        assert not h._released
        a.close()
        assert h._released
    finally:
        pair.close()
