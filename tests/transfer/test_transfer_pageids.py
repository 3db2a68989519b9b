"""The host's page ids: what ``KVSender.send`` / ``KVReceiver.expect`` accept, refuse and keep
(:func:`pdplug.transfer.pageids.page_ids`), and the planners' own conversion
(:func:`pdplug.packing.page_array`)."""

from __future__ import annotations

import array
import collections
import io
import mmap
import pickle

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from pdplug import PlanError
from pdplug.packing import page_array, segment_to_chunk
from pdplug.transfer.pageids import page_ids, short_page_ids
from pdplug.types import Segment


def _released() -> memoryview:
    m = memoryview(b"\x05")
    m.release()
    return m


def _ids(value: object, n: int = 16) -> np.ndarray:
    return page_ids(value, "src_pages", n, "KVSender.send", 3)


_GOOD = [
    [0, 1, 15],
    np.array([0, 1, 15], dtype=np.int8),
    np.array([0, 1, 15], dtype=np.uint64),
    np.array([0, 1, 15], dtype=">i8"),
    np.arange(32)[::2][:3] - np.array([0, 1, 1]),
    [[0, 1], [15]][0] + [15],
    range(3),
    np.int64(7),
    [[0, 1], [2, 3]],
    [np.array([0, 1]), np.array([2, 3])],
    collections.deque([0, 1, 15]),
    collections.UserList([[0, 1], [15, 2]]),
    [np.uint64(5), np.int64(3)],  # numpy makes floats of the pair: read as given
    [np.uint64(5), 3],
    np.ma.array([0, 1, 15]),  # a masked array with nothing masked
    np.ma.array([0, 1, 15], mask=[False, False, False]),
    np.array([0, 1, 15], dtype=object),  # ints numpy did not type: read as given
    np.array([[0, 1], [15, 2]], dtype=object),
    memoryview(np.array([0, 1, 15])),  # a buffer of int64 ids, not of bytes
    memoryview(np.array([0, 1, 15]).tobytes()).cast("q"),
    memoryview(np.array([0, 1, 15], dtype=">i8")),  # a format Python cannot unpack
    # a 2-D memoryview has no rows Python can iterate (helper-28: NotImplementedError)
    memoryview(np.array([[0, 1], [15, 2]])),
    memoryview(np.array([[[3]]], dtype=np.int32)),
    [array.array("q", [0, 1]), [15, 2]],  # rows of typed buffers: their ints
    array.array("q", [0, 1, 15]),
    np.array(7, dtype=object),
    np.array([np.array(0), np.array(1), np.array(15)], dtype=object),  # as the list is
    np.uint8(7),  # a numpy scalar exports a buffer of format "B": its dtype says uint8
    np.int8(7),
]


@pytest.mark.parametrize("value", _GOOD)
def test_integer_ids_come_back_as_a_private_int64_copy(value: object) -> None:
    got = _ids(value)
    assert got.dtype == np.int64 and got.ndim == 1
    assert got.tolist() == np.asarray(value).reshape(-1).astype(np.int64).tolist()
    if isinstance(value, np.ndarray):
        assert not np.shares_memory(got, value)


