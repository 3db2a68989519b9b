"""Frame and unframe one socket's messages: strict msgspec typing, size limit, HMAC, sender
envelope, replay rejection, drop counters.

Frames are msgpack-encoded frozen msgspec Structs decoded strictly into a tagged union of the
expected types; never pickle. A frame that is too large, fails the HMAC-SHA256, is not valid
msgpack, has an unknown tag or fields of the wrong type, comes from a sender outside the
socket's members, or is a replay is **dropped and counted**; nothing raises into the caller's
loop. Callers that reject a well-formed message on semantic grounds count it with
:meth:`Codec.drop`.

Frame layouts (``mac`` = 32-byte HMAC-SHA256 of the rest, present only when a key is set):

* *sealed* codec (built with ``identity=``; what sockets use): ``mac + envelope`` where the
  envelope is the msgpack array ``[sender, epoch, seq, sent_ms, payload]``. ``sender`` is the
  identity its owner derives from what it is (``"pp0:<group>:pp3"``, ``"prefill-0 tp0 pp1"``);
  a receiver takes a peer's identity from it, never from a ZMQ routing id the peer picked.
  ``epoch`` names one codec instance (one incarnation of the sending endpoint): creation time
  in microseconds ``<< 12`` plus 12 random bits, so a restart yields a larger epoch. ``seq``
  increases strictly per codec. ``sent_ms`` is the wall-clock send time in milliseconds.
* *plain* codec (no identity): ``mac + payload``; no sender, no replay protection. Kept for
  channels that are not sockets (completion tags inside backend notifications).

Freshness, per sender, on a sealed codec: a frame of the epoch in use must carry a larger
``seq`` than the last one accepted (a replayed or reordered frame fails); a larger epoch (a
restarted peer) is adopted only when its frame was sent within ``replay_window_s`` of this
host's clock; a smaller epoch is a replay. Limit: a frame recorded less than
``replay_window_s`` ago can still be replayed once to a receiver that never heard the
sender's current epoch; rotating the key per launch removes even that.
"""

from __future__ import annotations

import hashlib
import hmac as _hmac
import itertools
import logging
import secrets
import threading
import time
from collections import Counter
from collections.abc import Iterable
from typing import Any, Generic, NamedTuple, TypeVar, Union

import msgspec

from pdplug.config import WireConfig
from pdplug.types import KVLayout, PeerInfo

__all__ = [
    "Codec",
    "DROP_REASONS",
    "Inbound",
    "MAC_BYTES",
    "MAX_SENDERS",
    "peer_identity",
    "rank_identity",
]

log = logging.getLogger(__name__)

T = TypeVar("T")

MAC_BYTES = 32
#: Reasons a frame is dropped; ``Codec.drops`` counts each.
DROP_REASONS = (
    "oversize",
    "hmac",
    "malformed",
    "unknown_kind",
    "wrong_type",
    "unknown_rank",
    "replay",
    "stale",
    "other",
)
#: Senders a sealed codec without a member set remembers (oldest forgotten first).
MAX_SENDERS = 4096


class _Envelope(msgspec.Struct, frozen=True, array_like=True):
    sender: str
    epoch: int
    seq: int
    sent_ms: int
    body: msgspec.Raw


class Inbound(NamedTuple):
    """One accepted frame.

    :ivar route: ZMQ routing id to reply through (ROUTER sockets; ``b""`` otherwise). Only for
        addressing a reply, never an identity.
    :ivar sender: the authenticated sender identity from the envelope (``""`` on a plain codec).
    :ivar epoch: the sender's epoch (0 on a plain codec).
    :ivar msg: the decoded Struct.
    """

    route: bytes
    sender: str
    epoch: int
    msg: Any


def _tag(t: type) -> object:
    cfg = getattr(t, "__struct_config__", None)
    return None if cfg is None else cfg.tag


