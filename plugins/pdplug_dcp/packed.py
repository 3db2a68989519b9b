"""Packed plans: the rank's bytes gathered into its pack region in destination order, then one
run per destination-contiguous range (SGLang DCP packing, PRs #35762 / #40376, generalised to
head sub-rows).

Region layout: entry-major (layer-major, as before): pack entry ``e`` gets ``n * tok_bytes(e)``
bytes at ``region.offset + n * pack_cum[e]``; inside, destination pages in order, and inside a
page the destination's own order (token-major or head-major, :mod:`pdplug_dcp.pairs`). A
destination page's runs depend only on which of its tokens the rank owns, so the runs of a
full page are one cached template broadcast over the middle pages; only the first and last
page are computed apart. Costs O(destination pages) per class for the runs and O(tokens) for
the gather's token offsets (one int64 per token, as before); sub-row indices are expanded by
the packer.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import numpy as np

from pdplug.errors import CapacityError
from pdplug.kvtypes import PackGroup
from pdplug.types import PackRegion
from pdplug_dcp.chunks import ChunkState, src_offsets
from pdplug_dcp.pairs import EntryClass, Pair, _ro

__all__ = [
    "PackedShape",
    "check_capacity",
    "class_packed_runs",
    "dst_offsets",
    "packed_shape",
    "rank_block",
    "ranks_tokens",
    "shape_group",
    "token_bases",
]


_EMPTY = np.zeros(0, dtype=np.int64)
_EMPTY.flags.writeable = False
#: runs (entries x runs per entry) up to which destination offsets are spread with one take
_TAKE_MAX = 1536
_AR = np.arange(1 << 16, dtype=np.int64)
_AR.flags.writeable = False


def _steps(n: int, step: int, start: int) -> np.ndarray:
    """int64 ``[n]``: ``start + step * i`` (a fresh array)."""
    if n > _AR.shape[0]:
        return start + step * np.arange(n, dtype=np.int64)
    out = _AR[:n] * step
    if start:
        out += start
    return out


def check_capacity(st: ChunkState, pair: Pair, rank: int, n: int, rg: PackRegion) -> None:
    """:raises CapacityError: the rank's ``n`` tokens do not fit ``rg`` (names room, chunk,
    rank, tokens, capacity and the send bound to split at)."""
    if n <= rg.capacity_tokens and n * pair.pack_bpt <= rg.nbytes:
        return
    c = st.chunk
    cap = rg.capacity_tokens
    if pair.pack_bpt:  # the region's bytes may bind before its token capacity
        cap = min(cap, rg.nbytes // pair.pack_bpt // pair.src_page * pair.src_page)
    raise CapacityError(
        f"room {c.room}: chunk {c.chunk_id} puts {n} tokens on dst DCP rank {rank}, "
        f"pack region {rg.index} holds capacity={cap} tokens ({rg.nbytes} bytes, "
        f"{pair.pack_bpt} bytes/token); split the send at capacity*dcp_size="
        f"{cap * pair.dcp} tokens"
    )


def class_packed_runs(
    cls: EntryClass, dst_pages: np.ndarray, n: int, l0: int
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Region->destination runs of one entry of ``cls`` for the rank's ``n`` tokens stored
    from local offset ``l0``.

    :returns: int64 ``[R]`` ``(offset in the entry's region block, destination offset from
        the destination entry base, length)``.
    """
    pd = cls.d_page
    tb = cls.tok_bytes
    q0, q1 = l0 // pd, (l0 + n - 1) // pd
    o0 = l0 - q0 * pd
    cnt0 = min(n, pd - o0)
    cl = l0 + n - q1 * pd
    pages = cls._pages
    first = pages.get((o0, cnt0)) or cls.page_runs(o0, cnt0)
    full = pages.get((0, pd)) or cls.page_runs(0, pd)
    last = (pages.get((0, cl)) or cls.page_runs(0, cl)) if q1 > q0 else full
    if first[0].shape[0] == full[0].shape[0] == last[0].shape[0] == 1:
        # one run per page (rows, MLA latents, HND head ranges): page k's region block starts
        # after k * pd - o0 tokens
        nr = q1 - q0 + 1
        reg = _steps(nr, pd * tb, -o0 * tb)
        reg[0] = 0
        dst = dst_pages[q0 : q1 + 1] * cls.d_ps
        f1 = int(full[1][0])
        if f1:
            dst += f1
        dst[0] += int(first[1][0]) - f1
        ln = np.empty(nr, dtype=np.int64)
        ln.fill(int(full[2][0]))
        ln[0] = first[2][0]
        if nr > 1:
            dst[-1] += int(last[1][0]) - f1
            ln[-1] = last[2][0]
        return reg, dst, ln
    parts_r = [first[0]]
    parts_d = [first[1] + dst_pages[q0] * cls.d_ps]
    parts_n = [first[2]]
    if q1 > q0 + 1:  # full middle pages: one template, broadcast
        rf, df, nf = full
        f = q1 - q0 - 1
        t0 = cnt0 + pd * np.arange(f, dtype=np.int64)
        parts_r.append((t0[:, None] * tb + rf[None, :]).reshape(-1))
        parts_d.append((dst_pages[q0 + 1 : q1, None] * cls.d_ps + df[None, :]).reshape(-1))
        parts_n.append(np.tile(nf, f))
    if q1 > q0:
        parts_r.append(last[0] + (n - cl) * tb)
        parts_d.append(last[1] + dst_pages[q1] * cls.d_ps)
        parts_n.append(last[2])
    return np.concatenate(parts_r), np.concatenate(parts_d), np.concatenate(parts_n)