_BAD = [
    ([0, -1], "has page -1, outside [0, 16)"),
    ([0, 16], "has page 16, outside [0, 16)"),
    (np.array([0, 2**64 - 1], dtype=np.uint64), f"has page {2**64 - 1}, outside"),
    ([2**63, -1], f"has page {2**63}, outside"),
    ([2**70], f"has page {2**70}, outside"),
    ([-(2**63) - 1], f"has page {-(2**63) - 1}, outside"),
    (np.array([0.0, 1.0]), "must hold integer page ids, got dtype float64"),
    ([True, False], "must hold integer page ids, got dtype bool"),
    (["0"], "must hold integer page ids, got dtype <U1"),
    (None, "must hold integer page ids, got NoneType"),
    (np.array(5.0), "must hold integer page ids, got dtype float64"),  # 0-d: its dtype
    (np.array(True), "must hold integer page ids, got dtype bool"),
    ([np.uint64(5), np.int64(16)], "has page 16, outside [0, 16)"),
    ([7, True, 12], "must hold integer page ids, got a boolean among them"),
    ([[7, True]], "must hold integer page ids, got a boolean among them"),
    (((1, 2), (3, np.bool_(True))), "must hold integer page ids, got a boolean among them"),
    ([np.array([1, 2]), np.array([True, False])], "got a boolean among them"),
    ([np.array(True), 3], "got a boolean among them"),
    (collections.deque([9, 3, True]), "got a boolean among them"),
    (collections.UserList([True, 3]), "got a boolean among them"),
    ([9, 3, 2**63, True], "got a boolean among them"),
    ([[9, 3], [7, 2**70]], f"has page {2**70}, outside"),
    ([[9, 3], [7, 2**63]], f"has page {2**63}, outside"),
    ([[np.array(True)], [3]], "got a boolean among them"),
    ([[0, 1], [2]], "must be integer page ids, got list"),
    # the boolean's value and its index among the flattened ids
    ([7, 3, True, 12], "got a boolean among them (True at index 2 of the flattened ids)"),
    ([[1, 2], [3, np.bool_(False)]], "(np.False_ at index 3 of the flattened ids)"),
    # asarray would hand the data under the mask over as page ids
    (np.ma.array([0, 1, 15], mask=[0, 1, 0]), "is a masked array with 1 of 3 ids masked"),
    # numpy reads a buffer of bytes as uint8: one page id per byte
    (bytearray(b"\x05\x03"), "got a buffer of bytes (bytearray, item format 'B')"),
    (memoryview(b"\x05"), "got a buffer of bytes (memoryview, item format 'B')"),
    (memoryview(bytearray(b"\x05")), "got a buffer of bytes (memoryview"),
    (memoryview(np.array([5, 3])).cast("B"), "got a buffer of bytes (memoryview"),
    (pickle.PickleBuffer(b"\x05\x03"), "got a buffer of bytes (PickleBuffer"),
    (io.BytesIO(b"\x05\x03").getbuffer(), "got a buffer of bytes (memoryview"),
    (array.array("b", [1, 2]), "got a buffer of bytes (array, item format 'b')"),
    (b"\x05", "got a buffer of bytes (bytes, item format 'B')"),
    (np.array([1, True], dtype=object), "(True at index 1 of the flattened ids)"),
    (np.array(True, dtype=object), "(True at index 0 of the flattened ids)"),
    (np.array([1, 16], dtype=object), "has page 16, outside [0, 16)"),
    (np.array([1, 2.5], dtype=object), "got dtype object (2.5 at index 1 of the flattened"),
    ([1.5, 2], "got dtype float64 (1.5 at index 0 of the flattened ids)"),
    (np.array([np.array(1.5), 2], dtype=object), "got dtype object (array(1.5) at index 0"),
    # helper-27: rows of bytes in a list went out one page per byte
    ([bytearray(b"\x05\x06")], "buffer of bytes (bytearray, item format 'B') among them"),
    ([[1, 2], memoryview(b"\x05\x06")], "buffer of bytes (memoryview, item format 'B') among"),
    (([bytearray(b"\x05")],), "buffer of bytes (bytearray, item format 'B') among them"),
    ([array.array("b", [5, 6])], "buffer of bytes (array, item format 'b') among them"),
    ([_released()], "got dtype object (<released memory at"),  # a bare ValueError
    # memoryviews Python cannot iterate (helper-27: NotImplementedError from inside)
    (memoryview(np.array([1, 16], dtype=">i8")), "has page 16, outside [0, 16)"),
    (memoryview(np.array([1, 2], dtype=np.float16)), "got dtype float16"),
    (memoryview(np.array([(1,)], dtype=[("a", "<i8")])), "got dtype [('a', '<i8')]"),
    (memoryview(np.array([[1, 2], [3, 16]])), "has page 16, outside [0, 16)"),
    (memoryview(np.array([[1.0, 2.0]])), "got dtype float64 (1.0 at index 0"),
    (memoryview(np.array([[1, 2]], dtype=np.uint8)), "buffer of bytes (memoryview, item"),
    (np.array([2, np.array(True)], dtype=object), "boolean among them (array(True) at index 1"),
    (np.array([np.array(16), 2], dtype=object), "has page 16, outside [0, 16)"),
    (np.array([np.array([1]), 2], dtype=object), "got dtype object (array([1]) at index 0"),
    # numpy's timedelta64 is an np.integer: 5 seconds is not page 5
    ([np.timedelta64(5, "ns"), 3], "got dtype timedelta64[ns] (np.timedelta64(5,'ns') at"),
    (np.array([np.timedelta64(5, "s"), 3], dtype=object), "got dtype object (np.timedelta64"),
    (2**70, f"has page {2**70}, outside"),  # a scalar numpy holds as an object
]


@pytest.mark.parametrize(("value", "named"), _BAD)
def test_bad_ids_are_refused_naming_the_value_the_field_and_the_room(
    value: object, named: str
) -> None:
    with pytest.raises(ValueError) as ei:
        _ids(value)
    msg = str(ei.value)
    assert msg.startswith("KVSender.send: src_pages") and named in msg and "(room 3)" in msg, msg


def test_a_tensor_that_requires_grad_is_refused_as_a_value_error() -> None:
    torch = pytest.importorskip("torch")
    with pytest.raises(ValueError, match="src_pages must be integer page ids, got Tensor"):
        _ids(torch.tensor([1.0, 2.0], requires_grad=True))
    assert _ids(torch.tensor([1, 2])).tolist() == [1, 2]
    with pytest.raises(ValueError, match="src_pages must hold integer page ids, got a boolean"):
        _ids([torch.tensor(True), 3])  # numpy reads it as page 1
    assert _ids([torch.tensor(2), 3]).tolist() == [2, 3]


