"""Checked prefill->decode layout pairs: entry classes, routed heads and sub-row columns
(pure numpy; cached per pair of layout objects).

A *class* is a set of source entries that share one source and one destination geometry
(e.g. every layer's fused K|V entry). Inside a token, a class moves ``C`` *columns*: sub-rows of
``w`` bytes at byte offsets ``s_cols`` (source) and ``d_cols`` (destination) from the token's
offset (``page * page_stride + in-page offset * token_stride``). Columns are the routed heads
(:func:`pdplug.heads.routed_heads`); heads contiguous on both sides merge into one column, so
NHD with equal heads is one whole-row column, as before.

Destination order inside a page decides the pack-region layout and run merging: *token-major*
(all columns of a token, then the next token: NHD rows) or *head-major* (all tokens of a column,
then the next column: HND pages).
"""

from __future__ import annotations

import functools
import math
from itertools import pairwise
from typing import Any

import msgspec
import numpy as np

from pdplug import KVLayout, PlanError
from pdplug.heads import kv_head_range, layout_heads, routed_heads
from pdplug.kvtypes import KVEntry
from pdplug.layout import entry_map

__all__ = ["EntryClass", "Pair", "pair_of", "checked_pair"]

#: bytes of shared plan-shape arrays kept per class
_SHAPE_BUDGET = 4 << 20


def _ro(a: np.ndarray) -> np.ndarray:
    a.flags.writeable = False
    return a