def _tag_field(t: type) -> str:
    cfg = getattr(t, "__struct_config__", None)
    return "type" if cfg is None or cfg.tag_field is None else str(cfg.tag_field)


def _new_epoch() -> int:
    return (time.time_ns() // 1000) << 12 | secrets.randbits(12)


class Codec(Generic[T]):
    """Encode/decode one socket's messages: size limit, HMAC, sender envelope, drop counters.

    :param types: the Struct types this socket accepts. More than one must all be tagged
        (``tag=...``) so the union can be decoded strictly.
    :param max_bytes: largest accepted frame (bytes, MAC and envelope included); larger frames
        are dropped on decode and raise ``ValueError`` on encode.
    :param hmac_key: shared secret; ``None`` disables authentication.
    :param name: label used in logs.
    :param identity: this endpoint's sender identity; makes the codec *sealed* (module doc).
    :param members: identities accepted from (sealed only); ``None`` accepts any sender
        (authenticated by the key when one is set).
    :param replay_window_s: how far (seconds) a new epoch's send time may be from this host's
        clock (sealed only).
    :raises ValueError: empty ``types``, ``max_bytes <= 0``, ``replay_window_s <= 0``, or
        ``members`` without ``identity``.
    :raises TypeError: a key that is not bytes, or types that cannot form a strict union.

    Thread-safe: counters and the replay table are guarded by a lock. On a sealed codec the
    caller sends frames to each receiver in the order :meth:`encode` produced them (encode and
    send on one thread); a receiver drops a frame that overtakes a later one.
    """

    def __init__(
        self,
        *types: type[T],
        max_bytes: int = 16 << 20,
        hmac_key: bytes | None = None,
        name: str = "wire",
        identity: str | None = None,
        members: Iterable[str] | None = None,
        replay_window_s: float = 30.0,
    ) -> None:
        if not types:
            raise ValueError("Codec: types is empty; pass the Struct types this socket accepts")
        if max_bytes <= 0:
            raise ValueError(f"Codec: max_bytes must be > 0, got {max_bytes}")
        if hmac_key is not None and not isinstance(hmac_key, bytes):
            raise TypeError(f"Codec: hmac_key must be bytes or None, got {type(hmac_key).__name__}")
        if members is not None and identity is None:
            raise ValueError(f"Codec {name}: members={members!r} needs identity= (a sealed codec)")
        if not replay_window_s > 0:
            raise ValueError(f"Codec: replay_window_s must be > 0, got {replay_window_s}")
        self.types = types
        self.max_bytes = max_bytes
        self.name = name
        self._key = hmac_key or None
        self.identity = identity
        self.members = None if members is None else frozenset(members)
        self.epoch = _new_epoch()
        self._seq = itertools.count(1)
        self._window_ms = replay_window_s * 1000.0
        self._peers: dict[str, tuple[int, int]] = {}  # sender -> (epoch, last seq)
        self._enc = msgspec.msgpack.Encoder()
        self._env_dec = msgspec.msgpack.Decoder(_Envelope)
        if len(types) > 1:
            untagged = [t.__name__ for t in types if _tag(t) is None]
            if untagged:
                raise TypeError(
                    f"Codec: {untagged} have no msgspec tag; every type of a multi-type socket "
                    "must be a Struct declared with tag=... so the union decodes strictly"
                )
        target: Any = types[0] if len(types) == 1 else Union[types]
        try:
            self._dec = msgspec.msgpack.Decoder(target)
        except TypeError as e:
            names = ", ".join(t.__name__ for t in types)
            raise TypeError(f"Codec: cannot decode the union of {names}: {e}") from e
        # tag values this socket knows, to tell an unknown kind from a malformed known one
        self._tags = {_tag(t) for t in types} - {None}
        self._tag_fields = {_tag_field(t) for t in types if _tag(t) is not None}
        self._lock = threading.Lock()
        self.drops: Counter[str] = Counter()
        self.accepted = 0

    @classmethod
    def from_config(
        cls,
        wire: WireConfig,
        *types: type[T],
        name: str = "wire",
        identity: str | None = None,
        members: Iterable[str] | None = None,
    ) -> Codec[T]:
        """The one constructor sockets use: ``wire``'s size limit, key and replay window.

        :param wire: the :class:`~pdplug.config.WireConfig` shared by every process.
        :param types: the Struct types the socket accepts.
        :param name: label used in logs.
        :param identity: this endpoint's sender identity (sealed codec).
        :param members: identities accepted from; ``None``: any sender holding the key.
        """
        return cls(
            *types,
            max_bytes=wire.max_message_bytes,
            hmac_key=wire.hmac_key,
            name=name,
            identity=identity,
            members=members,
            replay_window_s=wire.replay_window_s,
        )

    @property
    def sealed(self) -> bool:
        """Whether frames carry the sender envelope."""
        return self.identity is not None

    def encode(self, msg: T) -> bytes:
        """Encode ``msg`` into one frame (sealed codecs: with the next ``seq``).

        :raises TypeError: ``msg`` is not one of this codec's types.
        :raises ValueError: the frame would exceed ``max_bytes``.
        """
        if not isinstance(msg, self.types):
            raise TypeError(
                f"{self.name}: cannot encode {type(msg).__name__}; accepted types: "
                + ", ".join(t.__name__ for t in self.types)
            )
        payload = self._enc.encode(msg)
        if self.identity is not None:
            env = _Envelope(
                self.identity,
                self.epoch,
                next(self._seq),
                time.time_ns() // 1_000_000,
                msgspec.Raw(payload),
            )
            payload = self._enc.encode(env)
        frame = (
            _hmac.new(self._key, payload, hashlib.sha256).digest() + payload
            if self._key
            else payload
        )
        if len(frame) > self.max_bytes:
            raise ValueError(
                f"{self.name}: {type(msg).__name__} is {len(frame)} bytes, over max_bytes="
                f"{self.max_bytes}"
            )
        return frame

    def decode(self, frame: object) -> T | None:
        """Decode one frame; return ``None`` (and count why) when it must be dropped.

        :param frame: any object; bytes-like objects (``bytes``, ``bytearray``,
            ``memoryview``, ``zmq.Frame``) are decoded, anything else is dropped as
            ``malformed``.
        :returns: the decoded Struct, or ``None`` when the frame was dropped. Never raises.
        """
        got = self.decode_from(frame)
        return None if got is None else got.msg  # type: ignore[no-any-return]

    def decode_from(self, frame: object, route: bytes = b"") -> Inbound | None:
        """Decode one frame with its sender; ``None`` (counted) when it must be dropped.

        Checks, in order: size, HMAC, envelope, member, freshness, payload type.

        :param frame: as for :meth:`decode`.
        :param route: routing id to carry into the result (ROUTER sockets).
        :returns: :class:`Inbound`, or ``None`` when dropped. Never raises.
        """
        try:
            buf = memoryview(frame).cast("B")  # type: ignore[arg-type]
        except (TypeError, ValueError):
            return self._dropped("malformed")
        if buf.nbytes > self.max_bytes:
            return self._dropped("oversize")
        if self._key:
            if buf.nbytes < MAC_BYTES:
                return self._dropped("hmac")
            mac, buf = bytes(buf[:MAC_BYTES]), buf[MAC_BYTES:]
            want = _hmac.new(self._key, buf, hashlib.sha256).digest()
            if not _hmac.compare_digest(mac, want):
                return self._dropped("hmac")
        if self.identity is None:
            msg = self._payload(buf)
            return None if msg is None else self._accept(Inbound(route, "", 0, msg))
        try:
            env = self._env_dec.decode(buf)
        except Exception:  # not an envelope: a plain or hostile frame
            return self._dropped("malformed")
        if self.members is not None and env.sender not in self.members:
            return self._dropped("unknown_rank")
        if not self._fresh(env):
            return self._dropped("replay")
        msg = self._payload(env.body)
        return None if msg is None else self._accept(Inbound(route, env.sender, env.epoch, msg))

    def _fresh(self, env: _Envelope) -> bool:
        """Record ``env`` as the sender's latest frame unless it is a replay (module doc)."""
        with self._lock:
            last = self._peers.get(env.sender)
            if last is not None and env.epoch == last[0]:
                if env.seq <= last[1]:
                    return False
                self._peers[env.sender] = (env.epoch, env.seq)
                return True
            if last is not None and env.epoch < last[0]:
                return False
            if abs(time.time_ns() / 1e6 - env.sent_ms) > self._window_ms:
                return False
            if last is None and len(self._peers) >= MAX_SENDERS:
                del self._peers[next(iter(self._peers))]
            self._peers[env.sender] = (env.epoch, env.seq)
            return True

    def _payload(self, payload: Any) -> T | None:
        try:
            return self._dec.decode(payload)  # type: ignore[no-any-return]
        except msgspec.ValidationError:
            return self._dropped("unknown_kind" if self._unknown_kind(payload) else "wrong_type")
        except (msgspec.DecodeError, ValueError, TypeError):
            return self._dropped("malformed")
        except Exception:  # never let a hostile frame escape into the caller's loop
            log.exception("%s: unexpected error decoding a frame", self.name)
            return self._dropped("other")

    def _unknown_kind(self, payload: Any) -> bool:
        """Whether a frame that failed validation carries a tag this socket does not know."""
        if not self._tags:
            return False
        try:
            raw = msgspec.msgpack.decode(payload)
        except Exception:
            return False

        def known(v: object) -> bool:  # tags are str or int; junk may be unhashable
            return isinstance(v, (str, int)) and v in self._tags

        if isinstance(raw, dict):
            return not any(known(raw.get(f)) for f in self._tag_fields)
        if isinstance(raw, list):  # array_like structs carry the tag first
            return not raw or not known(raw[0])
        return True

    def _accept(self, got: Inbound) -> Inbound:
        with self._lock:
            self.accepted += 1
        return got

    def _dropped(self, reason: str) -> Any:  # None, typed for `return self._dropped(...)`
        self.drop(reason)
        return None

    def drop(self, reason: str) -> None:
        """Count one dropped message under ``reason`` (see :data:`DROP_REASONS`)."""
        with self._lock:
            self.drops[reason] += 1
        log.debug("%s: dropped a frame (%s)", self.name, reason)

    @property
    def dropped(self) -> int:
        """Total frames dropped, all reasons."""
        with self._lock:
            return sum(self.drops.values())

    def stats(self) -> dict[str, int]:
        """``{"accepted": n, "dropped": n, "dropped_<reason>": n, …}``."""
        with self._lock:
            out = {"accepted": self.accepted, "dropped": sum(self.drops.values())}
            out.update({f"dropped_{k}": v for k, v in self.drops.items()})
            return out


def rank_identity(instance: str, layout: KVLayout) -> str:
    """Sender identity of a KV rank: ``"<instance> tp<r> pp<r>"`` (``" dcp<r>"`` when DCP > 1).

    :param instance: the instance id (``KVConfig.instance``).
    :param layout: the rank's layout (its TP / PP / DCP ranks).
    """
    dcp = f" dcp{layout.dcp_rank}" if layout.dcp_size > 1 else ""
    return f"{instance} tp{layout.tp_rank} pp{layout.pp_rank}{dcp}"


def peer_identity(peer: PeerInfo) -> str:
    """:func:`rank_identity` of the rank ``peer`` describes: the identity a prefill rank
    registers under at the rendezvous, and the one its control frames carry."""
    return rank_identity(peer.instance, peer.layout)
