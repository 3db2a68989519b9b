"""The control channel of a KV session: ZMQ sockets, frame intake, sends and peer liveness.

A prefill rank binds one ROUTER (:class:`RouterChannel`); each decode rank connects one DEALER
per prefill rank (:class:`DealerChannel`). Every frame is one msgspec Struct encoded by the
session's :class:`~pdplug.wire.Codec` (strict typed decode, size limit, optional HMAC; never
pickle). Every socket refuses frames above the wire's size limit inside ZMQ
(``ZMQ_MAXMSGSIZE``), so an oversized frame is never buffered, and lingers 0 ms on close.

Who sent a frame is decided in one place, :func:`frame_sender`. Sends never block: a frame a
peer cannot take now is counted (``control_send_failed``) and the sender's own timeouts decide
what that means. :class:`Liveness` paces heartbeats and says when a peer has been silent for too
long (``KVConfig.transfer_timeout_s``). All methods run on the session's engine thread.
"""

from __future__ import annotations

import logging
import time
import uuid
from collections import Counter
from collections.abc import Callable
from typing import Any

import zmq

from pdplug.bootstrap import bind_random
from pdplug.config import WireConfig
from pdplug.transfer.loop import EngineLoop
from pdplug.wire import MAC_BYTES, Codec

__all__ = [
    "control_socket",
    "frame_sender",
    "Liveness",
    "RouterChannel",
    "DealerChannel",
]

log = logging.getLogger(__name__)

#: ``on_message(sender, msg, now)``: a decoded frame, its sender id and the monotonic time
OnMessage = Callable[[bytes, Any, float], None]

_BATCH = 256  # frames taken per readable event, so one chatty peer cannot starve the loop


def control_socket(kind: int, wire: WireConfig) -> Any:
    """A ZMQ socket of ``kind`` (``zmq.ROUTER``/``zmq.DEALER``) for the control channel:
    ``LINGER`` 0 and ``MAXMSGSIZE`` = ``wire.max_message_bytes`` + the HMAC bytes, so ZMQ
    drops (and disconnects) a peer sending a larger frame instead of buffering it."""
    sock: Any = zmq.Context.instance().socket(kind)
    sock.setsockopt(zmq.LINGER, 0)
    sock.setsockopt(zmq.MAXMSGSIZE, wire.max_message_bytes + MAC_BYTES)
    return sock


def frame_sender(frames: list[bytes], peer: bytes | None = None) -> tuple[bytes, bytes] | None:
    """Who sent a control frame, and its payload: the one place a session decides it.

    :param frames: the multipart message as received.
    :param peer: ``None`` on a ROUTER (the sender is the ZMQ routing id ZMQ put first); on a
        DEALER, the id of the prefill rank the socket connects to (a DEALER talks to one peer).
    :returns: ``(sender id, payload)``, or ``None`` for a malformed multipart message.
    """
    if peer is None:
        return (frames[0], frames[1]) if len(frames) == 2 else None
    return (peer, frames[0]) if len(frames) == 1 else None


class Liveness:
    """Heartbeat pacing and the silence bound of one session's peers.

    Silence is counted only while this side could listen: after this side's own engine thread
    stalled (a round more than ``timeout_s / 2`` after the previous one — an overloaded host, a
    long GC pause), peers get a fresh ``timeout_s`` before they are called silent.

    :param timeout_s: a peer silent this long is dead (``KVConfig.transfer_timeout_s``);
        heartbeats go out every ``timeout_s / 5`` seconds, clamped to [0.05, 1].
    """

    def __init__(self, timeout_s: float) -> None:
        self.timeout_s = timeout_s
        self.interval_s = max(0.05, min(1.0, timeout_s / 5))
        self.seq = 0
        self._next = 0.0
        self._last = 0.0
        self._resumed = 0.0

    def due(self, now: float) -> bool:
        """Whether a heartbeat round is due at ``now`` (then ``seq`` moved on); called every
        round, it also notices when this side stalled."""
        if self._last and now - self._last > max(2 * self.interval_s, self.timeout_s / 2):
            self._resumed = now
        self._last = now
        if now < self._next:
            return False
        self._next = now + self.interval_s
        self.seq += 1
        return True

    def silent_for(self, last_seen: float, now: float) -> float | None:
        """Seconds a peer last seen at ``last_seen`` has been silent while this side listened,
        if that is over the bound; ``None`` while it is alive."""
        silent = now - max(last_seen, self._resumed)
        return silent if silent > self.timeout_s else None


