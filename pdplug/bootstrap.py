"""Rendezvous: prefill ranks register their :class:`~pdplug.types.PeerInfo`; decode ranks
resolve a prefill instance once every one of its ranks registered (ZMQ ROUTER + msgspec).

The server answers "not ready" (``Resolved.ready = False`` with the registered count) until all
``pp_size * tp_size`` ranks of the instance registered, like SGLang's bootstrap server answering
503 until ``registered >= dp*cp*tp*pp`` (prior-art sglang.md §1.3). A rank's id is
``pp_rank * tp_size + tp_rank`` of its layout (:func:`rank_of`). Re-registering a rank replaces
its entry (a restarted rank); a rank whose instance geometry disagrees with the ranks already
registered is refused with a reason.

The server runs in a thread and can be started by a host process or by a prefill rank::

    server = RendezvousServer(wire=WireConfig()).start()    # binds tcp://<bind_host>:<random>
    endpoint = server.endpoint                              # hand it to every rank's KVConfig
    ...
    register(endpoint, sender.peer_info(), timeout_s=30)    # prefill rank (KV senders do this)
    peers = resolve(endpoint, "prefill-0", timeout_s=30)    # decode rank, then receiver.connect
    server.stop()

Every frame goes through :class:`~pdplug.wire.Codec` (strict typed decode, size limit, optional
HMAC); malformed frames are dropped and counted, never raised. Never pickle.
"""

from __future__ import annotations

import logging
import threading
import time
import uuid
from typing import Any

import msgspec
import zmq

from pdplug.config import WireConfig
from pdplug.errors import TransferError
from pdplug.types import KVLayout, PeerInfo
from pdplug.wire import Codec

__all__ = [
    "Register",
    "Registered",
    "Resolve",
    "Resolved",
    "RendezvousServer",
    "register",
    "resolve",
    "rank_of",
    "world_of",
    "bind_random",
]

log = logging.getLogger(__name__)


class Register(msgspec.Struct, frozen=True, kw_only=True, tag="register"):
    """A prefill rank publishes itself. ``peer.role`` must be ``"prefill"``."""

    peer: PeerInfo


class Registered(msgspec.Struct, frozen=True, kw_only=True, tag="registered"):
    """Reply to :class:`Register`: ``ok`` or the reason it was refused; the rank id and world."""

    ok: bool
    rank: int = -1
    world: int = 0
    reason: str = ""


class Resolve(msgspec.Struct, frozen=True, kw_only=True, tag="resolve"):
    """A decode rank asks for every rank of a prefill instance."""

    instance: str


class Resolved(msgspec.Struct, frozen=True, kw_only=True, tag="resolved"):
    """Reply to :class:`Resolve`. ``peers`` (sorted by rank) only when ``ready``."""

    instance: str
    ready: bool
    registered: int = 0
    world: int = 0
    peers: tuple[PeerInfo, ...] = ()


def rank_of(layout: KVLayout) -> int:
    """Flat rank id of a prefill rank inside its instance: ``pp_rank * tp_size + tp_rank``."""
    return layout.pp_rank * layout.tp_size + layout.tp_rank


def world_of(layout: KVLayout) -> int:
    """Ranks in the instance: ``pp_size * tp_size``."""
    return layout.pp_size * layout.tp_size


def bind_random(sock: zmq.Socket, host: str) -> str:
    """Bind ``sock`` to a free port on ``host`` and return the ``tcp://host:port`` endpoint."""
    port = sock.bind_to_random_port(f"tcp://{host}")
    return f"tcp://{host}:{port}"


def _codec(wire: WireConfig, *types: type, name: str) -> Codec:
    return Codec(*types, max_bytes=wire.max_message_bytes, hmac_key=wire.hmac_key, name=name)


