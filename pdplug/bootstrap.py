"""Rendezvous: prefill ranks register their :class:`~pdplug.types.PeerInfo`; decode ranks
resolve a prefill instance once every one of its ranks registered (ZMQ ROUTER + msgspec).

The server answers "not ready" (``Resolved.ready = False`` with the registered count) until all
``pp_size * tp_size`` ranks of the instance registered, like SGLang's bootstrap server answering
503 until ``registered >= dp*cp*tp*pp``. A rank's id is ``pp_rank * tp_size + tp_rank`` of its
layout (:func:`rank_of`); a rank whose instance geometry disagrees with the ranks already
registered is refused with a reason.

Every frame is sealed (:class:`~pdplug.wire.Codec` with a sender envelope, HMAC when
``WireConfig.hmac_key`` is set): a prefill rank registers under its own identity
(:func:`~pdplug.wire.peer_identity`, e.g. ``"prefill-0 tp0 pp1"``) and the server refuses a
``Register`` whose peer is not the sender. **A registration is live** while its registrant's
epoch is the newest the server has seen from that identity: only a frame carrying that epoch
(the same registrant retrying) or a newer one (a restarted rank, which must hold the key) can
replace it; a replayed or older-epoch frame is dropped (counted ``replay``), and a frame
without the key never gets past the HMAC. Each request carries a random ``ref`` that its reply
echoes, so a replayed reply is ignored by the client. Without a key (loopback only) every local
process is trusted.

The server runs in a thread and can be started by a host process or by a prefill rank::

    server = RendezvousServer(wire=WireConfig()).start()    # binds tcp://<bind_host>:<random>
    endpoint = server.endpoint                              # hand it to every rank's KVConfig
    ...
    register(endpoint, sender.peer_info(), timeout_s=30)    # prefill rank (KV senders do this)
    peers = resolve(endpoint, "prefill-0", timeout_s=30)    # decode rank, then receiver.connect
    server.stop()

Malformed frames are dropped and counted, never raised. Never pickle.
"""

from __future__ import annotations

import logging
import secrets
import threading
import time
import uuid
from typing import Any

import msgspec
import zmq

from pdplug.config import WireConfig
from pdplug.errors import TransferError
from pdplug.types import KVLayout, PeerInfo
from pdplug.wire import Codec, Inbound, drain, endpoint_of, make_socket, peer_identity

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
    "Registrar",
    "ResolveTimeout",
]

log = logging.getLogger(__name__)

SERVER_IDENTITY = "rendezvous"


class Register(msgspec.Struct, frozen=True, kw_only=True, tag="register"):
    """A prefill rank publishes itself. ``peer.role`` must be ``"prefill"``; the frame's sender
    must be :func:`~pdplug.wire.peer_identity` of ``peer``.

    :ivar ref: random request id the reply echoes.
    """

    peer: PeerInfo
    ref: int = 0


class Registered(msgspec.Struct, frozen=True, kw_only=True, tag="registered"):
    """Reply to :class:`Register`: ``ok`` or the reason it was refused; the rank id and world."""

    ok: bool
    rank: int = -1
    world: int = 0
    reason: str = ""
    ref: int = 0


class Resolve(msgspec.Struct, frozen=True, kw_only=True, tag="resolve"):
    """A decode rank asks for every rank of a prefill instance (``ref``: echoed)."""

    instance: str
    ref: int = 0


class Resolved(msgspec.Struct, frozen=True, kw_only=True, tag="resolved"):
    """Reply to :class:`Resolve`. ``peers`` (sorted by rank) only when ``ready``."""

    instance: str
    ready: bool
    registered: int = 0
    world: int = 0
    peers: tuple[PeerInfo, ...] = ()
    ref: int = 0


_TYPES = (Register, Resolve, Registered, Resolved)


def rank_of(layout: KVLayout) -> int:
    """Flat rank id of a prefill rank inside its instance: ``pp_rank * tp_size + tp_rank``."""
    return layout.pp_rank * layout.tp_size + layout.tp_rank


