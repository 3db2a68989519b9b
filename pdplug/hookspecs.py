"""pdplug's hook specifications (pluggy project ``"pdplug"``): the contract every plugin implements.

Specs are module-level functions grouped by purpose, as in pytest's ``hookspec.py``; the
manager registers them with ``add_hookspecs(pdplug.hookspecs)``. Implement one with
:data:`hookimpl` (also exported as ``pdplug.hookimpl``) in a module that the ``pdplug``
entry-point group names.

Rules for every hook (the shared note; each spec says only what is its own):

* **Plain implementations only.** A pluggy ``wrapper=True`` or ``hookwrapper=True``
  implementation of a ``pdplug_*`` hook is refused at registration with a
  :class:`~pdplug.errors.PluginError` naming the plugin and the hook: the registry hooks are
  called per plugin and observers one by one (below), where a wrapper would wrap nothing.
* **Every implementation is called; no hook is first-result.** ``tryfirst`` / ``trylast`` only
  order the calls. The defaults shipped with pdplug are ``trylast``, so a third-party
  implementation always runs before them; overriding a default is decided by name (a record
  with ``overrides=True``), never by call order.
* **Fewer arguments are fine.** An implementation may accept fewer parameters than its spec
  (pluggy), so specs can grow without breaking plugins; calls are keyword-only.
* **Nothing on a hot path.** No hook is called per step, page or token: a host resolves its
  objects once through :class:`~pdplug.manager.PluginManager` and calls their Protocol methods.
* **Through pluggy.** Every call goes through pluggy, so ``pm.pm.add_hookcall_monitoring`` and
  pluggy's tracing see all of them.
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

__all__ = ["PROJECT", "hookspec", "hookimpl"]

#: the pluggy project name and the entry-point group every plugin is found in
PROJECT = "pdplug"
#: marks a spec below (pdplug's own; plugins never need it)
hookspec = pluggy.HookspecMarker(PROJECT)
#: marks a plugin's implementation: ``@hookimpl`` or ``@hookimpl(trylast=True)``
hookimpl = pluggy.HookimplMarker(PROJECT)


# -------------------------------------------------------------------------------------------
# Registry hooks: offer components by name.
#
# Called in every process that builds a PluginManager, when it builds its registry (at
# construction, and again after each register/unregister): once per plugin, through pluggy,
# so each record is attributed to its plugin; a plugin whose implementation raises or yields
# the wrong record type is marked failed and contributes nothing at any point. Records carry a
# lazy "module:attr" factory that is imported only when its name is selected, so an
# entry-point module must import nothing heavy (torch, nixl, mooncake, triton). A record that
# reuses a default's name must set ``overrides=True``; any other duplicate is an error naming
# both distributions. Returning ``None`` offers nothing.
# -------------------------------------------------------------------------------------------


@hookspec
def pdplug_register_consensus() -> Iterable[ConsensusSpec] | None:
    """Offer PP consensus implementations (per-request agreement across PP prefill ranks).

    Called in: every process that builds a :class:`~pdplug.manager.PluginManager`, at each
    registry build (see *Registry hooks* above). Takes no parameters. Default: ``pp0`` and
    ``ring`` from the ``pdplug-consensus`` plugin, ``trylast``.

    Example::

        @hookimpl
        def pdplug_register_consensus():
            yield ConsensusSpec(name="raft", factory="my_pkg.cons:make", summary="...")

    :returns: :class:`~pdplug.types.ConsensusSpec` records. The factory is called as
        ``factory(config: ConsensusConfig, **options)`` (options are the host's keywords to
        ``make_consensus``) and returns a :class:`~pdplug.protocols.Consensus`.
    """


@hookspec
def pdplug_register_kv_senders() -> Iterable[KVSenderSpec] | None:
    """Offer KV transfer backends: a prefill-side sender and a decode-side receiver per record.

    Called in: every process that builds a :class:`~pdplug.manager.PluginManager`, at each
    registry build (see *Registry hooks* above). Takes no parameters. Default: ``nixl`` and
    ``mooncake`` from the ``pdplug-nixl`` and ``pdplug-mooncake`` plugins, ``trylast``.

    Example::

        @hookimpl
        def pdplug_register_kv_senders():
            yield KVSenderSpec(name="tcp", factory="my_pkg.tx:make_sender",
                               receiver_factory="my_pkg.tx:make_receiver")

    :returns: :class:`~pdplug.types.KVSenderSpec` records. ``factory(config: KVConfig,
        planner: PackPlanner, packer: Packer | None, *, compat, emit)`` returns a
        :class:`~pdplug.protocols.KVSender`; ``receiver_factory(config: KVConfig, *, compat,
        emit)`` returns a :class:`~pdplug.protocols.KVReceiver`. ``compat(local, remote) ->
        list[str]`` is the building manager's :meth:`~pdplug.manager.PluginManager.check_compat`
        (the handshake must refuse a peer when it is non-empty) and ``emit(event)`` its
        :meth:`~pdplug.manager.PluginManager.emit` (room outcomes go there).
    """


@hookspec
def pdplug_register_pack_planners() -> Iterable[PackPlannerSpec] | None:
    """Offer pack planners (merged byte runs, and packing when the decode layout differs).

    Called in: every process that builds a :class:`~pdplug.manager.PluginManager`, at each
    registry build (see *Registry hooks* above). Takes no parameters. Default: ``dcp`` and
    ``tp`` from the ``pdplug-dcp`` plugin, ``trylast``.

    Example::

        @hookimpl
        def pdplug_register_pack_planners():
            yield PackPlannerSpec(name="flat", factory="my_pkg.plan:make")

    :returns: :class:`~pdplug.types.PackPlannerSpec` records. The factory is called as
        ``factory(config: PlannerConfig)`` and returns a :class:`~pdplug.protocols.PackPlanner`.
    """


@hookspec
def pdplug_register_schedulers() -> Iterable[SchedulerSpec] | None:
    """Offer schedulers (send splitting at pack capacity, dynamic chunked-prefill sizing).

    Called in: every process that builds a :class:`~pdplug.manager.PluginManager`, at each
    registry build (see *Registry hooks* above). Takes no parameters. Default: ``default``
    from the ``pdplug-scheduler`` plugin, ``trylast``.

    Example::

        @hookimpl
        def pdplug_register_schedulers():
            yield SchedulerSpec(name="fifo", factory="my_pkg.sched:make", summary="FIFO")

    :returns: :class:`~pdplug.types.SchedulerSpec` records. The factory is called as
        ``factory(config: SchedulerConfig)`` and returns a :class:`~pdplug.protocols.Scheduler`.
    """


# -------------------------------------------------------------------------------------------
# Peer hooks: decide about a remote rank before any byte moves.
# -------------------------------------------------------------------------------------------


@hookspec
def pdplug_check_compat(local: PeerInfo, remote: PeerInfo) -> list[str] | None:
    """Veto a peer at the handshake, before its first request.

    Called in: every KV sender and receiver built by a
    :class:`~pdplug.manager.PluginManager`, once per peer during the handshake, through that
    manager's :meth:`~pdplug.manager.PluginManager.check_compat` (never a process-wide one).
    The union of every implementation's list, after pdplug's own layout checks, is the
    refusal (:class:`~pdplug.errors.CompatError` on the decode side). An exception propagates
    to the handshake. No default implementation.

    :param local: this rank's published :class:`~pdplug.types.PeerInfo` (layout: page size in
        tokens, bytes per token per entry, dtype, layout version; ``extra`` for plugins).
    :param remote: the peer's :class:`~pdplug.types.PeerInfo`.
    :returns: human-readable mismatches naming the field and both values; empty or ``None``
        to accept.
    """


# -------------------------------------------------------------------------------------------
# Observer and configuration hooks.
# -------------------------------------------------------------------------------------------


@hookspec
def pdplug_on_event(event: PdplugEvent) -> None:
    """Observe an event (decision applied, transfer done or failed, message dropped).

    Called in: the process where the event happened, through the building manager's
    :meth:`~pdplug.manager.PluginManager.emit`, at most once per decision or room and rank.
    Each plugin's implementation is called through pluggy on its own, in call order; one that
    raises is logged and the others still run. Implementations must not block. No default
    implementation.

    :param event: the :class:`~pdplug.types.PdplugEvent` (``kind``; ``source``: the component
        name; ``room`` or -1; ``fields`` such as bytes, seconds, reason).
    :returns: nothing; return values are ignored.
    """


@hookspec(historic=True)
def pdplug_configure(config: Mapping[str, Any]) -> None:
    """Receive the host configuration (historic: replayed to plugins registered later).

    Called in: every process whose host calls
    :meth:`~pdplug.manager.PluginManager.configure` after its manager loaded the plugins;
    plugins registered later get the same call on registration. Must be idempotent: hosts may
    run it in every worker process. No default implementation.

    :param config: the host's pdplug settings (selected names, timeouts in seconds ...).
    :returns: nothing; return values of historic hooks are discarded.
    """
