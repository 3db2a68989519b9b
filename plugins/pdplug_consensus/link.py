"""One rank's ZMQ sockets and the background I/O thread that owns them.

Topology: every rank binds a ROUTER at its own endpoint (on ``wire.bind_host``) and connects
one DEALER to each peer it sends to; every socket comes from :func:`pdplug.wire.make_socket`
(``ZMQ_MAXMSGSIZE``, the off-loopback key rule). A frame is accepted only when it passes the
rank's sealed :class:`pdplug.wire.Codec` (size, HMAC, strict type, member identity, replay)
and the message's ``rank`` field, when it has one, is the rank of the authenticated sender;
anything else is dropped and counted. The peer's rank comes from the frame's envelope, never
from a ZMQ routing id (DEALERs keep the random one libzmq gives them, so a process squatting
a routing id blocks nobody). Dead-rank lists are taken only from the ranks allowed to report
them (``dead_from``: the leader in ``pp0``). DEALER/ROUTER over one TCP connection per
direction measured a lower loopback round trip than PUSH/PULL (p50 63 µs vs 110 µs, 3000
ping-pongs between two processes).

pyzmq sockets are not thread-safe, so after construction only the I/O thread touches the
network sockets, and it encodes every frame it sends right before sending it (a receiver
drops a sealed frame that overtakes a later one). The host thread hands it messages through
deques and wakes it through an inproc PAIR guarded by a lock. High-water marks are 0
(unbounded): a silently dropped decision would be a sequence gap, and a peer that stops
reading is reported dead after ``peer_timeout_s`` anyway.
"""

from __future__ import annotations

import itertools
import logging
import math
import threading
import time
from collections import deque
from collections.abc import Callable, Iterable
from typing import Any

import zmq

from pdplug import ConsensusConfig
from pdplug.wire import Codec, drain, make_socket
from pdplug_consensus.common import parse_port
from pdplug_consensus.messages import Heartbeat

__all__ = ["Link", "Liveness"]

log = logging.getLogger(__name__)
_ids = itertools.count()


class Liveness:
    """Last time each peer rank was heard from; silent longer than ``timeout_s`` = dead.

    A peer never heard from counts from construction, so a rank that never starts is also
    reported.
    """

    def __init__(self, ranks: Iterable[int], timeout_s: float, now: float) -> None:
        self.timeout_s = timeout_s
        self.last = {r: now for r in ranks}

    def touch(self, rank: int, now: float) -> None:
        if rank in self.last:
            self.last[rank] = now

    def dead(self, now: float) -> list[int]:
        return sorted(r for r, t in self.last.items() if now - t > self.timeout_s)


