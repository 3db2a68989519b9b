"""An engine's Prometheus ``/metrics``, read as one sum per metric name."""

from __future__ import annotations

import time
from collections.abc import Sequence

__all__ = ["scrape", "settled"]


def scrape(url: str, names: Sequence[str]) -> dict[str, float]:
    """Sum of every sample of each Prometheus metric in ``names`` at ``url/metrics`` (missing
    metrics: 0.0).

    :raises httpx.HTTPError: the engine did not answer.
    """
    import httpx

    text = httpx.get(url + "/metrics", timeout=10.0).text
    out = dict.fromkeys(names, 0.0)
    for line in text.splitlines():
        if line.startswith("#") or " " not in line:
            continue
        head, _, value = line.rpartition(" ")
        name = head.split("{", 1)[0]
        if name in out:
            out[name] += float(value)
    return out


def settled(url: str, metric: str, timeout_s: float = 15.0) -> int:
    """``metric`` at ``url`` once two reads 1 s apart agree (an engine's stats reach
    ``/metrics`` with its next outputs), or the last read after ``timeout_s`` seconds.

    :raises httpx.HTTPError: the engine did not answer.
    """
    last, deadline = -1.0, time.monotonic() + timeout_s
    while True:
        now = scrape(url, [metric])[metric]
        if now == last or time.monotonic() > deadline:
            return int(now)
        last = now
        time.sleep(1.0)