def test_the_check_reads_the_copy_it_returns() -> None:
    """What is returned is what was checked: a buffer changed after the call changes nothing
    (the engine thread reads the ids later)."""
    buf = np.array([0, 1, 2], dtype=np.int64)
    got = _ids(buf)
    buf[:] = [0, 1, 10**9]
    assert got.tolist() == [0, 1, 2]


@pytest.mark.parametrize(
    ("value", "named"),
    [
        (np.array([0, 2**64 - 1], dtype=np.uint64), f"src_pages holds page id {2**64 - 1}"),
        (np.array([0, 2**63], dtype=np.uint64), f"src_pages holds page id {2**63}"),
        (np.array([0, -3]), "src_pages holds page id -3, outside [0, 2**40)"),
        (np.array([[0, 1]]), "must be a 1-D array of integer page ids, got shape (1, 2)"),
        (np.array([0.9, 1.9]), "got shape (2,) dtype float64"),
        (np.array([True]), "dtype bool"),
    ],
)
def test_planner_page_arrays_are_1d_integers_named_exactly(value: object, named: str) -> None:
    with pytest.raises(PlanError) as ei:
        page_array(value, "src_pages", 4)
    assert str(ei.value).startswith("room 4: ") and named in str(ei.value), str(ei.value)
    # segment_to_chunk converts through it: a float id is never truncated into a page
    seg = Segment(token_start=0, token_end=4, page_start=0, num_tokens=4, chunk_id=0, is_last=True)
    with pytest.raises(ValueError, match=r"room 4: (src|dst)_pages"):
        segment_to_chunk(4, seg, value, np.arange(2), 0, 4)
    with pytest.raises(ValueError, match=r"room 4: dst_pages"):
        segment_to_chunk(4, seg, np.arange(2), value, 0, 4)


@pytest.mark.parametrize("n", [1, 2, 31, 32, 33, 200])
@pytest.mark.parametrize("where", [0, -1])
def test_int64_arrays_short_and_long_are_range_checked_alike(n: int, where: int) -> None:
    """The send path's own int64 arrays take a short check (builtin ``min``/``max`` up to
    32 ids, one reduction beyond): each length refuses an id outside the range
    wherever it sits, and passes a valid list unchanged."""
    from pdplug.packing.pages import MAX_PAGE_ID

    ok = np.arange(n, dtype=np.int64) % 16
    assert _ids(ok).tolist() == ok.tolist()
    assert page_array(ok, "src_pages", 4) is ok
    for bad, limit in ((-1, 16), (16, 16), (-(2**63), 16), (2**63 - 1, 16)):
        arr = ok.copy()
        arr[where] = bad
        with pytest.raises(ValueError, match=f"has page {bad}, outside \\[0, {limit}\\)"):
            _ids(arr)
    for bad in (-1, MAX_PAGE_ID, 2**63 - 1):
        arr = ok.copy()
        arr[where] = bad
        with pytest.raises(PlanError, match=f"holds page id {bad}, outside"):
            page_array(arr, "src_pages", 4)


class _ArrayOnly:
    """Neither a sequence nor iterable: numpy reads it through ``__array__`` alone."""

    def __init__(self, value: object) -> None:
        self.value = value

    def __array__(self, dtype: object = None, copy: object = None) -> np.ndarray:
        return np.asarray(self.value, dtype=dtype)


def test_an_object_numpy_reads_through_array_alone_is_read_by_its_dtype() -> None:
    """No TypeError from looking for booleans in an object that cannot be iterated: its
    array's dtype says what it holds."""
    assert _ids(_ArrayOnly([3, 4])).tolist() == [3, 4]
    with pytest.raises(
        ValueError, match=r"src_pages must hold integer page ids, got dtype float64"
    ):
        _ids(_ArrayOnly([1.5]))
    with pytest.raises(ValueError, match=r"has page 16, outside \[0, 16\)"):
        _ids(_ArrayOnly([0, 16]))


def test_a_released_memoryview_is_refused_naming_the_field_and_the_room() -> None:
    m = memoryview(b"\x05")
    m.release()
    with pytest.raises(ValueError, match=r"^KVSender.send: src_pages must be integer page ids, "
                       r"got memoryview \(operation forbidden.*\(room 3\)$"):  # fmt: skip
        _ids(m)


