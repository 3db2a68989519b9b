"""Pack-buffer regions: their sizes in bytes and tokens, the region table and the send bound.

A prefill rank registers one pack buffer and cuts it into ``dst_dcp_size * depth`` regions
(:func:`pack_regions`). Region ``rank * depth + slot`` belongs to destination DCP rank ``rank``;
each region holds ``capacity_tokens`` tokens (page-aligned) of every sharded entry,
layer-major: entry ``e`` of a plan with ``n`` tokens starts at
``region.offset + n * sum(bpt[j] for sharded j before e)``. Regions never overlap, so an
oversized shard cannot overwrite a neighbour: the planner raises :class:`pdplug.CapacityError`
instead. The bound a scheduler splits a send at is :func:`send_capacity_tokens`
(``capacity_tokens * dst_dcp_size``): a segment of at most that many tokens puts at most
``capacity_tokens`` tokens on any DCP rank. Segment ``k`` of a send uses slot ``k % depth``
(:func:`region_index`; double buffering: see :mod:`pdplug.packing`). The algorithm follows
SGLang's DCP packing (``dcp_pack_buffer_bytes`` / per-rank regions, PRs #35762 and #40376).
"""

from __future__ import annotations

from pdplug.types import KVLayout, PackRegion

__all__ = [
    "REGION_ALIGN",
    "sharded_entries",
    "pack_bytes_per_token",
    "region_capacity_tokens",
    "pack_buffer_nbytes",
    "pack_regions",
    "region_index",
    "send_capacity_tokens",
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
