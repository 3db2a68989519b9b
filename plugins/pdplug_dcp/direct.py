"""Unpacked plans: byte runs straight from source entries to destination entries, merged
wherever both sides are contiguous, never crossing a destination page.

Per class (:class:`~pdplug_dcp.pairs.EntryClass`): token runs (consecutive on both sides inside
one source and one destination page) x columns give pieces; pieces are put in destination
order inside each page (token-major or head-major) and neighbours contiguous on both sides are
merged (SGLang ``group_concurrent_contiguous`` on bytes). One template serves every entry of
the class (offsets are relative to each entry's base). Vectorised over runs; no Python loop
over tokens or pages.
"""

from __future__ import annotations

import numpy as np

from pdplug.packing import page_array
from pdplug.types import SendChunk
from pdplug_dcp.chunks import ChunkState, token_runs
from pdplug_dcp.pairs import EntryClass, Pair

__all__ = ["class_runs", "expand_entries", "whole_page_runs"]

_EMPTY = np.zeros(0, dtype=np.int64)
_EMPTY.flags.writeable = False


def class_runs(
    st: ChunkState,
    cls: EntryClass,
    ps: int,
    dst_pages: np.ndarray,
    l_start: int,
    first: int = 0,
    step: int = 1,
    n: int = -1,
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Merged runs of one entry of ``cls`` for chunk tokens ``first + step * j`` stored from
    local offset ``l_start`` (``n`` tokens; -1: all from ``first``).

    :returns: int64 ``[R]`` ``(source offset from the source entry base, destination offset
        from the destination entry base, length)`` in bytes, in destination order.
    """
    if step == 1 and ps == cls.d_page and cls.ncols == 1 and cls.w == cls.s_ts == cls.d_ts:
        fast = _page_runs(st, cls, ps, dst_pages, l_start, first, n)
        if fast is not None:
            return fast
    k, loc, ln = token_runs(st, ps, cls.d_page, l_start, first, step, n)
    if k.shape[0] == 0:
        return _EMPTY, _EMPTY, _EMPTY
    w, c = cls.w, cls.ncols
    if ln.max() > 1 and not (w == cls.s_ts == cls.d_ts):
        # a run is contiguous per column only when a column is a whole token stride on both
        # sides; otherwise every token is its own piece
        run = np.repeat(np.arange(k.shape[0]), ln)
        off = np.arange(run.shape[0], dtype=np.int64) - np.repeat(np.cumsum(ln) - ln, ln)
        k, loc = k[run] + off, loc[run] + off
        ln = np.ones(k.shape[0], dtype=np.int64)
    t = k.shape[0]
    src_tok = _src_at(st, ps, k, cls)
    q = loc // cls.d_page
    dst_tok = dst_pages[q] * cls.d_ps + (loc - q * cls.d_page) * cls.d_ts
    src = (src_tok[:, None] + cls.s_cols[None, :]).reshape(-1)
    dst = (dst_tok[:, None] + cls.d_cols[None, :]).reshape(-1)
    length = np.repeat(ln * w, c)
    page = np.repeat(q, c)
    if c > 1 and cls.head_major:
        # reorder (run, column) -> (page, column, run): position = c * first run of the page
        # + column * runs in the page + run index inside the page
        _, first_t, cnt = np.unique(q, return_index=True, return_counts=True)
        base = np.repeat(first_t, cnt)
        tt = np.arange(t, dtype=np.int64)
        pos = (c * base + (tt - base))[:, None] + np.arange(c)[None, :] * np.repeat(cnt, cnt)[
            :, None
        ]
        pos = pos.reshape(-1)
        order = np.empty_like(pos)
        order[pos] = np.arange(pos.shape[0])
        src, dst, length, page = src[order], dst[order], length[order], page[order]
    return _merge(src, dst, length, page)


def _page_runs(
    st: ChunkState,
    cls: EntryClass,
    ps: int,
    dst_pages: np.ndarray,
    l_start: int,
    first: int,
    n: int,
) -> tuple[np.ndarray, np.ndarray, np.ndarray] | None:
    """Whole-row pages aligned on both sides (the same layout at equal page size, the usual
    case): one run per page, straight from the page ids; None when not page-aligned."""
    a = st.s0 + first
    if a % ps or l_start % ps:
        return None
    if n < 0:
        n = st.nt - first
    if n <= 0:
        return _EMPTY, _EMPTY, _EMPTY
    pages = -(-n // ps)
    a //= ps
    q0 = l_start // ps
    src = st.src_pages[a : a + pages] * cls.s_ps
    dst = dst_pages[q0 : q0 + pages] * cls.d_ps
    if src.shape[0] < pages or dst.shape[0] < pages:
        return None  # the generic path names what is missing
    s0, d0 = int(cls.s_cols[0]), int(cls.d_cols[0])
    if s0:
        src += s0
    if d0:
        dst += d0
    length = np.full(pages, ps * cls.w, dtype=np.int64)
    length[-1] = (n - (pages - 1) * ps) * cls.w
    return src, dst, length


def _src_at(st: ChunkState, ps: int, k: np.ndarray, cls: EntryClass) -> np.ndarray:
    """Source byte offsets of chunk tokens ``k``."""
    a = st.s0 + k
    pg = a // ps
    return st.src_pages[pg] * cls.s_ps + (a - pg * ps) * cls.s_ts


def _merge(
    src: np.ndarray, dst: np.ndarray, length: np.ndarray, page: np.ndarray
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    m = src.shape[0]
    if m <= 1:
        return src, dst, length
    end_s = src[:-1] + length[:-1]
    end_d = dst[:-1] + length[:-1]
    brk = (src[1:] != end_s) | (dst[1:] != end_d) | (page[1:] != page[:-1])
    starts = np.concatenate(([0], np.flatnonzero(brk) + 1))
    csum = np.concatenate(([0], np.cumsum(length)))
    ends = np.concatenate((starts[1:], [m]))
    return src[starts], dst[starts], csum[ends] - csum[starts]


def expand_entries(
    entries: np.ndarray, src: np.ndarray, dst: np.ndarray, length: np.ndarray
) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """One template for every entry of a class, entry-major: four int64 ``[E * R]`` arrays
    ``(entry, src_offset, dst_offset, length)``. With one entry the template arrays are
    returned as they are (callers pass arrays of their own, as :func:`class_runs` makes)."""
    e, r = entries.shape[0], src.shape[0]
    if r == 0 or e == 0:
        return _EMPTY, _EMPTY, _EMPTY, _EMPTY
    if e == 1:
        return entries.repeat(r), src, dst, length
    # concatenate: np.tile's Python-level bookkeeping costs more than the copy at these sizes
    return (
        entries.repeat(r),
        np.concatenate((src,) * e),
        np.concatenate((dst,) * e),
        np.concatenate((length,) * e),
    )


def whole_page_runs(chunk: SendChunk, pair: Pair) -> tuple[np.ndarray, ...] | None:
    """The direct plan's runs ``(entry, src_offset, dst_offset, length)`` (int64 ``[E * P]``,
    entry-major) of the commonest pair, in a few array operations: one main class of whole
    rows at equal page size, no DCP, no draft entries, and a chunk that starts on a page
    boundary on both sides (what :func:`class_runs` does through :func:`_page_runs`, without
    the general path's per-chunk bookkeeping: a KV sender plans every send of such a pair
    this way). ``None`` when the pair or the chunk needs the general path, which also names
    every error (it re-validates, so no invalid chunk passes here)."""
    if pair.dcp != 1 or pair.drafts or len(pair.main) != 1:
        return None
    cls = pair.main[0]
    ps = pair.src_page
    if not (
        ps == pair.dst_page == cls.d_page and len(cls.cols_t) == 1 and cls.w == cls.s_ts == cls.d_ts
    ):
        return None
    n, prefix = chunk.num_tokens, chunk.decode_prefix_len
    if chunk.rel_start != -1 or prefix % ps or chunk.src_page_offset < 0 or n <= 0:
        return None
    q0 = chunk.src_page_offset
    pages = -(-n // ps)
    try:
        src = page_array(chunk.src_pages, "src_pages", chunk.room)
        dst = page_array(chunk.dst_pages, "dst_pages", chunk.room)
    except ValueError:
        return None
    if src.shape[0] < pages or dst.shape[0] < q0 + pages:
        return None
    e = cls.entries.shape[0]
    if e == 0:
        return _EMPTY, _EMPTY, _EMPTY, _EMPTY
    # entry ids, lengths and the per-run page index depend on the size alone (cached): a send
    # pays for its offsets only, one gather per side when several entries repeat them
    entry, length, pick = cls.whole_page_runs(pages, n - (pages - 1) * ps)
    if pick is None:
        src = src[:pages] * cls.s_ps
        dst = dst[q0 : q0 + pages] * cls.d_ps
    else:
        src = src[pick] * cls.s_ps
        dst = dst[q0 : q0 + pages][pick] * cls.d_ps
    s0, d0 = cls.cols_t[0], int(cls.d_cols[0])
    if s0:
        src += s0
    if d0:
        dst += d0
    return entry, src, dst, length
