"""The state machine of a peer's asynchronous Mooncake writes (:mod:`pdplug_mooncake.runs`):
window, post order, and what a failed run does to the writes behind it. The engine here is a
scripted stand-in for ``batch_transfer_async_write`` / ``transfer_check_status`` so every
interleaving is exact; the real engine runs the same paths in test_transfer_mooncake_runs.py."""

from __future__ import annotations

from collections import Counter
from typing import Any

import pytest

from pdplug.testing import require


class _Engine:
    """Batch ids from 1; a batch ends when ``land``/``fail`` says so; ``refuse`` makes the next
    submissions return 0."""

    def __init__(self) -> None:
        self.submitted: list[tuple[int, int]] = []  # (id, source address)
        self.rc: dict[int, int] = {}
        self.refuse = False

    def batch_transfer_async_write(
        self, session: str, src: list[int], dst: list[int], ln: list[int]
    ) -> int:
        assert len(src) == len(dst) == len(ln) == 1  # one run per batch
        if self.refuse:
            return 0
        bid = len(self.submitted) + 1
        self.submitted.append((bid, src[0]))
        self.rc[bid] = 0
        return bid

    def transfer_check_status(self, bid: int) -> int:
        return self.rc[bid]

    def land(self, n: int = 10**9, rc: int = 1) -> None:
        for bid, _ in self.submitted:
            if n and self.rc[bid] == 0:
                self.rc[bid] = rc
                n -= 1


def _runs(max_batch: int = 1024) -> tuple[_Engine, Any, list[str], Counter[str]]:
    require("mooncake")
    from pdplug_mooncake.runs import AsyncRuns

    eng = _Engine()
    dropped: list[str] = []
    counts: Counter[str] = Counter()
    return eng, AsyncRuns(eng, max_batch, dropped.append, counts), dropped, counts


def test_writes_share_the_window_in_post_order_and_it_grows_per_landed_run() -> None:
    eng, runs, dropped, _ = _runs()
    a = runs.post("s:1", list(range(0, 6)), list(range(6)), [1] * 6)
    b = runs.post("s:1", list(range(100, 103)), list(range(3)), [1] * 3)
    assert [s for _, s in eng.submitted] == [0, 1, 2, 3]  # window 4, a first
    assert runs.check(a) == "PROC" and runs.check(b) == "PROC"
    eng.land(2)
    assert runs.check(b) == "PROC"  # b's own runs are not in yet: a's two landed
    assert runs.check(a) == "PROC" and runs.window == 6  # 4 + 2 landed
    # a's last two runs, then b's three (6 - 2 still with the engine leaves room for 4)
    assert [s for _, s in eng.submitted][4:] == [4, 5, 100, 101]
    eng.land()
    assert runs.check(a) == "DONE"
    assert runs.check(b) == "PROC"  # its third run goes out now
    eng.land()
    assert runs.check(b) == "DONE" and not runs.live and not dropped
    assert [s for _, s in eng.submitted][-1] == 102


def test_a_failed_run_drops_the_session_and_fails_the_writes_behind_it() -> None:
    eng, runs, dropped, counts = _runs()
    a = runs.post("s:1", list(range(8)), list(range(8)), [1] * 8)
    b = runs.post("s:1", [50, 51], [0, 1], [1, 1])
    eng.land(1, rc=-1)  # a's first run fails
    assert runs.check(a) == "FAILING"  # three of its runs are still with the engine
    assert dropped and runs.dropped and runs.window == 4
    assert runs.check(b) == "ERR" and "another write to the session failed" in b.error
    assert counts["runs_not_submitted"] == 4 + 2  # a's last four, all of b's
    eng.land()
    assert runs.check(a) == "ERR" and "failed (-1)" in a.error
    assert len(eng.submitted) == 4 and not runs.live
    c = runs.post("s:1", [9], [9], [1])  # a dropped session submits nothing more
    assert runs.check(c) == "ERR" and len(eng.submitted) == 4


def test_a_refused_submission_fails_the_write_without_a_batch() -> None:
    eng, runs, dropped, _ = _runs()
    eng.refuse = True
    a = runs.post("s:1", [1, 2], [1, 2], [1, 1])
    assert runs.check(a) == "ERR" and "was refused" in a.error and dropped


@pytest.mark.parametrize("max_batch", [1, 5])
def test_the_window_never_passes_max_batch(max_batch: int) -> None:
    eng, runs, _, _ = _runs(max_batch)
    a = runs.post("s:1", list(range(40)), list(range(40)), [1] * 40)
    top = 0
    while runs.check(a) == "PROC":
        top = max(top, sum(1 for bid, _ in eng.submitted if eng.rc[bid] == 0))
        eng.land(1)
    assert runs.check(a) == "DONE" and top <= max_batch and runs.window == max_batch
