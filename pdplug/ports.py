"""Free TCP ports for endpoints that must be known before the socket that binds them exists.

Consensus and KV-transfer ranks learn each other's addresses from config, so a launcher (the
demo driver, ``pdplug bench consensus``, the multi-rank tests) picks ports first and the ranks
bind them later, in other processes. A port the kernel handed out through ``bind(port 0)`` lies
in its ephemeral range, which is also where every outgoing ``connect()`` takes its local port:
in the gap before the rank binds, another rank's connection can take it, and the bind fails
with ``EADDRINUSE`` (seen in CI). :func:`free_ports` therefore picks outside that range, where
the kernel never assigns ports on its own, checks each one by binding it, and never hands out
a port twice in one process (two calls, say one per consensus implementation, would otherwise
pick the same free port now and bind it twice later).
"""

from __future__ import annotations

import random
import socket
import threading
from pathlib import Path

__all__ = ["ephemeral_port_range", "free_ports", "free_endpoints"]

_RANGE_FILE = Path("/proc/sys/net/ipv4/ip_local_port_range")
_LOWEST = 20_000  # below: registered service ports (5432, 6379, 8080 ...) more likely in use
_TRIES_PER_PORT = 64
_RECENT_MAX = 4096  # ports this process handed out, not handed out again (FIFO)
_recent: dict[int, None] = {}  # insertion-ordered: the oldest is dropped first
_lock = threading.Lock()


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
    The last 4,096 ports this process handed out are not handed out again.
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
    with _lock:
        got = _pick(n, host, pool if len(pool) >= 1024 else [])
        _recent.update(dict.fromkeys(got))
        while len(_recent) > _RECENT_MAX:
            del _recent[next(iter(_recent))]
        return got


def _pick(n: int, host: str, pool: list[int]) -> list[int]:
    """Bind ``n`` ports from ``pool`` (the kernel's choice when empty), held until all bind."""
    rng = random.SystemRandom()
    held: list[socket.socket] = []
    try:
        for _ in range(_TRIES_PER_PORT * n):
            if len(held) == n:
                break
            s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            try:
                s.bind((host, rng.choice(pool) if pool else 0))
            except OSError:
                s.close()
                continue
            if s.getsockname()[1] in _recent:  # handed out before: its rank may bind it yet
                s.close()
                continue
            held.append(s)
        if len(held) < n:
            raise OSError(
                f"free_ports: found {len(held)} of {n} free ports on {host} in "
                f"{_TRIES_PER_PORT * n} tries"
            )
        return [int(s.getsockname()[1]) for s in held]
    finally:
        for s in held:
            s.close()


def free_endpoints(n: int, host: str = "127.0.0.1") -> tuple[str, ...]:
    """``n`` ZMQ TCP endpoints ``"tcp://host:port"`` on :func:`free_ports`."""
    return tuple(f"tcp://{host}:{p}" for p in free_ports(n, host))
