"""The ``dcp`` pack planner and the ``tp`` identity planner (pure numpy; no torch import).

DCP rule (SGLang ``build_dcp_token_transfer_plan``, PR #35762 / #40376; prior-art sglang.md
§3.1-3.4): decode logical token ``i`` lives on DCP rank ``i % D`` at local offset ``i // D``;
decode allocates virtual pages of ``P * D`` tokens whose id is the same local physical page id
on every rank. For a chunk covering tokens ``decode_prefix_len + rel`` (``rel`` from
``src_page_offset * P``), rank ``r`` owns ``rel ≡ r (mod D)``; its tokens are consecutive
locally (``rel // D``), so once gathered densely into a pack region they reach the destination
as one run per destination page and entry instead of one per token.

Draft (spec-decode) entries are not sharded: every rank receives every token, in virtual pages
of ``P * D`` tokens, read directly from the source entry (never packed).

Regions, capacity and double buffering: see :mod:`pdplug.packing`. In short, a sender cuts
its registered pack buffer into ``pack_regions(src, dst_dcp_size=D, depth=2, ...)``, splits
each send at ``send_capacity_tokens(region, D)``, and plans segment ``k`` for rank ``r`` into
region ``region_index(r, k, 2)``: segment ``k + 1`` is packed into the other slot while
segment ``k``'s writes are in flight, and a slot is repacked only after the write that read it
completed. A shard larger than its region raises :class:`pdplug.CapacityError`; there is no
per-token fallback. ``plan(...,
region=None)`` on a relayout is the explicit per-token baseline (one run per token per entry),
used only by benchmarks.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence

import msgspec
import numpy as np

from pdplug import KVLayout, PlanError, PlannerConfig
from pdplug.errors import CapacityError
from pdplug.layout import entry_map
from pdplug.packing import merge_runs, pack_bytes_per_token, region_capacity_tokens
from pdplug.protocols import Packer
from pdplug.types import PackRegion, SendChunk, TransferPlan

__all__ = [
    "DcpPlanner",
    "TpPlanner",
    "make_dcp_planner",
    "make_tp_planner",
    "Geometry",
    "EntrySet",
    "geometry",
    "checked_geometry",
]

_EMPTY = np.zeros(0, dtype=np.int64)
_EMPTY.flags.writeable = False
_COL_MAX_BYTES = 64 << 10  # largest cached entry column (8,192 runs)
_COLS_BUDGET = 1 << 20  # cached entry columns per entry set, in bytes


class EntrySet(msgspec.Struct, frozen=True):
    """A set of source entries expanded together into byte runs.

    :ivar entries: int64 ``[E]`` source entry indices.
    :ivar bpt: int64 ``[E]`` their bytes per token.
    """

    entries: np.ndarray
    bpt: np.ndarray
    _entry_cols: dict[int, np.ndarray] = {}

    def entry_column(self, runs: int) -> np.ndarray:
        """Read-only int64 ``[E * runs]``: each entry repeated ``runs`` times (entry-major;
        cached, shared by every plan with that many token runs)."""
        col = self._entry_cols.get(runs)
        if col is None:
            col = np.repeat(self.entries, runs)
            col.flags.writeable = False
            # packed plans repeat a few run counts (pages per region); per-token and identity
            # plans vary theirs per chunk, so only small columns are kept, up to a byte budget
            if col.nbytes <= _COL_MAX_BYTES and self._cached_bytes() + col.nbytes <= _COLS_BUDGET:
                self._entry_cols[runs] = col
        return col

    def _cached_bytes(self) -> int:
        # list() copies under the GIL: other senders' pack threads may insert meanwhile
        return sum(c.nbytes for c in list(self._entry_cols.values()))

    @classmethod
    def of(cls, entries: np.ndarray, bpt: np.ndarray) -> EntrySet:
        """Build (arrays are made read-only)."""
        for a in (entries, bpt):
            a.flags.writeable = False
        return cls(entries, bpt, {})


class Geometry(msgspec.Struct, frozen=True):
    """Checked source->destination geometry (cached per layout pair).

    :ivar page_size: tokens per physical page (both sides).
    :ivar dcp: destination DCP size.
    :ivar emap: int64 ``[E_src]`` destination entry of each source entry.
    :ivar sharded/draft: source entries that are packed / copied whole (draft).
    :ivar every: all source entries (identity plans).
    :ivar pack_cum: int64 bytes per token before each sharded entry in a region.
    :ivar pack_bpt: bytes per token of all sharded entries together.
    :ivar pack_entries/pack_row_bytes: the sharded entries and their sizes as tuples.
    :ivar uniform_bpt: the sharded entries' common bytes per token, 0 when they differ.
    """

    page_size: int
    dcp: int
    emap: np.ndarray
    sharded: EntrySet
    draft: EntrySet
    every: EntrySet
    pack_cum: np.ndarray
    pack_bpt: int
    pack_entries: tuple[int, ...]
    pack_row_bytes: tuple[int, ...]
    uniform_bpt: int


_BY_ID: dict[tuple[int, int], tuple[KVLayout, KVLayout, Geometry]] = {}


def geometry(src: KVLayout, dst: KVLayout) -> Geometry:
    """:func:`checked_geometry`, memoised: a sender passes the same two layout objects with
    every plan, so they are looked up by identity first (no hash of their entry tuples); the
    entry keeps both objects alive, so an id is never reused while it is cached.

    :raises PlanError: as :func:`checked_geometry`.
    """
    hit = _BY_ID.get((id(src), id(dst)))
    if hit is not None and hit[0] is src and hit[1] is dst:
        return hit[2]
    g = checked_geometry(src, dst)
    if len(_BY_ID) >= 256:
        _BY_ID.clear()
    _BY_ID[(id(src), id(dst))] = (src, dst, g)
    return g


@functools.lru_cache(maxsize=256)
def checked_geometry(src: KVLayout, dst: KVLayout) -> Geometry:
    """Check that ``src`` (prefill, plain TP) can feed ``dst`` and precompute the mapping.

    :raises PlanError: page sizes differ, the source is DCP-sharded, layers do not map, an
        entry's bytes per token differ (SGLang "geometry differs at entry i"), or draft
        entries do not correspond.
    """
    if src.page_size != dst.page_size:
        raise PlanError(
            f"page_size differs: source {src.page_size} vs destination {dst.page_size} tokens"
        )
    if src.dcp_size != 1:
        raise PlanError(f"source dcp_size must be 1 (plain TP prefill), got {src.dcp_size}")
    try:
        emap = entry_map(src, dst)
    except ValueError as e:
        raise PlanError(f"entry map: {e}") from e
    s_bpt = np.asarray(src.entry_bytes_per_token, dtype=np.int64)
    d_bpt = np.asarray(dst.entry_bytes_per_token, dtype=np.int64)[emap]
    bad = np.flatnonzero(s_bpt != d_bpt)
    if bad.size:
        i = int(bad[0])
        raise PlanError(
            f"geometry differs at source entry {i} (destination entry {int(emap[i])}): "
            f"entry_bytes_per_token {int(s_bpt[i])} vs {int(d_bpt[i])} bytes "
            f"({bad.size} entries differ)"
        )
    d_draft = set(dst.draft_entries)
    mapped = {i for i, j in enumerate(emap.tolist()) if j in d_draft}
    if mapped != set(src.draft_entries):
        raise PlanError(
            f"draft_entries do not correspond: source {sorted(src.draft_entries)} vs "
            f"destination {sorted(dst.draft_entries)} (maps to source {sorted(mapped)})"
        )
    is_draft = np.zeros(src.num_entries, dtype=bool)
    is_draft[list(src.draft_entries)] = True
    sharded = np.flatnonzero(~is_draft).astype(np.int64)
    draft = np.flatnonzero(is_draft).astype(np.int64)
    sb = s_bpt[sharded]
    cum = np.concatenate(([0], np.cumsum(sb)[:-1])).astype(np.int64)
    emap.flags.writeable = False
    cum.flags.writeable = False
    return Geometry(
        page_size=src.page_size,
        dcp=dst.dcp_size,
        emap=emap,
        sharded=EntrySet.of(sharded, sb),
        draft=EntrySet.of(draft, s_bpt[draft]),
        every=EntrySet.of(np.arange(src.num_entries, dtype=np.int64), s_bpt),
        pack_cum=cum,
        pack_bpt=int(sb.sum()),
        pack_entries=tuple(sharded.tolist()),
        pack_row_bytes=tuple(sb.tolist()),
        uniform_bpt=int(sb[0]) if sb.size and (sb == sb[0]).all() else 0,
    )


def _check_chunk(chunk: SendChunk, g: Geometry) -> tuple[np.ndarray, np.ndarray]:
    """Validate a chunk against the geometry; return (src_pages, dst_pages) as int64."""
    p, d = g.page_size, g.dcp
    vp = p * d
    if chunk.decode_prefix_len < 0 or chunk.decode_prefix_len % vp:
        raise PlanError(
            f"room {chunk.room}: decode_prefix_len={chunk.decode_prefix_len} is not a multiple "
            f"of the decode virtual page page_size*dcp_size={p}*{d}={vp} tokens"
        )
    if chunk.src_page_offset < 0 or chunk.num_tokens < 0:
        raise PlanError(
            f"room {chunk.room}: src_page_offset={chunk.src_page_offset} and "
            f"num_tokens={chunk.num_tokens} must be >= 0"
        )
    src_pages = np.asarray(chunk.src_pages, dtype=np.int64)
    dst_pages = np.asarray(chunk.dst_pages, dtype=np.int64)
    n = chunk.num_tokens
    if src_pages.shape[0] * p < n:
        raise PlanError(
            f"room {chunk.room}: num_tokens={n} needs {-(-n // p)} source pages "
            f"(page_size={p}), src_pages has {src_pages.shape[0]}"
        )
    end = chunk.src_page_offset * p + n
    need = -(-end // vp)
    if n and dst_pages.shape[0] < need:
        raise PlanError(
            f"room {chunk.room}: too few destination pages: tokens up to {end} after "
            f"decode_prefix_len={chunk.decode_prefix_len} need {need} virtual pages of {vp} "
            f"tokens, dst_pages has {dst_pages.shape[0]}"
        )
    return src_pages, dst_pages


def _src_slots(src_pages: np.ndarray, p: int, n: int) -> np.ndarray:
    """Source token slots of a chunk's first ``n`` tokens: int64 ``[n]``."""
    npg = -(-n // p)
    return (src_pages[:npg, None] * p + np.arange(p, dtype=np.int64)).reshape(-1)[:n]


def _expand(
    es: EntrySet, tok: np.ndarray, src_base: np.ndarray | int = 0
) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """Token runs -> byte runs of every entry of ``es``, entry-major (all runs of entry 0, then
    of entry 1, ...).

    :param tok: int64 ``[3, R]`` token runs: source start, destination start, length.
    :param src_base: bytes (scalar or int64 ``[E]``) added to every source offset.
    :returns: four int64 ``[E * R]`` arrays ``(entry, src_offset, dst_offset, length)``.
    """
    r = tok.shape[1]
    out = tok[:, None, :] * es.bpt[None, :, None]  # [3, E, R]: inner axis contiguous
    if not (isinstance(src_base, int) and src_base == 0):
        out[0] += np.asarray(src_base, dtype=np.int64).reshape(-1, 1)
    flat = out.reshape(3, -1)
    return es.entry_column(r), flat[0], flat[1], flat[2]


def _merged(src_slots: np.ndarray, dst_slots: np.ndarray, page: int) -> np.ndarray:
    """:func:`merge_runs` as one int64 ``[3, R]`` array."""
    return np.stack(merge_runs(src_slots, dst_slots, page))


def _cat(parts: list[tuple[np.ndarray, ...]]) -> tuple[np.ndarray, ...]:
    parts = [x for x in parts if x[0].shape[0]]
    if not parts:
        return (_EMPTY, _EMPTY, _EMPTY, _EMPTY)
    if len(parts) == 1:
        return parts[0]
    return tuple(np.concatenate(c) for c in zip(*parts))


class _Chunk(msgspec.Struct, frozen=True):
    """Per-chunk state shared by every destination rank's plan."""

    chunk: SendChunk
    src_pages: np.ndarray
    dst_pages: np.ndarray
    slots: np.ndarray | None  # all source token slots (lazily shared)
    draft_runs: tuple[np.ndarray, ...]


@functools.lru_cache(maxsize=64)
def _inpage_offsets(p: int, d: int, npg: int) -> np.ndarray:
    """Read-only int64 ``[d, npg * p / d]``: row ``f`` = in-page offsets ``f, f + d, ...`` of
    ``npg`` consecutive pages (``d`` divides ``p``)."""
    out = np.tile(np.arange(p, dtype=np.int64).reshape(p // d, d).T, (1, npg))
    out.flags.writeable = False
    return out


def _slot_maker(st: _Chunk, g: Geometry) -> Callable[[int, int], np.ndarray]:
    """``(first, n) -> `` gather slots (int64 ``[n]``) of the rank whose first chunk token is
    ``first``: chunk tokens ``first, first + d, ...``. When ``d`` divides the page size that
    rank owns in-page offsets ``first, first + d, ...`` of every page (chunks start on a page),
    so its slots are one add of a cached offset row to its pages' repeated bases."""
    d, p = g.dcp, g.page_size
    nt = st.chunk.num_tokens
    if p % d == 0 and nt:
        npg = -(-nt // p)
        offs = _inpage_offsets(p, d, npg)
        per_page = p // d
        src_pages = st.src_pages

        def divisible(first: int, n: int) -> np.ndarray:
            # the rank's n tokens sit on the first ceil(n / per_page) pages
            bases = (src_pages[: -(-n // per_page)] * p).repeat(per_page)
            return offs[first, :n] + bases[:n]

        return divisible

    def generic(first: int, n: int) -> np.ndarray:
        if st.slots is not None:
            return np.ascontiguousarray(st.slots[first::d])
        o = np.arange(first, nt, d, dtype=np.int64)
        return st.src_pages[o // p] * p + o % p

    return generic


class DcpPlanner:
    """``dcp`` pack planner: plain-TP prefill -> DCP decode relayout (see module docstring).

    Satisfies :class:`pdplug.protocols.PackPlanner`. Pure and thread-safe (the only state is
    an LRU cache of checked layout pairs). With ``dst.dcp_size == 1`` it plans identity runs.
    """

    name = "dcp"

    def __init__(self, config: PlannerConfig | None = None) -> None:
        self.config = config or PlannerConfig()
        if self.config.packer not in ("auto", "torch", "triton"):
            raise ValueError(
                f"PlannerConfig.packer must be 'auto', 'torch' or 'triton', got "
                f"{self.config.packer!r}"
            )

    # ------------------------------------------------------------------ Protocol

    def needs_relayout(self, src: KVLayout, dst: KVLayout) -> bool:
        """True when the destination is DCP-sharded (``dst.dcp_size > 1``) and the source has
        an entry to shard: sends are packed. (Draft entries alone are copied whole, straight
        from the source, without regions.)"""
        return dst.dcp_size > 1 and pack_bytes_per_token(src) > 0

    def capacity_tokens(self, src: KVLayout, dst: KVLayout, region_nbytes: int) -> int:
        """Tokens (per destination rank) a region of ``region_nbytes`` bytes holds: bytes over
        the source's packed bytes per token, floored to whole pages. The matching send bound
        is ``capacity * dst.dcp_size`` (:func:`pdplug.packing.send_capacity_tokens`).

        :raises PlanError: the layouts do not correspond.
        """
        geometry(src, dst)
        return region_capacity_tokens(src, region_nbytes)

    def plan(
        self,
        chunk: SendChunk,
        src: KVLayout,
        dst: KVLayout,
        dst_dcp_rank: int,
        region: PackRegion | None = None,
    ) -> TransferPlan:
        """Plan the writes of ``chunk`` to decode DCP rank ``dst_dcp_rank``.

        Packed when :meth:`needs_relayout` and ``region`` is given: ``pack_src_slots`` (int64
        ``[n]``) are the source slots of the rank's ``n`` tokens; runs go from the region
        (offsets include ``region.offset``) to destination bytes, one per (entry, destination
        page touched). ``region=None`` on a relayout gives the per-token baseline.

        :raises PlanError: geometry mismatch, unaligned ``decode_prefix_len``, too few source
            or destination pages, ``dst_dcp_rank`` out of range.
        :raises CapacityError: the rank's shard exceeds ``region.capacity_tokens`` (or its
            bytes exceed ``region.nbytes``); names room, rank, tokens and capacity.
        """
        g = self._geometry(src, dst)
        return self._plan_rank(self._chunk_state(chunk, g, shared=False), g, dst_dcp_rank, region)

    def plan_all(
        self,
        chunk: SendChunk,
        src: KVLayout,
        dst: KVLayout,
        regions: Sequence[PackRegion | None] | None = None,
        dst_pages: Sequence[np.ndarray] | None = None,
    ) -> list[TransferPlan]:
        """Plans for every destination DCP rank ``0 .. dst.dcp_size - 1`` (shared work done once).

        :param regions: one region per rank (``regions[r]``), or None for unpacked plans.
        :param dst_pages: per-rank destination page lists when decode ranks' DestInfos differ;
            default ``chunk.dst_pages`` for every rank.
        :raises PlanError, CapacityError: as :meth:`plan`.
        """
        g = self._geometry(src, dst)
        d = dst.dcp_size
        for name, seq in (("regions", regions), ("dst_pages", dst_pages)):
            if seq is not None and len(seq) != d:
                raise PlanError(f"{name} has {len(seq)} items, expected dst dcp_size={d}")
        base = self._chunk_state(chunk, g, shared=True)
        if dst_pages is None and d > 1 and regions is not None and None not in regions:
            return self._plan_packed(base, g, list(range(d)), list(regions))  # type: ignore[arg-type]
        out = []
        for r in range(d):
            st = base
            if dst_pages is not None:
                st = self._chunk_state(
                    msgspec.structs.replace(chunk, dst_pages=dst_pages[r]),
                    g,
                    shared=True,
                    like=base,
                )
            out.append(self._plan_rank(st, g, r, regions[r] if regions is not None else None))
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

    def _geometry(self, src: KVLayout, dst: KVLayout) -> Geometry:
        return geometry(src, dst)

    def _chunk_state(
        self, chunk: SendChunk, g: Geometry, *, shared: bool, like: _Chunk | None = None
    ) -> _Chunk:
        src_pages, dst_pages = _check_chunk(chunk, g)
        slots = None
        if like is not None:
            slots = like.slots
        elif shared and g.dcp > 1 and chunk.num_tokens and g.page_size % g.dcp:
            slots = _src_slots(src_pages, g.page_size, chunk.num_tokens)
        draft_runs: tuple[np.ndarray, ...] = (_EMPTY,) * 4
        if g.draft.entries.size and chunk.num_tokens and g.dcp > 1:
            if slots is None:
                slots = _src_slots(src_pages, g.page_size, chunk.num_tokens)
            vp = g.page_size * g.dcp
            rel = chunk.src_page_offset * g.page_size + np.arange(chunk.num_tokens)
            dst = dst_pages[rel // vp] * vp + rel % vp
            draft_runs = _expand(g.draft, _merged(slots, dst, vp))
        return _Chunk(chunk, src_pages, dst_pages, slots, draft_runs)

    def _plan_rank(
        self, st: _Chunk, g: Geometry, rank: int, region: PackRegion | None
    ) -> TransferPlan:
        c = st.chunk
        d, p = g.dcp, g.page_size
        if not 0 <= rank < d:
            raise PlanError(f"room {c.room}: dst_dcp_rank={rank} not in [0, dcp_size={d})")
        if d == 1:
            return self._identity(st, g)
        if region is not None and g.pack_bpt:
            return self._plan_packed(st, g, [rank], [region])[0]
        nt = c.num_tokens
        rel0 = c.src_page_offset * p
        first = (rank - rel0) % d
        n = (nt - first + d - 1) // d if nt > first else 0
        if st.slots is not None:
            slots = st.slots[first::d]
        else:
            o = np.arange(first, nt, d, dtype=np.int64)
            slots = st.src_pages[o // p] * p + o % p
        l0 = (rel0 + first) // d  # local offset of the rank's first token
        shard: tuple[np.ndarray, ...] = (_EMPTY,) * 4
        if n:  # per-token baseline: runs merge only where both sides happen to be contiguous
            loc = np.arange(l0, l0 + n, dtype=np.int64)
            dst_tok = st.dst_pages[loc // p] * p + loc % p
            shard = _expand(g.sharded, _merged(slots, dst_tok, p))
        entry, src_off, dst_off, length = _cat([shard, st.draft_runs])
        return TransferPlan(
            room=c.room,
            chunk_id=c.chunk_id,
            is_last=c.is_last,
            dst_dcp_rank=rank,
            num_tokens=n,
            packed=False,
            entry=entry,
            src_offset=src_off,
            dst_offset=dst_off,
            length=length,
            pack_src_slots=_EMPTY,
        )

    def _plan_packed(
        self, st: _Chunk, g: Geometry, ranks: list[int], regions: list[PackRegion]
    ) -> list[TransferPlan]:
        """Packed plans of ``ranks`` (region ``regions[i]`` for ``ranks[i]``).

        A rank's locals ``[l0, l0 + n)`` are consecutive, so it gets one token run per
        destination page touched (``R`` runs). Per rank: scalar bookkeeping in Python (a loop
        over at most ``dcp_size`` ranks, never over tokens or pages), a ``[3, R]`` token-run
        array, and one broadcast into the ``[3, E, R]`` byte runs.
        """
        c = st.chunk
        d, p = g.dcp, g.page_size
        nt = c.num_tokens
        rel0 = c.src_page_offset * p
        es = g.sharded
        e = es.entries.shape[0]
        uniform = g.uniform_bpt
        slots_of = _slot_maker(st, g)
        plans = []
        for r, rg in zip(ranks, regions):
            first = (r - rel0) % d
            n = (nt - first + d - 1) // d if nt > first else 0
            if n > rg.capacity_tokens or n * g.pack_bpt > rg.nbytes:
                cap = rg.capacity_tokens
                if g.pack_bpt:  # the region's bytes may bind before its token capacity
                    cap = min(cap, rg.nbytes // g.pack_bpt // p * p)
                raise CapacityError(
                    f"room {c.room}: chunk {c.chunk_id} puts {n} tokens on dst DCP rank {r}, "
                    f"pack region {rg.index} holds capacity={cap} tokens ({rg.nbytes} bytes, "
                    f"{g.pack_bpt} bytes/token); split the send at capacity*dcp_size="
                    f"{cap * d} tokens"
                )
            if n:
                l0 = (rel0 + first) // d  # local offset of the rank's first token
                q0, q1 = l0 // p, (l0 + n - 1) // p
                nr, skew = q1 - q0 + 1, l0 - q0 * p
                tok = np.empty((3, nr), dtype=np.int64)
                # region token start of run j: j*p - skew (the first run starts at 0)
                tok[0] = np.arange(-skew, nr * p - skew, p, dtype=np.int64)
                tok[0, 0] = 0
                np.multiply(st.dst_pages[q0 : q1 + 1], p, out=tok[1])
                tok[1, 0] += skew
                tok[2] = p
                tok[2, 0] = min(l0 + n, q0 * p + p) - l0
                if nr > 1:
                    tok[2, -1] = l0 + n - q1 * p
                # source bytes of entry e: region offset + n * (bytes of the entries before e
                # in the region) + token offset * bpt
                ebase = n * g.pack_cum
                ebase += rg.offset
                blk = np.empty((3, e, nr), dtype=np.int64)
                if uniform:  # one multiply on [3, R], then broadcasts straight into blk
                    tok *= uniform
                    np.add(tok[0][None, :], ebase[:, None], out=blk[0])
                    blk[1:] = tok[1:, None, :]
                else:
                    np.multiply(tok[:, None, :], es.bpt[None, :, None], out=blk)
                    blk[0] += ebase[:, None]
                flat = blk.reshape(3, -1)
                runs: tuple[np.ndarray, ...] = (es.entry_column(nr), flat[0], flat[1], flat[2])
                slots = slots_of(first, n)
            else:
                runs, slots = (_EMPTY,) * 4, _EMPTY
            if st.draft_runs[0].shape[0]:
                runs = _cat([runs, st.draft_runs])
            plans.append(
                TransferPlan(
                    room=c.room,
                    chunk_id=c.chunk_id,
                    is_last=c.is_last,
                    dst_dcp_rank=r,
                    num_tokens=n,
                    packed=True,
                    entry=runs[0],
                    src_offset=runs[1],
                    dst_offset=runs[2],
                    length=runs[3],
                    region=rg,
                    pack_src_slots=slots,
                    pack_entries=g.pack_entries,
                    pack_row_bytes=g.pack_row_bytes,
                )
            )
        return plans

    def _identity(self, st: _Chunk, g: Geometry) -> TransferPlan:
        c = st.chunk
        p = g.page_size
        nt = c.num_tokens
        runs: tuple[np.ndarray, ...] = (_EMPTY,) * 4
        if nt:
            # Both sides start on a page boundary and a run never crosses a destination page,
            # so the merged runs are exactly one per page: O(pages), not O(tokens).
            npg = -(-nt // p)
            tok = np.empty((3, npg), dtype=np.int64)
            tok[0] = st.src_pages[:npg] * p
            tok[1] = st.dst_pages[c.src_page_offset : c.src_page_offset + npg] * p
            tok[2] = p
            tok[2, -1] = nt - (npg - 1) * p
            runs = _expand(g.every, tok)
        entry, src_off, dst_off, length = runs
        return TransferPlan(
            room=c.room,
            chunk_id=c.chunk_id,
            is_last=c.is_last,
            dst_dcp_rank=0,
            num_tokens=nt,
            packed=False,
            entry=entry,
            src_offset=src_off,
            dst_offset=dst_off,
            length=length,
            pack_src_slots=_EMPTY,
        )


class TpPlanner(DcpPlanner):
    """``tp`` identity planner: same layout on both sides (decode ``dcp_size == 1``); merged
    contiguous page runs (never crossing a destination page), no packing; ``region`` is
    ignored. ``plan``/``plan_all`` raise :class:`PlanError` for a DCP destination."""

    name = "tp"

    def needs_relayout(self, src: KVLayout, dst: KVLayout) -> bool:
        """Always False: the identity planner never packs."""
        return False

    def _geometry(self, src: KVLayout, dst: KVLayout) -> Geometry:
        if dst.dcp_size != 1:
            raise PlanError(
                f"'tp' planner needs destination dcp_size 1, got {dst.dcp_size}; "
                "select the 'dcp' pack planner"
            )
        return geometry(src, dst)


def make_dcp_planner(config: PlannerConfig | None = None) -> DcpPlanner:
    """Factory of the ``dcp`` pack planner (entry point ``pdplug_dcp.planner:make_dcp_planner``).

    :raises ValueError: ``config.packer`` is not ``auto``/``torch``/``triton``.
    """
    return DcpPlanner(config)


def make_tp_planner(config: PlannerConfig | None = None) -> TpPlanner:
    """Factory of the ``tp`` identity planner (entry ``pdplug_dcp.planner:make_tp_planner``)."""
    return TpPlanner(config)
