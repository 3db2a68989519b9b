"""``ring``: the ring-intersection baseline, as the field runs it.

Algorithm (SGLang ``scheduler_pp_mixin`` ring consensus, with the frozen numbered decisions of
SGLang PR #34569):

1. Every ``poll()`` on PP0 starts a round: a :class:`~pdplug_consensus.messages.RingCandidate`
   holding, per stream, PP0's ready ids (``good``), its new failures (``bad``) and new offers
   (``seen``), plus its new aborts.
2. Rank ``k`` receives the candidate from rank ``k-1`` in its ``poll()``, intersects ``good``
   with its own ready ids and unites ``bad`` / ``seen`` / aborts with its own, and forwards it to
   rank ``k+1`` (rank ``P-1`` wraps to PP0).
3. PP0 freezes what came back into numbered :class:`pdplug.Decision` s through the same
   :class:`~pdplug_consensus.decide.Tally` as ``pp0`` (aborted or past ``vote_deadline_s`` →
   ``bad``; the deadline starts when PP0 first sees an id), applies them and sends them to
   rank 1; each rank applies and forwards the decision until rank ``P-1``.

Hop timing models the field: a message received at the top of an iteration (``poll()``) is
forwarded at the end of that iteration, i.e. at the start of the rank's next ``poll()`` (after
its forward pass). SGLang's stages receive with a blocking recv at the top of the matching
iteration of a pipeline, so a hop costs exactly one iteration there: ``P`` iterations until
PP0 can admit, ``2P-1`` until the last rank has the decision (2P-1 messages per round). A host
whose ranks poll at unrelated phases adds up to one more iteration per hop (the wait for the
next ``poll()``). Kept for comparison (``pdplug bench consensus``, which runs the ranks as a
pipeline) and as a fallback.

Same Protocol, wire codec, exactly-once application, holds, deadline and liveness (every rank
heartbeats every other rank; a rank silent for ``peer_timeout_s`` makes ``poll()`` raise
:class:`pdplug.ConsensusError` naming it) as ``pp0`` (:class:`~pdplug_consensus.base.
RankConsensus`). Candidates and decisions are accepted from the ring predecessor only. No host
relay: the decisions travel the ring itself, re-sealed by each rank that forwards them.
"""

from __future__ import annotations

import time
from typing import Any

from pdplug import ConsensusConfig
from pdplug.types import Decision
from pdplug_consensus.base import RankConsensus
from pdplug_consensus.common import horizon_s
from pdplug_consensus.decide import Tally
from pdplug_consensus.messages import RING_TYPES, Heartbeat, RingCandidate, StreamCandidate

__all__ = ["RingConsensus", "make_ring"]


