"""Plugin discovery, selection by name, and the typed facade hosts call (DESIGN.md §2).

Every plugin, the defaults included, is found through the ``pdplug`` entry-point group; the
core never imports a plugin. Import errors are isolated (logged with plugin, distribution,
version and exception) unless ``PDPLUG_STRICT_PLUGINS=1``; they are re-raised, chained, when
the failed plugin's name is selected.

Environment switches (explicit constructor arguments beat the environment; the block list
always beats the allow list):

* ``PDPLUG_DISABLE_PLUGIN_AUTOLOAD=1`` — skip entry points of distributions other than
  ``pdplug`` (the defaults still load; pytest's switch name).
* ``PDPLUG_PLUGINS=a,b`` — allow list of third-party plugins (entry-point or distribution
  names): these load even when autoload is off, and when the list is set, unlisted
  third-party plugins are skipped (vLLM's ``VLLM_PLUGINS``).
* ``PDPLUG_DISABLE_PLUGINS=x,y`` — block by entry-point or distribution name, defaults included.
* ``PDPLUG_STRICT_PLUGINS=1`` — a plugin that fails to load, or a duplicate name, is fatal.
* ``PDPLUG_CONSENSUS``, ``PDPLUG_KV_SENDER``, ``PDPLUG_PACK_PLANNER``, ``PDPLUG_SCHEDULER`` —
  selected names (defaults ``pp0``, ``nixl``, ``dcp``, ``default``).

Names in the lists are compared after PEP 503 normalisation (``pdplug_hello`` equals
``pdplug-hello``). Override semantics (style notes §4.3, hatchling/conda): a third-party record
may reuse a default's name only by declaring ``overrides=True``; every other duplicate is a
:class:`~pdplug.errors.DuplicateComponentError` naming every distribution involved.
"""

from __future__ import annotations

import importlib
import importlib.metadata as md
import logging
import os
import re
from collections.abc import Iterable, Mapping
from typing import Any, cast

import msgspec
import pluggy

from pdplug.config import ConsensusConfig, KVConfig, PlannerConfig, SchedulerConfig
from pdplug.errors import DuplicateComponentError, PluginError, UnknownComponentError
from pdplug.hookspecs import PROJECT, PdplugSpecs
from pdplug.layout import layout_mismatches
from pdplug.protocols import Consensus, KVReceiver, KVSender, Packer, PackPlanner, Scheduler
from pdplug.types import (
    ComponentSpec,
    ConsensusSpec,
    KVSenderSpec,
    PackPlannerSpec,
    PdplugEvent,
    PeerInfo,
    SchedulerSpec,
)

__all__ = [
    "EXTENSION_POINTS",
    "DEFAULTS",
    "ENV_SELECT",
    "PROVIDES_KEY",
    "CORE_DIST",
    "PluginRecord",
    "PluginManager",
    "discover_entry_points",
    "get_plugin_manager",
    "normalize",
    "load_factory",
]

log = logging.getLogger(__name__)

#: extension point -> (registry hook, record type)
EXTENSION_POINTS: dict[str, tuple[str, type[ComponentSpec]]] = {
    "consensus": ("pdplug_register_consensus", ConsensusSpec),
    "kv_sender": ("pdplug_register_kv_senders", KVSenderSpec),
    "pack_planner": ("pdplug_register_pack_planners", PackPlannerSpec),
    "scheduler": ("pdplug_register_schedulers", SchedulerSpec),
}
#: extension point -> key of ``provides`` in ``pdplug plugins --json``
PROVIDES_KEY = {
    "consensus": "consensus",
    "kv_sender": "kv_senders",
    "pack_planner": "pack_planners",
    "scheduler": "schedulers",
}
#: extension point -> name selected when neither the host nor the env names one
DEFAULTS = {"consensus": "pp0", "kv_sender": "nixl", "pack_planner": "dcp", "scheduler": "default"}
#: extension point -> environment variable that selects it
ENV_SELECT = {
    "consensus": "PDPLUG_CONSENSUS",
    "kv_sender": "PDPLUG_KV_SENDER",
    "pack_planner": "PDPLUG_PACK_PLANNER",
    "scheduler": "PDPLUG_SCHEDULER",
}
#: the distribution whose entry points are the defaults
CORE_DIST = "pdplug"


