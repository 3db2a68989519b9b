"""``pdplug bench transfer --runs N``: the run-to-run spread of its headline figures.

One run's medians move by several points between runs on a shared virtual machine (the
16 MiB overhead by +-4 points, a small send's fixed cost by tens of microseconds), so a goal
is read over several runs: each run is the whole measurement again in the same rig (same
processes and registrations, fresh rooms), and this table gives every run's figure, their
median and range, and in how many runs the goal was met (issue 24: "median of paired runs; say
the run-to-run spread").
"""

from __future__ import annotations

import statistics
from typing import Any

__all__ = ["GOALS", "RunFigures", "spread_rows"]

#: per figure: the goal and whether a value meets it (overhead: a fraction; fixed: us)
GOALS: dict[str, tuple[str, float]] = {
    "overhead": ("<= 5 %", 0.05),
    "fixed_us": ("<= 100 us", 100.0),
}

#: one run's figures: ``{"overhead": {backend: {MiB: x}}, "fixed_us": {backend: {MiB: us}}}``
RunFigures = dict[str, dict[str, dict[str, float]]]


def spread_rows(runs: list[RunFigures]) -> list[dict[str, Any]]:
    """One row per (figure, backend, size) present in every run: ``{figure, backend, size,
    values, median, low, high, goal, met}`` (``values`` in run order; ``met``: runs at or under
    the goal; ``goal`` is ``None`` for a size the issue sets none for: the fixed cost above
    1 MiB).

    :raises ValueError: ``runs`` is empty.
    """
    if not runs:
        raise ValueError("spread_rows: no run")
    out: list[dict[str, Any]] = []
    for figure, (goal_text, limit) in GOALS.items():
        for backend, per in runs[0].get(figure, {}).items():
            for size in per:
                values = [r[figure][backend][size] for r in runs
                          if size in r.get(figure, {}).get(backend, {})]  # fmt: skip
                if len(values) != len(runs):
                    continue  # a run that lacks it (its backend did not run): not comparable
                goal = goal_text if figure == "overhead" or float(size) <= 1 else None
                out.append(
                    {
                        "figure": figure,
                        "backend": backend,
                        "size": size,
                        "values": values,
                        "median": statistics.median(values),
                        "low": min(values),
                        "high": max(values),
                        "goal": goal,
                        "met": sum(v <= limit for v in values) if goal else None,
                    }
                )
    return out
