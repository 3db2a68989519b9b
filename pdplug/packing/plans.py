"""Planning one segment for its destinations: a planner's batched ``plan_all`` where it applies.

:func:`plan_all_ranks` plans one chunk for every DCP rank of one decode layout;
:func:`plan_segment` plans a KV sender's whole destination list, finding the runs of items that
are the DCP ranks of one decode instance (memoised by identity: a sender passes the same layout
and chunk objects with every segment) and planning each such run with one ``plan_all`` call.
"""

from __future__ import annotations

import operator
from collections.abc import Sequence

import msgspec
import numpy as np

from pdplug.protocols import PackPlanner
from pdplug.types import KVLayout, PackRegion, SendChunk, TransferPlan

__all__ = ["plan_all_ranks", "plan_segment"]


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
        of :func:`pdplug.packing.pack_regions`), or None for unpacked plans.
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