class PackedShape(NamedTuple):
    """What the packed plans of one class share when they have one *shape* (the rank's token
    count ``n``, first token ``first``, first in-page offsets ``o0`` (destination) and ``s0``
    (source), and the region): everything but the page ids. Arrays are read-only.

    :ivar offs: int64 ``[E]`` block offsets (:meth:`EntryClass.block_offsets`).
    :ivar ecol: int64 ``[E * R]`` entry of each run (entry-major).
    :ivar src: int64 ``[E * R]`` region offset of each run from the pack-buffer base.
    :ivar lens: int64 ``[E * R]`` run lengths (bytes).
    :ivar inpage: int64 ``[R]`` destination offset of each run from its page's base (the same
        for every entry: offsets are from each destination entry's base), or None when all 0.
    :ivar qidx: int64 ``[R]`` destination page of each run (from the first), or None when run
        ``k`` lies in page ``k`` (one run per page).
    :ivar pages: destination pages spanned.
    :ivar d_ps: int64 0-d: the destination page stride (a 0-d array multiplies faster than a
        Python int).
    :ivar tok_pages/tok_per/tok_mul/tok_row: when every source page holds the rank's tokens at
        the same in-page offsets: the source pages spanned, tokens per page, the page stride
        in units (int64 0-d) and the in-page offsets, int64 ``[n]`` tiled; else ``tok_pages``
        is 0 and the token offsets are computed from scratch.
    :ivar tok_key: ``(page stride, token stride)`` in units (:func:`pack_group` tokens key).
    :ivar whole_rows: the gather moves whole token rows of contiguous pages (token offsets are
        token slots).
    :ivar eidx: int64 ``[E * R]``: ``0 .. R - 1`` repeated per entry (one ``take`` spreads a
        row of ``R`` destination offsets over every entry), or None for large shapes, where a
        broadcast copy of the row per entry is cheaper than an indexed gather.
    """

    offs: np.ndarray
    ecol: np.ndarray
    src: np.ndarray
    lens: np.ndarray
    inpage: np.ndarray | None
    qidx: np.ndarray | None
    pages: int
    d_ps: np.ndarray
    tok_pages: int
    tok_per: int
    tok_mul: np.ndarray
    tok_row: np.ndarray
    tok_key: tuple[int, int]
    whole_rows: bool
    eidx: np.ndarray | None


