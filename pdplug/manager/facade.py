"""The typed facade hosts call: ``PluginManager`` selects by name and builds one object per point.

A host builds one manager at start-up (or several: nothing here is process-wide) and resolves
its objects through ``make_*``; the sessions a manager builds use that manager's
:meth:`~PluginManager.check_compat` vetoes and :meth:`~PluginManager.emit` observers.
Selection: the call's ``name`` > ``select=`` > ``PDPLUG_<POINT>`` > the table's default.
"""

from __future__ import annotations

import importlib.metadata as md
import logging
import os
from collections.abc import Iterable, Mapping
from typing import Any, cast

import pluggy

from pdplug import hookspecs
from pdplug.config import ConsensusConfig, KVConfig, PlannerConfig, SchedulerConfig
from pdplug.errors import PluginError
from pdplug.hookspecs import PROJECT
from pdplug.layout import layout_mismatches
from pdplug.manager import discovery
from pdplug.manager.discovery import PluginRecord, Switches, admit, load_entry_points
from pdplug.manager.listing import listing_document
from pdplug.manager.points import EXTENSION_POINTS, choose, extension_point
from pdplug.manager.registry import Registry, collect, load_factory, per_plugin
from pdplug.protocols import Consensus, KVReceiver, KVSender, Packer, PackPlanner, Scheduler
from pdplug.types import ComponentSpec, PdplugEvent, PeerInfo

__all__ = ["PluginManager", "load_factory"]

log = logging.getLogger("pdplug.manager")


