"""The network faults as data: argument checks and the exact ``tc`` and nftables text each
fault becomes. Pure functions, no command runs here (:mod:`pdplug.testing.netns.cluster`
applies them), so every check and every rule is testable without root.

Where each fault acts (the kernel here has no ``netem``, hence no fixed added delay):

* bandwidth (:func:`tbf_argv`): a token bucket (``tc-tbf(8)``) as the root qdisc of the
  host's own device (``out``: what the host sends) and of its port on the switch (``in``:
  what it receives). Queueing delay comes from the bucket's queue: a saturated link makes a
  packet wait up to ``latency_ms``; a packet that would wait longer is dropped; an idle link
  adds nothing.
* loss, partition, link cut (:func:`switch_ruleset`): nftables rules in the bridge's
  ``forward`` hook, inside the switch namespace. Frames vanish *in the network*: the host's
  own stack sees no error, no carrier change, no route change, exactly as when a switch or
  cable beyond the NIC drops them (a rule on the host's own ``output`` hook would instead
  make ``send()`` fail with EPERM, which no real network does).
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping

__all__ = [
    "DIRECTIONS",
    "LOSS_STEPS",
    "MAX_RATE_MBIT",
    "MAX_LATENCY_MS",
    "MIN_BURST_BYTES",
    "TABLE",
    "check_direction",
    "check_rate_mbit",
    "check_latency_ms",
    "check_burst_bytes",
    "default_burst_bytes",
    "loss_threshold",
    "tbf_argv",
    "switch_ruleset",
]

#: which traffic of a host a fault touches: what it receives (``in``), sends (``out``), or both
DIRECTIONS = ("both", "in", "out")
#: modulus of nftables' ``numgen random``: loss is set in steps of 100 / LOSS_STEPS percent
LOSS_STEPS = 10_000
#: the fastest bucket accepted, Mbit/s (400 Gbit/s: faster than any veth moves here)
MAX_RATE_MBIT = 400_000.0
#: the longest queueing delay accepted, ms
MAX_LATENCY_MS = 60_000.0
#: smallest bucket, bytes: two full Ethernet frames (a bucket below one frame passes nothing)
MIN_BURST_BYTES = 2 * 1514
#: the nftables table (bridge family) the harness owns inside a switch namespace
TABLE = "pdplug"


def _finite(field: str, value: object) -> float:
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise ValueError(f"{field}={value!r}: expected a number")
    if not math.isfinite(value):
        raise ValueError(f"{field}={value!r}: expected a finite number")
    return float(value)


def check_direction(direction: str) -> str:
    """``direction`` if it is one of :data:`DIRECTIONS`.

    :raises ValueError: any other value (the message lists the accepted ones).
    """
    if direction not in DIRECTIONS:
        raise ValueError(f"direction={direction!r}: expected one of {', '.join(DIRECTIONS)}")
    return direction


def check_rate_mbit(rate_mbit: float) -> float:
    """A bucket rate in Mbit/s (10**6 bit/s), ``0 < rate_mbit <= MAX_RATE_MBIT``.

    :raises ValueError: not a finite number in that range (the message names the value).
    """
    rate = _finite("rate_mbit", rate_mbit)
    if not 0 < rate <= MAX_RATE_MBIT:
        raise ValueError(f"rate_mbit={rate_mbit!r}: expected 0 < rate_mbit <= {MAX_RATE_MBIT:g}")
    if rate * 1e6 < 8:
        raise ValueError(f"rate_mbit={rate_mbit!r}: below one byte per second")
    return rate


def check_latency_ms(latency_ms: float) -> float:
    """The most a packet may wait in a bucket's queue, ms, ``0 < latency_ms <= 60000``.

    :raises ValueError: not a finite number in that range.
    """
    lat = _finite("latency_ms", latency_ms)
    if not 0 < lat <= MAX_LATENCY_MS:
        raise ValueError(
            f"latency_ms={latency_ms!r}: expected 0 < latency_ms <= {MAX_LATENCY_MS:g}"
        )
    return lat


def default_burst_bytes(rate_mbit: float) -> int:
    """The bucket size used when none is given: 1 ms of traffic at ``rate_mbit``, at least
    :data:`MIN_BURST_BYTES` (bytes). Small enough that a bulk transfer is shaped from its
    first milliseconds, large enough that the bucket refills between timer ticks."""
    return max(MIN_BURST_BYTES, math.ceil(check_rate_mbit(rate_mbit) * 1e6 / 8 / 1000))


def check_burst_bytes(burst_bytes: int) -> int:
    """A bucket size in bytes, an integer ``>= MIN_BURST_BYTES`` and ``<= 2**31``.

    :raises ValueError: anything else.
    """
    if isinstance(burst_bytes, bool) or not isinstance(burst_bytes, int):
        raise ValueError(f"burst_bytes={burst_bytes!r}: expected an integer number of bytes")
    if not MIN_BURST_BYTES <= burst_bytes <= 2**31:
        raise ValueError(
            f"burst_bytes={burst_bytes!r}: expected {MIN_BURST_BYTES} <= burst_bytes <= 2**31"
        )
    return burst_bytes


def loss_threshold(percent: float) -> int:
    """The ``numgen random mod LOSS_STEPS < N`` threshold that drops ``percent`` % of frames.

    :param percent: share of frames dropped, ``0 <= percent <= 100``, in steps of 0.01.
    :returns: ``N`` in ``[0, LOSS_STEPS]`` (0: no loss).
    :raises ValueError: outside 0-100, not finite, or above 0 yet below one step (0.01 %).
    """
    p = _finite("percent", percent)
    if not 0 <= p <= 100:
        raise ValueError(f"percent={percent!r}: expected 0 <= percent <= 100")
    n = round(p * LOSS_STEPS / 100)
    if p > 0 and n == 0:
        raise ValueError(f"percent={percent!r}: below the resolution of {100 / LOSS_STEPS} %")
    return n


def tbf_argv(
    ns: str, dev: str, *, rate_mbit: float, latency_ms: float, burst_bytes: int
) -> list[str]:
    """The ``tc`` command that makes a token bucket the root qdisc of ``dev`` in ``ns``.

    :param ns: namespace of the device.
    :param dev: device whose egress is shaped.
    :param rate_mbit: bucket rate, Mbit/s.
    :param latency_ms: the most a packet waits in the queue before it is dropped, ms (tbf
        sizes its queue from it: ``limit = rate * latency + burst``).
    :param burst_bytes: bucket size, bytes.
    :returns: argv for :func:`subprocess.run` (``replace``: applying twice is an update).
    :raises ValueError: as the ``check_*`` functions.
    """
    rate_bit = round(check_rate_mbit(rate_mbit) * 1e6)
    latency_us = max(1, round(check_latency_ms(latency_ms) * 1000))
    burst = check_burst_bytes(burst_bytes)
    return [
        *("tc", "-n", ns, "qdisc", "replace", "dev", dev, "root", "tbf"),
        *("rate", f"{rate_bit}bit", "burst", str(burst), "latency", f"{latency_us}us"),
    ]


def switch_ruleset(
    *,
    cut: Iterable[str] = (),
    blocked: Iterable[tuple[str, str]] = (),
    loss: Mapping[str, tuple[int, int]] | None = None,
) -> str:
    """The nftables script that makes the switch drop what the faults say (load it with
    ``nft -f``: it replaces the harness's table in one transaction; with no fault it only
    deletes the table).

    :param cut: switch ports whose every frame is dropped, both ways (a partitioned host
        or a dead one).
    :param blocked: ``(from_port, to_port)``: frames entering at the first port and leaving
        at the second are dropped (one direction of a partition between two hosts).
    :param loss: ``port -> (in_threshold, out_threshold)`` from :func:`loss_threshold`:
        frames leaving the switch towards the port's host (``in``) and entering from it
        (``out``) are dropped at random with probability ``threshold / LOSS_STEPS``.
    :returns: the script text.
    """
    rules = [f'iifname "{p}" counter drop' for p in sorted(set(cut))]
    rules += [f'oifname "{p}" counter drop' for p in sorted(set(cut))]
    rules += [f'iifname "{a}" oifname "{b}" counter drop' for a, b in sorted(set(blocked))]
    for port, (n_in, n_out) in sorted((loss or {}).items()):
        rand = f"numgen random mod {LOSS_STEPS}"
        if n_out:
            rules.append(f'iifname "{port}" {rand} < {n_out} counter drop')
        if n_in:
            rules.append(f'oifname "{port}" {rand} < {n_in} counter drop')
    # "table X" first makes "delete table X" valid whether or not it exists yet
    script = f"table bridge {TABLE}\ndelete table bridge {TABLE}\n"
    if rules:
        body = "".join(f"\t\t{r}\n" for r in rules)
        script += (
            f"table bridge {TABLE} {{\n\tchain links {{\n"
            "\t\ttype filter hook forward priority 0; policy accept;\n"
            f"{body}\t}}\n}}\n"
        )
    return script
