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

import numpy as np

from pdplug.errors import CapacityError
from pdplug.kvtypes import PackGroup
from pdplug.types import PackRegion
from pdplug_dcp.chunks import ChunkState, src_offsets
from pdplug_dcp.pairs import EntryClass, Pair

__all__ = ["check_capacity", "class_packed_runs", "class_packed_block", "pack_group"]


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


def class_packed_block(
    cls: EntryClass, dst_pages: np.ndarray, n: int, l0: int, offs: np.ndarray
) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """Every entry's region->destination runs of ``cls`` (entry-major ``[E * R]``: entry,
    region offset from the pack-buffer base, destination offset, length), for the rank's
    ``n`` tokens from local offset ``l0``; ``offs`` int64 ``[E]`` (read-only, cached by
    :meth:`EntryClass.block_offsets`) are the entries' block offsets.

    With one run per page (the common case) only the destination offsets depend on the
    chunk's pages: the region offsets and lengths depend on the shape alone (``n``, the
    block offsets, the first page's offset, the page count) and are shared, read-only,
    between plans of that shape."""
    pd = cls.d_page
    q0, q1 = l0 // pd, (l0 + n - 1) // pd
    o0 = l0 - q0 * pd
    cl = l0 + n - q1 * pd
    pages = cls._pages
    first = pages.get((o0, min(n, pd - o0))) or cls.page_runs(o0, min(n, pd - o0))
    full = pages.get((0, pd)) or cls.page_runs(0, pd)
    last = (pages.get((0, cl)) or cls.page_runs(0, cl)) if q1 > q0 else full
    e = offs.shape[0]
    if first[0].shape[0] == full[0].shape[0] == last[0].shape[0] == 1:
        r = q1 - q0 + 1
        dst = np.multiply(dst_pages[q0 : q1 + 1], cls.d_ps)
        f1 = int(full[1][0])
        if f1:
            dst += f1
        dst[0] += int(first[1][0]) - f1
        if r > 1:
            dst[-1] += int(last[1][0]) - f1
        out = np.empty((e, r), dtype=np.int64)
        out[:] = dst
        key = (id(offs), o0, r, int(first[2][0]), int(last[2][0]))
        shared = cls._shapes.get(key)
        if shared is None or shared[0] is not offs:
            tb = cls.tok_bytes
            reg = _steps(r, pd * tb, -o0 * tb)
            reg[0] = 0
            src = (reg[None, :] + offs[:, None]).reshape(-1)
            lens = np.empty((e, r), dtype=np.int64)
            lens[:] = full[2][0]
            lens[:, 0] = first[2][0]
            if r > 1:
                lens[:, -1] = last[2][0]
            ln = lens.reshape(-1)
            src.flags.writeable = False
            ln.flags.writeable = False
            shared = (offs, src, ln)
            cls.remember_shape(key, shared)
        return cls.entry_column(r), shared[1], out.reshape(-1), shared[2]
    reg, dst, ln = class_packed_runs(cls, dst_pages, n, l0)
    r = reg.shape[0]
    blk = np.empty((3, e, r), dtype=np.int64)
    np.add(reg[None, :], offs[:, None], out=blk[0])
    blk[1] = dst[None, :]
    blk[2] = ln[None, :]
    flat = blk.reshape(3, -1)
    return cls.entry_column(r), flat[0], flat[1], flat[2]


def pack_group(
    st: ChunkState,
    pair: Pair,
    cls: EntryClass,
    offsets: np.ndarray,
    first: int,
    n: int,
    l0: int,
    tokens: dict[tuple[int, int], np.ndarray],
) -> PackGroup:
    """The gather of ``cls`` for the rank's tokens (see :class:`pdplug.kvtypes.PackGroup`).

    :param offsets: int64 ``[E]`` byte offset of each entry's block from the pack-buffer base.
    :param tokens: token offsets already built for this rank, keyed by ``(page stride, token
        stride)`` in units (shared by classes with one source geometry).
    """
    key = (cls.s_ps // cls.unit, cls.s_ts // cls.unit)
    tok = tokens.get(key)
    if tok is None:
        tok = src_offsets(st, pair.src_page, first, pair.dcp, n, *key)
        tokens[key] = tok
    return PackGroup(
        entries=cls.entries_t,
        offsets=offsets,
        tokens=tok,
        cols=cls.cols_t,
        row_bytes=cls.w,
        unit=cls.unit,
        page_tokens=cls.d_page if cls.head_major else 0,
        first_offset=l0 % cls.d_page,
    )
