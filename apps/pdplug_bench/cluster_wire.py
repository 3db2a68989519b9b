"""What ``pdplug bench cluster``'s driver and its worker processes say to each other.

Every worker runs inside a host of the cluster (a network namespace) and talks to the driver
over its stdin and stdout, one JSON object per line: the driver writes the :class:`Spec`
first, then :data:`Command` s; the worker writes :data:`Event` s. Each line is a frozen,
tagged msgspec Struct decoded strictly into its union (a line that is not one is an error of
the driver's harness, never guessed at); nothing is ever pickled. Times are
``time.monotonic()`` seconds, which every namespace of one machine shares.
"""

from __future__ import annotations

from typing import Any, Union

import msgspec

__all__ = [
    "Geometry",
    "Timeouts",
    "Spec",
    "Join",
    "Serve",
    "Expect",
    "Resolve",
    "Stats",
    "Check",
    "Attack",
    "Quit",
    "Command",
    "Ready",
    "Drained",
    "Done",
    "Landed",
    "ConsensusLost",
    "Found",
    "StatsOf",
    "Checked",
    "Attacked",
    "Error",
    "Bye",
    "Event",
    "encode",
    "decode_command",
    "decode_event",
    "decode_spec",
]


class Geometry(msgspec.Struct, frozen=True, kw_only=True):
    """The KV every worker of a deployment holds (the reference host's demo model by
    default: :func:`pdplug_bench.cluster_kv.demo_geometry`).

    :ivar page_size: tokens per page (prefill and decode).
    :ivar num_layers: model layers; each has a K and a V entry.
    :ivar entry_bytes: bytes of one token row of one entry (one layer's K or V).
    :ivar pp_size: prefill PP ranks (layers split as the reference host splits them).
    :ivar dcp_size: decode DCP ranks per decode instance.
    :ivar chunk_size: the scheduler's grid (tokens).
    :ivar pack_region_tokens: capacity of one pack region (tokens).
    :ivar max_dst_dcp: decode DCP size a prefill rank's pack buffer is sized for (regions:
        ``max_dst_dcp * 2``; ``KVConfig``'s default, as the reference host runs it).
    :ivar src_pages: pages of each prefill rank's KV (read-only: seeded bytes).
    :ivar dst_pages: pages of each decode DCP rank's KV.
    :ivar seed: seed of the source bytes.
    """

    page_size: int = 16
    num_layers: int = 4
    entry_bytes: int = 256
    pp_size: int = 2
    dcp_size: int = 2
    chunk_size: int = 128
    pack_region_tokens: int = 64
    max_dst_dcp: int = 8
    src_pages: int = 256
    dst_pages: int = 1024
    seed: int = 0


class Timeouts(msgspec.Struct, frozen=True, kw_only=True):
    """Every bound of the sessions and consensus, seconds (issue 23 runs with
    ``transfer_timeout_s = peer_timeout_s = 2``)."""

    transfer_s: float = 2.0
    peer_s: float = 2.0
    bootstrap_s: float = 6.0
    waiting_s: float = 6.0
    refresh_s: float = 1.0
    heartbeat_s: float = 0.5


class Spec(msgspec.Struct, frozen=True, kw_only=True):
    """The first line a worker reads: what it is.

    :ivar role: ``rendezvous``, ``prefill``, ``decode`` or ``intruder``.
    :ivar backend: KV sender name (``nixl``, ``mooncake``).
    :ivar addr: the host's address (every socket binds and advertises it).
    :ivar key: the deployment's HMAC key, hex (``""``: none; the intruder has none).
    :ivar rendezvous: the rendezvous endpoint ``tcp://addr:port``.
    :ivar port: the rendezvous port (role ``rendezvous``).
    :ivar instance: this worker's instance (prefill or decode).
    :ivar prefill: the prefill instance a decode connects to.
    :ivar pp_rank: this prefill rank; ``consensus``: every PP rank's consensus endpoint.
    """

    role: str
    backend: str = "nixl"
    addr: str = "127.0.0.1"
    key: str = ""
    rendezvous: str = ""
    port: int = 0
    instance: str = ""
    prefill: str = ""
    pp_rank: int = 0
    consensus: tuple[str, ...] = ()
    geometry: Geometry = Geometry()
    timeouts: Timeouts = Timeouts()


# ----------------------------------------------------------------------------- commands


class Join(msgspec.Struct, frozen=True, kw_only=True, tag="join"):
    """Prefill: start this rank's consensus (every rank is sent it once all are ready, so none
    counts the others' start-up as silence)."""


class Serve(msgspec.Struct, frozen=True, kw_only=True, tag="serve"):
    """Prefill: lease ``room`` (``tokens`` prompt tokens) and send it once consensus admits it.

    :ivar pace_s: seconds between two segments of the room (a chunked prefill's compute per
        chunk; 0: all at once), so a fault can find the room mid-transfer.
    """

    room: int
    tokens: int
    pace_s: float = 0.0


class Expect(msgspec.Struct, frozen=True, kw_only=True, tag="expect"):
    """Decode: take pages for ``room``, poison them and expect it on every DCP rank."""

    room: int
    tokens: int


