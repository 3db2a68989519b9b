"""The bench's round orders (:mod:`pdplug_bench.orders`): balanced for carry-over."""

from __future__ import annotations

from collections import Counter
from itertools import pairwise

import pytest
from hypothesis import given
from hypothesis import strategies as st

from pdplug_bench.orders import MAX_MODES, mode_order, orders, timed_rounds


@given(st.integers(1, 9))
def test_every_mode_opens_and_follows_every_other_equally_often(n: int) -> None:
    rows = orders(n)
    assert len(rows) == (n if n % 2 == 0 else 2 * n)
    assert all(sorted(r) == list(range(n)) for r in rows)  # each row runs every mode once
    firsts = Counter(r[0] for r in rows)
    assert set(firsts.values()) == {len(rows) // n}
    pairs = Counter((a, b) for r in rows for a, b in pairwise(r))
    if n > 1:
        assert len(pairs) == n * (n - 1)  # every ordered pair of distinct modes ...
        assert set(pairs.values()) == {1 if n % 2 == 0 else 2}  # ... equally often


def test_the_old_rotation_was_not_balanced_and_this_is() -> None:
    modes = ["pdplug", "raw", "raw fresh", "python floor"]
    rotated = [modes[k:] + modes[:k] for k in range(4)]
    before = {r[r.index("pdplug") - 1] for r in rotated if r[0] != "pdplug"}
    assert before == {"python floor"}  # pdplug only ever ran right after the floor
    now = [mode_order(modes, k) for k in range(4)]
    assert {r[r.index("pdplug") - 1] for r in now if r[0] != "pdplug"} == set(modes) - {"pdplug"}
    assert mode_order(modes, 4) == now[0]  # cycles


def test_no_modes_is_refused_by_name() -> None:
    with pytest.raises(ValueError, match="mode_order: modes holds 0 modes"):
        mode_order([], 0)
    with pytest.raises(ValueError, match="modes holds 65 modes, must hold 1 to 64"):
        mode_order(range(65), 0)


@pytest.mark.parametrize(
    ("bad", "error", "match"),
    [
        (True, TypeError, "n must be an int, got bool True"),
        (2.0, TypeError, "n must be an int, got float 2.0"),
        (float("inf"), TypeError, "got float inf"),  # it looped until memory ran out
        ("3", TypeError, "got str '3'"),
        (None, TypeError, "got NoneType None"),
        (-1, ValueError, "n=-1 must be between 1 and"),
        (MAX_MODES + 1, ValueError, f"n={MAX_MODES + 1} must be between"),
    ],
)
def test_a_bad_mode_count_is_refused_by_name(bad: object, error: type, match: str) -> None:
    with pytest.raises(error, match=match):
        orders(bad)  # type: ignore[arg-type]


@pytest.mark.parametrize("bad", [True, 1.0, "1", None])
def test_a_bad_round_number_is_refused_by_name(bad: object) -> None:
    with pytest.raises(TypeError, match="round_no must be an int"):
        mode_order(["a", "b", "c"], bad)  # type: ignore[arg-type]


def test_a_numpy_count_and_a_negative_round_are_read_as_ints() -> None:
    np = pytest.importorskip("numpy")
    assert orders(np.int64(4)) == orders(4)
    assert mode_order("abc", -1) == mode_order("abc", len(orders(3)) - 1)


@given(st.integers(1, 12), st.integers(1, 60))
def test_timed_rounds_are_whole_cycles_so_the_balance_holds(n: int, at_least: int) -> None:
    rounds = timed_rounds(n, at_least)
    cycle = len(orders(n))
    assert rounds >= at_least and rounds % cycle == 0 and rounds - at_least < cycle
    rows = [mode_order(list(range(n)), r) for r in range(rounds)]
    firsts = Counter(r[0] for r in rows)
    assert len(set(firsts.values())) == 1 and len(firsts) == n
    with pytest.raises(ValueError, match="at_least=0"):
        timed_rounds(n, 0)