class EntryClass(msgspec.Struct, frozen=True):
    """Source entries moved with one pattern (see module docstring).

    :ivar entries: int64 ``[E]`` source entries.
    :ivar s_ps/s_ts: source page and token strides (bytes).
    :ivar d_ps/d_ts: destination page and token strides (bytes).
    :ivar s_cols/d_cols: int64 ``[C]`` column byte offsets inside a token.
    :ivar w: bytes per column sub-row.
    :ivar d_page: destination page tokens (the virtual page for draft entries).
    :ivar head_major: destination order inside a page is (column, token).
    :ivar unit: bytes dividing ``s_ps``, ``s_ts`` and every ``s_cols``.
    :ivar cum: int64 ``[E]`` bytes per token before each entry in a pack region (main classes).
    """

    entries: np.ndarray
    s_ps: int
    s_ts: int
    d_ps: int
    d_ts: int
    s_cols: np.ndarray
    d_cols: np.ndarray
    w: int
    d_page: int
    head_major: bool
    unit: int
    cum: np.ndarray
    entries_t: tuple[int, ...] = ()
    cols_t: tuple[int, ...] = ()
    _pages: dict[tuple[int, int], tuple[np.ndarray, ...]] = {}
    _ecols: dict[int, np.ndarray] = {}
    _offs: dict[tuple[int, int], np.ndarray] = {}
    _shapes: dict[tuple[int, ...], Any] = {}
    _shape_bytes: list[int] = []
    #: the last destination-offset and token-offset arrays built (see ``packed.rank_block``)
    _reuse: dict[str, Any] = {}
    #: read-only entry and length runs of whole-page plans by (pages, tokens on the last page)
    _whole: dict[tuple[int, int], tuple[np.ndarray, np.ndarray, np.ndarray | None]] = {}

    @property
    def ncols(self) -> int:
        """Columns per token."""
        return int(self.s_cols.shape[0])

    @property
    def tok_bytes(self) -> int:
        """Bytes moved per token per entry."""
        return self.ncols * self.w

    def block_offsets(self, n: int, region_offset: int) -> np.ndarray:
        """Read-only int64 ``[E]``: each entry's block offset from the pack-buffer base for
        ``n`` tokens in a region at ``region_offset`` (cached: sends repeat a few pairs)."""
        key = (n, region_offset)
        out = self._offs.get(key)
        if out is None:
            out = self.cum * n
            out += region_offset
            out.flags.writeable = False
            if len(self._offs) >= 64:
                self._offs.clear()
            self._offs[key] = out
        return out

    def whole_page_runs(
        self, pages: int, tail: int
    ) -> tuple[np.ndarray, np.ndarray, np.ndarray | None]:
        """What a whole-page plan of ``pages`` pages, its last holding ``tail`` tokens, takes
        from its size alone (cached read-only: a sender's sends repeat a few sizes): int64
        ``[E * pages]`` entry ids and run lengths (bytes), entry-major, each run one page of
        ``d_page`` tokens; and with several entries the int64 ``[E * pages]`` page index of
        each run (``tile(arange(pages), E)``: one gather gives every entry's page offsets),
        ``None`` with one entry."""
        key = (pages, tail)
        out = self._whole.get(key)
        if out is None:
            length = np.full(pages, self.d_page * self.w, dtype=np.int64)
            length[-1] = tail * self.w
            e = self.entries.shape[0]
            out = (
                _ro(self.entries.repeat(pages)),
                _ro(np.concatenate((length,) * e) if e > 1 else length),
                _ro(np.tile(np.arange(pages, dtype=np.int64), e)) if e > 1 else None,
            )
            if len(self._whole) >= 64:
                self._whole.clear()
            self._whole[key] = out
        return out

    def remember_shape(self, key: tuple[int, ...], shape: Any, nbytes: int) -> None:
        """Keep the read-only arrays a plan shape shares (``nbytes`` of them), up to a byte
        budget (4 MiB per class; the cache starts over when full; larger shapes are not kept)."""
        if nbytes > _SHAPE_BUDGET:
            return
        used = self._shape_bytes
        if used[0] + nbytes > _SHAPE_BUDGET:
            self._shapes.clear()
            used[0] = 0
        self._shapes[key] = shape
        used[0] += nbytes

    def entry_column(self, runs: int) -> np.ndarray:
        """Read-only int64 ``[E * runs]``: each entry repeated ``runs`` times (entry-major;
        small columns cached, up to a byte budget: packed plans repeat a few run counts)."""
        col = self._ecols.get(runs)
        if col is None:
            col = _ro(np.repeat(self.entries, runs))
            if col.nbytes <= 64 << 10 and sum(c.nbytes for c in list(self._ecols.values())) < (
                1 << 20
            ):
                self._ecols[runs] = col
        return col

    def page_runs(self, o: int, cnt: int) -> tuple[np.ndarray, ...]:
        """Region->destination runs of one destination page holding the rank's ``cnt`` tokens
        from in-page offset ``o``: int64 ``(region offset from the page's block, destination
        offset from the page base, length)``, maximal on the destination side (cached)."""
        hit = self._pages.get((o, cnt))
        if hit is not None:
            return hit
        c, w = self.ncols, self.w
        i = np.arange(cnt, dtype=np.int64)
        if self.head_major:  # (column, token)
            dst = (self.d_cols[:, None] + (o + i)[None, :] * self.d_ts).reshape(-1)
        else:  # (token, column)
            dst = ((o + i)[:, None] * self.d_ts + self.d_cols[None, :]).reshape(-1)
        brk = np.flatnonzero(dst[1:] != dst[:-1] + w) + 1
        starts = np.concatenate(([0], brk))
        lens = np.diff(np.concatenate((starts, [c * cnt]))) * w
        out = (_ro(starts * w), _ro(dst[starts]), _ro(lens))
        if len(self._pages) < 4096:
            self._pages[(o, cnt)] = out
        return out


class Pair(msgspec.Struct, frozen=True):
    """A checked (prefill rank, decode rank) layout pair.

    :ivar src_page/dst_page: page sizes (tokens); ``dcp``: destination DCP size.
    :ivar emap: int64 ``[E_src]`` destination entry of each source entry.
    :ivar heads: routed global heads ``(lo, hi)``, ``(0, 0)`` for whole rows, ``None`` when
        this prefill rank sends this decode rank nothing.
    :ivar main/drafts: classes of the DCP-sharded and the draft entries.
    :ivar pack_entries/pack_row_bytes: sharded entries in region order and their bytes per
        token in the region; ``pack_cum``: int64 bytes per token before each; ``pack_bpt``:
        their sum.
    """

    src_page: int
    dst_page: int
    dcp: int
    emap: np.ndarray
    heads: tuple[int, int] | None
    main: tuple[EntryClass, ...]
    drafts: tuple[EntryClass, ...]
    pack_entries: tuple[int, ...]
    pack_row_bytes: tuple[int, ...]
    pack_cum: np.ndarray
    pack_bpt: int
    _probe: list[bool] = []


