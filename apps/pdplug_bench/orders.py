"""The order of a round's modes: every mode first, and right after every other mode, equally
often (a Williams design: a Latin square balanced for first-order carry-over).

A paired benchmark runs every mode once per round. The run that follows another one inherits
what it left behind: caches a copy evicted, a decode still busy with the previous room's
completion, a thread woken by it. Rotating one fixed order by one mode a round (the bench's
order before 2026-12-07) makes every mode come first equally often, but every other run follows
the *same* predecessor: with the modes ``pdplug, raw, raw fresh, python floor``, pdplug ran
after the python floor in every round it did not open, and raw after pdplug. Here, over
``len(orders(n))`` rounds, each ordered pair ``(a, b)`` of distinct modes appears exactly once
as ``a`` immediately before ``b`` (twice for an odd ``n``, whose design has ``2 n`` rows), and
each mode opens the round equally often (Williams, "Experimental designs balanced for the
estimation of residual effects of treatments", Australian Journal of Scientific Research A 2,
1949).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TypeVar

__all__ = ["mode_order", "orders"]

T = TypeVar("T")


def orders(n: int) -> list[list[int]]:
    """The rows of a Williams design on ``n`` modes (indices ``0 .. n - 1``): ``n`` rows for
    an even ``n``, ``2 n`` for an odd one (each row of the square and its reverse).

    :raises ValueError: ``n`` is below 1.
    """
    if n < 1:
        raise ValueError(f"orders: n={n} must be at least 1 mode")
    # first row 0, 1, n-1, 2, n-2, ...; row i adds i to every entry (mod n)
    first = [0]
    lo, hi = 1, n - 1
    while len(first) < n:
        first.append(lo)
        lo += 1
        if len(first) < n:
            first.append(hi)
            hi -= 1
    rows = [[(x + i) % n for x in first] for i in range(n)]
    if n % 2:
        rows += [row[::-1] for row in rows]
    return rows


def mode_order(modes: Sequence[T], round_no: int) -> list[T]:
    """``modes`` in the order round ``round_no`` (0, 1, ...) runs them: row ``round_no`` of
    :func:`orders`, cycling.

    :raises ValueError: ``modes`` is empty.
    """
    rows = orders(len(modes))
    return [modes[i] for i in rows[round_no % len(rows)]]
