"""Driver <-> worker messages of the reference host (msgspec Structs through pdplug.wire)."""

from __future__ import annotations

from typing import Any

import msgspec

from pdplug.config import WireConfig
from pdplug.wire import Codec

__all__ = [
    "NewRequest",
    "FirstToken",
    "Shutdown",
    "Route",
    "Ready",
    "Leased",
    "Timing",
    "Finished",
    "RequestFailed",
    "Fatal",
    "WorkerStats",
    "to_worker_codec",
    "to_driver_codec",
]


class NewRequest(msgspec.Struct, frozen=True, kw_only=True, tag="new"):
    """A request routed to every prefill and decode rank (the router's job in production).

    :ivar rid: request id, used as the bootstrap room.
    :ivar tokens: int64 little-endian prompt token ids (``pages_to_bytes`` encoding).
    :ivar output_len: tokens to generate (the first comes from prefill).
    :ivar chain: chained block hashes of the prompt's full blocks (prefix-cache key).
    :ivar arrival: wall-clock arrival time (seconds since the epoch).
    """

    rid: int
    tokens: bytes
    output_len: int
    chain: tuple[int, ...]
    arrival: float


class FirstToken(msgspec.Struct, frozen=True, kw_only=True, tag="first"):
    """The first output token, computed by the last prefill PP rank (relayed to decode)."""

    rid: int
    token: int


class Route(msgspec.Struct, frozen=True, kw_only=True, tag="route"):
    """The request now goes to the prefill ranks (sent to every decode rank, which then leases
    the room with its KV receiver: its transfer timeouts start only now)."""

    rid: int


class Shutdown(msgspec.Struct, frozen=True, kw_only=True, tag="shutdown"):
    """Stop after the current iteration."""


class Ready(msgspec.Struct, frozen=True, kw_only=True, tag="ready"):
    """A worker finished start-up (plugins resolved, KV registered, peers connected)."""

    role: str
    rank: int
    served_by: dict[str, dict[str, str]] = {}


class Leased(msgspec.Struct, frozen=True, kw_only=True, tag="leased"):
    """Every decode DCP rank holds pages for request ``rid`` (the prealloc decision was good):
    the driver may route it to the prefill ranks (:class:`Route`), so a request waiting for
    decode pages never starts a transfer timeout."""

    rid: int


class Timing(msgspec.Struct, frozen=True, kw_only=True, tag="timing"):
    """Per-request timestamps (epoch seconds) and durations (seconds) seen by one rank."""

    role: str
    rank: int
    rid: int
    fields: dict[str, float]


class Finished(msgspec.Struct, frozen=True, kw_only=True, tag="finished"):
    """A request's generated tokens (from decode DCP rank 0)."""

    rid: int
    tokens: tuple[int, ...]


class RequestFailed(msgspec.Struct, frozen=True, kw_only=True, tag="req_failed"):
    """A request decided ``bad`` (transfer failed, timed out, or aborted)."""

    role: str
    rank: int
    rid: int
    reason: str


class Fatal(msgspec.Struct, frozen=True, kw_only=True, tag="fatal"):
    """A worker cannot continue (the driver stops the run and reports it)."""

    role: str
    rank: int
    message: str


class WorkerStats(msgspec.Struct, frozen=True, kw_only=True, tag="stats"):
    """Counters a worker reports at shutdown (bytes, segments, drops …)."""

    role: str
    rank: int
    stats: dict[str, Any]


def to_worker_codec(wire: WireConfig) -> Codec:
    """Codec of driver -> worker frames."""
    return Codec(
        NewRequest,
        FirstToken,
        Route,
        Shutdown,
        max_bytes=wire.max_message_bytes,
        hmac_key=wire.hmac_key,
    )


def to_driver_codec(wire: WireConfig) -> Codec:
    """Codec of worker -> driver frames."""
    return Codec(
        Ready,
        Leased,
        FirstToken,
        Timing,
        Finished,
        RequestFailed,
        Fatal,
        WorkerStats,
        max_bytes=wire.max_message_bytes,
        hmac_key=wire.hmac_key,
    )
