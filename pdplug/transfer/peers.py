"""The prefill side's table of decode peers: handshake acceptance, liveness, and drops.

A decode rank becomes a :class:`~pdplug.transfer.records.Peer` of a prefill rank when its
:class:`~pdplug.transfer.messages.Hello` comes sealed by the identity of the PeerInfo it carries
(:func:`~pdplug.wire.peer_identity`; a key holder cannot introduce another rank), passes
:func:`~pdplug.transfer.handshake.check_decode_peer` and the engine loaded its agent blob.
Peers are keyed by that authenticated identity and by full position
(:func:`~pdplug.transfer.records.peer_key`), never by a ZMQ routing id; a decode rank this
prefill rank owes no KV head is refused (:func:`~pdplug.transfer.handshake.tp_routing`). A
Hello from a new epoch of a known identity (a new connection: reconnect or restart) is a
re-handshake: from the same decode process (same agent blob) the rooms in flight continue on
the new connection; from a new process (or when the new one is refused) the old peer is dropped
and its rooms fail, since the codec no longer accepts the old epoch's frames. A peer silent for
``transfer_timeout_s`` is dropped. An engine handle is released only once no write uses it any
more (a shared NIXL remote agent stays loaded while a newer connection or an in-flight write
needs it). Runs on the engine thread.
"""

from __future__ import annotations

import logging
from collections import Counter
from collections.abc import Callable
from typing import Any

import numpy as np

from pdplug.heads import fed_ranks
from pdplug.transfer.channel import Liveness, RouterChannel
from pdplug.transfer.engine import TransferEngine
from pdplug.transfer.messages import Heartbeat, Hello, HelloAck
from pdplug.transfer.records import Peer, PeerKey, describe, peer_key
from pdplug.types import PeerInfo
from pdplug.wire import Inbound, peer_identity

__all__ = ["DecodePeers"]

log = logging.getLogger(__name__)

#: ``check(remote) -> (mismatches, entry map, relayout)``
Check = Callable[[PeerInfo], tuple[list[str], "np.ndarray | None", bool]]


