"""Room ids every adapter shares: allocators never collide, rooms stay a non-negative int64."""

from __future__ import annotations

import threading

import pytest
from hypothesis import given
from hypothesis import strategies as st

from pdplug.adapters.room_ids import (
    MAX_ALLOCATOR_ID,
    ROOM_BITS,
    ROOM_LIMIT,
    RoomAllocator,
    check_room,
)


@given(a=st.integers(0, MAX_ALLOCATOR_ID), b=st.integers(0, MAX_ALLOCATOR_ID),
       n=st.integers(1, 200))  # fmt: skip
def test_rooms_of_distinct_allocators_never_collide(a: int, b: int, n: int) -> None:
    ra, rb = RoomAllocator(a), RoomAllocator(b)
    xs = [ra() for _ in range(n)]
    ys = [rb() for _ in range(n)]
    assert len(set(xs)) == n and all(0 <= x < 1 << 63 for x in xs + ys)
    assert (set(xs) & set(ys)) == set() if a != b else xs == ys
    assert {x >> ROOM_BITS for x in xs} == {a}


def test_allocator_is_thread_safe() -> None:
    alloc = RoomAllocator(3)
    out: list[int] = []
    lock = threading.Lock()

    def take() -> None:
        got = [alloc() for _ in range(500)]
        with lock:
            out.extend(got)

    threads = [threading.Thread(target=take) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(set(out)) == 2000


def test_allocator_id_out_of_range_is_named() -> None:
    with pytest.raises(ValueError, match=r"allocator_id=-1"):
        RoomAllocator(-1)
    with pytest.raises(ValueError, match=rf"allocator_id={MAX_ALLOCATOR_ID + 1}"):
        RoomAllocator(MAX_ALLOCATOR_ID + 1)


def test_room_bounds_are_checked_and_named() -> None:
    check_room(0, "room")
    check_room(ROOM_LIMIT - 1, "room")
    with pytest.raises(ValueError, match=r"^x.room=-1 not in \[0, 2\*\*63\)$"):
        check_room(-1, "x.room")
    with pytest.raises(ValueError, match=rf"x.room={ROOM_LIMIT} not in"):
        check_room(ROOM_LIMIT, "x.room")
