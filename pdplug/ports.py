"""Free TCP ports for endpoints that must be known before the socket that binds them exists.

Consensus and KV-transfer ranks learn each other's addresses from config, so a launcher (the
demo driver, ``pdplug bench consensus``, the multi-rank tests) picks ports first and the ranks
bind them later, in other processes. A port the kernel handed out through ``bind(port 0)`` lies
in its ephemeral range, which is also where every outgoing ``connect()`` takes its local port:
in the gap before the rank binds, another rank's connection can take it, and the bind fails
with ``EADDRINUSE`` (seen in CI). :func:`free_ports` therefore picks outside that range, where
the kernel never assigns ports on its own, and checks each one by binding it.
"""

from __future__ import annotations

import random
import socket
from pathlib import Path

__all__ = ["ephemeral_port_range", "free_ports", "free_endpoints"]

_RANGE_FILE = Path("/proc/sys/net/ipv4/ip_local_port_range")
_LOWEST = 20_000  # below: registered service ports (5432, 6379, 8080 ...) more likely in use
_TRIES_PER_PORT = 64


def ephemeral_port_range() -> tuple[int, int]:
    """The kernel's ephemeral (automatic) local port range, inclusive.

    Linux reads ``/proc/sys/net/ipv4/ip_local_port_range``; elsewhere, or when it cannot be
    read, the Linux default ``(32768, 60999)``.
    """
    try:
        lo, hi = (int(v) for v in _RANGE_FILE.read_text().split())
        return lo, hi
    except (OSError, ValueError):
        return 32_768, 60_999


def free_ports(n: int, host: str = "127.0.0.1") -> list[int]:
    """``n`` distinct TCP ports on ``host`` that are free now and outside the ephemeral range.

    Each candidate is bound (without ``SO_REUSEADDR``, so a port in ``TIME_WAIT`` is refused
    too) and held until all ``n`` are found, then released for the caller's ranks to bind.
    When the ephemeral range leaves fewer than 1,024 ports outside it, falls back to ports the
    kernel picks (``bind`` to port 0).

    :param n: ports wanted, >= 0.
    :raises ValueError: ``n < 0``.
    :raises OSError: no ``n`` free ports found in ``64 * n`` tries.
    """
    if n < 0:
        raise ValueError(f"free_ports: n must be >= 0, got {n}")
    lo, hi = ephemeral_port_range()
    pool = [*range(_LOWEST, min(lo, 65_536)), *range(max(hi + 1, _LOWEST), 65_536)]
    rng = random.SystemRandom()
    held: list[socket.socket] = []
    try:
        tries = 0
        while len(held) < n:
            if tries >= _TRIES_PER_PORT * n:
                raise OSError(
                    f"free_ports: found {len(held)} of {n} free ports on {host} in {tries} tries"
                )
            tries += 1
            s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            try:
                s.bind((host, rng.choice(pool) if len(pool) >= 1024 else 0))
            except OSError:
                s.close()
                continue
            held.append(s)
        return [int(s.getsockname()[1]) for s in held]
    finally:
        for s in held:
            s.close()


def free_endpoints(n: int, host: str = "127.0.0.1") -> tuple[str, ...]:
    """``n`` ZMQ TCP endpoints ``"tcp://host:port"`` on :func:`free_ports`."""
    return tuple(f"tcp://{host}:{p}" for p in free_ports(n, host))