class RendezvousServer:
    """The rendezvous table, served by a ROUTER socket on a background thread.

    :param wire: socket rules (bind interface, size limit, HMAC).
    :param port: TCP port, 0 (default) for a free one.
    """

    def __init__(self, wire: WireConfig | None = None, port: int = 0) -> None:
        self.wire = wire or WireConfig()
        self._codec = _codec(
            self.wire, Register, Resolve, Registered, Resolved, name="rendezvous-server"
        )
        self._ctx: Any = zmq.Context.instance()
        self._sock = self._ctx.socket(zmq.ROUTER)
        self._sock.setsockopt(zmq.LINGER, 0)
        if port:
            self._sock.bind(f"tcp://{self.wire.bind_host}:{port}")
            self.endpoint = f"tcp://{self.wire.bind_host}:{port}"
        else:
            self.endpoint = bind_random(self._sock, self.wire.bind_host)
        self._table: dict[str, dict[int, PeerInfo]] = {}
        self._world: dict[str, int] = {}
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self.counts = {"registered": 0, "refused": 0, "resolved": 0, "not_ready": 0}

    def start(self) -> RendezvousServer:
        """Start serving on a daemon thread; returns ``self``."""
        if self._thread is None:
            self._thread = threading.Thread(target=self._run, name="pdplug-rendezvous", daemon=True)
            self._thread.start()
        return self

    def stop(self) -> None:
        """Stop the thread and close the socket; idempotent."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=5)
            self._thread = None
        if not self._sock.closed:
            self._sock.close(linger=0)

    def __enter__(self) -> RendezvousServer:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def peers(self, instance: str) -> dict[int, PeerInfo]:
        """Registered ranks of ``instance`` (a copy)."""
        with self._lock:
            return dict(self._table.get(instance, {}))

    def stats(self) -> dict[str, int]:
        """Counters (registered, refused, resolved, not_ready) and the codec's drop counters."""
        with self._lock:
            out = dict(self.counts)
        out.update(self._codec.stats())
        return out

    # ------------------------------------------------------------------ serving
    def _run(self) -> None:
        poller = zmq.Poller()
        poller.register(self._sock, zmq.POLLIN)
        while not self._stop.is_set():
            if not poller.poll(50):
                continue
            while True:
                try:
                    frames = self._sock.recv_multipart(zmq.NOBLOCK)
                except zmq.Again:
                    break
                except zmq.ZMQError:
                    return
                if len(frames) != 2:
                    self._codec.drop("malformed")
                    continue
                ident, frame = frames
                msg = self._codec.decode(frame)
                if msg is None:
                    continue
                reply = self._handle(msg)
                if reply is None:
                    self._codec.drop("wrong_type")
                    continue
                try:
                    self._sock.send_multipart([ident, self._codec.encode(reply)], zmq.NOBLOCK)
                except zmq.ZMQError:  # peer gone or queue full: it will retry
                    log.debug("rendezvous: reply to a gone peer dropped")

    def _handle(self, msg: object) -> Registered | Resolved | None:
        if isinstance(msg, Register):
            return self._register(msg.peer)
        if isinstance(msg, Resolve):
            return self._resolve(msg.instance)
        return None

    def _register(self, peer: PeerInfo) -> Registered:
        lay = peer.layout
        rank, world = rank_of(lay), world_of(lay)
        with self._lock:
            if peer.role != "prefill":
                self.counts["refused"] += 1
                return Registered(
                    ok=False, reason=f"role must be 'prefill' to register, got {peer.role!r}"
                )
            known = self._world.get(peer.instance)
            if known is not None and known != world and self._table.get(peer.instance):
                self.counts["refused"] += 1
                return Registered(
                    ok=False,
                    rank=rank,
                    world=known,
                    reason=(
                        f"instance {peer.instance!r} has {known} ranks (pp_size*tp_size) but this "
                        f"rank says {world} (pp_size={lay.pp_size}, tp_size={lay.tp_size})"
                    ),
                )
            self._world[peer.instance] = world
            self._table.setdefault(peer.instance, {})[rank] = peer
            self.counts["registered"] += 1
        return Registered(ok=True, rank=rank, world=world)

    def _resolve(self, instance: str) -> Resolved:
        with self._lock:
            ranks = self._table.get(instance, {})
            world = self._world.get(instance, 0)
            ready = bool(world) and len(ranks) >= world
            self.counts["resolved" if ready else "not_ready"] += 1
            peers = tuple(ranks[r] for r in sorted(ranks)) if ready else ()
            return Resolved(
                instance=instance, ready=ready, registered=len(ranks), world=world, peers=peers
            )


# --------------------------------------------------------------------------- clients


def _request(
    endpoint: str,
    msg: msgspec.Struct,
    codec: Codec,
    deadline: float,
    what: str,
) -> msgspec.Struct:
    """One request/reply over a fresh DEALER, retried until ``deadline`` (monotonic seconds)."""
    ctx: Any = zmq.Context.instance()
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.setsockopt(zmq.IDENTITY, uuid.uuid4().bytes)
    try:
        sock.connect(endpoint)
        frame = codec.encode(msg)
        retry = 0.25
        while True:
            sock.send(frame)
            until = min(deadline, time.monotonic() + retry)
            while True:
                left = until - time.monotonic()
                if left <= 0 or not sock.poll(int(left * 1000) + 1):
                    break
                reply = codec.decode(sock.recv())
                if reply is not None:
                    return reply  # type: ignore[no-any-return]
            if time.monotonic() >= deadline:
                raise TransferError(f"rendezvous {endpoint}: no answer to {what} before timeout")
            retry = min(retry * 2, 2.0)
    finally:
        sock.close(linger=0)


def register(
    endpoint: str, peer: PeerInfo, *, timeout_s: float = 30.0, wire: WireConfig | None = None
) -> Registered:
    """Publish a prefill rank at the rendezvous (retries until answered or ``timeout_s``).

    :raises TransferError: no answer within ``timeout_s`` seconds, or the server refused the
        rank (the message carries its reason).
    """
    w = wire or WireConfig()
    codec = _codec(w, Registered, Resolved, Register, Resolve, name="rendezvous-client")
    deadline = time.monotonic() + timeout_s
    reply = _request(endpoint, Register(peer=peer), codec, deadline, "register")
    if not isinstance(reply, Registered):
        raise TransferError(f"rendezvous {endpoint}: expected Registered, got {type(reply)}")
    if not reply.ok:
        raise TransferError(f"rendezvous {endpoint} refused {peer.instance}: {reply.reason}")
    return reply


def resolve(
    endpoint: str,
    instance: str,
    *,
    timeout_s: float = 30.0,
    poll_s: float = 0.05,
    wire: WireConfig | None = None,
) -> list[PeerInfo]:
    """Every rank of prefill ``instance``, sorted by rank id, once all of them registered.

    Polls every ``poll_s`` seconds while the server answers "not ready".

    :raises TransferError: not every rank registered within ``timeout_s`` (names how many did).
    """
    w = wire or WireConfig()
    codec = _codec(w, Registered, Resolved, Register, Resolve, name="rendezvous-client")
    deadline = time.monotonic() + timeout_s
    last: Resolved | None = None
    while True:
        reply = _request(endpoint, Resolve(instance=instance), codec, deadline, "resolve")
        if isinstance(reply, Resolved) and reply.instance == instance:
            last = reply
            if reply.ready:
                return list(reply.peers)
        if time.monotonic() + poll_s >= deadline:
            got = f"{last.registered} of {last.world or '?'}" if last else "no answer"
            raise TransferError(
                f"rendezvous {endpoint}: prefill instance {instance!r} not ready after "
                f"{timeout_s:g} s ({got} ranks registered)"
            )
        time.sleep(poll_s)
