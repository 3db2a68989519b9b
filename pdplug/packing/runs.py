"""Run merging: token-to-token copies merged into runs contiguous on both sides.

Follows SGLang's ``group_concurrent_contiguous``, with pdplug's rule that a run never crosses a
destination page (a decode page may sit anywhere in its pool).
"""

from __future__ import annotations

import numpy as np

__all__ = ["merge_runs"]


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
