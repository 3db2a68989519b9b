"""The host's page ids, checked and copied before a session keeps them.

``KVSender.send`` and ``KVReceiver.expect`` take page ids from the host's own arrays; the
session's engine thread reads them later (plans, DestInfos). A check on the caller's array
followed by a later read of the same array lets a caller that reuses its buffer slip an id past
the check (a page outside the registered KV, written or read by the engine), so both keep a
private int64 copy of what they checked.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import numpy as np

from pdplug.packing.pages import SHORT_IDS, ids_below, int64_ids

__all__ = ["check_span", "page_ids", "short_page_ids"]

_BOOLS = frozenset({bool, np.bool_})
_BYTE_FORMATS = frozenset({"B", "b", "c"})
_INTS = frozenset({int})
_BOOL_DTYPES = frozenset({"bool", "torch.bool"})
_INT64_END = 1 << 63


def short_page_ids(value: Any, num_pages: int) -> list[int] | None:
    """A private list (Python ints) of up to 64 page ids, each checked to lie in ``[0,
    num_pages)``, when ``value`` is an int64 ``[n]`` numpy array or a list of Python ints (a
    host's usual page lists); ``None`` for anything else, a longer list or an id out of range:
    the caller then takes :func:`page_ids`, which converts it or names what is wrong.

    A send's few page ids then reach the engine's post with one numpy operation (``tolist``)
    instead of five, each of which costs microseconds when it runs cold after a CPU copy
    (issue 24).
    """
    t = type(value)
    if t is np.ndarray:
        if not int64_ids(value) or value.shape[0] > SHORT_IDS:
            return None
        ids = value.tolist()  # the copy the checks read
    elif t is list and len(value) <= SHORT_IDS:
        ids = list(value)
        if set(map(type, ids)) - _INTS:  # a bool, a numpy integer, a float: page_ids says
            return None
    else:
        return None
    if ids and (min(ids) < 0 or max(ids) >= num_pages):
        return None
    return ids


def page_ids(value: Any, field: str, num_pages: int, where: str, room: int) -> np.ndarray:
    """A private int64 ``[n]`` copy of ``value`` (any integer array-like, flattened), every id
    checked to lie in ``[0, num_pages)``. The copy is made first and the checks read the copy,
    so a buffer the caller (or a device copy) is still writing cannot slip an id past them.

    :param field: the parameter's name in errors (``src_pages``, ``dst_pages``).
    :param num_pages: registered pages (ids are page indices, not bytes).
    :param where: the API call in errors (``KVSender.send``).
    :param room: the request's room, named in errors.
    :raises ValueError: ``value`` does not convert to an array (a tensor that requires grad, a
        ragged list, ...), holds non-integers (floats, booleans, strings: the dtype is named;
        a boolean among a list's or object array's ints too, at any depth, with its index),
        is a masked array with masked ids, a buffer of bytes other than a numpy array (item
        format ``B``, ``b`` or ``c``: ``bytearray``, ``mmap``, a ``memoryview`` of them or cast
        to bytes, ``array('b')``), or an id outside ``[0, num_pages)`` or at 2**63 or above
        (the copy is int64; the first one is named with its exact value, unsigned ones and
        Python ints beyond 64 bits included)."""
    if int64_ids(value):
        arr = value.copy()  # the usual case (a host's int64 page list)
        if ids_below(arr, num_pages):
            return arr
        value = arr
    # the ids go out as int64: one at 2**63 or above is outside whatever num_pages says
    num_pages = min(num_pages, _INT64_END)
    if isinstance(value, np.ma.MaskedArray) and np.ma.is_masked(value):
        # asarray keeps the data under the mask: a masked-out slot would go out as a page
        raise ValueError(
            f"{where}: {field} is a masked array with {int(np.ma.count_masked(value))} of "
            f"{value.size} ids masked; pass only the page ids to use (room {room})"
        )
    # numpy arrays and scalars export buffers too (np.uint8(7): format "B"): their dtype says;
    # a list or tuple (a host's block ids) exports none: no memoryview attempt raised and caught
    typed = isinstance(value, (list, tuple, np.ndarray, np.generic))
    fmt = "" if typed else _buffer_format(value, field, where, room)
    raw = value if fmt and _is_bytes(fmt) else None
    try:
        arr = np.asarray(value).copy()  # asarray: torch's __array__ takes no copy keyword
    except (OverflowError, RuntimeError, TypeError, ValueError) as e:
        raise ValueError(
            f"{where}: {field} must be integer page ids, got {type(value).__name__} ({e}) "
            f"(room {room})"
        ) from None
    if not fmt and arr.ndim > 1 and getattr(value, "dtype", None) is None:
        # [bytearray(...)]: a row of bytes; a buffer's own format said what it holds (a 2-D
        # memoryview has no rows Python can iterate)
        raw, fmt = _bytes_row(value, arr.ndim - 1)
    if raw is not None:
        # numpy reads a buffer of bytes as uint8 ids (bytes itself as a string): a page per
        # byte of a bytearray, an mmap or a memoryview cast to bytes
        among = "" if raw is value else " among them"
        raise ValueError(
            f"{where}: {field} must be integer page ids, got a buffer of bytes ("
            f"{type(raw).__name__}, item format {fmt!r}){among}; pass a list, a numpy array or "
            f"a tensor (room {room})"
        )
    if arr.size == 0:
        return np.zeros(0, dtype=np.int64)
    items = _elements(value, arr)
    at = -1 if items is None or arr.dtype.kind == "b" else _bool_at(items)
    if at >= 0:
        # numpy turns [7, True] into int64 [7, 1]: page 1 would be sent for a flag
        raise ValueError(
            f"{where}: {field} must hold integer page ids, got a boolean among them "
            f"({items[at]!r} at index {at} of the flattened ids) (room {room})"
        )
    if arr.dtype.kind not in "iu":
        ints = None if items is None else _ints(items)
        if ints is None:
            kind = getattr(value, "dtype", None) is not None  # a 0-d array or tensor
            got = f"dtype {arr.dtype}" if arr.ndim or kind else type(value).__name__
            if items is not None and arr.ndim:  # name the first id that is not an integer
                i = next(i for i, x in enumerate(items) if not _int_like(x))
                got = f"{got} ({items[i]!r} at index {i} of the flattened ids)"
            raise ValueError(
                f"{where}: {field} must hold integer page ids, got {got} (room {room})"
            )
        bad = next((x for x in ints if not 0 <= x < num_pages), None)
        if bad is None:  # numpy made floats of [np.uint64(5), 3]: the ids as given
            return np.array(ints, dtype=np.int64)
    else:
        arr = arr.reshape(-1)
        u = arr if arr.dtype.kind == "u" else arr.astype(np.int64, copy=False).view(np.uint64)
        # one reduction: a negative id read as uint64 is above any page count
        if int(np.maximum.reduce(u)) < num_pages:
            return arr.astype(np.int64, copy=False)  # the copy made above
        bad = int(arr[(arr < 0) | (arr >= num_pages)][0])
    raise ValueError(
        f"{where}: {field} has page {bad}, outside [0, {num_pages}) registered pages (room {room})"
    )


def _elements(value: Any, arr: np.ndarray) -> Any:
    """The ids of a Python sequence (list, tuple, deque, range, nested ones) or of an object
    array as given, flat; ``None`` for another array, a tensor or a scalar (its dtype says what
    it holds)."""
    if arr.ndim == 0:  # a scalar: an object one (a Python int beyond 64 bits) as given
        return [arr.item()] if arr.dtype == object else None
    if getattr(value, "dtype", None) is not None:  # an array or a tensor: its dtype says what
        # it holds, but an object array holds any Python objects: read them as given
        return arr.reshape(-1).tolist() if arr.dtype == object else None
    if arr.ndim == 1:
        if isinstance(value, (list, tuple)):
            return value
        try:
            return list(value)
        except (TypeError, NotImplementedError):
            # an object numpy reads through ``__array__`` alone, or a memoryview of a format
            # Python cannot unpack (">q", "e", a struct): its dtype says
            return None
    flat = np.empty(arr.shape, dtype=object)
    flat[...] = value  # the elements as given: asarray(dtype=object) would nest lists
    return flat.reshape(-1).tolist()


def _bool_at(items: Any) -> int:
    """Index of the first boolean in flat ``items``, also as a 0-d array or tensor
    (``[np.array(True), 3]``); -1 when there is none."""
    kinds = set(map(type, items))
    if kinds <= _INTS:  # the usual list (vLLM's block ids): Python ints
        return -1
    for i, x in enumerate(items):
        if type(x) in _BOOLS or str(getattr(x, "dtype", "")) in _BOOL_DTYPES:
            return i
    return -1


def _buffer_format(value: Any, field: str, where: str, room: int) -> str:
    """The buffer protocol's item format of ``value`` (``"B"`` for bytes), ``""`` when it
    exports no buffer (a list, a tensor)."""
    try:
        return memoryview(value).format
    except TypeError:
        return ""
    except ValueError as e:  # a released memoryview
        raise ValueError(
            f"{where}: {field} must be integer page ids, got {type(value).__name__} ({e}) "
            f"(room {room})"
        ) from None


def _is_bytes(fmt: str) -> bool:
    """Whether buffer item format ``fmt`` is a byte (``B``, ``b``, ``c``, any byte order);
    ``""`` (no buffer) is not."""
    return fmt.lstrip("@=<>!") in _BYTE_FORMATS


def _bytes_row(value: Any, levels: int) -> tuple[Any, str]:
    """The first buffer of bytes (not a numpy array) among the rows of a nested sequence, down
    ``levels`` levels, and its item format; ``(None, "")`` when there is none."""
    for x in value:
        if isinstance(x, (list, tuple, str)) or getattr(type(x), "dtype", None) is not None:
            fmt = ""  # a sequence, or an array or tensor whose dtype says
        else:
            try:
                fmt = memoryview(x).format
            except (TypeError, ValueError):
                fmt = ""
            if _is_bytes(fmt):
                return x, fmt
        if levels > 1 and not fmt and isinstance(x, Iterable) and not isinstance(x, str):
            found = _bytes_row(x, levels - 1)
            if found[0] is not None:
                return found
    return None, ""


def _int_like(x: Any) -> bool:
    # a bool is an int to isinstance ([True, False] is not pages 1 and 0), and numpy's
    # timedelta64 an np.integer (5 seconds is not page 5)
    if isinstance(x, (int, np.integer)):
        return not isinstance(x, (bool, np.timedelta64))
    if getattr(type(x), "dtype", None) is not None and x.ndim == 0:  # no released memoryview
        # a 0-d integer array or tensor: read like it is in a list ([np.array(1), 2])
        try:
            return np.asarray(x).dtype.kind in "iu"
        except Exception:  # a tensor on a device numpy cannot read
            return False
    return False


def _ints(items: Any) -> list[int] | None:
    """Flat ``items`` as Python ints when every one is a Python or numpy integer (or a 0-d
    integer array or tensor) that numpy could not hold in one int64 or uint64 array (it made
    floats or objects of them: Python ints beyond 64 bits, ``np.uint64`` beside ``np.int64``,
    0-d arrays in an object array), else ``None``."""
    return [int(x) for x in items] if all(map(_int_like, items)) else None


def check_span(layout: Any, pages: int, decode_prefix_len: int, num_tokens: int) -> None:
    """Check a decode rank's room span (``KVReceiver.expect``): ``decode_prefix_len`` tokens
    a multiple of the virtual page (``page_size * dcp_size`` tokens), and ``pages`` (virtual
    pages) enough for ``num_tokens`` (0: unknown, unchecked).

    :raises ValueError: naming the value and the virtual page, or the pages needed.
    """
    vpage = layout.page_size * layout.dcp_size
    if decode_prefix_len < 0 or decode_prefix_len % vpage:
        raise ValueError(
            f"KVReceiver.expect: decode_prefix_len={decode_prefix_len} must be a multiple of "
            f"the virtual page ({layout.page_size} x dcp {layout.dcp_size} = {vpage} tokens)"
        )
    if num_tokens:
        need = -(-(num_tokens - decode_prefix_len) // vpage)
        if num_tokens < decode_prefix_len or pages < need:
            raise ValueError(
                f"KVReceiver.expect: num_tokens={num_tokens} with decode_prefix_len="
                f"{decode_prefix_len} needs {max(need, 0)} pages, got {pages}"
            )
