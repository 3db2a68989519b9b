"""Wire messages of the consensus plugin (besides :class:`pdplug.Vote` / ``Decision``) and the
identities and codecs its sockets use.

Every struct is frozen and tagged, so each socket decodes a strict tagged union through a
sealed :class:`pdplug.wire.Codec` (size limit, HMAC when keyed, sender envelope, replay
rejection, drop counters). Never pickle.

A rank's identity is ``"<impl>:<group>:pp<rank>"``, ``group`` being a digest of the endpoint
list every rank of one group is configured with, so a frame of another group (or of the other
implementation) sharing the key is not a member here.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterable

import msgspec

from pdplug import ConsensusConfig
from pdplug.types import Decision, Vote
from pdplug.wire import Codec

__all__ = [
    "Heartbeat",
    "Abort",
    "StreamCandidate",
    "RingCandidate",
    "PP0_TYPES",
    "RING_TYPES",
    "identities",
    "rank_codec",
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


PP0_TYPES: tuple[type, ...] = (Vote, Decision, Abort, Heartbeat)
RING_TYPES: tuple[type, ...] = (RingCandidate, Decision, Heartbeat)


def identities(config: ConsensusConfig, impl: str) -> tuple[str, ...]:
    """Sender identity of every rank of ``config``'s group, indexed by PP rank."""
    group = hashlib.sha256("\n".join(config.endpoints).encode()).hexdigest()[:12]
    return tuple(f"{impl}:{group}:pp{r}" for r in range(config.pp_size))


def rank_codec(
    config: ConsensusConfig, impl: str, types: tuple[type, ...], peers: Iterable[int]
) -> Codec:
    """Sealed codec of this rank's sockets: its identity, accepting frames from ``peers`` only."""
    ids = identities(config, impl)
    return Codec.from_config(
        config.wire,
        *types,
        name=f"{impl}[r{config.pp_rank}]",
        identity=ids[config.pp_rank],
        members=[ids[p] for p in peers],
    )
