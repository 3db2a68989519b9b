"""A Consensus that delegates to the default ``pp0`` and logs every decision it applies.

The default is obtained through the public manager API,
:meth:`pdplug.PluginManager.overridden_factory`, never by importing another plugin's modules:
the manager remembers which record an override replaced.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable

from pdplug import Consensus, ConsensusConfig, get_plugin_manager
from pdplug.types import Decision

log = logging.getLogger("pdplug_logging_consensus")


class LoggingConsensus:
    """Wraps any :class:`pdplug.Consensus`; logs each vote and each applied decision.

    :param inner: the wrapped consensus.
    :param rank: this PP rank (for the log lines).
    """

    def __init__(self, inner: Consensus, rank: int) -> None:
        self.inner = inner
        self.rank = rank
        self.logged = 0

    def offer(self, stream: str, good: Iterable[int] = (), bad: Iterable[int] = ()) -> None:
        """Vote (delegated), logging the request ids."""
        good, bad = tuple(good), tuple(bad)
        log.debug("rank %d offers %s good=%s bad=%s", self.rank, stream, good, bad)
        self.inner.offer(stream, good, bad)

    def poll(self) -> list[Decision]:
        """Delegate, then log every decision before the host applies it."""
        decisions = self.inner.poll()
        for d in decisions:
            log.info(
                "rank %d decision %s#%d good=%s bad=%s", self.rank, d.stream, d.seq, d.good, d.bad
            )
        self.logged += len(decisions)
        return decisions

    def abort(self, rid: int) -> None:
        """Abort ``rid`` (delegated, logged)."""
        log.info("rank %d aborts %d", self.rank, rid)
        self.inner.abort(rid)

    def stats(self) -> dict[str, int]:
        """The inner counters plus ``decisions_logged``."""
        return {**self.inner.stats(), "decisions_logged": self.logged}

    def close(self) -> None:
        """Close the inner consensus."""
        self.inner.close()


def make_logging_pp0(config: ConsensusConfig) -> LoggingConsensus:
    """Factory of the overriding ``pp0``: the default pp0 built by its own factory, wrapped.

    :param config: the rank's :class:`pdplug.ConsensusConfig`.
    :raises pdplug.PluginError: the default pp0 is unavailable.
    """
    default_factory = get_plugin_manager().overridden_factory("consensus", "pp0")
    return LoggingConsensus(default_factory(config), rank=config.pp_rank)