class Resolve(msgspec.Struct, frozen=True, kw_only=True, tag="resolve"):
    """Decode: look ``instance`` up at the rendezvous now (answers :class:`Found`)."""

    instance: str
    timeout_s: float = 5.0


class Stats(msgspec.Struct, frozen=True, kw_only=True, tag="stats"):
    """Any role: answer :class:`StatsOf`."""


class Check(msgspec.Struct, frozen=True, kw_only=True, tag="check"):
    """Decode: check every free page is still poison (answers :class:`Checked`)."""


class Attack(msgspec.Struct, frozen=True, kw_only=True, tag="attack"):
    """Intruder: send well-formed and malformed frames to each ZMQ endpoint (answers
    :class:`Attacked`).

    :ivar targets: ``(endpoint, kind)`` pairs; ``kind`` is ``rendezvous``, ``sender`` or
        ``consensus`` (which well-formed messages to forge).
    :ivar identities: identities to impersonate in the envelopes.
    """

    targets: tuple[tuple[str, str], ...]
    identities: tuple[str, ...] = ()


class Quit(msgspec.Struct, frozen=True, kw_only=True, tag="quit"):
    """Any role: close everything and answer :class:`Bye`."""


Command = Union[Join, Serve, Expect, Resolve, Stats, Check, Attack, Quit]

# ----------------------------------------------------------------------------- events


class Ready(msgspec.Struct, frozen=True, kw_only=True, tag="ready"):
    """The worker is up. ``endpoints``: ``(what, endpoint)`` of every pdplug socket it bound."""

    pid: int
    t: float
    endpoints: tuple[tuple[str, str], ...] = ()


class Done(msgspec.Struct, frozen=True, kw_only=True, tag="done"):
    """A room reached a terminal state on this worker (every DCP rank, or this PP rank).

    :ivar ok: Success everywhere here.
    :ivar reason: the first failure reason (``""`` when ok).
    :ivar wrong_bytes: decode, Success only: bytes that differ from the source's (0 = exact).
    :ivar kv_bytes: decode: KV bytes the room's pages hold when exact.
    """

    room: int
    ok: bool
    t: float
    reason: str = ""
    wrong_bytes: int = 0
    kv_bytes: int = 0


class Drained(msgspec.Struct, frozen=True, kw_only=True, tag="drained"):
    """The room drained and was released (decode: its pages poisoned and freed; prefill:
    cleared)."""

    room: int
    t: float


class Landed(msgspec.Struct, frozen=True, kw_only=True, tag="landed"):
    """Decode: bytes of ``room``'s pages changed after the room was released (lost)."""

    room: int
    nbytes: int
    t: float


class ConsensusLost(msgspec.Struct, frozen=True, kw_only=True, tag="consensus_lost"):
    """Prefill: ``poll`` raised ``ConsensusError`` (its text) at ``t``."""

    error: str
    t: float


class Found(msgspec.Struct, frozen=True, kw_only=True, tag="found"):
    """Decode: what the rendezvous answered for ``instance`` (``error``: why not)."""

    instance: str
    endpoints: tuple[str, ...] = ()
    error: str = ""


class StatsOf(msgspec.Struct, frozen=True, kw_only=True, tag="stats_of"):
    """Counters of every component of the worker, by component name."""

    stats: dict[str, dict[str, Any]]


class Checked(msgspec.Struct, frozen=True, kw_only=True, tag="checked"):
    """Decode: free pages checked; ``changed``: ``(room, bytes)`` of pages no longer poison."""

    pages: int
    changed: tuple[tuple[int, int], ...] = ()
    undrained: tuple[int, ...] = ()


class Attacked(msgspec.Struct, frozen=True, kw_only=True, tag="attacked"):
    """Intruder: frames sent per endpoint."""

    sent: dict[str, int]


class Error(msgspec.Struct, frozen=True, kw_only=True, tag="error"):
    """The worker failed (a traceback)."""

    trace: str


class Bye(msgspec.Struct, frozen=True, kw_only=True, tag="bye"):
    """The worker closed everything and exits."""


Event = Union[
    Ready,
    Done,
    Drained,
    Landed,
    ConsensusLost,
    Found,
    StatsOf,
    Checked,
    Attacked,
    Error,
    Bye,
]

_enc = msgspec.json.Encoder()
_commands = msgspec.json.Decoder(Command)
_events = msgspec.json.Decoder(Event)
_spec = msgspec.json.Decoder(Spec)


def encode(msg: msgspec.Struct) -> bytes:
    """One line (JSON + ``\\n``) for ``msg``."""
    return _enc.encode(msg) + b"\n"


def decode_command(line: bytes) -> Command:
    """A command line. :raises msgspec.ValidationError: not one (names the field)."""
    return _commands.decode(line)


def decode_event(line: bytes) -> Event:
    """An event line. :raises msgspec.ValidationError: not one (names the field)."""
    return _events.decode(line)


def decode_spec(line: bytes) -> Spec:
    """The spec line. :raises msgspec.ValidationError: not one (names the field)."""
    return _spec.decode(line)
