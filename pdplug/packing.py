"""Pack-buffer layout, run merging and run addressing shared by planners and KV senders.

Pure numpy helpers (no torch, no plugin imports). The algorithm follows SGLang's DCP packing
(``dcp_pack_buffer_bytes`` / per-rank regions, PRs #35762 and #40376), rewritten for
pdplug's contracts; regions are laid out in destination order (:class:`pdplug.PackGroup`).

Pack buffer and regions
-----------------------
A prefill rank registers one pack buffer and cuts it into ``dst_dcp_size * depth`` regions
(:func:`pack_regions`). Region ``rank * depth + slot`` belongs to destination DCP rank ``rank``;
each region holds ``capacity_tokens`` tokens (page-aligned) of every sharded entry,
layer-major: entry ``e`` of a plan with ``n`` tokens starts at
``region.offset + n * sum(bpt[j] for sharded j before e)``. Regions never overlap, so an
oversized shard cannot overwrite a neighbour: the planner raises :class:`pdplug.CapacityError`
instead. The bound a scheduler splits a send at is :func:`send_capacity_tokens`
(``capacity_tokens * dst_dcp_size``): a segment of at most that many tokens puts at most
``capacity_tokens`` tokens on any DCP rank.

Double buffering (how a KV sender overlaps packing with transfer)
-----------------------------------------------------------------
With ``depth >= 2`` regions per destination rank, segment ``k`` of a send uses slot
``k % depth`` (:func:`region_index` with the segment's ``chunk_id``)::

    regions = pack_regions(src_layout, dst_dcp_size=D, depth=2, region_tokens=cap)
    segments = scheduler.split_send(..., capacity_tokens=send_capacity_tokens(regions[0], D))
    for seg in segments:
        chunk = segment_to_chunk(room, seg, send_pages[seg.page_start:], dst_pages, prefix, P)
        slot = [regions[region_index(r, seg.chunk_id, depth=2)] for r in range(D)]
        wait_until_free(slot)        # the writes posted from them depth segments ago are done
        plans = plan_all_ranks(planner, chunk, src_layout, dst_layout, slot)
        pack_segment(packer, plans, kv_entries, pack_buffer)  # one launch; async: record an event
        for r, plan in enumerate(plans):                      # after the event
            post(run_addresses(plan, src_bases, dst_bases[r], emap, pack_base))

While segment ``k`` is in flight from slot ``k % 2``, segment ``k + 1`` is packed into the
other slot; a sender must not repack a slot before the write that reads it has completed
(engines report completion per posted transfer). ``depth = 1`` serialises pack and transfer.
"""

from __future__ import annotations

import operator
from collections.abc import Sequence
from typing import Any

import msgspec
import numpy as np

from pdplug.protocols import Packer, PackPlanner
from pdplug.types import KVLayout, PackGroup, PackRegion, Segment, SendChunk, TransferPlan

__all__ = [
    "sharded_entries",
    "pack_bytes_per_token",
    "region_capacity_tokens",
    "pack_buffer_nbytes",
    "pack_regions",
    "region_index",
    "send_capacity_tokens",
    "merge_runs",
    "run_addresses",
    "MAX_PAGE_ID",
    "page_array",
    "segment_to_chunk",
    "segment_chunks",
    "pack_groups",
    "group_rows",
    "plan_all_ranks",
    "plan_segment",
    "pack_segment",
]

#: Default byte alignment of every region start (wide loads; RDMA-friendly).
REGION_ALIGN = 256


def sharded_entries(layout: KVLayout) -> tuple[int, ...]:
    """Entries that are DCP-sharded and therefore packed: every entry not in ``draft_entries``."""
    drafts = set(layout.draft_entries)
    return tuple(e for e in range(layout.num_entries) if e not in drafts)


def pack_bytes_per_token(layout: KVLayout) -> int:
    """Bytes one token occupies in a pack region: sum of ``entry_bytes_per_token`` over the
    sharded entries (draft entries are never packed). 0 if every entry is a draft entry."""
    bpt = layout.entry_bytes_per_token
    return sum(bpt[e] for e in sharded_entries(layout))