def packed_shape(
    cls: EntryClass, pair: Pair, n: int, first: int, o0: int, s0: int, region_offset: int
) -> PackedShape:
    """The :class:`PackedShape` of a rank's ``n > 0`` tokens (cached per class within a byte
    budget; built once per shape in O(runs + tokens))."""
    key = (n, first, o0, s0, region_offset)
    hit = cls._shapes.get(key)
    if hit is not None:
        return hit
    pd, tb = cls.d_page, cls.tok_bytes
    pages = (o0 + n - 1) // pd + 1
    reg, tdst, ln = class_packed_runs(cls, np.zeros(pages, dtype=np.int64), n, o0)
    # the region block is in destination page order: page 0 holds cnt0 tokens, others pd
    cnt0 = min(n, pd - o0)
    q = np.where(reg < cnt0 * tb, 0, 1 + (reg - cnt0 * tb) // (pd * tb))
    r = reg.shape[0]
    qidx = None if r == pages and bool((q == np.arange(r)).all()) else _ro(q)
    offs = cls.block_offsets(n, region_offset)
    e = offs.shape[0]
    src = np.add(reg[None, :], offs[:, None]).reshape(-1)
    lens = np.empty((e, r), dtype=np.int64)
    lens[:] = ln
    ps, step, unit = pair.src_page, pair.dcp, cls.unit
    tok_key = (cls.s_ps // unit, cls.s_ts // unit)
    tok_pages = per = 0
    row = _EMPTY
    if s0 == 0 and ps % step == 0 and first < step:
        # every source page holds the rank's tokens at the same in-page offsets
        per = ps // step
        tok_pages = -(-n // per)
        one = (first + step * np.arange(per, dtype=np.int64)) * tok_key[1]
        row = _ro(np.tile(one, tok_pages)[:n])
    out = PackedShape(
        offs=offs,
        ecol=cls.entry_column(r),
        src=_ro(src),
        lens=_ro(lens.reshape(-1)),
        inpage=_ro(tdst) if tdst.any() else None,
        qidx=qidx,
        pages=pages,
        d_ps=_ro(np.array(cls.d_ps, dtype=np.int64)),
        tok_pages=tok_pages,
        tok_per=per,
        tok_mul=_ro(np.array(tok_key[0], dtype=np.int64)),
        tok_row=row,
        tok_key=tok_key,
        whole_rows=tok_key == (ps, 1),
        eidx=_ro(np.tile(np.arange(r, dtype=np.int64), e)) if e * r <= _TAKE_MAX else None,
    )
    cls.remember_shape(key, out, ((3 if e * r <= _TAKE_MAX else 2) * e + 1) * r * 8 + row.nbytes)
    return out


#: the last destination-offset and token-offset arrays built, shared by every class of the
#: same geometry (the DCP ranks and the TP ranks of one decode instance share their page ids)
_LAST: dict[str, tuple[Any, ...]] = {}


_GEOMETRIES: dict[tuple[Any, ...], tuple[Any, ...]] = {}


def _dst_geometry(cls: EntryClass) -> tuple[Any, ...]:
    """The class's destination geometry, one object per distinct value (classes of the DCP
    and TP ranks of one decode instance compare by identity)."""
    geo = cls._reuse.get("geo")
    if geo is None:
        geo = (cls.d_ps, cls.d_ts, cls.d_page, cls.w, cls.head_major, cls.tok_bytes,
               cls.d_cols.tobytes(), cls.entries.shape[0])  # fmt: skip
        if len(_GEOMETRIES) >= 256:
            _GEOMETRIES.clear()
        geo = cls._reuse["geo"] = _GEOMETRIES.setdefault(geo, geo)
    return geo


def dst_offsets(st: ChunkState, cls: EntryClass, sh: PackedShape, n: int, o0: int, q0: int
                ) -> np.ndarray:  # fmt: skip
    """Read-only int64 ``[E * R]``: destination offsets of a packed shape's runs for the chunk's
    destination pages from page ``q0`` on (one row of ``R`` page offsets per entry: offsets
    are from each destination entry's base).

    The DCP and TP ranks of one decode instance share their destination pages (a sender
    gives them one chunk: :func:`pdplug.packing.segment_chunks`) and geometry, so their
    offsets are equal: the last array built is reused while the geometry and the page array
    are the same objects (the entry keeps the array alive, so its id is not reused)."""
    geo, pages = _dst_geometry(cls), st.dst_pages
    hit = _LAST.get("dst")
    if hit is not None and hit[0] is geo and hit[1] is pages and hit[2] == (n, o0, q0):
        return hit[3]  # type: ignore[no-any-return]
    pg = pages[q0 : q0 + sh.pages]
    if sh.qidx is not None:
        pg = pg[sh.qidx]
    row = np.multiply(pg, sh.d_ps)
    if sh.inpage is not None:
        row += sh.inpage
    if sh.eidx is not None:
        dst = row.take(sh.eidx)
    else:
        dst = np.empty((sh.offs.shape[0], row.shape[0]), dtype=np.int64)
        dst[:] = row
        dst = dst.reshape(-1)
    dst.flags.writeable = False
    _LAST["dst"] = (geo, pages, (n, o0, q0), dst)
    return dst


def token_bases(st: ChunkState, cls: EntryClass, sh: PackedShape, n: int) -> np.ndarray:
    """Read-only int64 ``[n]``: the source page base of each of a rank's ``n`` tokens in units
    (``sh.tok_pages > 0``: every source page holds the rank's tokens at the same in-page
    offsets; add ``sh.tok_row`` for the token offsets). Equal for every DCP rank of a chunk:
    the last array built per class is reused while the source page array is the same object
    (the entry keeps it alive, so its id is not reused)."""
    pages = st.src_pages
    key = (sh.tok_pages, sh.tok_per, sh.tok_key[0], n)
    reuse = cls._reuse
    hit = reuse.get("tok")
    if hit is not None and hit[0] is pages and hit[1] == key:
        return hit[2]  # type: ignore[no-any-return]
    base = np.multiply(pages[: sh.tok_pages], sh.tok_mul).repeat(sh.tok_per)
    if base.shape[0] != n:
        base = base[:n]
    base.flags.writeable = False
    reuse["tok"] = (pages, key, base)
    return base


def ranks_tokens(
    st: ChunkState, cls: EntryClass, shapes: list[PackedShape], n: int, firsts: tuple[int, ...]
) -> np.ndarray:
    """Read-only int64 ``[D, n]``: the token offsets (units) of every DCP rank of a chunk whose
    ranks all hold ``n`` tokens (``shapes[r].tok_pages > 0``: each source page holds rank
    ``r``'s tokens at the in-page offsets of ``shapes[r].tok_row``). Equal for the TP
    ranks of one decode instance (one source geometry, one chunk): the last array built is
    reused while the geometry and the source page array are the same (the entry keeps the
    array alive, so its id is not reused)."""
    sh0 = shapes[0]
    pages = st.src_pages
    key = (sh0.tok_key, sh0.tok_per, sh0.tok_pages, n, firsts)
    hit = _LAST.get("toks")
    if hit is not None and hit[0] is pages and hit[1] == key:
        return hit[2]  # type: ignore[no-any-return]
    # a send's segments need a few (count, firsts) rows: its full segments' and its last one's
    rows_by = cls._reuse.get("rows")
    if rows_by is None:
        rows_by = cls._reuse["rows"] = {}
    rkey = (n, firsts)
    rows = rows_by.get(rkey)
    if rows is None:
        rows = _ro(np.stack([sh.tok_row for sh in shapes]))
        if len(rows_by) >= 8:
            rows_by.clear()
        rows_by[rkey] = rows
    # a repeat and a flat add beat one 3-d broadcast add here
    toks = np.add(token_bases(st, cls, sh0, n), rows)
    toks.flags.writeable = False
    _LAST["toks"] = (pages, key, toks)
    return toks


def shape_group(cls: EntryClass, sh: PackedShape, tokens: np.ndarray, o0: int) -> PackGroup:
    """The gather of one class for a rank of shape ``sh``: int64 ``[n]`` token offsets
    ``tokens`` (units), the first token at destination in-page offset ``o0``."""
    return PackGroup(
        entries=cls.entries_t,
        offsets=sh.offs,
        tokens=tokens,
        cols=cls.cols_t,
        row_bytes=cls.w,
        unit=cls.unit,
        page_tokens=cls.d_page if cls.head_major else 0,
        first_offset=o0,
    )


def rank_block(
    st: ChunkState,
    pair: Pair,
    cls: EntryClass,
    first: int,
    n: int,
    l0: int,
    region_offset: int,
    tokens: dict[tuple[int, int], np.ndarray] | None = None,
) -> tuple[tuple[np.ndarray, ...], PackGroup, bool]:
    """One class of a rank's packed plan, for the rank's ``n > 0`` chunk tokens ``first,
    first + D, ...`` stored from local offset ``l0``: its runs (entry-major ``[E * R]``:
    entry, region offset from the pack-buffer base, destination offset, length), its gather,
    and whether the gather moves whole token rows (its token offsets are then token slots).

    Per plan only the page ids are new: the destination offsets (one row of ``R`` page
    offsets, written once per entry) and the token offsets (source page bases repeated per
    page, plus the shape's cached in-page row) take a few numpy calls on ``E * R`` and ``n``
    values; the rest is the shape's (:func:`packed_shape`).

    :param tokens: token offsets already built for this rank, keyed by ``(page stride, token
        stride)`` in units (shared by classes with one source geometry); None: one class.
    """
    pd = cls.d_page
    q0 = l0 // pd
    o0 = l0 - q0 * pd
    sh = cls._shapes.get((n, first, o0, st.s0, region_offset))
    if sh is None:
        sh = packed_shape(cls, pair, n, first, o0, st.s0, region_offset)
    ecol, src, lens, tok_key, whole = sh.ecol, sh.src, sh.lens, sh.tok_key, sh.whole_rows
    dst = dst_offsets(st, cls, sh, n, o0, q0)
    tok = tokens.get(tok_key) if tokens is not None else None
    if tok is None:
        if sh.tok_pages:
            tok = np.add(token_bases(st, cls, sh, n), sh.tok_row)
        else:
            tok = src_offsets(st, pair.src_page, first, pair.dcp, n, *tok_key)
        if tokens is not None:
            tokens[tok_key] = tok
    group = shape_group(cls, sh, tok, o0)
    return (ecol, src, dst, lens), group, whole
