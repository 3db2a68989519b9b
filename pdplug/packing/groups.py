"""Pack groups: the gather of a packed plan, and the source byte offset of every sub-row.

A packer reads a plan's :class:`pdplug.PackGroup` s (:func:`pack_groups`, which also turns a
plan in the original form into one whole-row group per entry) and expands each into byte
offsets from its entry's base with :func:`group_rows`, vectorised over tokens and columns.
"""

from __future__ import annotations

import numpy as np

from pdplug.types import PackGroup, TransferPlan

__all__ = ["pack_groups", "group_rows"]


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
