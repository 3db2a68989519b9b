"""Run addressing: a plan's runs as absolute ``(src_addr, dst_addr, length)`` descriptors.

A sender keeps per-entry base tables (:func:`source_table`, and ``dst_entry_base[entry_map]``)
made once per peer and turns each plan into descriptors with two gathers
(:func:`plan_addresses`); :func:`run_addresses` does both steps for one plan. The reading rule
(pack buffer for packed entries, the entry itself otherwise) is the one of
:class:`pdplug.kvtypes.TransferPlan`.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from pdplug.types import TransferPlan

__all__ = ["run_addresses", "source_table", "plan_addresses"]


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
