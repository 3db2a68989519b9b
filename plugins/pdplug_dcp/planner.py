"""The ``dcp`` pack planner and the ``tp`` direct planner (pure numpy; no torch import).

Maps any supported prefill layout to any supported decode layout with the fewest merged runs
(:mod:`pdplug.kvtypes` describes the memory model): NHD, HND (fused K|V or split K/V) and MLA
latents, NHD <-> HND, TP ratios both ways (each decode TP rank receives exactly its heads, each
head once: :mod:`pdplug.heads`), page-size ratios both ways, composed with DCP interleave
(decode token ``i`` on DCP rank ``i % D`` at local offset ``i // D``; SGLang
``build_dcp_token_transfer_plan``, PRs #35762 / #40376) and pack capacity.

Two plan shapes (:mod:`pdplug_dcp.direct`, :mod:`pdplug_dcp.packed`):

* **direct** — runs from source entries to destination entries, merged where both sides are
  contiguous; chosen when packing would not reduce the runs (same layout, HND head ranges at
  equal page size, or a destination that is itself strided per token such as NHD at TP 2:1).
* **packed** — the rank's bytes are gathered into its pack region in destination order
  (sub-rows of heads or whole rows), then one run per destination-contiguous range. Chosen for
  every DCP destination (``dcp_size > 1``) and, at ``dcp_size == 1``, whenever it gives fewer
  runs than direct (NHD <-> HND, NHD at TP 1:2, HND with a page ratio …), decided once per
  layout pair on a probe chunk (:meth:`DcpPlanner.needs_relayout`).

Draft (spec-decode) entries are not sharded: every DCP rank receives every token, in virtual
pages of ``page_size * dcp_size`` tokens, read directly from the source entry (never packed).

Regions, capacity and double buffering: see :mod:`pdplug.packing`. A shard larger than its
region raises :class:`pdplug.CapacityError`; there is no per-token fallback. ``plan(...,
region=None)`` on a relayout pair is the explicit unpacked baseline (benchmarks).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import msgspec
import numpy as np

from pdplug import KVLayout, PlanError, PlannerConfig
from pdplug.packing import region_capacity_tokens
from pdplug.protocols import Packer
from pdplug.types import DirectPages, PackGroup, PackRegion, SendChunk, TransferPlan
from pdplug_dcp.chunks import ChunkState, chunk_state
from pdplug_dcp.direct import class_runs, expand_entries, whole_page_runs
from pdplug_dcp.packed import (
    PackedShape,
    check_capacity,
    class_packed_runs,
    dst_offsets,
    packed_shape,
    rank_block,
    ranks_tokens,
)
from pdplug_dcp.pairs import Pair, pair_of

__all__ = ["DcpPlanner", "TpPlanner", "make_dcp_planner", "make_tp_planner"]

_EMPTY = np.zeros(0, dtype=np.int64)
_EMPTY.flags.writeable = False
#: byte runs ``(entry, src_offset, dst_offset, length)``
Runs = tuple[np.ndarray, ...]
_NONE: Runs = (_EMPTY, _EMPTY, _EMPTY, _EMPTY)
_NOT_OWN = tuple([False] * d for d in range(65))  # no rank has its own page list (read only)


def _cat(parts: Sequence[Runs]) -> Runs:
    keep = [x for x in parts if x[0].shape[0]]
    if not keep:
        return _NONE
    if len(keep) == 1:
        return keep[0]
    return tuple(np.concatenate(c) for c in zip(*keep))


def _draft_runs(st: ChunkState, pair: Pair) -> Runs:
    """Runs of every draft entry (the same for every DCP rank)."""
    if not pair.drafts:
        return _NONE
    parts: list[Runs] = []
    for cls in pair.drafts:
        t = class_runs(st, cls, pair.src_page, st.dst_pages, st.rel0)
        parts.append(expand_entries(cls.entries, *t))
    return _cat(parts)


class DcpPlanner:
    """``dcp`` pack planner (see module docstring); satisfies
    :class:`pdplug.protocols.PackPlanner`. Pure and thread-safe: its only state is the cache
    of checked layout pairs."""

    name = "dcp"

    def __init__(self, config: PlannerConfig | None = None) -> None:
        self.config = config or PlannerConfig()
        if self.config.packer not in ("auto", "torch", "triton"):
            raise ValueError(
                f"PlannerConfig.packer must be 'auto', 'torch' or 'triton', got "
                f"{self.config.packer!r}"
            )
        self._last: tuple[KVLayout, KVLayout, Pair] | None = None
        self._state: tuple[SendChunk, tuple[int, int, int], ChunkState] | None = None

    # ------------------------------------------------------------------ Protocol

    def needs_relayout(self, src: KVLayout, dst: KVLayout) -> bool:
        """Whether sends from ``src`` to ``dst`` are packed: always for a DCP destination with
        an entry to shard (draft entries alone are copied whole); at ``dcp_size == 1`` when a
        packed probe chunk needs fewer runs than a direct one.

        :raises PlanError: the layouts do not correspond (see :meth:`plan`).
        """
        pair = self._pair(src, dst)
        return self._relayout(pair)

    def direct_pages(self, src: KVLayout, dst: KVLayout) -> DirectPages | None:
        """The closed form of this pair's direct plans (:class:`pdplug.types.DirectPages`),
        for the commonest pair only: one class of whole rows at equal page sizes, no DCP, no
        draft entries (the pair :meth:`plan` plans with ``whole_page_runs``); ``None`` for
        every other pair, and for a pair that is packed (:meth:`needs_relayout`).

        :raises PlanError: the layouts do not correspond (see :meth:`plan`).
        """
        pair = self._pair(src, dst)
        if pair.dcp != 1 or pair.drafts or len(pair.main) != 1 or self._relayout(pair):
            return None
        cls = pair.main[0]
        ps = pair.src_page
        if not (
            ps == pair.dst_page == cls.d_page
            and len(cls.cols_t) == 1
            and cls.w == cls.s_ts == cls.d_ts
            and cls.entries.shape[0]
        ):
            return None
        return DirectPages(
            page_size=ps,
            entries=tuple(int(e) for e in cls.entries.tolist()),
            src_page_bytes=int(cls.s_ps),
            dst_page_bytes=int(cls.d_ps),
            src_offset=int(cls.cols_t[0]),
            dst_offset=int(cls.d_cols[0]),
            row_bytes=int(cls.w),
        )

    def capacity_tokens(self, src: KVLayout, dst: KVLayout, region_nbytes: int) -> int:
        """Tokens (per destination rank) a region of ``region_nbytes`` bytes holds: bytes over
        the source's packed bytes per token, floored to whole source pages. The matching send
        bound is ``capacity * dst.dcp_size`` (:func:`pdplug.packing.send_capacity_tokens`).

        :raises PlanError: the layouts do not correspond.
        """
        self._pair(src, dst)
        return region_capacity_tokens(src, region_nbytes)

    def plan(
        self,
        chunk: SendChunk,
        src: KVLayout,
        dst: KVLayout,
        dst_dcp_rank: int,
        region: PackRegion | None = None,
    ) -> TransferPlan:
        """Plan the writes of ``chunk`` from prefill rank ``src`` to decode rank ``dst`` (its
        ``tp_rank``), DCP rank ``dst_dcp_rank``.

        Packed when :meth:`needs_relayout` and ``region`` is given (offsets of region runs
        include ``region.offset``); direct otherwise. A prefill rank that holds none of the
        decode rank's heads gets a plan with no run and no token.

        :raises PlanError: page sizes that do not divide one another, an entry whose content
            or head bytes differ, heads that cannot be routed, unaligned ``decode_prefix_len``,
            too few source or destination pages, ``dst_dcp_rank`` out of range.
        :raises CapacityError: the rank's shard exceeds ``region.capacity_tokens`` (or its
            bytes exceed ``region.nbytes``); names room, rank, tokens and capacity.
        """
        pair = self._pair(src, dst)
        if region is None and dst_dcp_rank == 0:
            runs = whole_page_runs(chunk, pair)  # the commonest pair in a few array operations
            if runs is not None:
                return _transfer_plan(chunk, 0, chunk.num_tokens, False, runs, None, _EMPTY,
                                      pair, ())  # fmt: skip
        st = chunk_state(chunk, pair)
        return self._plan_rank(
            st, pair, dst_dcp_rank, region, _draft_runs(st, pair) if pair.drafts else _NONE
        )

    def plan_all(
        self,
        chunk: SendChunk,
        src: KVLayout,
        dst: KVLayout,
        regions: Sequence[PackRegion | None] | None = None,
        dst_pages: Sequence[np.ndarray] | None = None,
    ) -> list[TransferPlan]:
        """Plans for every destination DCP rank ``0 .. dst.dcp_size - 1`` (shared work done once).

        :param regions: one region per rank (``regions[r]``), or None for direct plans.
        :param dst_pages: per-rank destination page lists when decode ranks' DestInfos differ;
            default ``chunk.dst_pages`` for every rank.
        :raises PlanError, CapacityError: as :meth:`plan`.
        """
        pair = self._pair(src, dst)
        d = dst.dcp_size
        if regions is not None and len(regions) != d:
            raise PlanError(f"regions has {len(regions)} items, expected dst dcp_size={d}")
        if dst_pages is not None and len(dst_pages) != d:
            raise PlanError(f"dst_pages has {len(dst_pages)} items, expected dst dcp_size={d}")
        # the TP ranks of one decode instance are planned from one chunk (the sender shares it)
        geo = (pair.src_page, pair.dst_page, d)
        last = self._state
        if last is not None and last[0] is chunk and last[1] == geo:
            base = last[2]
        else:
            base = chunk_state(chunk, pair)
            self._state = (chunk, geo, base)
        # decode ranks of one instance usually send equal page lists: validate once
        own = _NOT_OWN[d] if d < len(_NOT_OWN) else [False] * d
        if dst_pages is not None:
            # a plan reads only the (virtual) pages its tokens fall in: compare those
            vp = pair.dst_page * d
            lo, hi = base.rel0 // vp, -(-(base.rel0 + base.nt) // vp)
            key = base.dst_pages[lo:hi].tobytes()
            own = [
                p is not chunk.dst_pages
                and (len(p) < hi or np.asarray(p[lo:hi], dtype=np.int64).tobytes() != key)
                for p in dst_pages
            ]
        if (
            regions is not None
            and (dst_pages is None or not any(own))
            and len(pair.main) == 1
            and not pair.drafts
            and self._relayout(pair)
        ):
            fast = _packed_ranks(base, pair, regions)
            if fast is not None:
                return fast
        drafts = _draft_runs(base, pair)
        out = []
        for r in range(d):
            st, dr = base, drafts
            if own[r]:
                assert dst_pages is not None
                st = chunk_state(msgspec.structs.replace(chunk, dst_pages=dst_pages[r]), pair)
                dr = _draft_runs(st, pair)
            out.append(self._plan_rank(st, pair, r, regions[r] if regions else None, dr))
        return out

    def packer(self, device: str = "cpu", kind: str = "auto") -> Packer:
        """The packer for ``device``: Triton on CUDA, torch otherwise (``kind`` overrides;
        ``"auto"`` defers to ``PlannerConfig.packer``).

        :raises ValueError: unknown ``kind``.
        :raises RuntimeError: ``kind="triton"`` and triton cannot be imported.
        """
        from pdplug_dcp.packers import make_packer

        return make_packer(
            device, self.config.packer if kind == "auto" else kind, self.config.pack_threads
        )

    # ------------------------------------------------------------------ internals

    def _pair(self, src: KVLayout, dst: KVLayout) -> Pair:
        last = self._last  # a sender passes the same two layout objects with every plan
        if last is not None and last[0] is src and last[1] is dst:
            return last[2]
        pair = pair_of(src, dst)
        self._last = (src, dst, pair)
        return pair

    def _relayout(self, pair: Pair) -> bool:
        if not pair.main:
            return False
        if pair.dcp > 1:
            return True
        if not pair._probe:
            pair._probe.append(_packing_helps(pair))
        return pair._probe[0]

    def _plan_rank(
        self,
        st: ChunkState,
        pair: Pair,
        rank: int,
        region: PackRegion | None,
        drafts: Runs,
    ) -> TransferPlan:
        c = st.chunk
        d = pair.dcp
        if not 0 <= rank < d:
            raise PlanError(f"room {c.room}: dst_dcp_rank={rank} not in [0, dcp_size={d})")
        # rank r of d owns chunk tokens first, first + d, ... (n of them), stored from local
        # offset l0 (see pdplug_dcp.chunks)
        first = (rank - st.rel0) % d
        n = (st.nt - first + d - 1) // d if st.nt > first and pair.main else 0
        l0 = (st.rel0 + first) // d
        groups: tuple[PackGroup, ...] = ()
        slots = _EMPTY
        runs = _NONE
        packed = region is not None and self._relayout(pair)
        if packed:
            assert region is not None
            if n > region.capacity_tokens or n * pair.pack_bpt > region.nbytes:
                check_capacity(st, pair, rank, n, region)  # raises, naming the values
            if n and len(pair.main) == 1:  # the usual case: one class, nothing to concatenate
                runs, g, whole = rank_block(st, pair, pair.main[0], first, n, l0, region.offset)
                groups = (g,)
                if whole:  # whole-row gathers index token slots
                    slots = g.tokens
            elif n:
                runs, groups, slots = _packed_rank(st, pair, first, n, l0, region)
        elif n:
            runs = _cat(
                [
                    expand_entries(
                        cls.entries,
                        *class_runs(st, cls, pair.src_page, st.dst_pages, l0, first, d, n),
                    )
                    for cls in pair.main
                ]
            )
        if drafts[0].shape[0]:
            runs = _cat([runs, drafts])
        return _transfer_plan(
            c, rank, n, packed, runs, region if packed else None, slots, pair, groups
        )


def _packed_ranks(
    st: ChunkState, pair: Pair, regions: Sequence[PackRegion | None]
) -> list[TransferPlan] | None:
    """Packed plans of every DCP rank for the usual pair (one class, no draft entries, equal
    page lists, every rank with a token): the ranks share their destination offsets and
    their source page bases, so the per-rank work is one row of token offsets (all ranks'
    rows in one add) and two structs. None when the shape needs the general path."""
    c = st.chunk
    d = pair.dcp
    cls = pair.main[0]
    pd = cls.d_page
    vp = pd * d
    # the ranks' shapes depend on the chunk's position inside a virtual page, its length, the
    # source offset and the regions only: the segments of a send repeat a few of them
    key = (st.rel0 % vp, st.nt, st.s0, *map(id, regions))
    memo: dict[tuple[int, ...], Any] | None = cls._reuse.get("ranks")
    if memo is None:
        memo = cls._reuse["ranks"] = {}
    hit = memo.get(key)
    if hit is None:  # an entry keeps its regions alive: their ids in the key are not reused
        hit = (tuple(regions), _rank_shapes(st, pair, regions))
        if len(memo) >= 64:
            memo.clear()
        memo[key] = hit
    found = hit[1]
    if found is None:
        return None
    firsts, n, dq0, o0, shapes = found
    q0 = st.rel0 // vp + dq0
    sh0 = shapes[0]
    dst = dst_offsets(st, cls, sh0, n, o0, q0)
    toks = ranks_tokens(st, cls, shapes, n, firsts)
    room, chunk_id, last = c.room, c.chunk_id, c.is_last
    entries, row_bytes = pair.pack_entries, pair.pack_row_bytes
    # inlined _transfer_plan / shape_group: this runs for every plan of every segment
    g_entries, g_cols, w, unit = cls.entries_t, cls.cols_t, cls.w, cls.unit
    page_tokens = pd if cls.head_major else 0
    out = []
    for rank, sh in enumerate(shapes):
        tok = toks[rank]
        group = PackGroup(entries=g_entries, offsets=sh.offs, tokens=tok, cols=g_cols,
                          row_bytes=w, unit=unit, page_tokens=page_tokens,
                          first_offset=o0)  # fmt: skip
        out.append(
            TransferPlan(
                room=room,
                chunk_id=chunk_id,
                is_last=last,
                dst_dcp_rank=rank,
                num_tokens=n,
                packed=True,
                entry=sh.ecol,
                src_offset=sh.src,
                dst_offset=dst,
                length=sh.lens,
                region=regions[rank],
                pack_src_slots=tok if sh.whole_rows else _EMPTY,
                pack_entries=entries,
                pack_row_bytes=row_bytes,
                pack_groups=(group,),
            )
        )
    return out


def _rank_shapes(
    st: ChunkState, pair: Pair, regions: Sequence[PackRegion | None]
) -> tuple[tuple[int, ...], int, int, int, list[PackedShape]] | None:
    """For :func:`_packed_ranks`: every rank's first token, the common token count, first
    destination page (from the chunk's virtual page) and in-page offset, and each rank's
    packed shape; None when a rank has no token or no region, or the ranks differ in count,
    page or offset, or a shape needs the general token path.

    :raises CapacityError: a rank's tokens exceed its region.
    """
    d = pair.dcp
    cls = pair.main[0]
    pd = cls.d_page
    rel0, nt, s0 = st.rel0, st.nt, st.s0
    m = rel0 % (pd * d)
    firsts = tuple((r - rel0) % d for r in range(d))
    n = (nt - firsts[0] + d - 1) // d if nt > firsts[0] else 0
    shapes = []
    where = set()
    for rank in range(d):
        region, first = regions[rank], firsts[rank]
        cnt = (nt - first + d - 1) // d if nt > first else 0
        if region is None or cnt == 0 or cnt != n:
            return None
        if n > region.capacity_tokens or n * pair.pack_bpt > region.nbytes:
            check_capacity(st, pair, rank, n, region)  # raises, naming the values
        loc = (m + first) // d  # local offset from the chunk's first virtual page
        o0 = loc % pd
        sh = cls._shapes.get((n, first, o0, s0, region.offset))
        if sh is None:
            sh = packed_shape(cls, pair, n, first, o0, s0, region.offset)
        if not sh.tok_pages:
            return None
        shapes.append(sh)
        where.add((loc // pd, o0))
    if len(where) != 1:
        return None
    ((dq0, o0),) = where
    return firsts, n, dq0, o0, shapes


def _transfer_plan(
    c: SendChunk,
    rank: int,
    n: int,
    packed: bool,
    runs: Runs,
    region: PackRegion | None,
    slots: np.ndarray,
    pair: Pair,
    groups: tuple[PackGroup, ...],
) -> TransferPlan:
    """One rank's plan of chunk ``c`` from its runs ``(entry, src, dst, length)``."""
    return TransferPlan(
        room=c.room,
        chunk_id=c.chunk_id,
        is_last=c.is_last,
        dst_dcp_rank=rank,
        num_tokens=n,
        packed=packed,
        entry=runs[0],
        src_offset=runs[1],
        dst_offset=runs[2],
        length=runs[3],
        region=region,
        pack_src_slots=slots,
        pack_entries=pair.pack_entries if packed else (),
        pack_row_bytes=pair.pack_row_bytes if packed else (),
        pack_groups=groups,
    )


def _packed_rank(
    st: ChunkState, pair: Pair, first: int, n: int, l0: int, region: PackRegion
) -> tuple[Runs, tuple[PackGroup, ...], np.ndarray]:
    """Runs, pack groups and token slots of one rank's packed plan (``n > 0``) with several
    classes."""
    tokens: dict[tuple[int, int], np.ndarray] = {}
    parts: list[Runs] = []
    groups: list[PackGroup] = []
    for cls in pair.main:  # a few classes at most
        runs, g, _ = rank_block(st, pair, cls, first, n, l0, region.offset, tokens)
        parts.append(runs)
        groups.append(g)
    # whole-row gathers index token slots; sub-row gathers leave the slots to their groups
    slots = tokens.get((pair.src_page, 1), _EMPTY)
    return _cat(parts), tuple(groups), slots


def _packing_helps(pair: Pair) -> bool:
    """Whether a packed probe chunk (two pages of the larger page size, page ids never
    adjacent) needs fewer runs than a direct one (``dcp_size == 1``)."""
    ps, pd = pair.src_page, pair.dst_page
    nt = 2 * max(ps, pd)
    chunk = SendChunk(
        room=0,
        src_pages=2 * np.arange(nt // ps + 1, dtype=np.int64),
        dst_pages=2 * np.arange(nt // pd + 1, dtype=np.int64),
        num_tokens=nt,
    )
    st = chunk_state(chunk, pair)
    direct = sum(class_runs(st, c, ps, st.dst_pages, 0)[0].shape[0] for c in pair.main)
    packed = sum(class_packed_runs(c, st.dst_pages, nt, 0)[0].shape[0] for c in pair.main)
    return packed < direct


class TpPlanner(DcpPlanner):
    """``tp`` planner: direct plans only (no packing; ``region`` is ignored), for decode
    ``dcp_size == 1``; TP and page ratios and NHD/HND are still mapped, run by run.
    ``plan``/``plan_all`` raise :class:`PlanError` for a DCP destination."""

    name = "tp"

    def needs_relayout(self, src: KVLayout, dst: KVLayout) -> bool:
        """Always False: this planner never packs."""
        return False

    def _relayout(self, pair: Pair) -> bool:
        return False

    def _pair(self, src: KVLayout, dst: KVLayout) -> Pair:
        if dst.dcp_size != 1:
            raise PlanError(
                f"'tp' planner needs destination dcp_size 1, got {dst.dcp_size}; "
                "select the 'dcp' pack planner"
            )
        return pair_of(src, dst)


def make_dcp_planner(config: PlannerConfig | None = None) -> DcpPlanner:
    """Factory of the ``dcp`` pack planner (entry point ``pdplug_dcp.planner:make_dcp_planner``).

    :raises ValueError: ``config.packer`` is not ``auto``/``torch``/``triton``.
    """
    return DcpPlanner(config)


def make_tp_planner(config: PlannerConfig | None = None) -> TpPlanner:
    """Factory of the ``tp`` planner (entry ``pdplug_dcp.planner:make_tp_planner``)."""
    return TpPlanner(config)