class DecodePeers:
    """The decode ranks connected to one prefill rank.

    :param name: log label; ``rank``: this prefill rank's id (carried in HelloAck).
    :param engine: returns the session's current engine (it is replaceable).
    :param channel: the session's ROUTER.
    :param check: the handshake check of a remote PeerInfo.
    :param local: returns this rank's PeerInfo (after ``register_kv``).
    :param on_drop: ``(peer, reason)`` when a peer is dropped (the session fails its rooms).
    :param on_rebind: ``(old, new)`` when the same decode process handshook again.
    :param liveness: heartbeat pacing and silence bound.
    :param counts: the session's counters (``refused``, ``peers``, ``peers_dead``).
    """

    def __init__(
        self,
        *,
        name: str,
        rank: int,
        engine: Callable[[], TransferEngine],
        channel: RouterChannel,
        check: Check,
        local: Callable[[], PeerInfo],
        on_drop: Callable[[Peer, str], None],
        on_rebind: Callable[[Peer, Peer], None],
        liveness: Liveness,
        counts: Counter[str],
    ) -> None:
        self._name = name
        self._rank = rank
        self._engine = engine
        self._channel = channel
        self._check = check
        self._local = local
        self._on_drop = on_drop
        self._on_rebind = on_rebind
        self._live = liveness
        self._counts = counts
        self.by_ident: dict[str, Peer] = {}
        self.by_key: dict[PeerKey, str] = {}
        self._retired: list[Peer] = []  # gone peers whose handle a write still uses

    def get(self, ident: str) -> Peer | None:
        """The accepted peer whose authenticated sender identity is ``ident``, if any."""
        return self.by_ident.get(ident)

    def by_position(self, key: PeerKey) -> Peer | None:
        """The current peer of a decode position."""
        ident = self.by_key.get(key)
        return None if ident is None else self.by_ident.get(ident)

    def on_hello(self, got: Inbound, msg: Hello, now: float) -> None:
        """Check a Hello (``got``: its frame), load the peer's agent, answer with a HelloAck."""
        remote, ident = msg.peer, got.sender
        key = peer_key(remote.instance, remote.layout)
        claimed = peer_identity(remote)
        mismatches: list[str] = []
        emap: np.ndarray | None = None
        relayout, handle, fed = False, None, 0
        if ident != claimed:
            mismatches.append(f"identity: frames sealed by {ident!r} cannot introduce {claimed!r}")
        else:
            mismatches, emap, relayout = self._check(remote)
        if not mismatches:
            try:
                fed = len(fed_ranks(self._local().layout, remote.layout.tp_size, remote.layout))
            except ValueError as e:  # the checks route heads already; kept for a custom check
                mismatches.append(str(e))
        if not mismatches:
            try:
                handle = self._engine().connect(remote)
            except Exception as e:
                mismatches.append(f"agent: cannot connect ({type(e).__name__}: {e})")
        if mismatches or emap is None:
            self._counts["refused"] += 1
            log.warning("%s: refused %s: %s", self._name, describe(key), mismatches)
            ack = HelloAck(
                nonce=msg.nonce, accepted=False, rank=self._rank, mismatches=tuple(mismatches)
            )
            self._channel.send(got.route, ack)
            self.restarted(got, "reconnected, and the new connection was refused")
            return
        new = Peer(
            ident=ident,
            route=got.route,
            epoch=got.epoch,
            info=remote,
            key=key,
            handle=handle,
            emap=emap,
            dst_base=np.asarray(remote.entry_base, dtype=np.int64),
            dst_table=np.asarray(remote.entry_base, dtype=np.int64)[np.asarray(emap)],
            relayout=relayout,
            last_seen=now,
            fed=fed,
        )
        olds = [self.get(i) for i in {self.by_key.get(key, ident), ident}]
        for old in {id(p): p for p in olds if p is not None}.values():
            if old.info.agent == remote.agent and old.key == key:
                self._counts["peers_rehandshake"] += 1
                self._retire(old)
                self._on_rebind(old, new)
            else:
                self.drop(old, "reconnected as a new process")
        self.by_ident[ident] = new
        self.by_key[key] = ident
        self._counts["peers"] += 1
        ack = HelloAck(nonce=msg.nonce, accepted=True, rank=self._rank, peer=self._local())
        self._channel.send(got.route, ack)

    def intake(self, got: Inbound, codec: Any, now: float) -> Peer | None:
        """A frame on the sender's ROUTER: a Hello is handled here (``None``); otherwise the
        accepted peer that sent it, its route and liveness refreshed, or ``None`` when it comes
        from no peer (dropped ``unknown_rank``) or from a new connection that never said Hello
        (dropped ``stale``, the old peer dropped: its epoch is over)."""
        if isinstance(got.msg, Hello):
            self.on_hello(got, got.msg, now)
            return None
        peer = self.get(got.sender)
        if peer is None:
            codec.drop("unknown_rank")
            return None
        if self.restarted(got, "sent from a new connection that never said Hello"):
            codec.drop("stale")
            return None
        peer.route = got.route  # libzmq gives a reconnected DEALER a new routing id
        peer.last_seen = now
        return peer

    def restarted(self, got: Inbound, reason: str) -> bool:
        """Drop the peer of ``got.sender`` (for ``reason``) if ``got`` comes from a newer epoch
        than the connection that said Hello: the codec now refuses the old epoch's frames, so
        the old connection can no longer be heard. Returns whether it did."""
        old = self.by_ident.get(got.sender)
        if old is None or got.epoch == old.epoch:
            return False
        self._counts["peers_restarted"] += 1
        self.drop(old, reason)
        return True

    def _retire(self, peer: Peer) -> None:
        peer.alive = False
        peer.gone = True
        if self.by_ident.get(peer.ident) is peer:
            del self.by_ident[peer.ident]
        if self.by_key.get(peer.key) == peer.ident and peer.ident not in self.by_ident:
            del self.by_key[peer.key]
        if peer.inflight:
            self._retired.append(peer)
        else:
            self.release(peer)

    def drop(self, peer: Peer, reason: str) -> None:
        """Forget ``peer``; the session fails the rooms bound to it."""
        self._retire(peer)
        self._on_drop(peer, reason)

    def release(self, peer: Peer) -> None:
        """Release a gone peer's engine handle (once no write uses it)."""
        if peer.released:
            return
        peer.released = True
        self._retired = [p for p in self._retired if p is not peer]
        try:
            self._engine().disconnect(peer.handle)
        except Exception:
            log.debug("%s: disconnect of %s failed", self._name, describe(peer.key))

    def heartbeat(self, now: float, live: dict[PeerKey, list[int]]) -> None:
        """Send a heartbeat to every live peer, with the generations of its rooms whose work
        is moving here (``live``); drop the peers silent for too long."""
        for peer in list(self.by_ident.values()):
            silent = self._live.silent_for(peer.last_seen, now)
            if silent is not None:
                self._counts["peers_dead"] += 1
                self.drop(peer, f"silent for {silent:.1f} s (KVConfig.transfer_timeout_s)")
            else:
                gens = tuple(live.get(peer.key, ()))
                self._channel.send(peer.route, Heartbeat(seq=self._live.seq, live=gens))

    def close(self) -> None:
        """Release every peer's engine handle."""
        for p in [*self.by_ident.values(), *self._retired]:
            p.gone = True
            self.release(p)

    def __len__(self) -> int:
        return len(self.by_ident)

    def send(self, peer: Peer, msg: Any) -> None:
        """Send ``msg`` to ``peer``."""
        self._channel.send(peer.route, msg)
