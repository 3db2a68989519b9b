"""The prefill side's table of decode peers: handshake acceptance, liveness, and drops.

A decode rank becomes a :class:`~pdplug.transfer.pipeline.Peer` of a prefill rank when its
:class:`~pdplug.transfer.messages.Hello` passes :func:`~pdplug.transfer.handshake.check_decode_peer`
and the engine loaded its agent blob. A peer is keyed by its decode instance and DCP rank; a
second Hello from the same key replaces the old peer. A peer silent for ``transfer_timeout_s``
is dropped; the session's ``on_drop`` fails the rooms bound to it. Runs on the engine thread.
"""

from __future__ import annotations

import logging
from collections import Counter
from collections.abc import Callable
from typing import Any

import numpy as np

from pdplug.transfer.channel import Liveness, RouterChannel
from pdplug.transfer.engine import TransferEngine
from pdplug.transfer.messages import Heartbeat, Hello, HelloAck
from pdplug.transfer.pipeline import Peer
from pdplug.types import PeerInfo

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
        self._live = liveness
        self._counts = counts
        self.by_ident: dict[bytes, Peer] = {}
        self.by_key: dict[tuple[str, int], bytes] = {}

    def get(self, ident: bytes) -> Peer | None:
        """The accepted peer that sent from ``ident``, if any."""
        return self.by_ident.get(ident)

    def by_position(self, key: tuple[str, int]) -> Peer | None:
        """The current peer of a decode position."""
        ident = self.by_key.get(key)
        return None if ident is None else self.by_ident.get(ident)

    def on_hello(self, ident: bytes, msg: Hello, now: float) -> None:
        """Check a Hello, load the peer's agent, and answer with a HelloAck."""
        remote = msg.peer
        key = (remote.instance, remote.layout.dcp_rank)
        mismatches, emap, relayout = self._check(remote)
        handle = None
        if not mismatches:
            try:
                handle = self._engine().connect(remote)
            except Exception as e:
                mismatches.append(f"agent: cannot connect ({type(e).__name__}: {e})")
        if mismatches:
            self._counts["refused"] += 1
            log.warning("%s: refused decode %s dcp %d: %s", self._name, key[0], key[1], mismatches)
            ack = HelloAck(
                nonce=msg.nonce, accepted=False, rank=self._rank, mismatches=tuple(mismatches)
            )
            self._channel.send(ident, ack)
            return
        old = self.by_key.get(key)
        if old is not None and old != ident:
            self.drop(self.by_ident[old], "decode peer reconnected")
        prev = self.by_ident.get(ident)
        if prev is not None and prev.handle is not None and prev.handle is not handle:
            self._engine().disconnect(prev.handle)
        assert emap is not None
        self.by_ident[ident] = Peer(
            ident=ident,
            info=remote,
            key=key,
            handle=handle,
            emap=emap,
            dst_base=np.asarray(remote.entry_base, dtype=np.int64),
            relayout=relayout,
            last_seen=now,
        )
        self.by_key[key] = ident
        self._counts["peers"] += 1
        ack = HelloAck(nonce=msg.nonce, accepted=True, rank=self._rank, peer=self._local())
        self._channel.send(ident, ack)

    def drop(self, peer: Peer, reason: str) -> None:
        """Forget ``peer``; the session fails the rooms bound to it."""
        peer.alive = False
        self.by_ident.pop(peer.ident, None)
        if self.by_key.get(peer.key) == peer.ident:
            del self.by_key[peer.key]
        self._on_drop(peer, reason)
        try:
            self._engine().disconnect(peer.handle)
        except Exception:
            pass

    def heartbeat(self, now: float) -> None:
        """Send a heartbeat to every live peer; drop the ones silent for too long."""
        for peer in list(self.by_ident.values()):
            silent = self._live.silent_for(peer.last_seen, now)
            if silent is not None:
                self._counts["peers_dead"] += 1
                self.drop(peer, f"silent for {silent:.1f} s (KVConfig.transfer_timeout_s)")
            else:
                self._channel.send(peer.ident, Heartbeat(seq=self._live.seq))

    def close(self) -> None:
        """Release every peer's engine handle."""
        for p in self.by_ident.values():
            try:
                self._engine().disconnect(p.handle)
            except Exception:
                pass

    def __len__(self) -> int:
        return len(self.by_ident)

    def send(self, peer: Peer, msg: Any) -> None:
        """Send ``msg`` to ``peer``."""
        self._channel.send(peer.ident, msg)
