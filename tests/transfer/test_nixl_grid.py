"""NIXL lists of a direct template's pages (:mod:`pdplug_nixl.grid`, issue 24): every index a
send posts names exactly the bytes of its page (pure, property-tested: Python-int and numpy
paths, whole and partial last pages, pages beyond the lists refused), and an engine posting by
page ids lands exactly those bytes over NIXL, falls back (``None``) for pages its lists do not
hold, refuses a bad last-page size, and stops using lists it released."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
import torch
from _nixlpair import NixlPair
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from pdplug import KVLayout
from pdplug.types import PageGrid
from pdplug_nixl import grid as gridmod
from pdplug_nixl.grid import GridLists, pages_in


class _Agent:
    """Stands in for ``nixl_agent`` in the pure tests: keeps the rows of every list."""

    def __init__(self) -> None:
        self.lists: list[np.ndarray] = []

    def prep_xfer_dlist(self, name: str, rows: np.ndarray, mem: str) -> int:
        self.lists.append(rows.astype(np.int64))
        return len(self.lists) - 1


def _decode(rows: np.ndarray, idx: Any, count: int) -> list[tuple[int, int]]:
    """``(address, bytes)`` of each index into a list of strided rows."""
    out = []
    for j in list(idx):
        r, u = divmod(int(j), count)
        addr, nbytes, _dev, stride, cnt = rows[r].tolist()
        assert cnt == count and 0 <= u < count
        out.append((addr + u * stride, nbytes))
    return out


@st.composite
def _sends(draw: Any) -> Any:
    e = draw(st.integers(1, 4))
    run = draw(st.sampled_from([256, 512]))
    stride = run + draw(st.sampled_from([0, 0, 64]))  # a page may move less than its stride
    count = draw(st.integers(2, 40))
    p = draw(st.integers(1, min(count, 24)))
    sp = draw(st.permutations(range(count)))[:p]
    dp = draw(st.permutations(range(count)))[:p]
    last = draw(st.sampled_from([run, run, 64, run - 64]))
    return e, run, stride, count, np.array(sp, np.int64), np.array(dp, np.int64), last


@settings(max_examples=300, deadline=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture])  # fmt: skip
@given(case=_sends(), numpy_path=st.booleans(), as_lists=st.booleans())
def test_every_index_names_its_pages_bytes(
    case: Any, numpy_path: bool, as_lists: bool, monkeypatch: Any
) -> None:
    """Every index a request gives names exactly its page's bytes (Python-int and numpy paths,
    whole and partial last pages), for page ids given as int64 arrays or as lists of Python ints
    (a session's short sends: the caller's lists stay as they were); ids beyond the lists are
    refused."""
    e, run, stride, count, sp, dp, last = case
    # each entry its own region on the source side, one region for all on the destination
    src_first = tuple((i + 1) * (1 << 24) for i in range(e))
    dst_first = tuple((1 << 30) + i * count * stride for i in range(e))
    local = [(f, (count - 1) * stride + run) for f in src_first]
    remote = [(dst_first[0], e * count * stride)]
    g = PageGrid(src_first=src_first, dst_first=dst_first, src_stride=stride,
                 dst_stride=stride, run_bytes=run)  # fmt: skip
    agent = _Agent()
    gl = GridLists(agent, "peer", g, local, remote, "DRAM", 0, {})
    assert gl.src_pages == count and gl.dst_pages >= count
    with monkeypatch.context() as m:
        if numpy_path:
            m.setattr(gridmod, "LIST_MAX", 0)
        s_in, d_in = (sp.tolist(), dp.tolist()) if as_lists else (sp, dp)
        lh, li, rh, ri = gl.request(s_in, d_in, last)
    assert list(s_in) == sp.tolist() and list(d_in) == dp.tolist()  # the caller's, unchanged
    assert isinstance(li, np.ndarray) == (numpy_path or e * len(sp) > gridmod.LIST_MAX)
    if isinstance(li, np.ndarray):  # NIXL reads int32 indices as they are
        assert li.dtype == np.int32 and ri.dtype == np.int32
    want_s = [(src_first[i] + q * stride, last if k == len(sp) - 1 else run)
              for i in range(e) for k, q in enumerate(sp.tolist())]  # fmt: skip
    want_d = [(dst_first[i] + q * stride, last if k == len(dp) - 1 else run)
              for i in range(e) for k, q in enumerate(dp.tolist())]  # fmt: skip
    assert _decode(agent.lists[lh], li, gl.src_pages) == want_s
    assert _decode(agent.lists[rh], ri, gl.dst_pages) == want_d
    # a page id at the lists' end would name the next entry's page: refused
    beyond = sp.copy()
    beyond[-1] = gl.src_pages
    assert gl.request(beyond, dp, last) is None
    beyond = dp.copy()
    beyond[0] = gl.dst_pages
    assert gl.request(sp, beyond, last) is None


def test_pages_in_regions_tail_sizes_and_release() -> None:
    assert pages_in([(1000, 4096)], [1000], 1024, 1024) == 4
    assert pages_in([(1000, 4096)], [1000 + 64], 1024, 512) == 4  # offset 64, 512 of 1024
    assert pages_in([(1000, 4096)], [1000 + 600], 1024, 512) == 3
    assert pages_in([(1000, 4096)], [999], 1024, 1024) == 0  # outside every region
    assert pages_in([(0, 8192), (8192, 1024)], [0, 8192], 1024, 1024) == 1  # the smallest
    g = PageGrid(src_first=(0,), dst_first=(0,), src_stride=64, dst_stride=64, run_bytes=64)
    with pytest.raises(ValueError, match="no whole page"):
        GridLists(_Agent(), "p", g, [(0, 32)], [(0, 640)], "DRAM", 0, {})
    agent = _Agent()
    local: dict[Any, Any] = {}
    gl = GridLists(agent, "p", g, [(0, 640)], [(0, 640)], "DRAM", 0, local)
    one = np.array([3], dtype=np.int64)
    with pytest.raises(ValueError, match="last_bytes=0"):
        gl.request(one, one, 0)
    with pytest.raises(ValueError, match="last_bytes=65"):
        gl.request(one, one, 65)
    for tail in range(1, 65):  # one list pair per last-page size, the local ones shared
        assert gl.request(one, one, tail) is not None
    assert len(agent.lists) == 2 * 64
    gl2 = GridLists(agent, "q", g, [(0, 640)], [(0, 640)], "DRAM", 0, local)
    assert gl2.request(one, one, 64) is not None and len(agent.lists) == 2 * 64 + 1
    released: list[Any] = []
    gl.release(released.append)
    assert len(released) == 64 and gl.request(one, one, 64) is None


@pytest.mark.parametrize("numpy_path", [False, True])
def test_a_peer_declaring_huge_regions_gets_int32_indexable_lists(
    numpy_path: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A peer whose regions span 2**62 bytes would make lists of 2**56 pages per entry, whose
    indices NIXL (int32) cannot hold: the lists stop at what int32 indexes, a page beyond them
    is refused (the send goes by addresses), every index the lists give fits (as Python ints
    and as the int32 array of a send of more than ``LIST_MAX`` descriptors)."""
    monkeypatch.setattr(gridmod, "LIST_MAX", 0 if numpy_path else 1 << 20)
    e, run = 3, 64
    src_first, dst_first = tuple(i << 20 for i in range(e)), tuple(i << 58 for i in range(e))
    g = PageGrid(src_first=src_first, dst_first=dst_first, src_stride=run, dst_stride=run,
                 run_bytes=run)  # fmt: skip
    agent = _Agent()
    gl = GridLists(agent, "peer", g, [(0, e << 20)], [(0, 1 << 62)], "DRAM", 0, {})
    assert gl.src_pages == (1 << 20) // run
    assert gl.dst_pages == gridmod.INDEX_MAX // (2 * e)
    sp = np.arange(100, dtype=np.int64)
    dp = np.full(100, gl.dst_pages - 1, dtype=np.int64)
    _lh, _li, _rh, ri = gl.request(sp, dp, 32)  # tail kind: the largest indices
    assert isinstance(ri, np.ndarray) == numpy_path
    ri = np.asarray(ri, dtype=np.int64)
    assert int(ri.max()) <= gridmod.INDEX_MAX
    assert int(ri.max()) == (2 * e - 1) * gl.dst_pages + gl.dst_pages - 1
    dp[0] = gl.dst_pages
    assert gl.request(sp, dp, 32) is None