def _columns(
    e: int, sg: KVEntry, dg: KVEntry, s_lo: int, d_lo: int, heads: tuple[int, int]
) -> tuple[list[int], list[int], int]:
    """Source and destination byte offsets of the sub-rows entry ``e`` moves, and their width."""
    if sg.content != dg.content:
        raise PlanError(f"source entry {e}: content {sg.content!r} vs destination {dg.content!r}")
    if sg.head_bytes != dg.head_bytes:
        raise PlanError(
            f"geometry differs at source entry {e}: head_bytes {sg.head_bytes} vs "
            f"{dg.head_bytes} bytes (entry_bytes_per_token {sg.heads * sg.head_bytes} vs "
            f"{dg.heads * dg.head_bytes})"
        )
    lo, hi = heads
    if sg.content in ("row", "latent") or lo == hi:
        if sg.heads != dg.heads:
            raise PlanError(f"geometry differs at source entry {e}: heads {sg.heads} vs {dg.heads}")
        g = range(sg.heads)
        return [h * sg.head_stride for h in g], [h * dg.head_stride for h in g], sg.head_bytes
    g = range(lo, hi)
    return (
        [(h - s_lo) * sg.head_stride for h in g],
        [(h - d_lo) * dg.head_stride for h in g],
        sg.head_bytes,
    )


def _make_class(
    entries: list[int], s_ps: int, s_ts: int, d_ps: int, d_ts: int,
    s_cols: list[int], d_cols: list[int], w: int, d_page: int,
) -> EntryClass:  # fmt: skip
    c = len(s_cols)
    if (
        c > 1
        and all(b - a == w for a, b in pairwise(s_cols))
        and all(b - a == w for a, b in pairwise(d_cols))
    ):
        s_cols, d_cols, w, c = s_cols[:1], d_cols[:1], w * c, 1
    if c == 1 or d_cols[-1] + w <= d_ts:
        head_major = False
    elif all(b - a >= (d_page - 1) * d_ts + w for a, b in pairwise(d_cols)):
        head_major = True
    else:
        raise PlanError(
            f"destination entries {entries[:4]}: sub-rows at {d_cols} with token_stride {d_ts} "
            "interleave in a way neither token-major nor head-major"
        )
    unit = math.gcd(s_ps, s_ts, *s_cols)
    return EntryClass(
        entries=_ro(np.asarray(entries, dtype=np.int64)),
        s_ps=s_ps, s_ts=s_ts, d_ps=d_ps, d_ts=d_ts,
        s_cols=_ro(np.asarray(s_cols, dtype=np.int64)),
        d_cols=_ro(np.asarray(d_cols, dtype=np.int64)),
        w=w, d_page=d_page, head_major=head_major, unit=unit,
        cum=_ro(np.zeros(len(entries), dtype=np.int64)),
        entries_t=tuple(entries), cols_t=tuple(s_cols), _pages={}, _ecols={}, _offs={},
        _shapes={}, _shape_bytes=[0], _reuse={},
    )  # fmt: skip


def _classes(
    src: KVLayout,
    dst: KVLayout,
    idx: list[int],
    emap: np.ndarray,
    heads: tuple[int, int],
    s_lo: int,
    d_lo: int,
) -> tuple[EntryClass, ...]:
    groups: dict[tuple[int, int, int, int, tuple[int, ...], tuple[int, ...], int, int], list[int]]
    groups = {}
    for e in idx:
        de = int(emap[e])
        sg, dg = src.entry(e), dst.entry(de)
        s_cols, d_cols, w = _columns(e, sg, dg, s_lo, d_lo, heads)
        key = (sg.page_stride, sg.token_stride, dg.page_stride, dg.token_stride,
               tuple(s_cols), tuple(d_cols), w, dst.page_tokens(de))  # fmt: skip
        groups.setdefault(key, []).append(e)
    return tuple(
        _make_class(es, k[0], k[1], k[2], k[3], list(k[4]), list(k[5]), k[6], k[7])
        for k, es in groups.items()
    )


_BY_ID: dict[tuple[int, int], tuple[KVLayout, KVLayout, Pair]] = {}


