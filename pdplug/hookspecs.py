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

        Called in: every process that builds a :class:`~pdplug.manager.PluginManager`, once,
        when it builds its registry (never on a per-step path). Every implementation is called.
        Takes no parameters.

        Example::

            @hookimpl
            def pdplug_register_schedulers():
                yield SchedulerSpec(name="fifo", factory="my_pkg.sched:make", summary="FIFO")

        :returns: :class:`~pdplug.types.SchedulerSpec` records; the factory is called as
            ``factory(config: SchedulerConfig)`` and returns a :class:`~pdplug.protocols.Scheduler`.
        """
        raise NotImplementedError

    @hookspec
    def pdplug_register_consensus(self) -> Iterable[ConsensusSpec]:
        """Offer PP consensus implementations.

        Called in: every process that builds a :class:`~pdplug.manager.PluginManager`, once,
        when it builds its registry (never on a per-step path). Every implementation is called.
        Takes no parameters. A record reusing a default's name must set ``overrides=True``.

        Example::

            @hookimpl
            def pdplug_register_consensus():
                yield ConsensusSpec(name="mine", factory="my_pkg.cons:make", summary="…")

        :returns: :class:`~pdplug.types.ConsensusSpec` records; the factory is called as
            ``factory(config: ConsensusConfig)`` and returns a :class:`~pdplug.protocols.Consensus`.
        """
        raise NotImplementedError

    @hookspec
    def pdplug_register_kv_senders(self) -> Iterable[KVSenderSpec]:
        """Offer KV transfer backends (a sender and a receiver per record).

        Called in: every process that builds a :class:`~pdplug.manager.PluginManager`, once,
        when it builds its registry (never on a per-step path). Every implementation is called.
        Takes no parameters. A record reusing a default's name must set ``overrides=True``.

        Example::

            @hookimpl
            def pdplug_register_kv_senders():
                yield KVSenderSpec(name="tcp", factory="my_pkg.tx:make_sender",
                                   receiver_factory="my_pkg.tx:make_receiver")

        :returns: :class:`~pdplug.types.KVSenderSpec` records; ``factory(config: KVConfig,
            planner: PackPlanner, packer: Packer | None)`` returns a
            :class:`~pdplug.protocols.KVSender`; ``receiver_factory(config: KVConfig)`` returns a
            :class:`~pdplug.protocols.KVReceiver`.
        """
        raise NotImplementedError

    @hookspec
    def pdplug_register_pack_planners(self) -> Iterable[PackPlannerSpec]:
        """Offer pack planners (byte-run planning and packing for layout changes).

        Called in: every process that builds a :class:`~pdplug.manager.PluginManager`, once,
        when it builds its registry (never on a per-step path). Every implementation is called.
        Takes no parameters. A record reusing a default's name must set ``overrides=True``.

        Example::

            @hookimpl
            def pdplug_register_pack_planners():
                yield PackPlannerSpec(name="flat", factory="my_pkg.plan:make")

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

        :param local: this rank's published :class:`~pdplug.types.PeerInfo` (layout: page size
            in tokens, bytes per token per entry, dtype, layout version; ``extra`` for plugins).
        :param remote: the peer's :class:`~pdplug.types.PeerInfo`.
        :returns: human-readable mismatches naming field and both values (empty or ``None``
            to accept).
        """
        raise NotImplementedError

    @hookspec
    def pdplug_on_event(self, event: PdplugEvent) -> None:
        """Observe an event (decision applied, transfer done/failed, message dropped).

        Called in: the process where the event happened, through
        :meth:`pdplug.manager.PluginManager.emit`, off the per-token path (at most once per
        decision or chunk). Every implementation is called (broadcast); one that raises is
        logged and the others still run. Implementations must not block.

        :param event: the :class:`~pdplug.types.PdplugEvent` (``kind``, ``source`` component
            name, ``room`` or -1, ``fields`` such as bytes, seconds, reason).
        :returns: nothing; return values are ignored.
        """
        raise NotImplementedError

    @hookspec(historic=True)
    def pdplug_configure(self, config: Mapping[str, Any]) -> None:
        """Receive the host configuration (historic: replayed to late-registered plugins).

        Called in: every process, once, when the host calls
        :meth:`pdplug.manager.PluginManager.configure` after the manager loaded its plugins;
        plugins registered later get the same call on registration. Must be idempotent: hosts
        may run it in every worker process.

        :param config: the host's pdplug settings (selected names, timeouts in seconds …).
        :returns: nothing; return values of historic hooks are discarded.
        """
        raise NotImplementedError
