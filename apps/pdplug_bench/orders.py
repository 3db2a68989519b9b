"""The order of a round's modes: every mode first, and right after every other mode, equally
often (a Williams design: a Latin square balanced for first-order carry-over).

A paired benchmark runs every mode once per round. The run that follows another one inherits
what it left behind: caches a copy evicted, a decode still busy with the previous room's
completion, a thread woken by it. Rotating one fixed order by one mode a round (the bench's
order before 2026-12-07) makes every mode come first equally often, but every other run follows
the *same* predecessor: with the modes ``pdplug, raw, raw fresh-request, python floor``,
pdplug ran right after the python floor in every round it did not open, and raw right after
pdplug. Here, over every ``len(orders(n))`` consecutive rounds, each ordered pair ``(a, b)`` of
distinct modes appears exactly once as ``a`` immediately before ``b`` (twice for an odd ``n``,
whose design has ``2 n`` rows), and each mode opens a round equally often; a benchmark runs a
whole number of such cycles (:func:`timed_rounds`). Source: E. J. Williams, "Experimental
designs balanced for the estimation of residual effects of treatments", Australian Journal of
Scientific Research A 2 (1949).
"""

from __future__ import annotations

import operator
from collections.abc import Sequence
from typing import TypeVar

__all__ = ["MAX_MODES", "mode_order", "orders", "timed_rounds"]

T = TypeVar("T")

#: modes a round may run (a design has up to ``2 n`` rows of ``n``)
MAX_MODES = 64


def _whole(value: object, what: str) -> int:
    # True would pass for 1 and 2.0 for 2: a count or a round number is an int
    if isinstance(value, bool):
        raise TypeError(f"{what} must be an int, got bool {value!r}")
    try:
        return operator.index(value)  # type: ignore[arg-type]
    except TypeError:
        raise TypeError(f"{what} must be an int, got {type(value).__name__} {value!r}") from None


def orders(n: int) -> list[list[int]]:
    """The rows of a Williams design on ``n`` modes (indices ``0 .. n - 1``): ``n`` rows for
    an even ``n``, ``2 n`` for an odd one (each row of the square and its reverse).

    :raises TypeError: ``n`` is not an int (a bool, a float, a string).
    :raises ValueError: ``n`` is outside ``[1, MAX_MODES]``.
    """
    n = _whole(n, "orders: n")
    if not 1 <= n <= MAX_MODES:
        raise ValueError(f"orders: n={n} must be between 1 and {MAX_MODES} modes")
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
    """``modes`` in the order round ``round_no`` (0, 1, ...; negative counts from the end of a
    cycle) runs them: row ``round_no`` of :func:`orders`, cycling.

    :raises TypeError: ``round_no`` is not an int.
    :raises ValueError: ``modes`` is empty or holds more than :data:`MAX_MODES`.
    """
    if not 1 <= len(modes) <= MAX_MODES:
        raise ValueError(f"mode_order: modes holds {len(modes)} modes, must hold 1 to {MAX_MODES}")
    rows = orders(len(modes))
    return [modes[i] for i in rows[_whole(round_no, "mode_order: round_no") % len(rows)]]


def timed_rounds(n: int, at_least: int) -> int:
    """The fewest rounds, at least ``at_least``, that make whole cycles of the design on ``n``
    modes (so each mode opens, and follows each other one, equally often over them).

    :raises TypeError, ValueError: as :func:`orders`; ``at_least`` below 1.
    """
    cycle = len(orders(n))
    at_least = _whole(at_least, "timed_rounds: at_least")
    if at_least < 1:
        raise ValueError(f"timed_rounds: at_least={at_least} must be at least 1 round")
    return -(-at_least // cycle) * cycle
