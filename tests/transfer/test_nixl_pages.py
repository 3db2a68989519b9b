"""NIXL whole-page lists (:mod:`pdplug_nixl.pages`): the page indices of a write name exactly
its bytes (pure, property-tested), and an engine posting from prepared page lists lands exactly
the bytes the general ``initialize_xfer`` path lands, partial last pages and merged runs
included, and falls back to the general path for runs off page boundaries."""

from __future__ import annotations

import time
from typing import Any

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from pdplug import KVConfig, KVLayout
from pdplug.testing import require
from pdplug_nixl.pages import (
    PairSpace,
    UnitSpace,
    format_regions,
    page_indices,
    page_unit,
    parse_regions,
)

UNIT = 64


def _decode(space: UnitSpace, idx: np.ndarray, kinds: tuple[int, ...]) -> list[tuple[int, int]]:
    """``(address, bytes)`` of each descriptor index of a list prepared for ``kinds``."""
    rows = space.rows(kinds, 0).astype(np.int64)  # (address, bytes, device, stride, count)
    out = []
    for i in idx.tolist():
        j, rest = divmod(int(i), space.total)
        r = int(np.searchsorted(space.first, rest, side="right") - 1)
        addr, nbytes, _d, stride, count = rows[j * space.start.shape[0] + r]
        u = rest - int(space.first[r])
        assert 0 <= u < count
        out.append((int(addr + u * stride), int(nbytes)))
    return out


def _bytes(descs: list[tuple[int, int]]) -> np.ndarray:
    return np.concatenate([np.arange(a, a + n) for a, n in descs])