class RingConsensus(RankConsensus):
    """One PP rank's ``ring`` consensus (implements :class:`pdplug.protocols.Consensus`).

    :param config: rank, size, endpoints (each rank's inbox), streams, timeouts (s), wire rules.
    :raises ValueError: a config field is invalid (named with its value), or an endpoint is
        off loopback without ``wire.hmac_key``.
    :raises zmq.ZMQError: this rank's endpoint cannot be bound.
    """

    impl = "ring"

    def __init__(self, config: ConsensusConfig) -> None:
        r, p = config.pp_rank, config.pp_size
        super().__init__(config, RING_TYPES, [q for q in range(p) if q != r])
        self._succ, self._pred = (r + 1) % p, (r - 1) % p
        self._outbox: list[Any] = []
        self._round = 0
        self.counters.update(
            polls=0,
            rounds_started=0,
            rounds_frozen=0,
            round_polls=0,
            candidates_forwarded=0,
            decisions_relayed=0,
        )
        if self.leader:
            self._tally = Tally(p, config.streams, config.vote_deadline_s, horizon_s(config))
        self._start_link(heartbeat=lambda dead: Heartbeat(rank=r))

    def poll(self) -> list[Decision]:
        """One loop iteration: forward last iteration's messages, take one step of the ring.

        :raises ConsensusError: a sequence gap/duplicate or repeated id, a peer silent for
            ``peer_timeout_s`` (named), or a crashed I/O thread; sticky once raised.
        """
        self._open()
        self._check()
        self.counters["polls"] += 1
        for m in self._outbox:  # end of the previous iteration
            self._link.send(self._succ, m)
        self._outbox = []
        now = time.monotonic()
        out: list[Decision] = []
        inbox = self._link.inbox
        for _ in range(len(inbox)):
            sender, msg = inbox.popleft()
            if sender != self._pred:  # data frames only travel the ring
                self._codec.drop("unknown_rank")
            elif isinstance(msg, Decision) and not self.leader:
                self._apply(msg, now, out)
                if self._succ != 0:
                    self._outbox.append(msg)
                    self.counters["decisions_relayed"] += 1
            elif isinstance(msg, RingCandidate) and self._known(msg):
                if self.leader:
                    self._freeze(msg, now, out)
                else:
                    self._outbox.append(self._merge(msg))
                    self.counters["candidates_forwarded"] += 1
            elif not isinstance(msg, RingCandidate):
                self._codec.drop("wrong_type")
        if self.leader:
            cand = self._merge(None)
            self.counters["rounds_started"] += 1
            if self.size == 1:
                self._freeze(cand, now, out)
            else:
                self._outbox.append(cand)
        return out

    def wait(self, timeout_s: float) -> bool:
        """Block until the next round's candidate is queued for :meth:`poll`, at most
        ``timeout_s`` seconds; returns whether it is.

        Not part of the Protocol (whose methods never block): for hosts that, like SGLang's PP
        stages, receive the ring with a blocking recv at the top of the iteration, so a late
        hand-off delays the iteration instead of costing a whole one. A rank forwards the
        decisions it relays before the candidate, so they are queued by then too.
        """
        link, until = self._link, time.monotonic() + timeout_s

        def queued() -> bool:
            return any(isinstance(m, RingCandidate) for _, m in link.inbox)

        while not queued():
            link.arrived.clear()
            left = until - time.monotonic()
            if queued() or (left > 0 and link.arrived.wait(left)):
                continue
            return queued()
        return True

    def stats(self) -> dict[str, int]:
        """Counters: polls, rounds, candidates forwarded, decisions relayed / applied, frames
        dropped by reason, deferred and late offers; on PP0 decisions, deadline/abort bads and
        ``round_polls`` (PP0 polls frozen rounds spent in the ring; ``pp_size`` each when every
        rank polls right after its predecessor)."""
        out = super().stats()
        if self.leader:
            out.update(self._tally.counters)
        return out

    # ------------------------------------------------------------------ internals

    def _known(self, c: RingCandidate) -> bool:
        if all(sc.stream in self._votes.ready for sc in c.streams):
            return True
        self._codec.drop("malformed")  # a peer configured with other streams
        return False

    def _merge(self, c: RingCandidate | None) -> RingCandidate:
        """Add this rank's view to ``c`` (``None``: start a round on PP0)."""
        votes, aborts = self._votes.take()
        new = {s: (g, b) for s, g, b in votes}
        by: dict[str, Any] = {sc.stream: sc for sc in c.streams} if c is not None else {}
        streams = []
        for s in self.config.streams:
            ready = self._votes.ready[s]
            g_new, b_new = new.get(s, ((), ()))
            sc = by.get(s)
            if c is None:
                good = tuple(ready)
                bad, seen = b_new, g_new + b_new
            elif sc is None:
                good, bad, seen = (), b_new, g_new + b_new
            else:
                good = tuple(x for x in sc.good if x in ready)
                bad, seen = sc.bad + b_new, sc.seen + g_new + b_new
            if good or bad or seen:
                streams.append(StreamCandidate(stream=s, good=good, bad=bad, seen=seen))
        if c is None:
            self._round += 1
        return RingCandidate(
            rank=self.rank,
            round=self._round if c is None else c.round,
            streams=tuple(streams),
            aborted=(c.aborted if c is not None else ()) + aborts,
        )

    def _freeze(self, c: RingCandidate, now: float, out: list[Decision]) -> None:
        t = self._tally
        t.abort(c.aborted, now)
        for sc in c.streams:
            t.see(sc.stream, sc.seen, now)
            t.vote(sc.stream, 0, (), sc.bad, now)
            t.complete(sc.stream, sc.good, now)
        self.counters["rounds_frozen"] += 1
        self.counters["round_polls"] += self._round - c.round  # PP0 polls it spent in the ring
        for d in t.decide(now):
            self._apply(d, now, out)
            if self.size > 1:
                self._outbox.append(d)


def make_ring(config: ConsensusConfig) -> RingConsensus:
    """Factory of the ``ring`` consensus (registry record ``pdplug_consensus.ring:make_ring``).

    :param config: the rank's :class:`pdplug.ConsensusConfig`.
    :raises ValueError: invalid config (field and value named).
    """
    return RingConsensus(config)
