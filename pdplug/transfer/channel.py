"""The control channel of a KV session: ZMQ sockets, authenticated frame intake, sends, liveness.

A prefill rank binds one ROUTER (:class:`RouterChannel`); each decode rank connects one DEALER
per prefill rank (:class:`DealerChannel`). Every socket comes from
:func:`pdplug.wire.make_socket` (``ZMQ_MAXMSGSIZE`` = ``WireConfig.max_message_bytes``, so an
oversized frame is never buffered; linger 0, but for a closing prefill's failure notices; a
socket off loopback without ``WireConfig.hmac_key`` is refused) and every frame is one
msgspec Struct sealed by a :class:`~pdplug.wire.Codec` (strict typed decode, size limit, HMAC
when keyed, sender identity, epoch and sequence; never pickle), received through
:func:`pdplug.wire.drain`.

Who sent a frame is the authenticated sender identity in its envelope
(:class:`~pdplug.wire.Inbound` ``.sender``, :func:`~pdplug.wire.rank_identity` of the sending
rank), never a ZMQ routing id: DEALERs keep the random routing id libzmq gives them, and a
ROUTER uses it only to address a reply. Replayed frames, frames of an older epoch of a sender,
and (on a DEALER) frames from anyone but the prefill rank it connects to are dropped and counted
by the codec. Each DEALER has its own codec: its own epoch (a new connection is a new
incarnation to the prefill rank) and the prefill rank's identity as its only member.

Frames are encoded on the engine thread immediately before they are sent, so each receiver sees
one codec's sequence numbers in order; a frame a host thread sends (holding the engine lock) is
queued and sent by the loop thread, after every frame queued before it. Sends never block: a
frame a peer cannot take now is counted (``control_send_failed``) and the session's own
timeouts decide what that means. A
DEALER connection libzmq cut for good (a frame over the size limit) is replaced by
:meth:`DealerChannel.revive`.
:class:`Liveness` paces heartbeats and says when a peer has been silent for too long
(``KVConfig.transfer_timeout_s``). All methods run on the session's engine thread.
"""

from __future__ import annotations

import logging
import time
import uuid
from collections import Counter
from collections.abc import Callable, Iterable, Mapping
from typing import Any

import zmq
from zmq.utils.monitor import recv_monitor_message

from pdplug.config import WireConfig
from pdplug.transfer.loop import EngineLoop
from pdplug.transfer.messages import control_codec
from pdplug.wire import Codec, Inbound, drain, endpoint_of, make_socket

__all__ = ["Liveness", "RouterChannel", "DealerChannel", "merge_stats"]

log = logging.getLogger(__name__)

_BATCH = 256  # frames taken per readable event, so one chatty peer cannot starve the loop
#: seconds a cut DEALER connection may go without a reconnect attempt before it is replaced
REVIVE_S = 0.5
_CUT_EVENTS = zmq.EVENT_DISCONNECTED
_RETRY_EVENTS = zmq.EVENT_CONNECT_DELAYED | zmq.EVENT_CONNECT_RETRIED | zmq.EVENT_CONNECTED