def test_an_mmap_of_bytes_is_refused_not_read_one_page_per_byte() -> None:
    with mmap.mmap(-1, 4) as mm:
        mm.write(b"\x05\x03\x00\x01")  # numpy read it as pages 5, 3, 0, 1
        with pytest.raises(ValueError, match=r"got a buffer of bytes \(mmap, item format 'B'\)"):
            _ids(mm)
        with memoryview(mm) as view, pytest.raises(ValueError, match=r"bytes \(memoryview, "):
            _ids(view)


def test_an_object_array_of_0d_int_tensors_is_read_as_the_list_of_them_is() -> None:
    """helper-26: ``[torch.tensor(1), 2]`` was read while the same ids in an object array were
    refused as ``dtype object``; a float or bool tensor among them is still refused."""
    torch = pytest.importorskip("torch")
    assert _ids(np.array([torch.tensor(3), 4], dtype=object)).tolist() == [3, 4]
    assert _ids([torch.tensor(3), 4]).tolist() == [3, 4]
    with pytest.raises(ValueError, match=r"got dtype object \(tensor\(1\.\) at index 0"):
        _ids(np.array([torch.tensor(1.0), 4], dtype=object))
    with pytest.raises(ValueError, match=r"boolean among them \(tensor\(True\) at index 0"):
        _ids(np.array([torch.tensor(True), 4], dtype=object))


@pytest.mark.parametrize(
    "value",
    [
        np.array([2**63 + 5], dtype=np.uint64),
        [2**63 + 5],
        np.array([np.array(2**63 + 5, dtype=np.uint64), 1], dtype=object),
    ],
)
def test_an_id_int64_cannot_hold_is_out_of_range_whatever_num_pages_says(value: object) -> None:
    """helper-27: with ``num_pages=2**64`` a uint64 id of 2**63 + 5 went out as page
    -9223372036854775803, and the object array's raised OverflowError from inside."""
    with pytest.raises(
        ValueError, match=r"page 9223372036854775813, outside \[0, 9223372036854775808\)"
    ):
        _ids(value, 2**64)
    assert _ids(np.array([2**63 - 1], dtype=np.uint64), 2**64).tolist() == [2**63 - 1]


def _short(value: object, n: int = 16) -> list[int] | None:
    return short_page_ids(value, n)


_SHORT_EXTRA = [
    [],
    np.zeros(0, dtype=np.int64),
    list(range(16)) * 4,  # 64 ids: still short
    list(range(16)) * 4 + [3],  # 65: page_ids' way
    np.arange(16, dtype=np.int64).repeat(4),
    np.arange(16, dtype=np.int64).repeat(4)[:-1][::-1],  # a negative-stride view
    np.zeros(65, dtype=np.int64),
    np.arange(6, dtype=np.int64).reshape(2, 3),  # 2-D: page_ids flattens it
    np.arange(6, dtype=np.int64)[::2],
    np.array([1, 2], dtype=np.int32),
    [np.int64(3), 4],
    (3, 4),
    collections.UserList([3, 4]),
    type("Ids", (list,), {})([3, 4]),  # a list subclass: page_ids' way
]


@pytest.mark.parametrize("value", _GOOD + [v for v, _ in _BAD] + _SHORT_EXTRA)
def test_short_page_ids_give_what_page_ids_gives_or_leave_it_to_page_ids(value: object) -> None:
    """The send path's short lane (:func:`short_page_ids`) never lets through what
    :func:`page_ids` refuses, and gives the same ids as a private list of Python ints."""
    got = _short(value)
    if got is None:
        return
    assert type(got) is list and all(type(x) is int for x in got), got
    assert got is not value
    assert got == _ids(value).tolist()


@pytest.mark.parametrize(
    "value",
    [
        np.array([0, 15, 3], dtype=np.int64),
        np.array([0, 15, 3], dtype=np.int64)[::-1],
        np.zeros(64, dtype=np.int64),
        [0, 15, 3],
        [7] * 64,
        [],
    ],
)
def test_the_usual_short_lists_take_the_short_lane_as_private_copies(value: object) -> None:
    """int64 arrays and lists of Python ints up to 64 ids come back as a list; changing the
    caller's buffer afterwards changes nothing (the engine reads the ids later)."""
    got = _short(value)
    assert got == np.asarray(value, dtype=np.int64).tolist()
    before = list(got)  # type: ignore[arg-type]
    if isinstance(value, np.ndarray) and value.size:
        value[...] = 10**9
    elif isinstance(value, list) and value:
        value[0] = 10**9
    assert got == before


@given(
    ids=st.lists(st.integers(min_value=-3, max_value=20), max_size=70),
    as_array=st.booleans(),
)
def test_short_page_ids_take_exactly_the_short_in_range_lists(
    ids: list[int], as_array: bool
) -> None:
    value: object = np.array(ids, dtype=np.int64) if as_array else list(ids)
    got = _short(value)
    ok = len(ids) <= 64 and all(0 <= x < 16 for x in ids)
    assert got == (ids if ok else None)
