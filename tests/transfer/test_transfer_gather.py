"""The sender's ordering and busy-time bookkeeping without engines: :class:`ReadyGate` (segments
wait for the host's ready marker without holding up other rooms, in send order per room; a
marker that never completes or raises fails its room) and :class:`BusyClock` (pack time that
overlapped an in-flight write)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from pdplug.transfer.gather import BusyClock, ReadyGate, check_ready
from pdplug.transfer.records import Job, Lease


class Flag:
    def __init__(self, done: bool = False, boom: bool = False) -> None:
        self.done, self.boom = done, boom

    def query(self) -> bool:
        if self.boom:
            raise RuntimeError("CUDA error: an illegal memory access")
        return self.done


def _jobs(lease: Lease, chunk_id: int, n: int = 2) -> list[Job]:
    chunk = SimpleNamespace(chunk_id=chunk_id)
    return [Job(lease=lease, key=("d", 0, r, 0), dst_rank=r, chunk=chunk) for r in range(n)]


def test_gate_holds_a_segment_until_its_marker_and_lets_other_rooms_pass() -> None:
    gate = ReadyGate()
    a, b = Lease(room=1, generation=1), Lease(room=2, generation=1)
    ev = Flag()
    assert gate.admit(_jobs(a, 0), ev, 0.0) == []
    later = _jobs(a, 1)
    assert gate.admit(later, None, 0.1) == []  # behind A's parked segment 0
    other = _jobs(b, 0)
    assert gate.admit(other, None, 0.1) == other  # another room: straight to the queues
    assert len(gate) == 4
    assert gate.release(0.5, 1.0) == ([], [])
    ev.done = True
    out, failed = gate.release(0.6, 1.0)
    assert [j.chunk.chunk_id for j in out] == [0, 0, 1, 1] and failed == []
    assert len(gate) == 0 and not gate


def test_gate_fails_a_room_whose_marker_never_completes_or_raises() -> None:
    gate = ReadyGate()
    a, b = Lease(room=1, generation=1), Lease(room=2, generation=1)
    gate.admit(_jobs(a, 0), Flag(), 0.0)
    gate.admit(_jobs(b, 0), Flag(boom=True), 0.0)
    out, failed = gate.release(0.5, 1.0)
    assert out == [] and [lease.room for lease, _ in failed] == [2]
    assert "illegal memory access" in failed[0][1]
    out, failed = gate.release(1.01, 1.0)
    assert out == [] and [lease.room for lease, _ in failed] == [1]
    assert "not ready after 1 s" in failed[0][1] and "transfer_timeout_s" in failed[0][1]
    gate.drop(a)
    gate.drop(b)
    assert len(gate) == 0


def test_ready_must_have_query() -> None:
    check_ready(None)
    check_ready(Flag())
    with pytest.raises(TypeError, match="ready must have query"):
        check_ready(object())


def test_busy_clock_counts_pack_time_under_a_write_as_overlap() -> None:
    c = BusyClock()
    c.write_started(0.0)
    c.pack_ran(2.0, 5.0)  # wholly inside the open write period
    c.writes_idle(10.0)
    c.pack_ran(9.0, 12.0)  # 1 s overlaps the closed period [0, 10]
    c.write_started(11.0)
    c.pack_ran(10.5, 13.0)  # 2 s overlap the open period from 11
    t = c.totals(now=14.0)
    assert t["pack_busy_s"] == pytest.approx(3 + 3 + 2.5)
    assert t["write_busy_s"] == pytest.approx(10 + 3)
    assert t["overlap_s"] == pytest.approx(3 + 1 + 2)


def test_busy_clock_counts_a_write_ended_inside_its_post_once() -> None:
    # issue 24: such a write reports its span after the post instead of opening a period
    c = BusyClock()
    c.wrote(1.0, 1.5)  # no period open: its own span
    c.pack_ran(1.2, 2.0)  # 0.3 s of it under that write
    c.write_started(3.0)
    c.wrote(3.5, 4.0)  # inside the open period: not counted twice
    c.writes_idle(5.0)
    t = c.totals(now=9.0)
    assert t["write_busy_s"] == pytest.approx(0.5 + 2.0)
    assert t["overlap_s"] == pytest.approx(0.3)


def test_busy_clock_counts_every_write_ended_in_its_post_under_one_long_pack() -> None:
    # helper-33: 300 such writes under one pack kept only the last 256 spans (0.256 s)
    c = BusyClock()
    for i in range(300):
        c.wrote(1.0 + i * 0.002, 1.0 + i * 0.002 + 0.001)
    c.pack_ran(0.5, 2.0)
    assert c.totals(now=2.0)["overlap_s"] == pytest.approx(0.300)
    assert c.totals(now=2.0)["write_busy_s"] == pytest.approx(0.300)