def pair_of(src: KVLayout, dst: KVLayout) -> Pair:
    """:func:`checked_pair`, memoised by layout identity first (a sender passes the same two
    objects with every plan; the entry keeps both alive, so an id is never reused).

    :raises PlanError: as :func:`checked_pair`.
    """
    hit = _BY_ID.get((id(src), id(dst)))
    if hit is not None and hit[0] is src and hit[1] is dst:
        return hit[2]
    # a pair does not depend on the decode DCP rank: the ranks of one instance share it
    p = checked_pair(src, msgspec.structs.replace(dst, dcp_rank=0) if dst.dcp_rank else dst)
    if len(_BY_ID) >= 256:
        _BY_ID.clear()
    _BY_ID[(id(src), id(dst))] = (src, dst, p)
    return p


@functools.lru_cache(maxsize=256)
def checked_pair(src: KVLayout, dst: KVLayout) -> Pair:
    """Check that prefill rank ``src`` (no DCP) can feed decode rank ``dst``; build its classes.

    :raises PlanError: page sizes that do not divide one another, a DCP-sharded source, layers
        that do not map, an entry whose content or head bytes differ (SGLang "geometry differs
        at entry i"), draft entries that do not correspond or cross unequal TP, heads that
        cannot be routed between the two TP sizes, or an unsupported destination geometry.
    """
    ps, pd = src.page_size, dst.page_size
    if ps % pd and pd % ps:
        raise PlanError(
            f"page_size: source {ps} vs destination {pd} tokens: neither divides the other"
        )
    if src.dcp_size != 1:
        raise PlanError(f"source dcp_size must be 1 (plain TP prefill), got {src.dcp_size}")
    try:
        emap = entry_map(src, dst)
        heads = routed_heads(src, dst)
    except ValueError as e:
        raise PlanError(str(e)) from e
    d_draft = set(dst.draft_entries)
    mapped = {i for i, j in enumerate(emap.tolist()) if j in d_draft}
    if mapped != set(src.draft_entries):
        raise PlanError(
            f"draft_entries do not correspond: source {sorted(src.draft_entries)} vs "
            f"destination {sorted(dst.draft_entries)} (maps to source {sorted(mapped)})"
        )
    if src.draft_entries and src.tp_size != dst.tp_size:
        raise PlanError(
            f"draft_entries need equal TP: source tp_size {src.tp_size} vs destination "
            f"{dst.tp_size}"
        )
    n_heads = layout_heads(src)
    s_lo = d_lo = 0
    if n_heads:
        s_lo = kv_head_range(n_heads, src.tp_size, src.tp_rank)[0]
        d_lo = kv_head_range(n_heads, dst.tp_size, dst.tp_rank)[0]
    drafts = sorted(src.draft_entries)
    sharded = [e for e in range(src.num_entries) if e not in set(drafts)]
    main: tuple[EntryClass, ...] = ()
    dr: tuple[EntryClass, ...] = ()
    if heads is not None:
        main = _classes(src, dst, sharded, emap, heads, s_lo, d_lo)
    if drafts and src.tp_rank == dst.tp_rank:
        dr = _classes(src, dst, drafts, emap, (0, 0), 0, 0)
    row = {int(e): cls.tok_bytes for cls in main for e in cls.entries}
    pe = tuple(sorted(row))
    rb = tuple(row[e] for e in pe)
    cum = np.concatenate(([0], np.cumsum(rb, dtype=np.int64)[:-1])) if rb else np.zeros(0, np.int64)
    at = {e: int(c) for e, c in zip(pe, cum.tolist())}
    main = tuple(
        msgspec.structs.replace(
            c, cum=_ro(np.asarray([at[e] for e in c.entries_t], dtype=np.int64))
        )
        for c in main
    )
    return Pair(
        src_page=ps,
        dst_page=pd,
        dcp=dst.dcp_size,
        emap=_ro(emap),
        heads=heads,
        main=main,
        drafts=dr,
        pack_entries=pe,
        pack_row_bytes=rb,
        pack_cum=_ro(cum.astype(np.int64)),
        pack_bpt=int(sum(rb)),
        _probe=[],
    )