class PluginManager:
    """Discovers plugins and builds one object per extension point, by name.

    :param entry_points: override discovery (tests); default: every ``pdplug`` entry point.
    :param env: environment mapping (tests, embedded hosts); default ``os.environ``.
    :param strict: make load failures and duplicate names fatal; default from
        ``PDPLUG_STRICT_PLUGINS``.
    :param plugins: extra ``(name, module_or_object)`` pairs registered as if discovered
        (``pdplug.testing`` and hosts use this for in-process plugins).
    :param autoload: load third-party entry points; default: not
        ``PDPLUG_DISABLE_PLUGIN_AUTOLOAD``.
    :param allow: allow list of third-party plugins; default ``PDPLUG_PLUGINS``.
    :param block: names blocked in addition to ``PDPLUG_DISABLE_PLUGINS``.
    :param select: extension point -> selected name, beating ``PDPLUG_<POINT>`` env vars.

    :ivar pm: the underlying :class:`pluggy.PluginManager` (e.g. for
        ``pm.pm.add_hookcall_monitoring``; register plugins through :meth:`register`).
    :ivar records: one :class:`~pdplug.manager.discovery.PluginRecord` per plugin.
    :raises PluginError: in strict mode, when a plugin fails to load or an allowed plugin is
        not installed; or a plugin in ``plugins`` is refused.
    :raises DuplicateComponentError: in strict mode, when two distributions provide one name.
    :raises ValueError: ``select`` names an unknown extension point.
    """

    def __init__(
        self,
        entry_points: Iterable[md.EntryPoint] | None = None,
        env: Mapping[str, str] | None = None,
        *,
        strict: bool | None = None,
        plugins: Iterable[tuple[str, object]] = (),
        autoload: bool | None = None,
        allow: Iterable[str] | None = None,
        block: Iterable[str] = (),
        select: Mapping[str, str] | None = None,
    ) -> None:
        self.env: Mapping[str, str] = os.environ if env is None else env
        sw = Switches.from_env(self.env, strict=strict, autoload=autoload, allow=allow, block=block)
        self.switches = sw  # strict, autoload, allow, block
        self.strict, self.autoload = sw.strict, sw.autoload
        self.select = {extension_point(p).name: n for p, n in (select or {}).items() if n}
        self.pm = pluggy.PluginManager(PROJECT)
        self.pm.add_hookspecs(hookspecs)
        # (the pdplug_on_event implementations, one caller per plugin) for emit()
        self._observers: tuple[tuple[Any, ...], list[tuple[str, Any]]] = ((), [])
        eps = discovery.discover_entry_points() if entry_points is None else entry_points
        self.records: list[PluginRecord] = load_entry_points(self.pm, eps, sw)
        for name, obj in plugins:
            self._add(obj, name, "<in-process>")
        self._rebuild()

    # ------------------------------------------------------------------ in-process plugins
    def register(self, plugin: object, name: str, distribution: str = "<in-process>") -> None:
        """Register an in-process plugin (tests, embedded hosts) and rebuild the registry.

        :param plugin: a module or object with ``@hookimpl`` functions.
        :param name: its plugin name (always explicit: pluggy would otherwise use an ``id``).
        :param distribution: shown in listings and duplicate-name errors.
        :raises PluginError: the name is taken, the plugin implements an unknown hook, or it
            implements a pdplug hook as a pluggy wrapper/hookwrapper.
        :raises DuplicateComponentError: in strict mode, the plugin reuses a name.
        """
        self._add(plugin, name, distribution)
        self._rebuild()

    def _add(self, plugin: object, name: str, distribution: str) -> None:
        if self.pm.has_plugin(name) or self.pm.is_blocked(name):
            raise PluginError(f"a plugin named {name!r} is already registered or blocked")
        admit(self.pm, plugin, name)
        self.records.append(
            PluginRecord(name=name, distribution=distribution, version="", value=repr(plugin))
        )

    def unregister(self, name: str) -> None:
        """Remove a plugin registered under ``name`` and rebuild the registry.

        :raises PluginError: no plugin of that name is registered.
        """
        if self.pm.get_plugin(name) is None:
            raise PluginError(f"no plugin named {name!r} is registered")
        self.pm.unregister(name=name)
        self.records = [r for r in self.records if r.name != name]
        self._rebuild()

    def _rebuild(self) -> None:
        found = collect(self.pm, self.records, self.strict)
        self.registry = Registry(found, self.records, self.strict)

    # ------------------------------------------------------------------ selection
    def names(self, point: str) -> list[str]:
        """Names available at ``point`` (sorted).

        :raises ValueError: unknown extension point.
        """
        return sorted(self.registry.entries[extension_point(point).name])

    def selected(self, point: str, name: str | None = None) -> str:
        """The name selected at ``point``: ``name`` > ``select=`` > env var > default.

        :raises ValueError: unknown extension point.
        """
        return choose(point, name, self.select, self.env)[0]

    def conflicts(self) -> list[str]:
        """Messages for every duplicate name that no override declaration resolves."""
        return list(self.registry.conflicts.values())

    def overrides(self) -> list[tuple[str, str, str, str]]:
        """``(point, name, overriding distribution, overridden distribution)`` of every override."""
        return self.registry.overrides()

    def failed(self) -> list[PluginRecord]:
        """Records of the plugins that failed to load or to register their components."""
        return [r for r in self.records if r.status.startswith("failed")]

    def resolve(self, point: str, name: str | None = None) -> tuple[ComponentSpec, str, str]:
        """Find the record selected at ``point``: ``(spec, plugin name, distribution)``.

        :param point: ``"consensus"``, ``"kv_sender"``, ``"pack_planner"`` or ``"scheduler"``.
        :param name: explicit selection (beats ``select=``, the env and the default).
        :raises DuplicateComponentError: two distributions provide the name, no override.
        :raises PluginError: the plugin that would provide it failed to load (chained to the
            plugin's own exception).
        :raises UnknownComponentError: nobody provides it; lists alternatives and failures.
        """
        chosen, source = choose(point, name, self.select, self.env)
        entry = self.registry.resolve(point, chosen, source, self.records)
        return entry.spec, entry.plugin, entry.distribution

    def _factory(self, point: str, name: str | None, attr: str = "factory") -> Any:
        spec, _plugin, dist = self.resolve(point, name)
        ref = getattr(spec, attr, "")
        if not ref:
            raise PluginError(f"{point} {spec.name!r} from {dist} has no {attr}")
        return load_factory(ref)

    def overridden_factory(self, point: str, name: str, attr: str = "factory") -> Any:
        """The factory of the default that an override replaced (for wrapping overrides).

        :param point: extension point.
        :param name: the overridden name (e.g. ``"pp0"``).
        :param attr: ``"factory"``, or ``"receiver_factory"`` for KV senders.
        :raises UnknownComponentError: nothing overrides ``name`` at ``point``.
        """
        return self.registry.overridden_factory(extension_point(point).name, name, attr)

    def describe(self, point: str, name: str | None = None) -> dict[str, str]:
        """``{"name", "plugin", "distribution", "version"}`` of the selected component.

        :raises PluginError: as :meth:`resolve`.
        """
        spec, plugin, dist = self.resolve(point, name)
        rec = next((r for r in self.records if r.name == plugin), None)
        version = rec.version if rec else ""
        return {"name": spec.name, "plugin": plugin, "distribution": dist, "version": version}

    # ------------------------------------------------------------------ typed facade
    def make_consensus(
        self, config: ConsensusConfig, name: str | None = None, **options: Any
    ) -> Consensus:
        """Build the selected consensus for one PP rank.

        :param config: the rank's :class:`~pdplug.config.ConsensusConfig`.
        :param name: explicit selection; default ``select=`` / ``PDPLUG_CONSENSUS`` / ``pp0``.
        :param options: implementation-specific keywords passed to the factory unchanged (e.g.
            ``relay=`` for ``pp0``'s host-supplied decision fan-out).
        :raises PluginError: as :meth:`resolve`, or the factory failed to import.
        :raises TypeError: the selected factory does not accept an option.
        """
        return cast(Consensus, self._factory("consensus", name)(config, **options))

    def make_scheduler(self, config: SchedulerConfig, name: str | None = None) -> Scheduler:
        """Build the selected scheduler.

        :param config: the :class:`~pdplug.config.SchedulerConfig`.
        :param name: explicit selection; default ``select=`` / ``PDPLUG_SCHEDULER`` /
            ``default``.
        :raises PluginError: as :meth:`resolve`, or the factory failed to import.
        """
        return cast(Scheduler, self._factory("scheduler", name)(config))

    def make_pack_planner(
        self, config: PlannerConfig | None = None, name: str | None = None
    ) -> PackPlanner:
        """Build the selected pack planner.

        :param config: the :class:`~pdplug.config.PlannerConfig` (default: ``PlannerConfig()``).
        :param name: explicit selection; default ``select=`` / ``PDPLUG_PACK_PLANNER`` / ``dcp``.
        :raises PluginError: as :meth:`resolve`, or the factory failed to import.
        :raises TypeError: ``config`` is not a :class:`~pdplug.config.PlannerConfig` (a planner
            name passed positionally: ``make_pack_planner(name="tp")``).
        """
        if config is not None and not isinstance(config, PlannerConfig):
            hint = f" (to select a planner: name={config!r})" if isinstance(config, str) else ""
            raise TypeError(
                f"make_pack_planner: config must be a PlannerConfig or None, got "
                f"{type(config).__name__}{hint}"
            )
        return cast(PackPlanner, self._factory("pack_planner", name)(config or PlannerConfig()))

    def make_kv_sender(
        self,
        config: KVConfig,
        planner: PackPlanner | None = None,
        packer: Packer | None = None,
        name: str | None = None,
    ) -> KVSender:
        """Build the selected prefill-side KV sender, bound to this manager.

        Its handshake refuses a peer for every reason :meth:`check_compat` of THIS manager
        gives, and its room outcomes go to THIS manager's :meth:`emit` (issue 10 item 7).

        :param config: the rank's :class:`~pdplug.config.KVConfig` (``role="prefill"``).
        :param planner: the pack planner (default: :meth:`make_pack_planner`).
        :param packer: the packer, or ``None`` to let the sender pick one.
        :param name: explicit selection; default ``select=`` / ``PDPLUG_KV_SENDER`` / ``nixl``.
        :raises PluginError: as :meth:`resolve`, or the factory failed to import.
        """
        if planner is None:
            planner = self.make_pack_planner()
        factory = self._factory("kv_sender", name)
        sender = factory(config, planner, packer, compat=self.check_compat, emit=self.emit)
        return cast(KVSender, sender)

    def make_kv_receiver(self, config: KVConfig, name: str | None = None) -> KVReceiver:
        """Build the selected decode-side KV receiver (same selection and binding as the sender).

        :param config: the rank's :class:`~pdplug.config.KVConfig` (``role="decode"``).
        :param name: explicit selection; default ``select=`` / ``PDPLUG_KV_SENDER`` / ``nixl``.
        :raises PluginError: as :meth:`resolve`, or the factory failed to import.
        """
        factory = self._factory("kv_sender", name, "receiver_factory")
        return cast(KVReceiver, factory(config, compat=self.check_compat, emit=self.emit))

    # ------------------------------------------------------------------ broadcast hooks
    def check_compat(self, local: PeerInfo, remote: PeerInfo) -> list[str]:
        """Every reason to refuse ``remote``: layout checks plus every plugin's veto.

        :param local: this rank's :class:`~pdplug.types.PeerInfo`.
        :param remote: the peer's.
        :returns: mismatches, each naming the field and both values; empty to accept.
        """
        out = layout_mismatches(local.layout, remote.layout)
        for res in self.pm.hook.pdplug_check_compat(local=local, remote=remote):
            out.extend(res)
        return out

    def emit(self, event: PdplugEvent) -> None:
        """Broadcast an observer event to every ``pdplug_on_event`` implementation.

        Each plugin is called through pluggy on its own (a subset hook caller), in call order;
        one that raises is logged and the rest still run.
        """
        impls = tuple(self.pm.hook.pdplug_on_event.get_hookimpls())
        if impls != self._observers[0]:  # a plugin came or went since the last event
            self._observers = (impls, per_plugin(self.pm, "pdplug_on_event"))
        for name, call in self._observers[1]:
            try:
                call(event=event)
            except Exception:
                log.exception("pdplug: observer %r failed on %s", name, event.kind)

    def configure(self, config: Mapping[str, Any]) -> None:
        """Broadcast the host configuration (historic: replayed to later registrations)."""
        self.pm.hook.pdplug_configure.call_historic(kwargs={"config": dict(config)})

    # ------------------------------------------------------------------ listing
    def listing(self, selections: Mapping[str, str | None] | None = None) -> dict[str, Any]:
        """The document printed by ``pdplug plugins --json``.

        ``{"plugins": [{"name", "distribution", "version", "status", "provides": {"consensus",
        "kv_senders", "pack_planners", "schedulers"}}], "selected": {"consensus", "kv_sender",
        "pack_planner", "scheduler"}, "conflicts": [{"point", "name", "plugins", "message"}]}``.
        ``provides`` lists the names each plugin serves after override resolution; a name in
        conflict is listed under every plugin that claims it and in ``conflicts``.

        :param selections: explicit selections (as the ``name`` argument of :meth:`resolve`).
        """
        sel = {p: self.selected(p, (selections or {}).get(p)) for p in EXTENSION_POINTS}
        return listing_document(self.records, self.registry, sel)

    def problems(self, selections: Mapping[str, str | None] | None = None) -> list[str]:
        """Why a selected component could not be built (one message per extension point)."""
        out = []
        for p in EXTENSION_POINTS:
            try:
                self.resolve(p, (selections or {}).get(p))
            except PluginError as e:
                out.append(str(e))
        return out
