"""The decode side's table of prefill sources: connections, handshakes and liveness.

A decode rank connects one DEALER (:class:`~pdplug.transfer.channel.DealerChannel`) to every
rank of a prefill instance and sends each a :class:`~pdplug.transfer.messages.Hello`; a source
is ``accepted`` or ``refused`` by its :class:`~pdplug.transfer.messages.HelloAck`. Completion
tags are attributed to a source by its connection (control channel) or its engine agent name
(engine notifications). A source silent for ``transfer_timeout_s`` is declared dead; the
session's ``on_dead`` fails the rooms that wait for it. Connecting to an instance again replaces
its sources; a rank served by the same process (same agent) keeps its rooms (``on_replace``,
once the new connection was accepted).

Silence is not proof that a source stopped writing: a partition silences a prefill rank whose
writes land once it heals. A source has **ended** (:meth:`PrefillSources.ended`: nothing it
posted can land any more) only when its control connection was closed by the far end and not
reconnected since (its process ended: a FIN or RST came back, which no partition sends) and it
has been silent for ``transfer_timeout_s``, or when the instance answered again with another
process at that rank (a restart: the old incarnation is gone). Until then a failed room bound
to it is not drained; its Abort goes to whichever connection serves that rank now.
Runs on the engine thread.
"""

from __future__ import annotations

import random
import time
from collections import Counter
from collections.abc import Callable
from concurrent.futures import Future
from typing import Any

import msgspec

from pdplug.bootstrap import rank_of
from pdplug.transfer.channel import DealerChannel, Liveness
from pdplug.transfer.messages import Heartbeat, Hello, HelloAck
from pdplug.types import PeerInfo
from pdplug.wire import Codec, peer_identity

__all__ = ["Source", "PrefillSources"]


class Source(msgspec.Struct, kw_only=True):
    """One prefill rank as seen by a decode rank (engine thread state).

    :ivar cid: the control connection's id; ``rank``: the prefill rank id.
    :ivar state: ``pending`` | ``accepted`` | ``refused`` (with ``mismatches``).
    :ivar silent: declared dead for its silence (``alive`` is then False too).
    :ivar cut: its connection was closed by the far end and not reconnected when this side
        closed it (kept: the socket that told is gone).
    :ivar over: another process answered for its rank since (:meth:`PrefillSources.ended`).
    """

    instance: str
    rank: int
    info: PeerInfo
    cid: bytes
    agent_name: str
    nonce: int
    last_seen: float
    alive: bool = True
    state: str = "pending"
    mismatches: tuple[str, ...] = ()
    silent: bool = False
    cut: bool = False
    over: bool = False