def world_of(layout: KVLayout) -> int:
    """Ranks in the instance: ``pp_size * tp_size``."""
    return layout.pp_size * layout.tp_size


def bind_random(sock: zmq.Socket, host: str) -> str:
    """Bind ``sock`` to a free port on ``host`` and return the ``tcp://host:port`` endpoint.

    Prefer :func:`pdplug.wire.make_socket` (``bind=0``), which also applies the wire rules.
    """
    port = sock.bind_to_random_port(f"tcp://{host}")
    return f"tcp://{host}:{port}"


class RendezvousServer:
    """The rendezvous table, served by a ROUTER socket on a background thread.

    :param wire: socket rules (bind interface, size limit, HMAC key, replay window).
    :param port: TCP port, 0 (default) for a free one.
    :raises ValueError: ``wire.bind_host`` is off loopback and ``wire.hmac_key`` is ``None``.
    :raises zmq.ZMQError: the bind failed.
    """

    def __init__(self, wire: WireConfig | None = None, port: int = 0) -> None:
        self.wire = wire or WireConfig()
        self._codec = Codec.from_config(
            self.wire, *_TYPES, name="rendezvous-server", identity=SERVER_IDENTITY
        )
        self._ctx: Any = zmq.Context.instance()
        self._sock = make_socket(
            self._ctx, zmq.ROUTER, self.wire, bind=port, name="RendezvousServer"
        )
        self.endpoint = endpoint_of(self._sock)
        self._table: dict[str, dict[int, PeerInfo]] = {}
        self._epochs: dict[tuple[str, int], int] = {}  # (instance, rank) -> registrant epoch
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
        """Counters of requests answered (registered, refused, resolved, not_ready: a client
        that retried before its answer came counts once per request answered; registering is
        idempotent) and the codec's drop counters."""
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
            try:
                for got in drain(self._sock, self._codec):
                    reply = self._handle(got)
                    if reply is None:
                        continue
                    try:
                        self._sock.send_multipart(
                            [got.route, self._codec.encode(reply)], zmq.NOBLOCK
                        )
                    except zmq.Again:  # peer gone or queue full: it will retry
                        log.debug("rendezvous: reply to a gone peer dropped")
            except zmq.ZMQError:
                return

    def _handle(self, got: Inbound) -> Registered | Resolved | None:
        msg = got.msg
        if isinstance(msg, Register):
            return self._register(msg, got.sender, got.epoch)
        if isinstance(msg, Resolve):
            return self._resolve(msg.instance, msg.ref)
        self._codec.drop("wrong_type")  # a reply sent as a request
        return None

    def _register(self, msg: Register, sender: str, epoch: int) -> Registered | None:
        peer, ref = msg.peer, msg.ref
        lay = peer.layout
        rank, world = rank_of(lay), world_of(lay)
        with self._lock:
            if sender != peer_identity(peer):
                self.counts["refused"] += 1
                return Registered(
                    ok=False,
                    ref=ref,
                    reason=f"sender {sender!r} cannot register {peer_identity(peer)!r}",
                )
            if peer.role != "prefill":
                self.counts["refused"] += 1
                return Registered(
                    ok=False,
                    ref=ref,
                    reason=f"role must be 'prefill' to register, got {peer.role!r}",
                )
            live = self._epochs.get((peer.instance, rank))
            if live is not None and epoch < live:  # an older incarnation the codec forgot
                self._codec.drop("replay")
                return None
            known = self._world.get(peer.instance)
            if known is not None and known != world and self._table.get(peer.instance):
                self.counts["refused"] += 1
                return Registered(
                    ok=False,
                    rank=rank,
                    world=known,
                    ref=ref,
                    reason=(
                        f"instance {peer.instance!r} has {known} ranks (pp_size*tp_size) but this "
                        f"rank says {world} (pp_size={lay.pp_size}, tp_size={lay.tp_size})"
                    ),
                )
            self._world[peer.instance] = world
            self._table.setdefault(peer.instance, {})[rank] = peer
            self._epochs[(peer.instance, rank)] = epoch
            self.counts["registered"] += 1
        return Registered(ok=True, rank=rank, world=world, ref=ref)

    def _resolve(self, instance: str, ref: int) -> Resolved:
        with self._lock:
            ranks = self._table.get(instance, {})
            world = self._world.get(instance, 0)
            ready = bool(world) and len(ranks) >= world
            self.counts["resolved" if ready else "not_ready"] += 1
            peers = tuple(ranks[r] for r in sorted(ranks)) if ready else ()
            return Resolved(
                instance=instance,
                ready=ready,
                registered=len(ranks),
                world=world,
                peers=peers,
                ref=ref,
            )


