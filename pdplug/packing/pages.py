"""Page-id conversion: a page list as int64 ``[n]`` ids, checked and converted without loss.

What planners read from a :class:`pdplug.types.SendChunk` (``src_pages``, ``dst_pages``): the
send path's own int64 arrays pass with one reduction; anything else is converted or refused
with :class:`pdplug.PlanError` naming the room, the field and the value.
"""

from __future__ import annotations

from typing import Any, Union

import numpy as np

__all__ = ["MAX_PAGE_ID", "page_array"]

#: page ids at or above this are refused: times a page stride they would overflow int64 byte
#: offsets (and no engine has that many pages)
MAX_PAGE_ID = 1 << 40
#: page lists up to this long are range-checked with ``min``/``max`` over a Python list
#: instead of a ufunc reduction, whose set-up costs more than a few comparisons, the more so
#: run cold after a CPU copy; beyond about a hundred ids the reduction wins (issue 24; README)
SHORT_IDS = 64
#: page ids as a sender's direct lane carries them from ``send`` to the engine's post: an int64
#: ``[n]`` array, or a short list of Python ints (no numpy operation between the two; issue 24)
PageIds = Union[np.ndarray, "list[int]"]
_INT64 = np.dtype(np.int64)
_MAX = np.maximum.reduce


def int64_ids(value: Any) -> bool:
    """Whether ``value`` is already the send path's own form: an int64 ``[n]`` numpy array."""
    return type(value) is np.ndarray and value.dtype == _INT64 and value.ndim == 1


def ids_below(ids: np.ndarray, bound: int) -> bool:
    """Whether every id of int64 ``[n]`` ``ids`` lies in ``[0, bound)`` (``True`` when empty).

    One reduction over the ids read as uint64 (a negative id is then above any bound); up to
    64 ids by the builtins over a list (issue 24: the send path checks three short lists).
    """
    n = ids.shape[0]
    if n > SHORT_IDS:
        return int(_MAX(ids.view(np.uint64))) < bound
    if not n:
        return True
    listed = ids.tolist()
    return min(listed) >= 0 and max(listed) < bound


def page_array(value: Any, field: str, room: int) -> np.ndarray:
    """``value`` as int64 ``[n]`` page ids, converted without loss (what planners read from a
    :class:`SendChunk`).

    :param field: the field's name in errors (``src_pages``, ``dst_pages``).
    :param room: the request's room, named in errors.
    :raises pdplug.PlanError: (a ``ValueError``) not 1-D, not integers (a float id would be
        truncated silently), or an id outside ``[0, 2**40)`` (named with its exact value,
        unsigned ones above 2**63 included).
    """
    if int64_ids(value) and ids_below(value, MAX_PAGE_ID):
        return value  # the send path's own arrays pass unconverted
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