def normalize(name: str) -> str:
    """PEP 503 normalisation: ``Pdplug_Hello`` and ``pdplug-hello`` compare equal.

    :param name: a distribution or entry-point name.
    :returns: the name lower-cased, runs of ``-``, ``_`` and ``.`` replaced by one ``-``.
    """
    return re.sub(r"[-_.]+", "-", name).lower()


def _names(value: str | Iterable[str] | None) -> set[str]:
    if value is None:
        return set()
    items = value.split(",") if isinstance(value, str) else value
    return {normalize(x.strip()) for x in items if x.strip()}


def _env_flag(env: Mapping[str, str], key: str) -> bool:
    return env.get(key, "").strip().lower() in ("1", "true", "yes", "on")


def discover_entry_points() -> list[md.EntryPoint]:
    """Every entry point of the ``pdplug`` group in the installed distributions.

    An editable install counts; running from a source tree via ``PYTHONPATH`` has no metadata
    and finds nothing (``pdplug plugins`` then hints at ``pip install -e .``).
    """
    return list(md.entry_points(group=PROJECT))


def load_factory(ref: str) -> Any:
    """Import a lazy ``"module:attr"`` factory reference (``attr`` may be dotted).

    :param ref: e.g. ``"pdplug_consensus.pp0:make_pp0"``.
    :returns: the object named by ``ref``.
    :raises PluginError: malformed reference, or the import/attribute lookup failed (the
        message names the reference and the original exception, which is chained).
    """
    mod_name, sep, attr = ref.partition(":")
    if not sep or not mod_name or not attr:
        raise PluginError(f"factory {ref!r} is not of the form 'module:attr'")
    try:
        obj: Any = importlib.import_module(mod_name)
        for part in attr.split("."):
            obj = getattr(obj, part)
    except Exception as e:
        raise PluginError(f"factory {ref!r} failed to load: {type(e).__name__}: {e}") from e
    return obj


class PluginRecord(msgspec.Struct, kw_only=True):
    """One discovered plugin (an entry point, or an in-process registration) and its names.

    :ivar name: entry-point name (``pdplug-consensus``) or the name given to ``register``.
    :ivar distribution: the distribution that declares it (``pdplug`` for the defaults).
    :ivar version: that distribution's version.
    :ivar value: the entry point's ``module`` (or ``repr`` of an in-process plugin).
    :ivar status: ``"loaded"``, ``"blocked"``, ``"skipped: …"`` or ``"failed: …"``.
    :ivar default: True for the entry points of the ``pdplug`` distribution.
    :ivar provides: extension point -> names this plugin serves (after override resolution;
        a name in conflict is listed under every plugin that claims it).
    :ivar error: the exception behind a ``failed`` status.
    """

    name: str
    distribution: str
    version: str
    value: str
    status: str = "loaded"
    default: bool = False
    provides: dict[str, list[str]] = {}
    error: BaseException | None = None


class _Entry(msgspec.Struct, kw_only=True):
    spec: ComponentSpec
    plugin: str
    distribution: str

    @property
    def is_default(self) -> bool:
        return normalize(self.distribution) == CORE_DIST

    def who(self) -> str:
        extra = ", declares overrides=True" if self.spec.overrides else ""
        return f"{self.distribution} (plugin {self.plugin!r}{extra})"


