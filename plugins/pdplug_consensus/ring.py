"""``ring``: the ring-intersection baseline, as the field runs it (DESIGN.md §3).

Algorithm (SGLang ``scheduler_pp_mixin`` ring consensus, described in
``prior-art/sglang.md`` §2.3, with the frozen numbered decisions of SGLang PR #34569):

1. Every ``poll()`` on PP0 starts a round: a :class:`~pdplug_consensus.messages.RingCandidate`
   holding, per stream, PP0's ready ids (``good``), its new failures (``bad``) and new offers
   (``seen``), plus its new aborts.
2. Rank ``k`` receives the candidate from rank ``k-1`` in its ``poll()``, intersects ``good``
   with its own ready ids and unites ``bad`` / ``seen`` / aborts with its own, and forwards it to
   rank ``k+1`` (rank ``P-1`` wraps to PP0).
3. PP0 freezes what came back into numbered :class:`pdplug.Decision` s through the same
   :class:`~pdplug_consensus.common.Tally` as ``pp0`` (aborted or past ``vote_deadline_s`` →
   ``bad``; the deadline starts when PP0 first sees an id), applies them and sends them to
   rank 1; each rank applies and forwards the frame unchanged until rank ``P-1``.

Hop timing models the field: a message received at the top of an iteration (``poll()``) is
forwarded at the end of that iteration, i.e. at the start of the rank's next ``poll()`` (after
its forward pass). So each hop costs one loop iteration of the receiving rank: about ``P``
iterations until PP0 can admit, ``2P-1`` until the last rank has the decision (2P-1 messages
per round). Kept for comparison (``pdplug bench consensus``) and as a fallback.

Same Protocol, wire codec, exactly-once application, holds, deadline and liveness (every rank
heartbeats every other rank over ZMQ DEALER→ROUTER; a rank silent for ``peer_timeout_s`` makes
``poll()`` raise :class:`pdplug.ConsensusError` naming it) as ``pp0``. No host relay: the
decisions travel the ring itself.
"""

from __future__ import annotations

import time
from collections.abc import Iterable
from typing import Any

from pdplug import ConsensusConfig, ConsensusError
from pdplug.types import Decision
from pdplug_consensus.common import Applier, LocalVotes, Tally, check_config, horizon_s
from pdplug_consensus.link import Link
from pdplug_consensus.messages import Heartbeat, RingCandidate, StreamCandidate, ring_codec

__all__ = ["RingConsensus", "make_ring"]