# ------------------------------------------------------------------ the engine, over NIXL
PAGE, ROW, PAGES = 8, 64, 24  # one entry class: 512 B per page


class _Pair(NixlPair):
    """Two entries of ``ROW`` bytes per token; the decode holds fewer pages: ids the source
    has may lie beyond its lists. ``grid``: the template of both sides' pages."""

    def __init__(self) -> None:
        lay = KVLayout(page_size=PAGE, entry_bytes_per_token=(ROW, ROW), dtype="uint8")
        super().__init__(lay, PAGES, PAGES - 4, seed=3)
        self.grid = PageGrid(
            src_first=tuple(t.data_ptr() for t in self.src),
            dst_first=tuple(t.data_ptr() for t in self.dst),
            src_stride=PAGE * ROW, dst_stride=PAGE * ROW, run_bytes=PAGE * ROW,
        )  # fmt: skip


@pytest.fixture(scope="module")
def pair() -> Any:
    p = _Pair()
    yield p
    p.close()


@pytest.mark.nixl
@settings(max_examples=25, deadline=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture])  # fmt: skip
@given(data=st.data())
def test_posts_by_page_ids_land_exactly_their_bytes(pair: Any, data: Any) -> None:
    lists = pair.a.prepare_pages(pair.peer, pair.grid)
    assert lists is not None and lists.dst_pages == PAGES - 4
    p = data.draw(st.integers(1, 6))
    sp = np.array(data.draw(st.permutations(range(PAGES)))[:p], dtype=np.int64)
    dp = np.array(data.draw(st.permutations(range(PAGES - 4)))[:p], dtype=np.int64)
    tail = data.draw(st.sampled_from([PAGE, PAGE, 1, 5]))
    for t in pair.dst:
        t.fill_(0xA5)  # poison: a byte past the last page's tail shows
    before = pair.a.counts["grid_xfer"]
    h = pair.a.post_pages(pair.peer, lists, sp, dp, tail * ROW, b"tag")
    pair.finish(h)
    assert pair.a.counts["grid_xfer"] == before + 1
    pb = PAGE * ROW
    for s_t, d_t in zip(pair.src, pair.dst):
        want = torch.full_like(d_t, 0xA5)
        for k, (s, d) in enumerate(zip(sp.tolist(), dp.tolist())):
            n = tail * ROW if k == p - 1 else pb
            want[d * pb : d * pb + n] = s_t[s * pb : s * pb + n]
        assert torch.equal(d_t, want)


