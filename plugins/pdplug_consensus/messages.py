"""Wire messages private to the consensus plugin (besides :class:`pdplug.Vote` / ``Decision``).

Every struct is frozen and tagged, so each socket decodes a strict tagged union through
:class:`pdplug.wire.Codec` (size limit, optional HMAC, drop counters). Never pickle.
"""

from __future__ import annotations

import msgspec

from pdplug import ConsensusConfig
from pdplug.types import Decision, Vote
from pdplug.wire import Codec

__all__ = [
    "Heartbeat",
    "Abort",
    "StreamCandidate",
    "RingCandidate",
    "pp0_codec",
    "ring_codec",
]


class Heartbeat(msgspec.Struct, frozen=True, kw_only=True, tag="hb"):
    """Liveness beacon sent every ``heartbeat_s`` seconds.

    :ivar rank: the sending PP rank (must match the sender's socket identity).
    :ivar dead: ranks the sender already declared dead (PP0 relays what it saw to followers).
    """

    rank: int
    dead: tuple[int, ...] = ()


class Abort(msgspec.Struct, frozen=True, kw_only=True, tag="abort"):
    """Request ids aborted on ``rank`` (pp0: sent to PP0; decided ``bad`` where pending).

    :ivar seq: per-rank abort message counter (duplicates are dropped as ``stale``).
    """

    rank: int
    seq: int
    rids: tuple[int, ...] = ()


class StreamCandidate(msgspec.Struct, frozen=True, kw_only=True):
    """One stream's part of a ring candidate.

    :ivar good: request ids ready on every rank the candidate passed so far (intersection).
    :ivar bad: request ids newly failed on some rank it passed (union).
    :ivar seen: request ids newly offered on some rank it passed (union); PP0 starts their
        vote deadline when it sees them.
    """

    stream: str
    good: tuple[int, ...] = ()
    bad: tuple[int, ...] = ()
    seen: tuple[int, ...] = ()


class RingCandidate(msgspec.Struct, frozen=True, kw_only=True, tag="ring_cand"):
    """A ring round: started by PP0, merged by every rank, frozen into decisions by PP0.

    :ivar rank: the sending rank (the receiver's ring predecessor).
    :ivar round: PP0's round counter (diagnostics).
    :ivar aborted: request ids newly aborted on some rank it passed (union).
    """

    rank: int
    round: int
    streams: tuple[StreamCandidate, ...] = ()
    aborted: tuple[int, ...] = ()


def pp0_codec(config: ConsensusConfig) -> Codec:
    """Codec of every ``pp0`` socket: Vote, Decision, Abort, Heartbeat."""
    return Codec(
        Vote,
        Decision,
        Abort,
        Heartbeat,
        max_bytes=config.wire.max_message_bytes,
        hmac_key=config.wire.hmac_key,
        name=f"pp0[r{config.pp_rank}]",
    )


def ring_codec(config: ConsensusConfig) -> Codec:
    """Codec of every ``ring`` socket: RingCandidate, Decision, Heartbeat."""
    return Codec(
        RingCandidate,
        Decision,
        Heartbeat,
        max_bytes=config.wire.max_message_bytes,
        hmac_key=config.wire.hmac_key,
        name=f"ring[r{config.pp_rank}]",
    )