class PluginManager:
    """Discovers plugins and builds one object per extension point, by name.

    :param entry_points: override discovery (tests); default: :func:`discover_entry_points`.
    :param env: environment mapping (tests, embedded hosts); default ``os.environ``.
    :param strict: make load failures and duplicate names fatal; default from
        ``PDPLUG_STRICT_PLUGINS``.
    :param plugins: extra ``(name, module_or_object)`` pairs registered as if discovered
        (``pdplug.testing`` uses this for in-test plugins).
    :param autoload: load third-party entry points; default: not
        ``PDPLUG_DISABLE_PLUGIN_AUTOLOAD``.
    :param allow: allow list of third-party plugins; default ``PDPLUG_PLUGINS``.
    :param block: names blocked in addition to ``PDPLUG_DISABLE_PLUGINS`` (the two are joined:
        a block never gets lifted by an argument).
    :param select: extension point -> selected name, beating ``PDPLUG_<POINT>`` env vars.

    :raises PluginError: in strict mode, when a plugin fails to load or an allowed plugin is
        not installed.
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
        self.strict = _env_flag(self.env, "PDPLUG_STRICT_PLUGINS") if strict is None else strict
        self.autoload = (
            not _env_flag(self.env, "PDPLUG_DISABLE_PLUGIN_AUTOLOAD")
            if autoload is None
            else autoload
        )
        self.allow = _names(self.env.get("PDPLUG_PLUGINS") if allow is None else allow)
        self.block = _names(self.env.get("PDPLUG_DISABLE_PLUGINS")) | _names(block)
        self.select: dict[str, str] = {}
        for point, name in (select or {}).items():
            self._check_point(point)
            if name:
                self.select[point] = name
        self.pm = pluggy.PluginManager(PROJECT)
        self.pm.add_hookspecs(PdplugSpecs)
        self.records: list[PluginRecord] = []
        self._registry: dict[str, dict[str, _Entry]] = {k: {} for k in EXTENSION_POINTS}
        self._overridden: dict[tuple[str, str], _Entry] = {}
        self._conflicts: dict[tuple[str, str], str] = {}
        self._claims: dict[tuple[str, str], list[str]] = {}
        self._built = False
        eps = discover_entry_points() if entry_points is None else list(entry_points)
        self._discover(eps)
        for name, obj in plugins:
            self.register(obj, name=name)
        self._build_registry()

    # ------------------------------------------------------------------ discovery
    def _discover(self, eps: list[md.EntryPoint]) -> None:
        seen: set[tuple[str, str]] = set()
        for ep in eps:
            dist = ep.dist.name if ep.dist is not None else "<unknown>"
            version = ep.dist.version if ep.dist is not None else "?"
            if (ep.name, dist) in seen:  # the same distribution found twice on sys.path
                continue
            seen.add((ep.name, dist))
            is_default = normalize(dist) == CORE_DIST
            rec = PluginRecord(
                name=ep.name, distribution=dist, version=version, value=ep.value, default=is_default
            )
            self.records.append(rec)
            keys = {normalize(ep.name), normalize(dist)}
            if keys & self.block:
                rec.status = "blocked"
                self.pm.set_blocked(ep.name)
                continue
            if not is_default and not keys & self.allow:
                if self.allow:
                    rec.status = "skipped: not in PDPLUG_PLUGINS"
                    continue
                if not self.autoload:
                    rec.status = "skipped: autoload off"
                    continue
            try:
                obj = ep.load()
            except Exception as e:
                self._fail(ep.name, rec, "import failed", e)
                continue
            try:
                self.pm.register(obj, name=ep.name)
                self._check_hooks(ep.name, obj)
            except Exception as e:  # pluggy validation (bad hookimpl) or an unknown hook
                self._forget(ep.name)
                self._fail(ep.name, rec, "registration failed", e)
        present = {normalize(r.name) for r in self.records} | {
            normalize(r.distribution) for r in self.records
        }
        missing = sorted(self.allow - present)
        if missing:
            msg = f"PDPLUG_PLUGINS names {missing}, but no such pdplug plugin is installed"
            log.warning("pdplug: %s", msg)
            if self.strict:
                raise PluginError(msg + " (PDPLUG_STRICT_PLUGINS=1)")

    def _forget(self, name: str) -> None:
        """Undo a failed registration (pluggy < 1.6 keeps a plugin whose validation failed)."""
        if self.pm.get_plugin(name) is not None:
            try:
                self.pm.unregister(name=name)
            except Exception:
                log.debug("pdplug: could not unregister %r", name, exc_info=True)

    def _check_hooks(self, name: str, plugin: object) -> None:
        """A ``pdplug_*`` function matching no hook spec is a typo; refuse the plugin."""
        unknown = sorted(h.name for h in self.pm.get_hookcallers(plugin) or () if not h.has_spec())
        if unknown:
            raise PluginError(
                f"plugin {name!r} implements unknown hooks {unknown}; known hooks: "
                + ", ".join(sorted(n for n in dir(PdplugSpecs) if n.startswith("pdplug_")))
            )

    def register(self, plugin: object, name: str, distribution: str = "<in-process>") -> None:
        """Register an in-process plugin (tests, embedded hosts) and rebuild the registry.

        :param plugin: a module or object with ``@hookimpl`` functions.
        :param name: its plugin name (always explicit: pluggy would otherwise use an ``id``).
        :param distribution: shown in listings and duplicate-name errors.
        :raises PluginError: the name is taken, or the plugin implements an unknown hook.
        :raises DuplicateComponentError: in strict mode, the plugin reuses a name.
        """
        if self.pm.has_plugin(name) or self.pm.is_blocked(name):
            raise PluginError(f"a plugin named {name!r} is already registered or blocked")
        try:
            self.pm.register(plugin, name=name)
            self._check_hooks(name, plugin)
        except Exception:
            self._forget(name)
            raise
        self.records.append(
            PluginRecord(name=name, distribution=distribution, version="", value=repr(plugin))
        )
        if self._built:
            self._build_registry()

    def unregister(self, name: str) -> None:
        """Remove a plugin registered under ``name`` and rebuild the registry.

        :raises PluginError: no plugin of that name is registered.
        """
        if self.pm.get_plugin(name) is None:
            raise PluginError(f"no plugin named {name!r} is registered")
        self.pm.unregister(name=name)
        self.records = [r for r in self.records if r.name != name]
        self._build_registry()

    def _record(self, plugin_name: str) -> PluginRecord | None:
        for r in self.records:
            if r.name == plugin_name and r.status == "loaded":
                return r
        return None

    def _build_registry(self) -> None:
        self._built = True
        candidates: dict[str, dict[str, list[_Entry]]] = {k: {} for k in EXTENSION_POINTS}
        for point, (hook_name, rec_type) in EXTENSION_POINTS.items():
            hook = getattr(self.pm.hook, hook_name)
            # One implementation at a time, in call order, so every record is attributed to
            # its plugin and a raising plugin is isolated like an import failure.
            for impl in reversed(hook.get_hookimpls()):
                if impl.hookwrapper or getattr(impl, "wrapper", False):
                    continue
                rec = self._record(impl.plugin_name)
                if rec is None:  # failed earlier at another extension point
                    continue
                try:
                    specs = list(impl.function() or ())
                except Exception as e:
                    self._fail(impl.plugin_name, rec, f"{hook_name} raised", e)
                    continue
                bad = [s for s in specs if not isinstance(s, rec_type)]
                if bad:
                    self._fail(
                        impl.plugin_name,
                        rec,
                        f"{hook_name} yielded {type(bad[0]).__name__}, expected "
                        f"{rec_type.__name__}",
                        None,
                    )
                    continue
                for spec in specs:
                    entry = _Entry(
                        spec=spec, plugin=impl.plugin_name, distribution=rec.distribution
                    )
                    candidates[point].setdefault(spec.name, []).append(entry)
        self._registry = {k: {} for k in EXTENSION_POINTS}
        self._overridden = {}
        self._conflicts = {}
        self._claims = {}
        # A plugin that failed at one hook contributes nothing at any hook.
        failed = {r.name for r in self.failed()}
        for point, by_name in candidates.items():
            for name, entries in by_name.items():
                ok = [e for e in entries if e.plugin not in failed]
                if ok:
                    self._settle(point, name, ok)
        self._fill_provides()
        if self.strict and self._conflicts:
            raise DuplicateComponentError(
                "; ".join(self._conflicts.values()) + " (PDPLUG_STRICT_PLUGINS=1)"
            )

    def _settle(self, point: str, name: str, entries: list[_Entry]) -> None:
        """Pick the one entry serving ``name``, or record a conflict naming every claimant.

        Decided on the whole set of claimants at once, so the outcome and the message do not
        depend on entry-point discovery order.
        """
        if len(entries) == 1:
            self._registry[point][name] = entries[0]
            return
        defaults = [e for e in entries if e.is_default]
        overriders = [e for e in entries if not e.is_default and e.spec.overrides]
        if len(overriders) == 1 and len(defaults) == 1 and len(entries) == 2:
            self._registry[point][name] = overriders[0]
            self._overridden[(point, name)] = defaults[0]
            log.info(
                "pdplug: %s %r from %s overrides the default from %s",
                point,
                name,
                overriders[0].distribution,
                defaults[0].distribution,
            )
            return
        ordered = sorted(entries, key=lambda e: (not e.is_default, e.distribution, e.plugin))
        why = (
            "two records declare overrides=True"
            if len(overriders) > 1
            else "only one third-party record that declares overrides=True may replace a default"
        )
        self._conflicts[(point, name)] = (
            f"{point} name {name!r} is provided by "
            + " and ".join(e.who() for e in ordered)
            + f"; {why}. Block one with PDPLUG_DISABLE_PLUGINS="
            + ",".join(dict.fromkeys(normalize(e.plugin) for e in ordered if not e.is_default))
        )
        self._claims[(point, name)] = [e.plugin for e in ordered]
        self._registry[point][name] = ordered[0]

    def _fill_provides(self) -> None:
        for r in self.records:
            r.provides = {}
        by_name = {r.name: r for r in self.records if r.status == "loaded"}
        for point, reg in self._registry.items():
            for name, entry in reg.items():
                for plugin in self._claims.get((point, name), [entry.plugin]):
                    if plugin in by_name:
                        by_name[plugin].provides.setdefault(point, []).append(name)
        for r in self.records:
            for names in r.provides.values():
                names.sort()

    def _fail(
        self, plugin: str, rec: PluginRecord | None, what: str, e: BaseException | None
    ) -> None:
        msg = f"{what}: {type(e).__name__}: {e}" if e else what
        dist = f"{rec.distribution} {rec.version}" if rec else "<in-process>"
        if rec is not None:
            rec.status = f"failed: {msg}"
            rec.error = e or PluginError(msg)
        log.warning("pdplug: plugin %r from %s failed: %s", plugin, dist, msg)
        if self.strict:
            raise PluginError(
                f"plugin {plugin!r} from {dist} failed: {msg} (PDPLUG_STRICT_PLUGINS=1)"
            ) from e

    # ------------------------------------------------------------------ selection
    @staticmethod
    def _check_point(point: str) -> None:
        if point not in EXTENSION_POINTS:
            raise ValueError(
                f"unknown extension point {point!r}; known: {sorted(EXTENSION_POINTS)}"
            )

    def names(self, point: str) -> list[str]:
        """Names available at ``point`` (sorted).

        :raises ValueError: unknown extension point.
        """
        self._check_point(point)
        return sorted(self._registry[point])

    def selected(self, point: str, name: str | None = None) -> str:
        """The name selected at ``point``: ``name`` > ``select=`` > env var > default.

        :raises ValueError: unknown extension point.
        """
        self._check_point(point)
        return (
            name
            or self.select.get(point)
            or self.env.get(ENV_SELECT[point], "").strip()
            or DEFAULTS[point]
        )

    def conflicts(self) -> list[str]:
        """Messages for every duplicate name that no override declaration resolves."""
        return list(self._conflicts.values())

    def overrides(self) -> list[tuple[str, str, str, str]]:
        """``(point, name, overriding distribution, overridden distribution)`` of every override."""
        return [
            (point, name, self._registry[point][name].distribution, old.distribution)
            for (point, name), old in sorted(self._overridden.items())
        ]

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
        chosen = self.selected(point, name)
        if (point, chosen) in self._conflicts:
            raise DuplicateComponentError(self._conflicts[(point, chosen)])
        entry = self._registry[point].get(chosen)
        if entry is not None:
            return entry.spec, entry.plugin, entry.distribution
        failed = self.failed()
        want = {normalize(chosen), normalize(point)}
        for r in failed:
            # A failed plugin yields no records, so match on its name: "my-consensus" or
            # "pdplug-my-consensus" for a selection "my-consensus"; "pdplug-consensus" for any
            # consensus. Its own exception is chained.
            short = {normalize(r.name), normalize(r.name).removeprefix("pdplug-")}
            if short & want:
                raise PluginError(
                    f"{point} {chosen!r} is unavailable: plugin {r.name!r} ({r.distribution} "
                    f"{r.version}) {r.status}"
                ) from r.error
        alts = ", ".join(self.names(point)) or "none"
        fails = "; ".join(f"{r.name} ({r.distribution}): {r.status}" for r in failed) or "none"
        blocked = [r.name for r in self.records if r.status == "blocked"]
        hint = (
            f" Blocked plugins (PDPLUG_DISABLE_PLUGINS / block=): {', '.join(blocked)}."
            if blocked
            else ""
        )
        raise UnknownComponentError(
            f"no {point} named {chosen!r} (set by {self._source(point, name)}). Available: "
            f"{alts}. Plugins that failed to load: {fails}.{hint}"
        )

    def _source(self, point: str, name: str | None) -> str:
        if name:
            return "the caller"
        if self.select.get(point):
            return "explicit selection"
        if self.env.get(ENV_SELECT[point], "").strip():
            return ENV_SELECT[point]
        return "default"

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
        self._check_point(point)
        old = self._overridden.get((point, name))
        if old is None:
            raise UnknownComponentError(
                f"no override of {point} {name!r} is active, so there is no default to wrap"
            )
        return load_factory(getattr(old.spec, attr))

    def describe(self, point: str, name: str | None = None) -> dict[str, str]:
        """``{"name", "plugin", "distribution", "version"}`` of the selected component.

        :raises PluginError: as :meth:`resolve`.
        """
        spec, plugin, dist = self.resolve(point, name)
        rec = self._record(plugin)
        return {
            "name": spec.name,
            "plugin": plugin,
            "distribution": dist,
            "version": rec.version if rec else "",
        }

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
        """
        return cast(PackPlanner, self._factory("pack_planner", name)(config or PlannerConfig()))

    def make_kv_sender(
        self,
        config: KVConfig,
        planner: PackPlanner | None = None,
        packer: Packer | None = None,
        name: str | None = None,
    ) -> KVSender:
        """Build the selected prefill-side KV sender.

        :param config: the rank's :class:`~pdplug.config.KVConfig` (``role="prefill"``).
        :param planner: the pack planner (default: :meth:`make_pack_planner`).
        :param packer: the packer, or ``None`` to let the sender pick one.
        :param name: explicit selection; default ``select=`` / ``PDPLUG_KV_SENDER`` / ``nixl``.
        :raises PluginError: as :meth:`resolve`, or the factory failed to import.
        """
        if planner is None:
            planner = self.make_pack_planner()
        factory = self._factory("kv_sender", name)
        return cast(
            KVSender,
            factory(config, planner, packer, compat=self.check_compat, emit=self.emit),
        )

    def make_kv_receiver(self, config: KVConfig, name: str | None = None) -> KVReceiver:
        """Build the selected decode-side KV receiver (same selection as the sender).

        :param config: the rank's :class:`~pdplug.config.KVConfig` (``role="decode"``).
        :param name: explicit selection; default ``select=`` / ``PDPLUG_KV_SENDER`` / ``nixl``.
        :raises PluginError: as :meth:`resolve`, or the factory failed to import.
        """
        factory = self._factory("kv_sender", name, "receiver_factory")
        return cast(KVReceiver, factory(config, compat=self.check_compat, emit=self.emit))

    def check_compat(self, local: PeerInfo, remote: PeerInfo) -> list[str]:
        """Every reason to refuse ``remote``: layout checks plus every plugin's veto.

        :param local: this rank's :class:`~pdplug.types.PeerInfo`.
        :param remote: the peer's.
        :returns: mismatches, each naming the field and both values; empty to accept.
        """
        out = layout_mismatches(local.layout, remote.layout)
        for res in self.pm.hook.pdplug_check_compat(local=local, remote=remote):
            out.extend(res or ())
        return out

    def emit(self, event: PdplugEvent) -> None:
        """Broadcast an observer event to every ``pdplug_on_event`` implementation.

        Observers are called one by one; one that raises is logged and the rest still run.
        """
        for impl in reversed(self.pm.hook.pdplug_on_event.get_hookimpls()):
            if impl.hookwrapper or getattr(impl, "wrapper", False):
                continue
            try:
                impl.function(*[{"event": event}[a] for a in impl.argnames])
            except Exception:
                log.exception("pdplug: observer %r failed on %s", impl.plugin_name, event.kind)

    def configure(self, config: Mapping[str, Any]) -> None:
        """Broadcast the host configuration (historic: replayed to later registrations)."""
        self.pm.hook.pdplug_configure.call_historic(kwargs={"config": dict(config)})

    # ------------------------------------------------------------------ listing
    def listing(self, selections: Mapping[str, str | None] | None = None) -> dict[str, Any]:
        """The document printed by ``pdplug plugins --json``.

        ``{"plugins": [{"name", "distribution", "version", "status", "provides":
        {"consensus", "kv_senders", "pack_planners", "schedulers"}}], "selected":
        {"consensus", "kv_sender", "pack_planner", "scheduler"}}``. ``provides`` lists the
        names each plugin serves after override resolution.

        :param selections: explicit selections (as the ``name`` argument of :meth:`resolve`).
        """
        sel = {p: self.selected(p, (selections or {}).get(p)) for p in EXTENSION_POINTS}
        plugins = [
            {
                "name": r.name,
                "distribution": r.distribution,
                "version": r.version,
                "status": r.status,
                "provides": {
                    PROVIDES_KEY[p]: list(r.provides.get(p, [])) for p in EXTENSION_POINTS
                },
            }
            for r in self.records
        ]
        return {"plugins": plugins, "selected": sel}

    def problems(self, selections: Mapping[str, str | None] | None = None) -> list[str]:
        """Why a selected component could not be built (one message per extension point)."""
        out = []
        for p in EXTENSION_POINTS:
            try:
                self.resolve(p, (selections or {}).get(p))
            except PluginError as e:
                out.append(str(e))
        return out


_default: PluginManager | None = None


def get_plugin_manager(refresh: bool = False) -> PluginManager:
    """The process-wide manager, built on first use from entry points and ``os.environ``.

    :param refresh: rebuild it (after changing the environment or installing a plugin).
    :raises PluginError: as :class:`PluginManager` (strict mode).
    """
    global _default
    if _default is None or refresh:
        _default = PluginManager()
    return _default
