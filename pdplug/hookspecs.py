"""pdplug's extension points (pluggy hook specifications; project name ``"pdplug"``).

Registry hooks return iterables of named records with lazy ``"module:attr"`` factories; the
manager collects them once. Broadcast hooks let every plugin veto a peer or observe events. No
hook is on a per-step, per-page or per-token path: hosts resolve objects through the manager's
facade and then call their Protocol methods directly.

Implementations may accept fewer arguments than a spec (pluggy), so specs can grow without
breaking plugins. Default plugins are registered ``trylast``.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import TYPE_CHECKING, Any

import pluggy

if TYPE_CHECKING:
    from pdplug.types import (
        ConsensusSpec,
        KVSenderSpec,
        PackPlannerSpec,
        PdplugEvent,
        PeerInfo,
        SchedulerSpec,
    )

PROJECT = "pdplug"
hookspec = pluggy.HookspecMarker(PROJECT)
hookimpl = pluggy.HookimplMarker(PROJECT)

__all__ = ["PROJECT", "hookspec", "hookimpl", "PdplugSpecs"]


class PdplugSpecs:
    """The hook specifications. Register with ``pm.add_hookspecs(PdplugSpecs)``."""

    @hookspec
    def pdplug_register_schedulers(self) -> Iterable[SchedulerSpec]:
        """Offer schedulers (send splitting, dynamic chunked prefill).

        Called once per process, when the manager builds its registry.

        :returns: :class:`~pdplug.types.SchedulerSpec` records; the factory is called as
            ``factory(config: SchedulerConfig)`` and returns a :class:`~pdplug.protocols.Scheduler`.
        """
        raise NotImplementedError

    @hookspec
    def pdplug_register_consensus(self) -> Iterable[ConsensusSpec]:
        """Offer PP consensus implementations.

        Called once per process, when the manager builds its registry.

        :returns: :class:`~pdplug.types.ConsensusSpec` records; the factory is called as
            ``factory(config: ConsensusConfig)`` and returns a :class:`~pdplug.protocols.Consensus`.
        """
        raise NotImplementedError

    @hookspec
    def pdplug_register_kv_senders(self) -> Iterable[KVSenderSpec]:
        """Offer KV transfer backends (a sender and a receiver per record).

        Called once per process, when the manager builds its registry.

        :returns: :class:`~pdplug.types.KVSenderSpec` records; ``factory(config: KVConfig,
            planner: PackPlanner, packer: Packer | None)`` returns a
            :class:`~pdplug.protocols.KVSender`; ``receiver_factory(config: KVConfig)`` returns a
            :class:`~pdplug.protocols.KVReceiver`.
        """
        raise NotImplementedError

    @hookspec
    def pdplug_register_pack_planners(self) -> Iterable[PackPlannerSpec]:
        """Offer pack planners (byte-run planning and packing for layout changes).

        Called once per process, when the manager builds its registry.

        :returns: :class:`~pdplug.types.PackPlannerSpec` records; the factory is called as
            ``factory(config: PlannerConfig)`` and returns a
            :class:`~pdplug.protocols.PackPlanner`.
        """
        raise NotImplementedError

    @hookspec
    def pdplug_check_compat(self, local: PeerInfo, remote: PeerInfo) -> list[str] | None:
        """Veto a peer at the handshake, before its first request.

        Called in: every rank, once per peer, during the rendezvous handshake. Every
        implementation is called (broadcast); the union of the returned lists is the refusal.

        :param local: this rank's published info (layout: page size in tokens, bytes per token
            per entry, dtype, layout version).
        :param remote: the peer's info.
        :returns: human-readable mismatches naming field and both values (empty or ``None``
            to accept).
        """
        raise NotImplementedError

    @hookspec
    def pdplug_on_event(self, event: PdplugEvent) -> None:
        """Observe an event (decision applied, transfer done/failed, message dropped).

        Called in: the process where the event happened, off the per-token path (at most once
        per decision or chunk). Implementations must not raise or block.
        """
        raise NotImplementedError

    @hookspec(historic=True)
    def pdplug_configure(self, config: Mapping[str, Any]) -> None:
        """Receive the host configuration (historic: replayed to late-registered plugins).

        Called in: every process, once, after the manager loaded its plugins.

        :param config: the host's pdplug settings (selected names, timeouts …).
        """
        raise NotImplementedError