@st.composite
def _writes(draw: Any) -> Any:
    """Two sides' regions (in units) and a write of runs between them: whole pages, merged
    runs, partial tails, and sometimes a run off a unit boundary."""

    def regions(base: int) -> list[tuple[int, int]]:
        sizes = draw(st.lists(st.integers(1, 6), min_size=1, max_size=3))
        out, at = [], base
        for n in sizes:
            extra = draw(st.sampled_from([0, 0, 17]))  # a region not a whole number of units
            out.append((at, n * UNIT + extra))
            at += n * UNIT + extra + draw(st.sampled_from([0, UNIT, 3 * UNIT + 5]))
        return out

    loc, rem = regions(1 << 20), regions(1 << 24)
    n = draw(st.integers(1, 6))
    src, dst, ln = [], [], []
    for _ in range(n):
        la, lsz = draw(st.sampled_from(loc))
        ra, rsz = draw(st.sampled_from(rem))
        lu, ru = draw(st.integers(0, lsz // UNIT - 1)), draw(st.integers(0, rsz // UNIT - 1))
        room = min(lsz - lu * UNIT, rsz - ru * UNIT)
        length = draw(st.integers(1, room))
        shift = draw(st.sampled_from([0, 0, 0, 0, 8]))  # sometimes off a unit boundary
        if shift and length > shift:
            length -= shift
        src.append(la + lu * UNIT + shift)
        dst.append(ra + ru * UNIT)
        ln.append(length)
    arr = [np.asarray(x, dtype=np.int64) for x in (src, dst, ln)]
    return loc, rem, arr[0], arr[1], arr[2]


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(_writes())
def test_page_indices_name_exactly_the_runs_bytes(case: Any) -> None:
    loc, rem, src, dst, ln = case
    lsp, rsp = UnitSpace(loc, UNIT), UnitSpace(rem, UNIT)
    got = page_indices(PairSpace(lsp, rsp), src, dst, ln)

    def maps(regions: list[tuple[int, int]], a: int, n: int) -> bool:
        base, size = max((r for r in regions if r[0] <= a), key=lambda r: r[0])
        u, rem = divmod(a - base, UNIT)
        return rem == 0 and u + -(-n // UNIT) <= size // UNIT

    ok = all(
        maps(loc, s_, n) and maps(rem, d_, n)
        for s_, d_, n in zip(src.tolist(), dst.tolist(), ln.tolist())
    )
    assert (got is not None) == ok
    if got is None:
        return
    li, ri, tails = got
    kinds = (UNIT, *tails)
    assert all(0 < t < UNIT for t in tails) and list(tails) == sorted(set(tails))
    ldesc, rdesc = _decode(lsp, li, kinds), _decode(rsp, ri, kinds)
    assert [n for _, n in ldesc] == [n for _, n in rdesc]  # a pair moves equal bytes
    want_src = _bytes(list(zip(src.tolist(), ln.tolist())))
    want_dst = _bytes(list(zip(dst.tolist(), ln.tolist())))
    # byte k of the write goes from want_src[k] to want_dst[k], and nothing else moves
    assert np.array_equal(_bytes(ldesc), want_src)
    assert np.array_equal(_bytes(rdesc), want_dst)


def test_unit_regions_and_refusals() -> None:
    assert page_unit([64 * 2048, 64 * 2048, 64 * 1024]) == 64 * 1024
    assert page_unit([]) == 0
    regions = [(4096, 1 << 20), (1 << 30, 12345)]
    assert parse_regions(format_regions(regions)) == regions
    assert parse_regions("") == []
    with pytest.raises(ValueError, match="negative"):
        parse_regions("-5:3")
    with pytest.raises(ValueError, match="unit must be > 0"):
        UnitSpace(regions, 0)
    a, b = UnitSpace([(0, 4 * UNIT)], UNIT), UnitSpace([(0, 4 * UNIT)], 2 * UNIT)
    one = np.array([0], dtype=np.int64)
    with pytest.raises(ValueError, match="units differ"):
        PairSpace(a, b)
    with pytest.raises(ValueError, match="at or above"):
        PairSpace(a, UnitSpace([(1 << 56, UNIT)], UNIT))
    pair, u1 = PairSpace(a, a), np.array([UNIT], dtype=np.int64)
    below = np.array([-UNIT], dtype=np.int64)  # below every region, on either side
    assert page_indices(pair, below, one, u1) is None
    assert page_indices(pair, one, below, u1) is None
    assert page_indices(pair, one, one, np.zeros(0, dtype=np.int64)) is None
    assert page_indices(pair, one, one, 5 * u1) is None  # past the region's last unit


# ------------------------------------------------------------------ the engine, over NIXL
PAGE, BPT = 8, (64, 32)  # page bytes 512 and 256: unit 256
PAGES = 24


def _engine(role: str, **extra: str) -> Any:
    from pdplug_nixl.engine import NixlEngine

    lay = KVLayout(page_size=PAGE, entry_bytes_per_token=BPT, dtype="uint8")
    return NixlEngine(KVConfig(instance=role[0], role=role, layout=lay, extra=extra)), lay


def _run(a: Any, b: Any, peer: Any, src: np.ndarray, dst: np.ndarray, ln: np.ndarray) -> None:
    h = a.post(peer, src, dst, ln, b"tag")
    t_end = time.monotonic() + 10
    got: list[tuple[str, bytes]] = []
    while (st_ := a.check(h)) == "PROC" and time.monotonic() < t_end:
        got.extend(b.poll_notifications())
    a.release(h)
    assert st_ == "DONE"
    while not got and time.monotonic() < t_end:
        got.extend(b.poll_notifications())
    assert [m for _, m in got] == [b"tag"]  # the tag comes after the bytes


class _Pair:
    """A prefill engine over two entries of ``PAGES`` pages and a decode engine over the
    same, which publishes its regions; ``pages``: page lists on, else the default (off: the
    general path)."""

    def __init__(self, pages: bool) -> None:
        require("nixl")
        self.a, lay = _engine("prefill", **({"page_lists": "1"} if pages else {}))
        self.b, _ = _engine("decode")
        g = torch.Generator().manual_seed(1)
        self.src = [torch.randint(1, 256, (PAGES * PAGE * n,), generator=g, dtype=torch.uint8)
                    for n in BPT]  # fmt: skip
        self.dst = [torch.zeros(PAGES * PAGE * n, dtype=torch.uint8) for n in BPT]
        self.a.register([(t.data_ptr(), t.numel()) for t in self.src])
        self.b.register([(t.data_ptr(), t.numel()) for t in self.dst])
        from pdplug.types import PeerInfo

        extra = self.b.info_extra()  # published either way: the default ignores them
        self.peer = self.a.connect(
            PeerInfo(instance="d", role="decode", layout=lay, agent=self.b.agent(), extra=extra)
        )

    def close(self) -> None:
        self.a.close()
        self.b.close()


@pytest.fixture(scope="module")
def pairs() -> Any:
    got = (_Pair(True), _Pair(False))
    yield got
    for p in got:
        p.close()


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
def test_page_lists_land_the_same_bytes_as_the_general_path(
    pairs: Any, runs: Any, off: int
) -> None:
    outs = []
    for pair in pairs:
        for t in pair.dst:
            t.fill_(0xA5)  # poison: any byte past a run shows
        src = np.array([pair.src[e].data_ptr() + s * PAGE * BPT[e] + off for e, s, _, _ in runs])
        dst = np.array([pair.dst[e].data_ptr() + d * PAGE * BPT[e] for e, _, d, _ in runs])
        ln = np.array([n - off for *_, n in runs], dtype=np.int64)
        before = dict(pair.a.counts)
        _run(pair.a, pair.b, pair.peer, src.astype(np.int64), dst.astype(np.int64), ln)
        paged = pair.a.counts["page_xfer"] - before.get("page_xfer", 0)
        outs.append([t.clone() for t in pair.dst])
        if pair is pairs[0]:
            assert paged == (1 if off == 0 else 0), (runs, off)  # off a boundary: general
        else:
            assert paged == 0
    want = [torch.full_like(t, 0xA5) for t in pairs[0].dst]
    for e, s, d, n in runs:
        pb = PAGE * BPT[e]
        want[e][d * pb : d * pb + n - off] = pairs[0].src[e][s * pb + off : s * pb + n]
    for got in outs:
        assert all(torch.equal(g, w) for g, w in zip(got, want))


@pytest.mark.nixl
def test_ended_handles_are_released_off_the_send_path_and_at_close() -> None:
    """``release`` of an ended write defers NIXL's release to the next progress round (neither
    the host that reaped it nor the next send waits for it); every handle is released by then,
    and ``close`` releases what is left; a write that ended inside its post reads ``DONE`` with
    no status call."""
    pair = _Pair(False)
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
