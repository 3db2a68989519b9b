"""``pp0``: PP0-centric consensus — one hop in, one hop out, whatever ``pp_size`` is.

Algorithm (the PP0-centric store of SGLang PR #38959 with the frozen, numbered
decisions of PR #34569):

1. ``offer(stream, good, bad)`` on any rank sends a :class:`pdplug.Vote` (only the ids new
   since the last vote) to PP0 at once over DEALER→ROUTER; PP0's own votes take an in-process
   shortcut to the same tally. ``abort(rid)`` sends an ``Abort``.
2. PP0's I/O thread tallies votes as they arrive (:class:`~pdplug_consensus.common.Tally`):
   ``good`` = voted ready by every rank and failed nowhere, ``bad`` = failed or aborted on any
   rank, or not voted by some rank within ``vote_deadline_s`` of its first vote. It numbers one
   :class:`pdplug.Decision` per stream per wake-up (gap-free ``seq``) and sends the same frame
   to every follower directly (one DEALER per follower), and queues it for PP0 itself.
3. ``poll()`` on every rank, PP0 included, applies the decisions that arrived, in ``seq``
   order, exactly once (:class:`~pdplug_consensus.common.Applier`: a gap or duplicate raises
   :class:`pdplug.ConsensusError`).

Admission latency is one network hop in, one out, plus the wait for each rank's next
``poll()``; no chain through the ranks. A rank's ``good`` is not voted while it holds the
request id (``hold(rid)`` per pending chunk, ``release_hold(rid)`` when it completes).

Liveness: followers heartbeat PP0 and PP0 heartbeats followers every ``heartbeat_s``; PP0's
heartbeat carries the ranks it declared dead (followers believe dead-lists from PP0 only). A
rank silent for ``peer_timeout_s`` makes ``poll()`` raise :class:`pdplug.ConsensusError` naming
it, on every surviving rank. Votes, aborts and heartbeats count only from authenticated
members (sealed codec, :mod:`pdplug_consensus.link`); a replayed frame is dropped.

Host-supplied decision relay
----------------------------
A host that already has a PP point-to-point channel may carry the decision fan-out itself:
pass ``relay=`` (a :class:`DecisionRelay`) to :func:`make_pp0` on **every** rank. Contract:

* ``publish(frame: bytes)`` is called on PP0 only, from the host thread inside ``poll()``,
  once per decision, in ``seq`` order. It must deliver ``frame`` unchanged to every follower
  (ranks ``1..pp_size-1``), reliably and in order, and must not block for long.
* ``receive() -> list[bytes]`` is called on followers only, from the host thread inside
  ``poll()``; it returns the frames that arrived since the last call, in publish order,
  without blocking (``[]`` when none).
* Frames are opaque sealed codec frames (PP0's identity, epoch and sequence; HMAC when a key
  is set); followers authenticate them with a codec of their own that accepts PP0 only, so a
  relay that repeats or reorders a frame has it dropped (counted ``replay``), and one that
  drops a frame makes ``poll()`` raise :class:`pdplug.ConsensusError` (sequence gap).

With a relay, decisions leave PP0 at its next ``poll()`` rather than from its I/O thread (up
to one PP0 loop iteration later); votes, aborts and heartbeats still use ZMQ.

Obtaining it with a relay through the plugin manager::

    spec, _, _ = pm.resolve("consensus", "pp0")
    consensus = pdplug.manager.load_factory(spec.factory)(config, relay=my_relay)
"""

from __future__ import annotations

import logging
import time
from collections import deque
from typing import Any, Protocol, runtime_checkable

from pdplug import ConsensusConfig
from pdplug.types import Decision, Vote
from pdplug.wire import Codec
from pdplug_consensus.base import RankConsensus
from pdplug_consensus.common import horizon_s
from pdplug_consensus.decide import Tally
from pdplug_consensus.messages import PP0_TYPES, Abort, Heartbeat

__all__ = ["DecisionRelay", "PP0Consensus", "make_pp0"]

log = logging.getLogger(__name__)


@runtime_checkable
class DecisionRelay(Protocol):
    """Host channel that replaces the ZMQ decision fan-out (contract: module docstring)."""

    def publish(self, frame: bytes) -> None:
        """PP0: deliver ``frame`` unchanged, reliably and in order, to every follower."""
        ...

    def receive(self) -> list[bytes]:
        """Follower: frames arrived since the last call, in publish order; never blocks."""
        ...