# --------------------------------------------------------------------------- clients


class ResolveTimeout(TransferError):
    """:func:`resolve` gave up after its ``timeout_s``: the rendezvous never answered, or its
    last answer said the instance was not ready (issue 22: a client is told which).

    :ivar answered: the rendezvous answered at least once (False: nothing came back).
    :ivar registered: ranks of the instance registered at the last answer (0: unknown there).
    :ivar world: ranks the instance has (``pp_size * tp_size``; 0 while none registered).
    """

    def __init__(
        self, message: str, *, answered: bool = False, registered: int = 0, world: int = 0
    ) -> None:
        super().__init__(message)
        self.answered, self.registered, self.world = answered, registered, world


def _request(
    endpoint: str,
    msg: Register | Resolve,
    codec: Codec,
    wire: WireConfig,
    deadline: float,
    what: str,
) -> msgspec.Struct:
    """One request/reply over a fresh DEALER, retried until ``deadline`` (monotonic seconds).

    Only a reply from the server that echoes ``msg.ref`` is taken (others: ``stale``).
    """
    ctx: Any = zmq.Context.instance()
    sock = make_socket(ctx, zmq.DEALER, wire, connect=endpoint, name=f"rendezvous {what}")
    try:
        retry = 0.25
        while True:
            sock.send(codec.encode(msg))
            until = min(deadline, time.monotonic() + retry)
            while True:
                left = until - time.monotonic()
                if left <= 0 or not sock.poll(int(left * 1000) + 1):
                    break
                for got in drain(sock, codec):
                    if got.sender != SERVER_IDENTITY or getattr(got.msg, "ref", None) != msg.ref:
                        codec.drop("stale")
                        continue
                    return got.msg  # type: ignore[no-any-return]
            if time.monotonic() >= deadline:
                raise TransferError(f"rendezvous {endpoint}: no answer to {what} before timeout")
            retry = min(retry * 2, 2.0)
    finally:
        sock.close(linger=0)


def _client_codec(wire: WireConfig, identity: str) -> Codec:
    return Codec.from_config(
        wire, *_TYPES, name="rendezvous-client", identity=identity, members=(SERVER_IDENTITY,)
    )


def register(
    endpoint: str, peer: PeerInfo, *, timeout_s: float = 30.0, wire: WireConfig | None = None
) -> Registered:
    """Publish a prefill rank at the rendezvous (retries until answered or ``timeout_s``).

    Sent under :func:`~pdplug.wire.peer_identity` of ``peer`` with a new epoch, so it replaces
    an earlier registration of the same rank (a restart).

    :raises TransferError: no answer within ``timeout_s`` seconds, or the server refused the
        rank (the message carries its reason).
    :raises ValueError: ``endpoint`` is off loopback and ``wire.hmac_key`` is ``None``.
    """
    w = wire or WireConfig()
    codec = _client_codec(w, peer_identity(peer))
    deadline = time.monotonic() + timeout_s
    msg = Register(peer=peer, ref=secrets.randbits(63))
    reply = _request(endpoint, msg, codec, w, deadline, "register")
    if not isinstance(reply, Registered):
        raise TransferError(f"rendezvous {endpoint}: expected Registered, got {type(reply)}")
    if not reply.ok:
        raise TransferError(f"rendezvous {endpoint} refused {peer.instance}: {reply.reason}")
    return reply


