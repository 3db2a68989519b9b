"""The wire rules every pdplug socket applies: one codec, one socket factory, one receive loop.

* :class:`Codec` (:mod:`pdplug.wire.codec`): strict msgspec frames, size limit, HMAC, the
  sender envelope (identity, epoch, sequence) and replay rejection; drops are counted.
* :func:`make_socket`, :func:`drain` (:mod:`pdplug.wire.sockets`): every socket gets
  ``ZMQ_MAXMSGSIZE``, linger 0 and the off-loopback key check; one receive loop.
"""

from __future__ import annotations

from pdplug.wire.codec import (
    DROP_REASONS,
    MAC_BYTES,
    MAX_SENDERS,
    Codec,
    Inbound,
    peer_identity,
    rank_identity,
)
from pdplug.wire.sockets import drain, endpoint_of, is_loopback, make_socket, require_key

__all__ = [
    "Codec",
    "DROP_REASONS",
    "Inbound",
    "MAC_BYTES",
    "MAX_SENDERS",
    "drain",
    "endpoint_of",
    "is_loopback",
    "make_socket",
    "peer_identity",
    "rank_identity",
    "require_key",
]
