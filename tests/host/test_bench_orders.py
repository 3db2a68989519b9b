"""The bench's round orders (:mod:`pdplug_bench.orders`): balanced for carry-over."""

from __future__ import annotations

from collections import Counter
from itertools import pairwise

import pytest
from hypothesis import given
from hypothesis import strategies as st

from pdplug_bench.orders import mode_order, orders


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
    with pytest.raises(ValueError, match="n=0"):
        mode_order([], 0)
