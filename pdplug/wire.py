"""The one codec every pdplug socket uses (DESIGN.md §4).

Frames are msgpack-encoded frozen msgspec Structs decoded strictly into a tagged union of the
expected types. Never pickle. A frame that is too large, fails the optional HMAC-SHA256, is not
valid msgpack, has an unknown tag, or has fields of the wrong type is **dropped and counted**;
nothing raises into the caller's loop. Callers that reject a well-formed message on semantic
grounds (unknown rank, stale generation) count it with :meth:`Codec.drop`.

Frame layout: ``[32-byte HMAC-SHA256 of payload]`` (only when a key is set) ``+ payload``.
"""

from __future__ import annotations

import hashlib
import hmac as _hmac
import logging
import threading
from collections import Counter
from typing import Any, Generic, TypeVar, Union

import msgspec

from pdplug.config import WireConfig

__all__ = ["Codec", "DROP_REASONS", "MAC_BYTES"]

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
    "stale",
    "other",
)


def _tag(t: type) -> object:
    cfg = getattr(t, "__struct_config__", None)
    return None if cfg is None else cfg.tag


def _tag_field(t: type) -> str:
    cfg = getattr(t, "__struct_config__", None)
    return "type" if cfg is None or cfg.tag_field is None else str(cfg.tag_field)


class Codec(Generic[T]):
    """Encode/decode one socket's messages with size limit, HMAC and drop counters.

    :param types: the Struct types this socket accepts. More than one must all be tagged
        (``tag=...``) so the union can be decoded strictly.
    :param max_bytes: largest accepted frame (bytes, HMAC included); larger frames are dropped
        on decode and raise ``ValueError`` on encode.
    :param hmac_key: shared secret; ``None`` disables authentication.
    :param name: label used in logs.

    Thread-safe: counters are guarded by a lock, msgspec encoders/decoders are reentrant.
    """

    def __init__(
        self,
        *types: type[T],
        max_bytes: int = 16 << 20,
        hmac_key: bytes | None = None,
        name: str = "wire",
    ) -> None:
        if not types:
            raise ValueError("Codec: types is empty; pass the Struct types this socket accepts")
        if max_bytes <= 0:
            raise ValueError(f"Codec: max_bytes must be > 0, got {max_bytes}")
        if hmac_key is not None and not isinstance(hmac_key, bytes):
            raise TypeError(f"Codec: hmac_key must be bytes or None, got {type(hmac_key).__name__}")
        self.types = types
        self.max_bytes = max_bytes
        self.name = name
        self._key = hmac_key or None
        self._enc = msgspec.msgpack.Encoder()
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

    def encode(self, msg: T) -> bytes:
        """Encode ``msg`` into one frame.

        :raises TypeError: ``msg`` is not one of this codec's types.
        :raises ValueError: the frame would exceed ``max_bytes``.
        """
        if not isinstance(msg, self.types):
            raise TypeError(
                f"{self.name}: cannot encode {type(msg).__name__}; accepted types: "
                + ", ".join(t.__name__ for t in self.types)
            )
        payload = self._enc.encode(msg)
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

    @classmethod
    def from_config(cls, wire: WireConfig, *types: type[T], name: str = "wire") -> Codec[T]:
        """A codec applying ``wire``'s size limit and HMAC key (what every socket should use).

        :param wire: the :class:`~pdplug.config.WireConfig` shared by every rank.
        :param types: the Struct types the socket accepts.
        :param name: label used in logs.
        """
        return cls(*types, max_bytes=wire.max_message_bytes, hmac_key=wire.hmac_key, name=name)

    def decode(self, frame: object) -> T | None:
        """Decode one frame; return ``None`` (and count why) when it must be dropped.

        :param frame: any object; bytes-like objects (``bytes``, ``bytearray``,
            ``memoryview``, ``zmq.Frame``) are decoded, anything else is dropped as
            ``malformed``.
        :returns: the decoded Struct, or ``None`` when the frame was dropped. Never raises.
        """
        try:
            buf = memoryview(frame).cast("B")  # type: ignore[arg-type]
        except (TypeError, ValueError):
            self.drop("malformed")
            return None
        if buf.nbytes > self.max_bytes:
            self.drop("oversize")
            return None
        n = buf.nbytes
        if self._key:
            if n < MAC_BYTES:
                self.drop("hmac")
                return None
            mac, payload = bytes(buf[:MAC_BYTES]), buf[MAC_BYTES:]
            want = _hmac.new(self._key, payload, hashlib.sha256).digest()
            if not _hmac.compare_digest(mac, want):
                self.drop("hmac")
                return None
        else:
            payload = buf
        try:
            msg = self._dec.decode(payload)
        except msgspec.ValidationError:
            self.drop("unknown_kind" if self._unknown_kind(payload) else "wrong_type")
            return None
        except (msgspec.DecodeError, ValueError, TypeError):
            self.drop("malformed")
            return None
        except Exception:  # never let a hostile frame escape into the caller's loop
            log.exception("%s: unexpected error decoding a frame", self.name)
            self.drop("other")
            return None
        with self._lock:
            self.accepted += 1
        return msg  # type: ignore[no-any-return]

    def _unknown_kind(self, payload: memoryview) -> bool:
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