class PrefillSources:
    """The prefill ranks one decode rank is connected to, by instance.

    :param channel: the session's DEALER sockets.
    :param codec: the control codec (drops of stale acks).
    :param liveness: heartbeat pacing and silence bound.
    :param on_dead: ``(source, reason)`` when a source is declared dead.
    :param on_replace: ``(old, new)`` when a reconnect to the same prefill process was
        accepted (never before: a connection that never answers must not take its rooms).
    :param counts: the session's counters (``sources_dead``).
    :param on_answered: ``(instance)`` when a handshake with it ended (every rank answered,
        or it was given up).
    """

    def __init__(
        self,
        *,
        channel: DealerChannel,
        codec: Codec[Any],
        liveness: Liveness,
        on_dead: Callable[[Source, str], None],
        on_replace: Callable[[Source, Source], None],
        counts: Counter[str],
        on_answered: Callable[[str], None] = lambda _instance: None,
    ) -> None:
        self._on_answered = on_answered
        self._channel = channel
        self._codec = codec
        self._live = liveness
        self._on_dead = on_dead
        self._on_replace = on_replace
        self._counts = counts
        self.by_instance: dict[str, dict[int, Source]] = {}
        self.by_cid: dict[bytes, Source] = {}
        self.by_agent: dict[str, Source] = {}
        # the last accepted source of each (instance, rank), kept after its connection closed:
        # rooms failed while it was silent stay bound to it until it is replaced or answers
        self._last: dict[tuple[str, int], Source] = {}
        self._pending: list[tuple[list[Source], Future[list[Source]]]] = []

    def table(self, instance: str) -> dict[int, Source]:
        """Sources of ``instance`` by prefill rank (empty if not connected)."""
        return self.by_instance.get(instance, {})

    def connect(
        self, instance: str, peers: list[PeerInfo], hello: PeerInfo
    ) -> Future[list[Source]]:
        """Open a connection to every rank in ``peers`` and send each a Hello; the future
        resolves once every rank answered (replaces an earlier connection to ``instance``: a
        connect of it still waiting then resolves with this one, whose answer is the only one
        that can come; the host's connect and a re-find's raced, and the earlier one said
        "did not answer the handshake" while the instance was answering)."""
        fut: Future[list[Source]] = Future()
        old = self.by_instance.get(instance, {})
        if old:
            self.disconnect(instance)
        now = time.monotonic()
        group: list[Source] = []
        for p in peers:
            src = Source(
                instance=instance,
                rank=rank_of(p.layout),
                info=p,
                cid=self._channel.open(p.control_endpoint, peer_identity(p)),
                agent_name=p.extra.get("agent_name", ""),
                nonce=random.getrandbits(62),
                last_seen=now,
            )
            self.by_cid[src.cid] = src
            self._channel.send(src.cid, Hello(peer=hello, nonce=src.nonce))
            group.append(src)
        self.by_instance[instance] = {s.rank: s for s in group}
        self._pending = [
            (group if g and g[0].instance == instance else g, f) for g, f in self._pending
        ]
        self._pending.append((group, fut))
        return fut

    def ended(self, src: Source, now: float) -> bool:
        """Whether nothing ``src`` posted can land any more (module docstring): another process
        answered for its rank since, or the far end closed its connection and it has been
        silent for ``transfer_timeout_s`` since its last frame."""
        if src.over:
            return True
        cut = src.cut or self._channel.closed_by_peer(src.cid)
        return cut and self._live.silent_for(src.last_seen, now) is not None

    def current(self, instance: str, rank: int) -> Source | None:
        """The accepted, live source of ``instance`` at ``rank`` now (the connection a room's
        Abort goes to, whichever connection the room was expected on)."""
        src = self.table(instance).get(rank)
        return src if src is not None and src.alive and src.state == "accepted" else None

    def abandon(self, fut: Future[list[Source]]) -> list[int]:
        """Give up a connect that timed out; returns the ranks that never answered."""
        for group, f in self._pending:
            if f is fut:
                self._pending.remove((group, f))
                missing = [s.rank for s in group if s.state == "pending"]
                first = group[0] if group else None
                # only if still current (a later connect to the instance may have replaced it)
                # and no other connect waits for it
                waited = any(g is group for g, _f in self._pending)
                if first and not waited and self.table(first.instance).get(first.rank) is first:
                    self.disconnect(first.instance)
                    self._on_answered(first.instance)
                return missing
        return []

    def disconnect(self, instance: str) -> None:
        """Close every connection to ``instance``."""
        for src in self.by_instance.pop(instance, {}).values():
            src.cut = src.cut or self._channel.closed_by_peer(src.cid)  # kept past the socket
            src.alive = False
            self.by_cid.pop(src.cid, None)
            if self.by_agent.get(src.agent_name) is src:
                del self.by_agent[src.agent_name]
            self._channel.close(src.cid)

    def close(self) -> None:
        """Close every connection."""
        for inst in list(self.by_instance):
            self.disconnect(inst)

    def send(self, src: Source, msg: Any) -> None:
        """Send ``msg`` to ``src``."""
        self._channel.send(src.cid, msg)

    def on_ack(self, src: Source, ack: HelloAck) -> None:
        """A prefill rank answered our Hello."""
        if ack.nonce != src.nonce or src.state != "pending":
            self._codec.drop("stale")
            return
        if ack.rank != src.rank:
            self._codec.drop("unknown_rank")
            return
        if ack.accepted:
            src.state = "accepted"
            if src.agent_name:
                self.by_agent[src.agent_name] = src
            # rooms move to a connection only once it answered: a reconnect that never does
            # (a stale registration of a dead process) must not strand them on it
            prev = self._last.get((src.instance, src.rank))
            if prev is not None and prev is not src:
                if prev.agent_name != src.agent_name:
                    prev.over = True  # a new incarnation answers for this rank
                elif src.agent_name:
                    self._on_replace(prev, src)  # the same process: its rooms continue here
            self._last[(src.instance, src.rank)] = src
        else:
            src.state = "refused"
            src.mismatches = tuple(ack.mismatches) or ("refused without a reason",)
        for group, fut in list(self._pending):
            if all(s.state != "pending" for s in group):
                self._pending.remove((group, fut))
                fut.set_result(group)
                self._on_answered(src.instance)

    def heartbeat(self, now: float) -> None:
        """Heartbeat every accepted source; declare the silent ones dead."""
        for inst, table in self.by_instance.items():
            for src in table.values():
                if not src.alive or src.state != "accepted":
                    continue
                silent = self._live.silent_for(src.last_seen, now)
                if silent is None:
                    self.send(src, Heartbeat(seq=self._live.seq))
                    continue
                src.alive = False
                src.silent = True
                self._counts["sources_dead"] += 1
                reason = (
                    f"prefill {inst} rank {src.rank} silent for {silent:.1f} s "
                    "(KVConfig.transfer_timeout_s)"
                )
                self._on_dead(src, reason)
