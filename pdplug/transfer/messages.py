"""Control-channel messages between a prefill rank (ROUTER) and a decode rank (DEALER).

Every frame is one of these frozen msgspec Structs (plus :class:`~pdplug.types.DestInfo`),
sealed by :func:`control_codec` (strict typed decode, size limit, HMAC when keyed, the sender's
identity, epoch and sequence; never pickle). :class:`~pdplug.types.ChunkTag` is array-like
(compact for NIXL notifications), so on the control channel it travels wrapped in
:class:`Done`.

Decode -> prefill: :class:`Hello` (handshake), ``DestInfo`` (per request), :class:`Abort`,
:class:`Heartbeat`. Prefill -> decode: :class:`HelloAck`, :class:`Done` (completion or failure
of one chunk: the only completion signal for engines without notifications, and the failure
twin for all), :class:`Heartbeat`.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import msgspec

from pdplug.config import WireConfig
from pdplug.types import ChunkTag, DestInfo, PeerInfo
from pdplug.wire import Codec

__all__ = [
    "Hello",
    "HelloAck",
    "Abort",
    "Done",
    "Heartbeat",
    "CONTROL_TYPES",
    "TAG_MAX_BYTES",
    "control_codec",
    "tag_codec",
]


class Hello(msgspec.Struct, frozen=True, kw_only=True, tag="hello"):
    """Decode rank -> prefill rank: who I am (layout, engine blob, entry bases).

    :ivar peer: the decode rank's :class:`~pdplug.types.PeerInfo`.
    :ivar nonce: echoed in the :class:`HelloAck` so a reply to an older Hello is ignored.
    """

    peer: PeerInfo
    nonce: int


class HelloAck(msgspec.Struct, frozen=True, kw_only=True, tag="hello_ack"):
    """Prefill rank -> decode rank: accepted, or refused naming every mismatch.

    :ivar rank: the prefill rank id (``pp_rank * tp_size + tp_rank``).
    :ivar peer: the prefill rank's PeerInfo (``None`` when refused).
    """

    nonce: int
    accepted: bool
    rank: int
    mismatches: tuple[str, ...] = ()
    peer: PeerInfo | None = None


class Abort(msgspec.Struct, frozen=True, kw_only=True, tag="abort"):
    """Decode rank -> prefill rank: stop sending ``room`` (lease ``generation``) to me."""

    room: int
    generation: int
    reason: str = "aborted"


class Done(msgspec.Struct, frozen=True, kw_only=True, tag="done"):
    """Prefill rank -> decode rank: one chunk completed (``chunk.ok``) or the room failed.

    A failure (``ok=False``) is sent at once (``drained=False`` while writes of the room are
    still in flight on the prefill rank) and again with ``drained=True`` once the prefill rank
    stopped and drained every write of the room: then the decode rank's pages are no longer
    written by this source.
    """

    chunk: ChunkTag
    drained: bool = True


class Heartbeat(msgspec.Struct, frozen=True, kw_only=True, tag="hb"):
    """Liveness, both directions; a peer silent for ``transfer_timeout_s`` is declared dead.

    :ivar live: (prefill -> decode) lease generations of the decode rank's rooms whose work is
        moving on the prefill rank (queued behind other rooms, packing, or being written): the
        decode rank re-arms their deadlines, so time spent queued is not taken for silence.
    """

    seq: int
    live: tuple[int, ...] = ()


#: every type a control socket accepts
CONTROL_TYPES: tuple[type, ...] = (Hello, HelloAck, DestInfo, Abort, Done, Heartbeat)


#: largest engine notification (bytes): a ChunkTag with a 512-character reason and its HMAC
TAG_MAX_BYTES = 4096


def control_codec(
    wire: WireConfig,
    *,
    identity: str,
    members: Iterable[str] | None = None,
    name: str = "control",
) -> Codec[Any]:
    """The sealed codec of a control socket under ``wire``'s size limit, key and replay window.

    :param identity: this rank's sender identity (:func:`~pdplug.wire.rank_identity`).
    :param members: identities accepted from (a decode rank's DEALER: its prefill rank's);
        ``None`` (a prefill rank's ROUTER): any holder of ``WireConfig.hmac_key``, each keyed
        by its sealed identity.
    :param name: label used in logs.
    """
    return Codec.from_config(wire, *CONTROL_TYPES, name=name, identity=identity, members=members)


def tag_codec(wire: WireConfig, name: str = "tags") -> Codec[Any]:
    """The codec of engine notifications: a bare :class:`~pdplug.types.ChunkTag`, at most
    :data:`TAG_MAX_BYTES` (or the wire's limit, if smaller). Plain (no sender envelope):
    notifications may arrive out of order, and the receiver checks each tag's source rank and
    lease generation itself."""
    limit = min(wire.max_message_bytes, TAG_MAX_BYTES)
    return Codec.from_config(
        msgspec.structs.replace(wire, max_message_bytes=limit), ChunkTag, name=name
    )