class Link:
    """ROUTER inbox + DEALERs to peers + liveness, served by one daemon thread.

    :param config: the rank's config (rank, endpoints, wire rules, heartbeat and timeout).
    :param codec: the rank's sealed codec; its members are the identities of ``in_peers``.
    :param identities: sender identity of every rank, indexed by rank.
    :param out_peers: ranks this rank sends to (frames and heartbeats).
    :param in_peers: ranks whose frames are accepted (and watched for liveness).
    :param heartbeat: ``(dead ranks) -> Heartbeat`` sent every ``heartbeat_s`` (I/O thread).
    :param dead_from: ranks whose heartbeat dead-lists are believed.
    :param on_frame: ``(sender, msg)`` for accepted non-heartbeat frames, run on the I/O
        thread; default appends to :attr:`inbox` for the host thread.
    :param on_local: handler of objects the host passes with :meth:`local` (I/O thread).
    :param on_tick: ``(now)`` after every wake-up (I/O thread), e.g. the leader's decide step.
    :param tick_s: longest sleep between ticks (seconds).
    :param name: label of the thread and the inproc wake-up socket.
    :raises ValueError: an endpoint off loopback without ``wire.hmac_key``.
    :raises zmq.ZMQError: the bind failed (address in use, bad interface).
    """

    def __init__(
        self,
        *,
        config: ConsensusConfig,
        codec: Codec,
        identities: tuple[str, ...],
        out_peers: Iterable[int],
        in_peers: Iterable[int],
        heartbeat: Callable[[tuple[int, ...]], Heartbeat],
        dead_from: Iterable[int] = (),
        on_frame: Callable[[int, Any], None] | None = None,
        on_local: Callable[[Any], None] | None = None,
        on_tick: Callable[[float], None] | None = None,
        tick_s: float = 0.05,
        name: str = "link",
    ) -> None:
        self.rank = rank = config.pp_rank
        self.codec = codec
        self.heartbeat_s = config.heartbeat_s
        self.out_peers = tuple(out_peers)
        self._rank_of = {identities[p]: p for p in in_peers}
        self._dead_from = frozenset(dead_from)
        self._heartbeat = heartbeat
        self._on_frame = on_frame
        self._on_local = on_local
        self._on_tick = on_tick
        self._tick_s = min(tick_s, config.heartbeat_s)
        self.inbox: deque[tuple[int, Any]] = deque()
        #: set by the I/O thread after it queued a frame on :attr:`inbox`
        self.arrived = threading.Event()
        self._out: deque[tuple[int, Any]] = deque()
        self._local: deque[Any] = deque()
        self.liveness = Liveness(self._rank_of.values(), config.peer_timeout_s, time.monotonic())
        #: ranks declared dead (silent, or reported by the leader); read by the host thread
        self.dead: tuple[int, ...] = ()
        #: dead rank -> the peer that reported it
        self.reported_dead: dict[int, int] = {}
        self.error: BaseException | None = None
        self.counters = {
            "frames_out": 0,
            "send_again": 0,
            "heartbeats_out": 0,
            "dead_reports_ignored": 0,
        }
        self._stop = False
        wire, eps = config.wire, config.endpoints
        self._ctx = zmq.Context()
        try:
            port = parse_port(eps[rank], f"ConsensusConfig.endpoints[{rank}]")
            what = f"consensus {name} rank {rank}"
            self._router = make_socket(self._ctx, zmq.ROUTER, wire, bind=port, hwm=0, name=what)
            self._dealers: dict[int, zmq.Socket] = {
                # linger: flush the last decisions on close
                p: make_socket(
                    self._ctx, zmq.DEALER, wire, connect=eps[p], hwm=0, linger_ms=200, name=what
                )
                for p in self.out_peers
            }
            addr = f"inproc://pdplug-consensus-{name}-{next(_ids)}"
            self._wake_rx = make_socket(self._ctx, zmq.PAIR, wire, bind=addr, name=what)
            self._wake_tx = make_socket(self._ctx, zmq.PAIR, wire, connect=addr, name=what)
        except BaseException:
            self._ctx.destroy(linger=0)
            raise
        self._wake_lock = threading.Lock()
        # started by start(): the callbacks may reach the owner through the attribute it is
        # about to assign this link to (a leader's first tick raced that assignment)
        self._thread = threading.Thread(
            target=self._run, name=f"pdplug-{name}-r{rank}", daemon=True
        )

    def start(self) -> None:
        """Start the I/O thread (once, after the owner holds this link)."""
        self._thread.start()

    # ------------------------------------------------------------------ host thread side

    def send(self, peer: int, msg: Any) -> None:
        """Queue ``msg`` for ``peer``; the I/O thread encodes and sends it (any thread)."""
        self._out.append((peer, msg))
        self._wake()

    def local(self, obj: Any) -> None:
        """Hand ``obj`` to ``on_local`` on the I/O thread (non-blocking; any thread)."""
        self._local.append(obj)
        self._wake()

    def _wake(self) -> None:
        with self._wake_lock:
            if self._stop:
                return
            try:
                self._wake_tx.send(b"", zmq.NOBLOCK)
            except zmq.Again:  # already plenty of wake-ups queued
                pass

    def failure(self) -> str | None:
        """Why consensus cannot continue (crashed I/O thread, dead peers), else ``None``."""
        if self.error is not None:
            return f"consensus I/O thread failed: {self.error!r}"
        if not self.dead:
            return None
        silent = [r for r in self.dead if r not in self.reported_dead]
        told = {r: self.reported_dead[r] for r in self.dead if r in self.reported_dead}
        why = []
        if silent:
            why.append(
                f"peer rank(s) {silent} sent nothing for more than "
                f"peer_timeout_s={self.liveness.timeout_s} s (process dead or hung?)"
            )
        if told:
            by = sorted(set(told.values()))
            why.append(f"rank(s) {sorted(told)} reported dead by rank(s) {by}")
        return "; ".join(why)

    def close(self, timeout_s: float = 2.0) -> None:
        """Stop the thread and close every socket; idempotent."""
        with self._wake_lock:
            if self._stop:
                return
            self._stop = True
            try:
                self._wake_tx.send(b"", zmq.NOBLOCK)
            except zmq.ZMQError:
                pass
        if self._thread.ident is None:  # never started: its sockets are closed here
            self._ctx.destroy(linger=0)
            return
        self._thread.join(timeout_s)
        if self._thread.is_alive():  # never hang a host on close
            log.warning("consensus link r%d: I/O thread did not stop; destroying", self.rank)
            self._ctx.destroy(linger=0)
            return
        self._wake_tx.close(0)
        self._ctx.term()

    # ------------------------------------------------------------------ I/O thread side

    def send_now(self, peer: int, frame: bytes) -> None:
        """Send a frame just encoded on the I/O thread (``on_frame`` / ``on_local`` /
        ``on_tick`` only)."""
        try:
            self._dealers[peer].send(frame, zmq.NOBLOCK)
            self.counters["frames_out"] += 1
        except zmq.Again:
            self.counters["send_again"] += 1

    def _run(self) -> None:
        try:
            self._loop()
        except BaseException as e:  # surfaced to the host by poll()
            log.exception("consensus link r%d: I/O thread crashed", self.rank)
            self.error = e
        finally:
            for d in self._dealers.values():
                d.close()
            self._router.close(0)
            self._wake_rx.close(0)

    def _loop(self) -> None:
        poller = zmq.Poller()
        poller.register(self._router, zmq.POLLIN)
        poller.register(self._wake_rx, zmq.POLLIN)
        next_hb = 0.0
        while not self._stop:
            now = time.monotonic()
            if now >= next_hb:
                next_hb = now + self.heartbeat_s
                self._beat()
            self._check(now)
            timeout_ms = math.ceil(max(0.0, min(next_hb - now, self._tick_s)) * 1000.0)
            events = dict(poller.poll(timeout_ms))
            if self._wake_rx in events:
                while True:
                    try:
                        self._wake_rx.recv(zmq.NOBLOCK)
                    except zmq.Again:
                        break
            if self._router in events:
                self._drain(time.monotonic())
            while self._local:
                self._on_local(self._local.popleft())  # type: ignore[misc]
            while self._out:
                peer, msg = self._out.popleft()
                self.send_now(peer, self.codec.encode(msg))
            if self._on_tick is not None:
                self._on_tick(time.monotonic())

    def _beat(self) -> None:
        frame = self.codec.encode(self._heartbeat(self.dead))
        for p in self.out_peers:
            self.send_now(p, frame)
            self.counters["heartbeats_out"] += 1

    def _check(self, now: float) -> None:
        dead = set(self.liveness.dead(now)) | set(self.reported_dead)
        if dead and tuple(sorted(dead)) != self.dead:
            self.dead = tuple(sorted(dead))
            log.error("consensus link r%d: peer ranks %s declared dead", self.rank, self.dead)
            self._beat()  # tell peers now (the leader's heartbeat carries the dead list)

    def _drain(self, now: float) -> None:
        for got in drain(self._router, self.codec):
            sender = self._rank_of[got.sender]  # the codec admits members only
            msg = got.msg
            if getattr(msg, "rank", sender) != sender:
                self.codec.drop("unknown_rank")
                continue
            self.liveness.touch(sender, now)
            if isinstance(msg, Heartbeat):
                if msg.dead and sender not in self._dead_from:
                    self.counters["dead_reports_ignored"] += 1
                elif msg.dead:
                    fresh = [r for r in msg.dead if r not in self.reported_dead]
                    if fresh:
                        self.reported_dead.update(dict.fromkeys(fresh, sender))
                        self._check(now)
                continue
            if self._on_frame is not None:
                self._on_frame(sender, msg)
            else:
                self.inbox.append((sender, msg))
                self.arrived.set()
