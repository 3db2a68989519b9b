"""The lifecycle ``pp0`` and ``ring`` share: votes, holds, aborts, apply-or-fail, stats, close.

:class:`RankConsensus` owns one rank's :class:`~pdplug_consensus.votes.LocalVotes`,
:class:`~pdplug_consensus.decide.Applier`, sealed codec and
:class:`~pdplug_consensus.link.Link`; a subclass supplies the message flow (``poll`` and what
happens after a local vote changes, :meth:`RankConsensus._voted`).
"""

from __future__ import annotations

import time
from collections.abc import Iterable
from typing import Any

from pdplug import ConsensusConfig, ConsensusError
from pdplug.types import Decision
from pdplug.wire import Codec
from pdplug_consensus.common import check_config, horizon_s
from pdplug_consensus.decide import Applier
from pdplug_consensus.link import Link
from pdplug_consensus.messages import identities, rank_codec
from pdplug_consensus.votes import LocalVotes

__all__ = ["RankConsensus"]


class RankConsensus:
    """One PP rank's consensus lifecycle (implements most of :class:`pdplug.protocols.Consensus`).

    :param config: rank, size, endpoints, streams, timeouts (s), wire rules.
    :param types: the wire message types of the implementation.
    :param peers: ranks this rank exchanges frames with (sent to and accepted from).
    :raises ValueError: a config field is invalid (named with its value).
    """

    #: implementation name (``"pp0"``, ``"ring"``): part of identities and error messages
    impl = "consensus"

    def __init__(
        self, config: ConsensusConfig, types: tuple[type, ...], peers: Iterable[int]
    ) -> None:
        check_config(config)
        self.config = config
        self.rank = config.pp_rank
        self.size = config.pp_size
        self.leader = self.rank == 0
        self.peers = tuple(peers)
        self.identities = identities(config, self.impl)
        self._codec = rank_codec(config, self.impl, types, self.peers)
        self._codecs: list[Codec] = [self._codec]  # every codec whose drops stats() reports
        hz = horizon_s(config)
        self._applier = Applier(config.streams, hz)
        self._votes = LocalVotes(config.streams, self._applier, hz)
        self._failed: ConsensusError | None = None
        self._closed = False
        self.counters: dict[str, int] = {"decisions_applied": 0}
        self._link: Link

    def _start_link(self, **kw: Any) -> None:
        """Open the sockets and start the I/O thread (last step of a subclass ``__init__``)."""
        self._link = Link(
            config=self.config,
            codec=self._codec,
            identities=self.identities,
            out_peers=self.peers,
            in_peers=self.peers,
            name=self.impl,
            **kw,
        )
        self._link.start()

    # ------------------------------------------------------------------ host API

    def offer(self, stream: str, good: Iterable[int] = (), bad: Iterable[int] = ()) -> None:
        """Vote ``good`` (ready here) and ``bad`` (failed here) request ids for ``stream``.

        ``good`` ids with holds are deferred until released; ids already offered or already
        decided are ignored.

        :raises ValueError: unknown ``stream`` or a non-integer id.
        :raises ConsensusError: this object was closed.
        """
        self._open()
        self._votes.offer(stream, good, bad)
        self._voted()

    def hold(self, rid: int, n: int = 1) -> None:
        """Mark ``n`` chunks of ``rid`` pending here: its ``good`` votes wait for release.

        :raises ValueError: ``n < 1``.
        """
        self._votes.hold(rid, n)

    def release_hold(self, rid: int, n: int = 1) -> None:
        """``n`` pending chunks of ``rid`` completed; deferred ``good`` votes count at zero.

        :raises ValueError: more holds released than taken.
        """
        if self._votes.release_hold(rid, n):
            self._voted()

    def abort(self, rid: int) -> None:
        """Abort ``rid``: decided ``bad`` in every stream where it is pending, and on later
        votes (remembered for ``max(60, 4 * vote_deadline_s)`` seconds).

        :raises ConsensusError: this object was closed.
        """
        self._open()
        self._votes.abort(rid, time.monotonic())
        self._voted()

    def stats(self) -> dict[str, int]:
        """Counters: decisions applied, frames dropped by reason (every codec), deferred and
        late offers, link counters, and the implementation's own."""
        out = dict(self.counters)
        out.update(self._votes.counters)
        for c in self._codecs:
            for k, v in c.stats().items():
                out[k] = out.get(k, 0) + v
        out.update(self._link.counters)
        return out

    def close(self) -> None:
        """Stop the I/O thread and close the sockets; idempotent."""
        if not self._closed:
            self._closed = True
            self._link.close()

    def __enter__(self) -> Any:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # ------------------------------------------------------------------ for subclasses

    def _voted(self) -> None:
        """A local vote or abort is new (``pp0`` sends it at once; ``ring`` waits a round)."""

    def _open(self) -> None:
        if self._closed:
            raise ConsensusError(f"{self.impl} rank {self.rank}: consensus is closed")

    def _check(self) -> None:
        """Raise the sticky failure (a dead peer, a crashed I/O thread, a bad decision)."""
        if self._failed is None and (why := self._link.failure()) is not None:
            self._failed = ConsensusError(f"{self.impl} rank {self.rank}: {why}")
        if self._failed is not None:
            raise self._failed

    def _apply(self, d: Decision, now: float, out: list[Decision]) -> None:
        """Apply ``d`` exactly once or fail for good.

        :raises ConsensusError: a sequence gap/duplicate or a repeated id (sticky).
        """
        try:
            self._applier.apply(d, now)
        except ConsensusError as e:
            self._failed = ConsensusError(f"{self.impl} rank {self.rank}: {e}")
            raise self._failed from None
        self._votes.applied(d)
        out.append(d)
        self.counters["decisions_applied"] += 1
