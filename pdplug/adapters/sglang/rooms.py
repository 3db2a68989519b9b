"""One SGLang request's room across the planes of a rank (pure bookkeeping, no SGLang import).

A request's bootstrap room is leased in every plane session of the rank (KV, aux, each state
type; :mod:`pdplug.adapters.sglang.planes`). SGLang sees one status per request: the planes'
statuses merged on the ``KVPoll`` lattice (MIN: Success only once every plane succeeded;
Failed once any plane failed), with one rule of pdplug's on top: a failed room is reported
Failed only once it is *drained* on every plane (no write of it in flight here), because
SGLang frees a failed request's pages as soon as it sees Failed.
"""

from __future__ import annotations

from collections.abc import Sequence

from pdplug.types import KVPoll

__all__ = ["merge_polls", "first_failure"]


def merge_polls(polls: Sequence[KVPoll], drained: bool = True) -> KVPoll:
    """The request's status from its planes' statuses.

    :param polls: one status per plane (at least one).
    :param drained: whether every plane is drained (asked only when one failed).
    :returns: ``Failed`` when a plane failed and all are drained, ``Transferring`` when a plane
        failed but writes are still in flight, else the lowest status.
    :raises ValueError: no statuses.
    """
    if not polls:
        raise ValueError("merge_polls: no plane statuses")
    if KVPoll.Failed in polls:
        return KVPoll.Failed if drained else KVPoll.Transferring
    return min(polls)


def first_failure(reasons: Sequence[tuple[str, str | None]]) -> str | None:
    """``"<plane>: <reason>"`` of the first plane that gives a failure reason, else None."""
    for plane, why in reasons:
        if why:
            return f"{plane}: {why}"
    return None