class RingConsensus:
    """One PP rank's ``ring`` consensus (implements :class:`pdplug.protocols.Consensus`).

    :param config: rank, size, endpoints (each rank's inbox), streams, timeouts (s), wire rules.
    :raises ValueError: a config field is invalid (named with its value).
    :raises zmq.ZMQError: this rank's endpoint cannot be bound.
    """

    def __init__(self, config: ConsensusConfig) -> None:
        check_config(config)
        self.config = config
        self.rank = r = config.pp_rank
        self.size = p = config.pp_size
        self.leader = r == 0
        self._succ, self._pred = (r + 1) % p, (r - 1) % p
        self._codec = ring_codec(config)
        hz = horizon_s(config)
        self._applier = Applier(config.streams, hz)
        self._votes = LocalVotes(config.streams, self._applier, hz)
        self._outbox: list[bytes] = []
        self._round = 0
        self._failed: ConsensusError | None = None
        self._closed = False
        self.counters = {
            "polls": 0,
            "rounds_started": 0,
            "rounds_frozen": 0,
            "candidates_forwarded": 0,
            "decisions_relayed": 0,
            "decisions_applied": 0,
        }
        if self.leader:
            self._tally = Tally(p, config.streams, config.vote_deadline_s, hz)
        others = [q for q in range(p) if q != r]
        self._link = Link(
            rank=r,
            endpoints=config.endpoints,
            out_peers=others,
            in_peers=others,
            codec=self._codec,
            bind_host=config.wire.bind_host,
            heartbeat_s=config.heartbeat_s,
            peer_timeout_s=config.peer_timeout_s,
            heartbeat=lambda dead: Heartbeat(rank=r),
            name="ring",
        )

    # ------------------------------------------------------------------ host API

    def offer(self, stream: str, good: Iterable[int] = (), bad: Iterable[int] = ()) -> None:
        """Vote ``good`` / ``bad`` ids for ``stream``; they join the next candidate passing.

        :raises ValueError: unknown ``stream`` or a non-integer id.
        :raises ConsensusError: this object was closed.
        """
        self._open()
        self._votes.offer(stream, good, bad)

    def hold(self, rid: int, n: int = 1) -> None:
        """Mark ``n`` chunks of ``rid`` pending here: its ``good`` votes wait for release.

        :raises ValueError: ``n < 1``.
        """
        self._votes.hold(rid, n)

    def release_hold(self, rid: int, n: int = 1) -> None:
        """``n`` pending chunks of ``rid`` completed; deferred ``good`` votes count at zero.

        :raises ValueError: more holds released than taken.
        """
        self._votes.release_hold(rid, n)

    def abort(self, rid: int) -> None:
        """Abort ``rid``: it travels with the next candidate; PP0 decides it ``bad`` where
        pending and on later votes."""
        self._open()
        self._votes.abort(rid, time.monotonic())

    def poll(self) -> list[Decision]:
        """One loop iteration: forward last iteration's messages, take one step of the ring.

        :raises ConsensusError: a sequence gap/duplicate or repeated id, a peer silent for
            ``peer_timeout_s`` (named), or a crashed I/O thread; sticky once raised.
        """
        self._open()
        if self._failed is None and (why := self._link.failure()) is not None:
            self._failed = ConsensusError(f"ring rank {self.rank}: {why}")
        if self._failed is not None:
            raise self._failed
        self.counters["polls"] += 1
        for f in self._outbox:  # end of the previous iteration
            self._link.send(self._succ, f)
        self._outbox = []
        now = time.monotonic()
        out: list[Decision] = []
        inbox = self._link.inbox
        for _ in range(len(inbox)):
            sender, msg, frame = inbox.popleft()
            if sender != self._pred:  # data frames only travel the ring
                self._codec.drop("unknown_rank")
            elif isinstance(msg, Decision) and not self.leader:
                self._apply(msg, now, out)
                if self._succ != 0:
                    self._outbox.append(frame)  # relayed unchanged
                    self.counters["decisions_relayed"] += 1
            elif isinstance(msg, RingCandidate) and self._known(msg):
                if self.leader:
                    self._freeze(msg, now, out)
                else:
                    self._outbox.append(self._codec.encode(self._merge(msg)))
                    self.counters["candidates_forwarded"] += 1
            elif not isinstance(msg, RingCandidate):
                self._codec.drop("wrong_type")
        if self.leader:
            cand = self._merge(None)
            self.counters["rounds_started"] += 1
            if self.size == 1:
                self._freeze(cand, now, out)
            else:
                self._outbox.append(self._codec.encode(cand))
        self.counters["decisions_applied"] += len(out)
        return out

    def stats(self) -> dict[str, int]:
        """Counters: polls, rounds, candidates forwarded, decisions relayed / applied, frames
        dropped by reason, deferred and late offers; on PP0 decisions, deadline/abort bads."""
        out = dict(self.counters)
        out.update(self._votes.counters)
        out.update(self._codec.stats())
        out.update(self._link.counters)
        if self.leader:
            out.update(self._tally.counters)
        return out

    def close(self) -> None:
        """Stop the I/O thread and close the sockets; idempotent."""
        if not self._closed:
            self._closed = True
            self._link.close()

    def __enter__(self) -> RingConsensus:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # ------------------------------------------------------------------ internals

    def _open(self) -> None:
        if self._closed:
            raise ConsensusError(f"ring rank {self.rank}: consensus is closed")

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
        for d in t.decide(now):
            self._apply(d, now, out)
            if self.size > 1:
                self._outbox.append(self._codec.encode(d))

    def _apply(self, d: Decision, now: float, out: list[Decision]) -> None:
        try:
            self._applier.apply(d, now)
        except ConsensusError as e:
            self._failed = ConsensusError(f"ring rank {self.rank}: {e}")
            raise self._failed from None
        self._votes.applied(d)
        out.append(d)


def make_ring(config: ConsensusConfig) -> RingConsensus:
    """Factory of the ``ring`` consensus (registry record ``pdplug_consensus.ring:make_ring``).

    :param config: the rank's :class:`pdplug.ConsensusConfig`.
    :raises ValueError: invalid config (field and value named).
    """
    return RingConsensus(config)