@pytest.mark.nixl
def test_pages_beyond_the_lists_bad_sizes_and_released_lists() -> None:
    pair = _Pair()
    try:
        a, peer = pair.a, pair.peer
        lists = a.prepare_pages(peer, pair.grid)
        assert lists is not None and lists.src_pages == PAGES
        ok = np.array([1], dtype=np.int64)
        past = np.array([PAGES - 4], dtype=np.int64)  # a source page the decode does not hold
        assert a.post_pages(peer, lists, ok, past, PAGE * ROW, b"tag") is None
        with pytest.raises(ValueError, match="last_bytes"):
            a.post_pages(peer, lists, ok, ok, PAGE * ROW + 1, b"tag")
        # a peer that published no regions gets no lists (its sends post addresses)
        assert a.prepare_pages(type(peer)(name=peer.name), pair.grid) is None
        # nor one whose regions are not what a pdplug rank writes: counted, not raised
        bad = type(peer)(name=peer.name, regions="4096:+512")
        assert a.prepare_pages(bad, pair.grid) is None
        assert a.counts["grid_regions_malformed"] == 1
        # nor one whose regions hold no whole page of an entry (a region of 1 byte)
        tiny = type(peer)(name=peer.name, regions=f"{pair.dst[0].data_ptr()}:1")
        assert a.prepare_pages(tiny, pair.grid) is None
        assert a.counts["grid_no_whole_page"] == 1
        a.disconnect(peer)  # its lists go with its agent
        assert lists.released
        assert a.post_pages(peer, lists, ok, ok, PAGE * ROW, b"tag") is None
    finally:
        pair.close()