def merge_stats(stats: Iterable[Mapping[str, int]]) -> dict[str, int]:
    """Sum codec counters key by key.

    :param stats: counter mappings (:meth:`pdplug.wire.Codec.stats`), e.g. one per connection.
    :returns: ``{name: total}`` over every mapping.
    """
    out: Counter[str] = Counter()
    for s in stats:
        out.update(s)
    return dict(out)


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
    :param wire: socket rules (bind interface, size limit, key).
    :param codec: the session's sealed control codec (any key holder may send; the session
        keys peers by :attr:`~pdplug.wire.Inbound.sender`).
    :param on_message: ``(frame, now)`` for every accepted frame (``now``: monotonic seconds).
    :param counts: the session's counters (``control_send_failed``).
    :raises ValueError: ``wire.bind_host`` is off loopback and ``wire.hmac_key`` is ``None``.
    :raises zmq.ZMQError: the bind failed.
    """

    def __init__(
        self,
        loop: EngineLoop,
        wire: WireConfig,
        codec: Codec[Any],
        on_message: Callable[[Inbound, float], None],
        counts: Counter[str],
    ) -> None:
        self._loop = loop
        self._codec = codec
        self._on_message = on_message
        self._counts = counts
        self.sock = make_socket(
            zmq.Context.instance(), zmq.ROUTER, wire, bind=0, name=f"{codec.name} (ROUTER)"
        )
        self.endpoint = endpoint_of(self.sock)
        loop.add_socket(self.sock, self._on_readable)

    def send(self, route: bytes, msg: Any) -> None:
        """Encode ``msg`` and send it to the connection ``route`` (a routing id from an
        accepted frame); never blocks. From a host thread (holding the engine lock) it is sent
        by the loop thread at its next round (:meth:`EngineLoop.defer`)."""
        self._loop.defer(lambda: self._send(route, msg))

    def _send(self, route: bytes, msg: Any) -> None:
        try:
            self.sock.send_multipart([route, self._codec.encode(msg)], zmq.NOBLOCK)
        except zmq.ZMQError as e:
            self._counts["control_send_failed"] += 1
            log.debug("%s: control send failed: %s", self._loop.name, e)

    def close(self, linger_s: float = 0.0) -> None:
        """Stop polling and close the socket; messages already queued keep being sent for
        ``linger_s`` seconds (by ZeroMQ's I/O thread: this call does not wait)."""
        self._loop.remove_socket(self.sock)
        self.sock.close(linger=int(linger_s * 1000))

    def _on_readable(self, sock: Any) -> None:
        for got in drain(sock, self._codec, limit=_BATCH):
            self._on_message(got, time.monotonic())


class DealerChannel:
    """The decode rank's control sockets: one DEALER (and one sealed codec) per prefill rank.

    :param loop: the session's engine loop (every socket is polled by it).
    :param wire: socket rules (size limit, key).
    :param identity: this decode rank's sender identity (:func:`~pdplug.wire.rank_identity`).
    :param name: label of the codecs (logs).
    :param on_message: ``(connection id, msg, now)`` for every accepted frame; the connection
        id is :meth:`open`'s return value, and the frame was sealed by that connection's
        prefill rank (its codec's only member).
    :param counts: the session's counters (``control_send_failed``, ``control_reconnected``).
    """

    def __init__(
        self,
        loop: EngineLoop,
        wire: WireConfig,
        identity: str,
        name: str,
        on_message: Callable[[bytes, Any, float], None],
        counts: Counter[str],
    ) -> None:
        self._loop = loop
        self._wire = wire
        self._identity = identity
        self._name = name
        self._on_message = on_message
        self._counts = counts
        self._socks: dict[bytes, Any] = {}
        self._codecs: dict[bytes, Codec[Any]] = {}
        self._monitors: dict[bytes, Any] = {}
        self._endpoints: dict[bytes, str] = {}
        self._ids: dict[Any, bytes] = {}  # DEALER or its monitor -> connection id
        self._cut: dict[bytes, float] = {}  # connection id -> when libzmq cut it
        self._peer_closed: set[bytes] = set()  # cut, and not connected again since
        self._closed: Counter[str] = Counter()  # counters of closed connections' codecs

    def open(self, endpoint: str, member: str) -> bytes:
        """Connect a new DEALER to ``endpoint``, accepting frames sealed by ``member`` only.

        :param endpoint: the prefill rank's control endpoint.
        :param member: the prefill rank's identity (:func:`~pdplug.wire.peer_identity`).
        :returns: a local connection id (never sent on the wire).
        :raises ValueError: ``endpoint`` is off loopback and ``WireConfig.hmac_key`` is
            ``None``, or it is malformed.
        """
        codec = control_codec(
            self._wire, identity=self._identity, members=(member,), name=f"{self._name}>{member}"
        )
        cid = uuid.uuid4().bytes
        self._codecs[cid] = codec
        self._endpoints[cid] = endpoint
        self._attach(cid)
        return cid

    def _attach(self, cid: bytes) -> None:
        """Connect a fresh DEALER (and its event monitor) for connection ``cid``."""
        ep, name = self._endpoints[cid], self._codecs[cid].name
        sock = make_socket(zmq.Context.instance(), zmq.DEALER, self._wire, connect=ep, name=name)
        mon = sock.get_monitor_socket(_CUT_EVENTS | _RETRY_EVENTS)
        self._socks[cid] = sock
        self._monitors[cid] = mon
        self._ids[sock] = self._ids[mon] = cid
        self._loop.add_socket(sock, self._on_readable)
        self._loop.add_socket(mon, self._on_event)

    def _detach(self, cid: bytes) -> None:
        sock, mon = self._socks.pop(cid), self._monitors.pop(cid)
        self._cut.pop(cid, None)
        self._peer_closed.discard(cid)
        for s in (mon, sock):
            del self._ids[s]
            self._loop.remove_socket(s)
        sock.disable_monitor()
        mon.close(linger=0)
        sock.close(linger=0)

    def revive(self, now: float) -> None:
        """Reconnect every connection libzmq cut for good.

        libzmq reconnects a DEALER by itself after a connection error, but terminates it after
        a protocol error (a frame over ``ZMQ_MAXMSGSIZE``, which only an on-path attacker
        sends): its socket then never talks again. A connection cut (``EVENT_DISCONNECTED``)
        with no reconnect attempt within :data:`REVIVE_S` seconds gets a fresh DEALER to the
        same endpoint under the same codec (its sequence carries on, so the prefill rank keeps
        the peer and learns the new routing id from the next frame), counted as
        ``control_reconnected``. Frames queued on the cut socket are lost; the session's
        timeouts bound what that costs.

        :param now: monotonic seconds.
        """
        for cid, t in list(self._cut.items()):
            if now - t < REVIVE_S or cid not in self._socks:
                continue
            closed = cid in self._peer_closed  # still true of the far end until it answers
            self._detach(cid)
            self._attach(cid)
            if closed:
                self._peer_closed.add(cid)
            self._counts["control_reconnected"] += 1
            log.warning(
                "%s: control connection to %s was cut; reconnected",
                self._name,
                self._endpoints[cid],
            )

    def _on_event(self, mon: Any) -> None:
        cid = self._ids.get(mon)
        for _ in range(_BATCH):
            try:
                event = recv_monitor_message(mon, zmq.NOBLOCK)["event"]
            except zmq.Again:
                return
            if cid is None:
                continue
            if event & _CUT_EVENTS:
                self._cut[cid] = time.monotonic()
                self._peer_closed.add(cid)
            else:
                self._cut.pop(cid, None)
                if event & zmq.EVENT_CONNECTED:
                    self._peer_closed.discard(cid)

    def closed_by_peer(self, cid: bytes) -> bool:
        """Whether connection ``cid`` was cut (the far end closed or reset it: its process
        ended, or its kernel forgot the connection) and has not connected again since. A
        partition never shows here: no FIN or RST crosses it."""
        return cid in self._peer_closed

    def codec(self, cid: bytes) -> Codec[Any] | None:
        """The codec of connection ``cid`` (``None`` once closed)."""
        return self._codecs.get(cid)

    def send(self, cid: bytes, msg: Any) -> None:
        """Encode ``msg`` and send it on connection ``cid``; never blocks (unknown ids are
        ignored). From a host thread, sent by the loop thread (:meth:`EngineLoop.defer`)."""
        self._loop.defer(lambda: self._send(cid, msg))

    def _send(self, cid: bytes, msg: Any) -> None:
        sock = self._socks.get(cid)
        if sock is None:
            return
        try:
            sock.send(self._codecs[cid].encode(msg), zmq.NOBLOCK)
        except zmq.ZMQError as e:
            self._counts["control_send_failed"] += 1
            log.debug("%s: control send failed: %s", self._loop.name, e)

    def close(self, cid: bytes) -> None:
        """Close connection ``cid``; idempotent. Its codec's counters stay in :meth:`stats`."""
        if cid not in self._socks:
            return
        self._detach(cid)
        self._endpoints.pop(cid)
        self._closed.update(self._codecs.pop(cid).stats())

    def close_all(self) -> None:
        """Close every connection."""
        for cid in list(self._socks):
            self.close(cid)

    def stats(self) -> dict[str, int]:
        """The counters of every connection's codec, open or closed, summed."""
        return merge_stats([self._closed, *(c.stats() for c in self._codecs.values())])

    def __len__(self) -> int:
        return len(self._socks)

    def _on_readable(self, sock: Any) -> None:
        cid = self._ids.get(sock)
        if cid is None:
            return
        for got in drain(sock, self._codecs[cid], limit=_BATCH):
            self._on_message(cid, got.msg, time.monotonic())
            if cid not in self._socks:  # the handler closed this connection
                return