class PP0Consensus(RankConsensus):
    """One PP rank's ``pp0`` consensus (implements :class:`pdplug.protocols.Consensus`).

    :param config: rank, size, endpoints (``endpoints[0]`` is PP0), streams, timeouts (s),
        wire rules (size limit, HMAC key, bind interface).
    :param relay: optional host channel for decisions (see the module docstring).
    :raises ValueError: a config field is invalid (named with its value), or an endpoint is
        off loopback without ``wire.hmac_key``.
    :raises TypeError: ``relay`` lacks ``publish`` / ``receive``.
    :raises zmq.ZMQError: this rank's endpoint cannot be bound.
    """

    impl = "pp0"

    def __init__(self, config: ConsensusConfig, relay: DecisionRelay | None = None) -> None:
        peers = range(1, config.pp_size) if config.pp_rank == 0 else (0,)
        super().__init__(config, PP0_TYPES, peers)
        if relay is not None and not isinstance(relay, DecisionRelay):
            raise TypeError(
                f"make_pp0: relay={relay!r} lacks publish(frame) / receive() (DecisionRelay)"
            )
        self._relay = relay
        self._vote_seq = dict.fromkeys(config.streams, 0)
        self._abort_seq = 0
        self._own: deque[tuple[Decision, bytes]] = deque()  # PP0: its decisions, as sent
        self.counters.update(votes_sent=0, aborts_sent=0)
        if relay is not None and not self.leader:
            self._relay_codec: Codec = Codec.from_config(
                config.wire,
                Decision,
                name=f"pp0-relay[r{self.rank}]",
                identity=self.identities[self.rank],
                members=(self.identities[0],),
            )
            self._codecs.append(self._relay_codec)
        if self.leader:
            hz = horizon_s(config)
            self._tally = Tally(config.pp_size, config.streams, config.vote_deadline_s, hz)
            self._vote_next: dict[tuple[int, str], int] = {}
            self._abort_next: dict[int, int] = {}
            self._lcount = {"vote_gaps": 0}
        self._start_link(
            heartbeat=self._heartbeat,
            dead_from=() if self.leader else (0,),
            on_frame=self._leader_frame if self.leader else None,
            on_local=self._leader_local if self.leader else None,
            on_tick=self._leader_tick if self.leader else None,
        )

    # ------------------------------------------------------------------ host API

    def poll(self) -> list[Decision]:
        """Decisions that arrived since the last call, in ``seq`` order per stream.

        :raises ConsensusError: a sequence gap/duplicate or a repeated id, a peer silent for
            ``peer_timeout_s`` (named), or a crashed I/O thread. Once raised, every later call
            raises the same error.
        """
        self._open()
        self._check()
        inbox = self._link.inbox
        if self.leader:
            own = [self._own.popleft() for _ in range(len(self._own))]
            if self._relay is not None:
                for _, f in own:
                    self._relay.publish(f)
            msgs: list[Any] = [d for d, _ in own]
        elif self._relay is not None:
            msgs = [self._relay_codec.decode(f) for f in self._relay.receive()]
            for _ in range(len(inbox)):  # decisions must come through the relay only
                inbox.popleft()
                self._codec.drop("other")
        else:
            msgs = [inbox.popleft()[1] for _ in range(len(inbox))]
        out: list[Decision] = []
        now = time.monotonic()
        for m in msgs:
            if m is None:  # dropped and counted by the codec
                continue
            if not isinstance(m, Decision):
                self._codec.drop("wrong_type")
                continue
            self._apply(m, now, out)
        return out

    def stats(self) -> dict[str, int]:
        """Counters: votes/aborts sent, decisions applied, frames dropped by reason (codec),
        deferred and late offers; on PP0 also decisions made, deadline/abort bads."""
        out = super().stats()
        if self.leader:
            out.update(self._tally.counters)
            out.update(self._lcount)
        return out

    # ------------------------------------------------------------------ internals

    def _voted(self) -> None:
        votes, aborts = self._votes.take()
        msgs: list[Any] = []
        for stream, good, bad in votes:
            seq = self._vote_seq[stream]
            self._vote_seq[stream] = seq + 1
            msgs.append(Vote(stream=stream, rank=self.rank, seq=seq, good=good, bad=bad))
        if aborts:
            msgs.append(Abort(rank=self.rank, seq=self._abort_seq, rids=aborts))
            self._abort_seq += 1
            self.counters["aborts_sent"] += 1
        self.counters["votes_sent"] += len(votes)
        for m in msgs:
            if self.leader:
                self._link.local(m)
            else:
                self._link.send(0, m)

    def _heartbeat(self, dead: tuple[int, ...]) -> Heartbeat:
        return Heartbeat(rank=self.rank, dead=dead if self.leader else ())

    # ------------------------------------------------------------------ PP0's I/O thread

    def _leader_local(self, msg: Any) -> None:
        self._leader_frame(0, msg)

    def _leader_frame(self, sender: int, msg: Any) -> None:
        now = time.monotonic()
        if isinstance(msg, Vote):
            if not self._tally.has_stream(msg.stream):
                self._codec.drop("malformed")
                return
            key = (sender, msg.stream)
            want = self._vote_next.get(key, 0)
            if msg.seq < want:  # a duplicate the envelope let through (cannot happen)
                self._codec.drop("stale")
                return
            if msg.seq > want:
                self._lcount["vote_gaps"] += 1
            self._vote_next[key] = msg.seq + 1
            self._tally.vote(msg.stream, sender, msg.good, msg.bad, now)
        elif isinstance(msg, Abort):
            want = self._abort_next.get(sender, 0)
            if msg.seq < want:
                self._codec.drop("stale")
                return
            self._abort_next[sender] = msg.seq + 1
            self._tally.abort(msg.rids, now)
        else:  # a Decision sent to the leader
            self._codec.drop("wrong_type")

    def _leader_tick(self, now: float) -> None:
        for d in self._tally.decide(now):
            frame = self._codec.encode(d)
            if self._relay is None:
                for p in self.peers:
                    self._link.send_now(p, frame)
            self._own.append((d, frame))


def make_pp0(config: ConsensusConfig, *, relay: DecisionRelay | None = None) -> PP0Consensus:
    """Factory of the ``pp0`` consensus (registry record ``pdplug_consensus.pp0:make_pp0``).

    :param config: the rank's :class:`pdplug.ConsensusConfig`.
    :param relay: optional host channel replacing the ZMQ decision fan-out.
    :raises ValueError: invalid config (field and value named).
    """
    return PP0Consensus(config, relay=relay)