class Registrar:
    """Keeps one prefill rank registered: :func:`register` again every ``every_s`` seconds on
    a daemon thread (its own sockets), so a rendezvous that restarted — its table lives in
    memory — knows the rank again within ``every_s``. A refusal or a rendezvous that does not
    answer is logged and counted; the next round tries again.

    :param endpoint: the rendezvous; ``peer``: what the rank publishes (its ``PeerInfo``).
    :param every_s: seconds between two registrations (> 0).
    :param timeout_s: how long one registration waits for its answer (seconds).
    :raises ValueError: ``every_s`` is not > 0.
    """

    def __init__(
        self,
        endpoint: str,
        peer: PeerInfo,
        every_s: float,
        *,
        timeout_s: float = 5.0,
        wire: WireConfig | None = None,
    ) -> None:
        if not every_s > 0:
            raise ValueError(f"Registrar: every_s must be > 0 seconds, got {every_s!r}")
        self.endpoint, self.peer, self.every_s = endpoint, peer, every_s
        self._timeout_s = min(timeout_s, every_s)
        self._wire = wire
        self._stop = threading.Event()
        self.counts = {"registered": 0, "failed": 0}
        self._thread = threading.Thread(
            target=self._run, name=f"pdplug-registrar-{peer_identity(peer)}", daemon=True
        )
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.wait(self.every_s):
            try:
                register(self.endpoint, self.peer, timeout_s=self._timeout_s, wire=self._wire)
                self.counts["registered"] += 1
            except Exception as e:  # the rendezvous is down or refused: try again next round
                self.counts["failed"] += 1
                log.debug("rendezvous %s: refresh of %s failed: %s", self.endpoint,
                          peer_identity(self.peer), e)  # fmt: skip

    def stop(self) -> None:
        """Stop refreshing (a registration under way finishes on its daemon thread; it only
        repeats the one the rank had); idempotent, never blocks."""
        self._stop.set()


def resolve(
    endpoint: str,
    instance: str,
    *,
    timeout_s: float = 30.0,
    poll_s: float = 0.05,
    wire: WireConfig | None = None,
    identity: str | None = None,
) -> list[PeerInfo]:
    """Every rank of prefill ``instance``, sorted by rank id, once all of them registered.

    Polls every ``poll_s`` seconds while the server answers "not ready".

    :param identity: sender identity (e.g. the decode rank's
        :func:`~pdplug.wire.peer_identity`); default: a random ``"resolver-…"`` one.
    :raises ResolveTimeout: (a :class:`~pdplug.errors.TransferError`) not every rank
        registered within ``timeout_s`` (names how many did), or no answer at all.
    :raises ValueError: ``endpoint`` is off loopback and ``wire.hmac_key`` is ``None``, or
        ``instance`` is empty (no rank registers under an empty name).
    """
    if not instance:
        raise ValueError(f"resolve: instance={instance!r} must be a non-empty prefill name")
    w = wire or WireConfig()
    codec = _client_codec(w, identity or f"resolver-{uuid.uuid4().hex[:12]}")
    deadline = time.monotonic() + timeout_s
    last: Resolved | None = None
    while True:
        msg = Resolve(instance=instance, ref=secrets.randbits(63))
        try:
            reply: msgspec.Struct | None = _request(endpoint, msg, codec, w, deadline, "resolve")
        except TransferError as e:
            if last is None:
                raise ResolveTimeout(str(e), answered=False) from None
            reply = None  # the server answered "not ready" before: say so, not "no answer"
        if isinstance(reply, Resolved) and reply.instance == instance:
            last = reply
            if reply.ready:
                return list(reply.peers)
        if time.monotonic() + poll_s >= deadline:
            if last is None:
                got = "no answer"
            elif not last.world:  # the server knows no rank of it (never registered, or gone)
                got = "no rank of it registered"
            else:
                got = f"{last.registered} of {last.world} ranks registered"
            raise ResolveTimeout(
                f"rendezvous {endpoint}: prefill instance {instance!r} not ready after "
                f"{timeout_s:g} s ({got})",
                answered=last is not None,
                registered=last.registered if last else 0,
                world=last.world if last else 0,
            )
        time.sleep(poll_s)