class RouterChannel:
    """The prefill rank's control socket: one ROUTER every decode rank connects to.

    :param loop: the session's engine loop (the socket is polled by it).
    :param wire: socket rules (bind interface, size limit).
    :param codec: the session's control codec (decode counts its drops).
    :param on_message: called for every decoded frame with the sender id (:func:`frame_sender`).
    :param counts: the session's counters (``control_send_failed``).
    """

    def __init__(
        self,
        loop: EngineLoop,
        wire: WireConfig,
        codec: Codec[Any],
        on_message: OnMessage,
        counts: Counter[str],
    ) -> None:
        self._loop = loop
        self._codec = codec
        self._on_message = on_message
        self._counts = counts
        self.sock = control_socket(zmq.ROUTER, wire)
        self.endpoint = bind_random(self.sock, wire.bind_host)
        loop.add_socket(self.sock, self._on_readable)

    def send(self, ident: bytes, msg: Any) -> None:
        """Send ``msg`` to the decode rank ``ident``; never blocks."""
        try:
            self.sock.send_multipart([ident, self._codec.encode(msg)], zmq.NOBLOCK)
        except zmq.ZMQError as e:
            self._counts["control_send_failed"] += 1
            log.debug("%s: control send failed: %s", self._loop.name, e)

    def close(self) -> None:
        """Stop polling and close the socket."""
        self._loop.remove_socket(self.sock)
        self.sock.close(linger=0)

    def _on_readable(self, sock: Any) -> None:
        for _ in range(_BATCH):
            try:
                frames = sock.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                return
            got = frame_sender(frames)
            if got is None:
                self._codec.drop("malformed")
                continue
            msg = self._codec.decode(got[1])
            if msg is not None:
                self._on_message(got[0], msg, time.monotonic())


class DealerChannel:
    """The decode rank's control sockets: one DEALER per prefill rank.

    :param loop: the session's engine loop (every socket is polled by it).
    :param wire: socket rules (size limit).
    :param codec: the session's control codec.
    :param on_message: called for every decoded frame with the id of the prefill rank's
        connection (:meth:`open`'s return value).
    :param counts: the session's counters (``control_send_failed``).
    """

    def __init__(
        self,
        loop: EngineLoop,
        wire: WireConfig,
        codec: Codec[Any],
        on_message: OnMessage,
        counts: Counter[str],
    ) -> None:
        self._loop = loop
        self._wire = wire
        self._codec = codec
        self._on_message = on_message
        self._counts = counts
        self._socks: dict[bytes, Any] = {}
        self._ids: dict[Any, bytes] = {}

    def open(self, endpoint: str) -> bytes:
        """Connect a new DEALER to ``endpoint``; returns the connection id frames from it carry
        (a fresh random id, also the socket's routing id at the prefill rank)."""
        cid = uuid.uuid4().bytes
        sock = control_socket(zmq.DEALER, self._wire)
        sock.setsockopt(zmq.IDENTITY, cid)
        sock.connect(endpoint)
        self._socks[cid] = sock
        self._ids[sock] = cid
        self._loop.add_socket(sock, self._on_readable)
        return cid

    def send(self, cid: bytes, msg: Any) -> None:
        """Send ``msg`` on connection ``cid``; never blocks (unknown ids are ignored)."""
        sock = self._socks.get(cid)
        if sock is None:
            return
        try:
            sock.send(self._codec.encode(msg), zmq.NOBLOCK)
        except zmq.ZMQError as e:
            self._counts["control_send_failed"] += 1
            log.debug("%s: control send failed: %s", self._loop.name, e)

    def close(self, cid: bytes) -> None:
        """Close connection ``cid``; idempotent."""
        sock = self._socks.pop(cid, None)
        if sock is None:
            return
        del self._ids[sock]
        self._loop.remove_socket(sock)
        sock.close(linger=0)

    def close_all(self) -> None:
        """Close every connection."""
        for cid in list(self._socks):
            self.close(cid)

    def __len__(self) -> int:
        return len(self._socks)

    def _on_readable(self, sock: Any) -> None:
        cid = self._ids.get(sock)
        for _ in range(_BATCH):
            try:
                frames = sock.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                return
            if cid is None:
                continue
            got = frame_sender(frames, cid)
            if got is None:
                self._codec.drop("malformed")
                continue
            msg = self._codec.decode(got[1])
            if msg is not None:
                self._on_message(got[0], msg, time.monotonic())