def _align_up(x: int, a: int) -> int:
    return -(-x // a) * a


def region_capacity_tokens(layout: KVLayout, region_nbytes: int) -> int:
    """Tokens a region of ``region_nbytes`` bytes holds, floored to whole ``layout.page_size``.

    :param layout: the source (prefill) layout whose sharded entries are packed.
    :param region_nbytes: region size in bytes (>= 0).
    :raises ValueError: ``region_nbytes < 0``.
    """
    if region_nbytes < 0:
        raise ValueError(f"region_nbytes must be >= 0, got {region_nbytes}")
    pbpt = pack_bytes_per_token(layout)
    if pbpt == 0:
        return 0
    p = layout.page_size
    return (region_nbytes // pbpt) // p * p


def pack_buffer_nbytes(
    layout: KVLayout,
    *,
    region_tokens: int,
    dst_dcp_size: int,
    depth: int = 2,
    align: int = REGION_ALIGN,
) -> int:
    """Bytes of a pack buffer with ``dst_dcp_size * depth`` regions of ``region_tokens`` tokens.

    ``region_tokens`` is floored to whole pages; each region starts ``align``-aligned.

    :raises ValueError: a non-positive argument, or ``region_tokens`` below one page.
    """
    return _region_stride(layout, region_tokens, dst_dcp_size, depth, align)[1] * (
        dst_dcp_size * depth
    )


def _region_stride(
    layout: KVLayout, region_tokens: int, dst_dcp_size: int, depth: int, align: int
) -> tuple[int, int]:
    for name, v in (("dst_dcp_size", dst_dcp_size), ("depth", depth), ("align", align)):
        if v <= 0:
            raise ValueError(f"{name} must be > 0, got {v}")
    cap = region_tokens // layout.page_size * layout.page_size
    if cap <= 0:
        raise ValueError(
            f"region_tokens={region_tokens} is below one page (page_size={layout.page_size})"
        )
    return cap, _align_up(cap * pack_bytes_per_token(layout), align)


def pack_regions(
    layout: KVLayout,
    *,
    dst_dcp_size: int,
    depth: int = 2,
    region_tokens: int | None = None,
    buffer_nbytes: int | None = None,
    align: int = REGION_ALIGN,
) -> list[PackRegion]:
    """The region table of a pack buffer: ``dst_dcp_size * depth`` disjoint, aligned regions.

    Region ``i = rank * depth + slot`` (see :func:`region_index`) starts at byte
    ``i * stride`` and holds ``capacity_tokens`` tokens of every sharded entry of ``layout``
    (``capacity_tokens * pack_bytes_per_token(layout) <= nbytes``).

    Give exactly one of ``region_tokens`` (tokens per region, floored to whole pages; size the
    buffer with :func:`pack_buffer_nbytes`) or ``buffer_nbytes`` (an existing buffer, split
    evenly; its regions' capacity is floored to whole pages).

    :param layout: the source (prefill) layout.
    :param dst_dcp_size: destination DCP ranks served (>= 1).
    :param depth: regions per destination rank (2 = double buffering).
    :param align: byte alignment of every region start.
    :raises ValueError: both or neither of ``region_tokens``/``buffer_nbytes``, a buffer too
        small for one page per region, or a non-positive argument.
    """
    if (region_tokens is None) == (buffer_nbytes is None):
        raise ValueError(
            "pack_regions: give exactly one of region_tokens and buffer_nbytes, got "
            f"region_tokens={region_tokens}, buffer_nbytes={buffer_nbytes}"
        )
    count = dst_dcp_size * depth
    if buffer_nbytes is not None:
        if dst_dcp_size <= 0 or depth <= 0 or align <= 0:
            raise ValueError(
                f"dst_dcp_size={dst_dcp_size}, depth={depth}, align={align} must all be > 0"
            )
        stride = buffer_nbytes // count // align * align
        cap = region_capacity_tokens(layout, stride)
        if cap <= 0:
            raise ValueError(
                f"buffer_nbytes={buffer_nbytes} gives {stride} bytes per region for "
                f"{count} regions (dst_dcp_size={dst_dcp_size} x depth={depth}): below one page "
                f"({layout.page_size} tokens x {pack_bytes_per_token(layout)} bytes)"
            )
    else:
        assert region_tokens is not None
        cap, stride = _region_stride(layout, region_tokens, dst_dcp_size, depth, align)
    return [
        PackRegion(index=i, offset=i * stride, nbytes=stride, capacity_tokens=cap)
        for i in range(count)
    ]


def region_index(dst_dcp_rank: int, chunk_id: int, depth: int = 2) -> int:
    """Index of the region destination rank ``dst_dcp_rank`` uses for chunk ``chunk_id``:
    ``dst_dcp_rank * depth + chunk_id % depth`` (consecutive chunks alternate slots)."""
    if depth <= 0 or dst_dcp_rank < 0 or chunk_id < 0:
        raise ValueError(
            f"region_index: dst_dcp_rank={dst_dcp_rank}, chunk_id={chunk_id} must be >= 0 and "
            f"depth={depth} > 0"
        )
    return dst_dcp_rank * depth + chunk_id % depth


def send_capacity_tokens(region: PackRegion | int, dst_dcp_size: int) -> int:
    """Largest send segment (tokens) whose shard fits one region on every DCP rank:
    ``capacity_tokens * dst_dcp_size``. Pass this to ``Scheduler.split_send``.

    :param region: a region (or its ``capacity_tokens``).
    """
    cap = region.capacity_tokens if isinstance(region, PackRegion) else int(region)
    if dst_dcp_size <= 0:
        raise ValueError(f"dst_dcp_size must be > 0, got {dst_dcp_size}")
    return cap * dst_dcp_size


def merge_runs(
    src_slots: np.ndarray, dst_slots: np.ndarray, dst_page_tokens: int
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Merge token-to-token copies into runs contiguous on both sides (SGLang
    ``group_concurrent_contiguous``), never crossing a destination page.

    :param src_slots: int64 ``[m]`` source token slots, in copy order.
    :param dst_slots: int64 ``[m]`` destination token slots.
    :param dst_page_tokens: destination page size in tokens (a run never crosses a multiple).
    :returns: int64 ``[R]`` arrays ``(src_start, dst_start, num_tokens)``.
    :raises ValueError: length mismatch or ``dst_page_tokens <= 0``.
    """
    m = src_slots.shape[0]
    if dst_slots.shape[0] != m:
        raise ValueError(f"merge_runs: {m} source slots vs {dst_slots.shape[0]} destination slots")
    if dst_page_tokens <= 0:
        raise ValueError(f"merge_runs: dst_page_tokens must be > 0, got {dst_page_tokens}")
    if m == 0:
        e = np.zeros(0, dtype=np.int64)
        return e, e, e
    d1 = dst_slots[1:]
    brk = (src_slots[1:] != src_slots[:-1] + 1) | (d1 != dst_slots[:-1] + 1)
    brk |= d1 % dst_page_tokens == 0
    starts = np.flatnonzero(brk)
    starts += 1
    starts = np.concatenate(([0], starts))
    ends = np.concatenate((starts[1:], [m]))
    return src_slots[starts], dst_slots[starts], ends - starts


def run_addresses(
    plan: TransferPlan,
    src_entry_base: Sequence[int] | np.ndarray,
    dst_entry_base: Sequence[int] | np.ndarray,
    entry_map: np.ndarray,
    pack_base: int = 0,
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Absolute ``(src_addr, dst_addr, length)`` int64 ``[R]`` descriptors of a plan.

    A run reads ``pack_base + src_offset`` when the plan is packed and the run's entry is in
    ``plan.pack_entries``; otherwise (unpacked plans, and draft entries, which are never
    packed) it reads ``src_entry_base[entry] + src_offset``. It writes
    ``dst_entry_base[entry_map[entry]] + dst_offset``.

    :param src_entry_base: base address of every source entry (``[num source entries]``).
    :param dst_entry_base: base address of every destination entry.
    :param entry_map: int64 source entry -> destination entry (:func:`pdplug.layout.entry_map`).
    :param pack_base: address of the pack buffer (the plan's offsets include the region's).
    """
    # per-entry tables first (a few dozen entries), then one gather per run array
    src_tab = source_table(
        np.asarray(src_entry_base), pack_base, plan.pack_entries if plan.packed else ()
    )
    dst_tab = np.asarray(dst_entry_base, dtype=np.int64)[np.asarray(entry_map)]
    src, dst, length = plan_addresses(plan, src_tab, dst_tab)
    return src, dst, length.copy()


def source_table(
    src_entry_base: np.ndarray, pack_base: int, pack_entries: Sequence[int]
) -> np.ndarray:
    """int64 base address per source entry as a plan reads it: the pack buffer's base for
    ``pack_entries`` (a packed plan's), each entry's own base otherwise (a copy)."""
    tab = np.array(src_entry_base, dtype=np.int64)
    if pack_entries:
        tab[np.asarray(pack_entries, dtype=np.int64)] = pack_base
    return tab


def plan_addresses(
    plan: TransferPlan, src_table: np.ndarray, dst_table: np.ndarray
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """:func:`run_addresses` from per-entry tables a sender keeps (no per-send table work).

    :param src_table: int64 base address per source entry as the plan reads it (the pack
        buffer's base for packed entries of a packed plan).
    :param dst_table: int64 base address per *source* entry's destination entry
        (``dst_entry_base[entry_map]``).
    :returns: int64 ``[R]`` ``(src_addr, dst_addr, length)``; ``length`` is the plan's own
        array (read-only for callers).
    """
    entry = plan.entry
    src = src_table[entry]
    src += plan.src_offset
    dst = dst_table[entry]
    dst += plan.dst_offset
    return src, dst, plan.length


#: page ids at or above this are refused: times a page stride they would overflow int64 byte
#: offsets (and no engine has that many pages)
MAX_PAGE_ID = 1 << 40
_INT64 = np.dtype(np.int64)
_MAX = np.maximum.reduce


def page_array(value: Any, field: str, room: int) -> np.ndarray:
    """``value`` as int64 ``[n]`` page ids, converted without loss (what planners read from a
    :class:`SendChunk`).

    :param field: the field's name in errors (``src_pages``, ``dst_pages``).
    :param room: the request's room, named in errors.
    :raises pdplug.PlanError: (a ``ValueError``) not 1-D, not integers (a float id would be
        truncated silently), or an id outside ``[0, 2**40)`` (named with its exact value,
        unsigned ones above 2**63 included).
    """
    # the send path's own arrays: one reduction (a negative id read as uint64 is huge)
    if (
        type(value) is np.ndarray
        and value.dtype == _INT64
        and value.ndim == 1
        and (not value.shape[0] or int(_MAX(value.view(np.uint64))) < MAX_PAGE_ID)
    ):
        return value
    from pdplug.errors import PlanError

    a = np.asarray(value)
    if a.size == 0:
        return np.zeros(0, dtype=np.int64)
    if a.ndim != 1 or a.dtype.kind not in "iu":
        raise PlanError(
            f"room {room}: {field} must be a 1-D array of integer page ids, got shape "
            f"{a.shape} dtype {a.dtype}"
        )
    out = a if a.dtype == np.int64 else a.astype(np.int64)
    # one reduction: a negative id read as uint64 is above any bound
    if int(np.maximum.reduce(a if a.dtype.kind == "u" else out.view(np.uint64))) >= MAX_PAGE_ID:
        bad = int(a.min()) if int(a.min()) < 0 else int(a.max())
        raise PlanError(f"room {room}: {field} holds page id {bad}, outside [0, 2**40)")
    return out


def segment_to_chunk(
    room: int,
    segment: Segment,
    src_pages: np.ndarray,
    dst_pages: np.ndarray,
    decode_prefix_len: int,
    page_size: int,
) -> SendChunk:
    """The :class:`SendChunk` a planner needs for one scheduler :class:`Segment`.

    :param src_pages: int64 source page ids from the page holding the segment's first token on
        (as ``KVSender.send`` receives them; from a whole send's list pass
        ``send_pages[segment.token_start // page_size:]``). Only the pages the segment's tokens
        occupy are kept.
    :param dst_pages: int64 destination (virtual) page ids from ``decode_prefix_len`` on.
    :param decode_prefix_len: tokens decode already holds (tokens).
    :param page_size: source page size (tokens). A segment may start inside a source page
        when the decode side's page differs (then ``rel_start`` is set).
    :raises ValueError: the segment starts before ``decode_prefix_len``, or ``src_pages`` is
        too short; :func:`page_array`'s errors (``PlanError``) for ids that are not 1-D
        integers in ``[0, 2**40)``.
    """
    start, n = segment.token_start, segment.num_tokens
    rel = start - decode_prefix_len
    if rel < 0 or page_size <= 0:
        raise ValueError(
            f"segment.token_start={start} must be >= decode_prefix_len="
            f"{decode_prefix_len} (page_size={page_size} must be > 0)"
        )
    skip = start % page_size
    need = -(-(skip + n) // page_size) if n else 0
    pages = page_array(src_pages, "src_pages", room)
    if pages.shape[0] < need:
        raise ValueError(
            f"segment of {n} tokens from in-page offset {skip} needs {need} "
            f"source pages (page_size={page_size}), got {pages.shape[0]}"
        )
    aligned = not rel % page_size and not decode_prefix_len % page_size
    return SendChunk(
        room=room,
        src_pages=pages[:need],
        dst_pages=page_array(dst_pages, "dst_pages", room),
        decode_prefix_len=decode_prefix_len,
        src_page_offset=rel // page_size,
        num_tokens=n,
        chunk_id=segment.chunk_id,
        is_last=segment.is_last,
        rel_start=-1 if aligned else rel,
    )


def segment_chunks(
    room: int,
    segment: Segment,
    src_pages: np.ndarray,
    dests: Sequence[tuple[bytes, int]],
    page_size: int,
) -> list[SendChunk]:
    """One :class:`SendChunk` per destination for one segment, as a KV sender builds them:
    destinations that declared the same ``(dst_pages, decode_prefix_len)`` share one chunk
    object (the DCP and TP ranks of one decode instance hold a request in the same block ids),
    so planners tell equal chunks apart by identity instead of comparing page lists.

    :param src_pages: as :func:`segment_to_chunk`.
    :param dests: per destination, its page ids as wire bytes (:func:`pdplug.types.
        pages_to_bytes`: int64 little-endian) and its ``decode_prefix_len`` (tokens).
    :param page_size: source page size (tokens).
    :raises ValueError: as :func:`segment_to_chunk`; page bytes not a multiple of 8.
    """
    from pdplug.types import pages_from_bytes

    made: dict[tuple[bytes, int], SendChunk] = {}
    out = []
    for key in dests:
        chunk = made.get(key)
        if chunk is None:
            chunk = made[key] = segment_to_chunk(
                room, segment, src_pages, pages_from_bytes(key[0]), key[1], page_size
            )
        out.append(chunk)
    return out


def pack_groups(plan: TransferPlan) -> tuple[PackGroup, ...]:
    """The gather of a packed plan: ``plan.pack_groups``, or for a plan in the original form
    (``pack_src_slots`` rows of every pack entry) one whole-row group per entry.

    :raises ValueError: a plan without region, or ``pack_row_bytes`` not matching
        ``pack_entries``.
    """
    if plan.pack_groups:
        return plan.pack_groups
    if plan.region is None or len(plan.pack_row_bytes) != len(plan.pack_entries):
        raise ValueError(
            f"room {plan.room}: packed plan needs a region and pack_row_bytes per pack entry "
            f"(region={plan.region}, {len(plan.pack_row_bytes)} row sizes for "
            f"{len(plan.pack_entries)} entries)"
        )
    slots = np.asarray(
        plan.pack_src_slots if plan.pack_src_slots is not None else [], dtype=np.int64
    )
    n = slots.shape[0]
    off = plan.region.offset
    out = []
    for e, b in zip(plan.pack_entries, plan.pack_row_bytes):
        out.append(
            PackGroup(
                entries=(e,),
                offsets=np.array([off], dtype=np.int64),
                tokens=slots,
                cols=(0,),
                row_bytes=b,
                unit=b,
            )
        )
        off += n * b
    return tuple(out)


def group_rows(group: PackGroup) -> np.ndarray:
    """Source byte offset (from the entry base) of every sub-row of ``group``, in region order:
    int64 ``[n * C]`` (see :class:`pdplug.kvtypes.PackGroup`)."""
    tok = np.asarray(group.tokens, dtype=np.int64) * group.unit
    cols = np.asarray(group.cols, dtype=np.int64)
    c, n, p = cols.shape[0], tok.shape[0], group.page_tokens
    if p == 0 or c == 1 or n == 0:
        return (tok[:, None] + cols[None, :]).reshape(-1)
    cnt0 = min(n, p - group.first_offset)
    parts = [(cols[:, None] + tok[None, :cnt0]).reshape(-1)]
    rest = tok[cnt0:]
    f = rest.shape[0] // p
    if f:
        parts.append((rest[: f * p].reshape(f, 1, p) + cols[None, :, None]).reshape(-1))
    if rest.shape[0] > f * p:
        parts.append((cols[:, None] + rest[None, f * p :]).reshape(-1))
    return np.concatenate(parts)


def plan_all_ranks(
    planner: PackPlanner,
    chunk: SendChunk,
    src: KVLayout,
    dst: KVLayout,
    regions: Sequence[PackRegion | None] | None = None,
) -> list[TransferPlan]:
    """Plans of ``chunk`` for every destination DCP rank ``0 .. dst.dcp_size - 1``.

    Uses the planner's batched ``plan_all(chunk, src, dst, regions)`` when it has one (the
    ``dcp`` planner shares per-chunk work across ranks), else calls ``plan`` per rank.

    :param regions: ``regions[r]`` for rank ``r`` (e.g. ``regions[region_index(r, chunk_id)]``
        of :func:`pack_regions`), or None for unpacked plans.
    :raises pdplug.PlanError: as ``PackPlanner.plan`` (wrong number of regions included).
    """
    from pdplug.errors import PlanError

    d = dst.dcp_size
    if regions is not None and len(regions) != d:
        raise PlanError(f"regions has {len(regions)} items, expected dst dcp_size={d}")
    batched = getattr(planner, "plan_all", None)
    if batched is not None:
        return list(batched(chunk, src, dst, regions))
    return [
        planner.plan(chunk, src, dst, r, regions[r] if regions is not None else None)
        for r in range(d)
    ]


_RANK_FREE: dict[int, tuple[KVLayout, KVLayout]] = {}
_INTERNED: dict[KVLayout, KVLayout] = {}


def _rank_free(layout: KVLayout) -> KVLayout:
    """``layout`` with ``dcp_rank`` 0, one object per distinct value (the decode DCP ranks of
    one instance hand out layouts that differ in ``dcp_rank`` only; plans take the rank
    apart). Memoised by identity; an entry keeps its layout alive, so ids are not reused."""
    hit = _RANK_FREE.get(id(layout))
    if hit is not None and hit[0] is layout:
        return hit[1]
    norm = msgspec.structs.replace(layout, dcp_rank=0) if layout.dcp_rank else layout
    if len(_RANK_FREE) >= 1024:
        _RANK_FREE.clear()
        _INTERNED.clear()
    norm = _INTERNED.setdefault(norm, norm)
    _RANK_FREE[id(layout)] = (layout, norm)
    return norm


def plan_segment(
    planner: PackPlanner,
    src: KVLayout,
    items: Sequence[tuple[SendChunk, KVLayout, int, PackRegion | None]],
) -> list[TransferPlan]:
    """Plans of one segment for every destination ``(chunk, dst_layout, dst_dcp_rank,
    region)`` in ``items``, in item order: what a KV sender plans between two writes.

    ``D`` consecutive items that are DCP ranks ``0 .. D - 1`` of one decode instance and TP
    rank (layouts equal but for ``dcp_rank``) with one chunk (equal but for ``dst_pages``:
    each decode rank sends its own page list) are planned with the planner's batched
    ``plan_all`` when it has one (per-chunk work done once for the ``D`` ranks); the others
    with ``plan``, one item at a time. Plans are the same either way.

    :raises pdplug.PlanError, pdplug.CapacityError: as ``PackPlanner.plan``.
    """
    batched = getattr(planner, "plan_all", None)
    out: list[TransferPlan] = []
    i, total = 0, len(items)
    while i < total:
        chunk, dst, rank, region = items[i]
        d = dst.dcp_size
        if batched is not None and d > 1 and rank == 0 and i + d <= total:
            group = items[i : i + d]
            shared = _one_instance(group)
            if shared is not None:
                out.extend(
                    batched(
                        chunk,
                        src,
                        _rank_free(dst),
                        None if region is None else [it[3] for it in group],
                        None if shared else [it[0].dst_pages for it in group],
                    )
                )
                i += d
                continue
        out.append(planner.plan(chunk, src, dst, rank, region))
        i += 1
    return out


_CHUNK_KEY = operator.attrgetter(
    "room", "chunk_id", "num_tokens", "decode_prefix_len", "src_page_offset", "rel_start",
    "is_last",
)  # fmt: skip
#: ids of a group's layouts -> (the layouts, kept alive so their ids are not reused; verdict)
_GROUPS: dict[tuple[int, ...], tuple[tuple[KVLayout, ...], bool]] = {}
_LAYOUT = operator.itemgetter(1)


def _ranks_of_one(layouts: tuple[KVLayout, ...]) -> bool:
    """Whether ``layouts`` are equal but for ``dcp_rank`` (memoised by identity: a sender
    passes its peers' layout objects with every segment)."""
    key = tuple(map(id, layouts))
    hit = _GROUPS.get(key)
    if hit is not None:
        return hit[1]
    norm = _rank_free(layouts[0])
    ok = all(_rank_free(lay) is norm for lay in layouts[1:])
    if len(_GROUPS) >= 1024:
        _GROUPS.clear()
    _GROUPS[key] = (layouts, ok)
    return ok


def _one_instance(
    group: Sequence[tuple[SendChunk, KVLayout, int, PackRegion | None]],
) -> bool | None:
    """Whether ``group`` holds DCP ranks ``0 .. d - 1`` of one decode layout with one chunk
    (but for ``dst_pages``), all packed or all direct: None if not, True when every rank has
    the very same chunk object (a sender shares one between ranks with equal pages), else
    False."""
    c0, _, _, g0 = group[0]
    direct = g0 is None
    shared = True
    key = None
    for r, (c, _, rank, g) in enumerate(group):
        if rank != r or (g is None) is not direct:
            return None
        if c is c0:
            continue
        shared = False
        if key is None:
            key = _CHUNK_KEY(c0)
        if _CHUNK_KEY(c) != key or (
            c.src_pages is not c0.src_pages
            and np.asarray(c.src_pages).tobytes() != np.asarray(c0.src_pages).tobytes()
        ):
            return None
    return shared if _ranks_of_one(tuple(map(_LAYOUT, group))) else None


def pack_segment(
    packer: Packer,
    plans: Sequence[TransferPlan],
    entries: Sequence[Any],
    pack_buffer: Any,
) -> None:
    """Pack one segment's plans (one per destination DCP rank, each into its own region).

    Uses the packer's ``pack_all(plans, entries, pack_buffer)`` when it has one (the ``dcp``
    packers: one launch table, one upload and one kernel launch for the whole segment on
    CUDA), else calls ``pack`` per plan. On CUDA the work is enqueued on the current stream:
    record an event before posting writes that read the regions.

    :param entries: the source KV entries (tensors, as ``Packer.pack`` takes them).
    :param pack_buffer: uint8 ``[nbytes]`` tensor.
    :raises ValueError: as ``Packer.pack``; plans writing overlapping pack-buffer bytes.
    """
    batched = getattr(packer, "pack_all", None)
    if batched is not None:
        batched(plans, entries, pack_buffer)
        return
    for plan in plans:
        packer.pack(plan, entries, pack_buffer)
