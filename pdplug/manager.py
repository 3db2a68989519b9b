"""Plugin discovery, selection by name, and the typed facade hosts call (DESIGN.md §2).

Every plugin, the defaults included, is found through the ``pdplug`` entry-point group; the
core never imports a plugin. Import errors are isolated (logged with plugin, distribution,
version and exception) unless ``PDPLUG_STRICT_PLUGINS=1``; they are re-raised when the failed
plugin's component is actually selected.

Environment switches (the block list beats the allow list; explicit arguments beat the env):

* ``PDPLUG_DISABLE_PLUGIN_AUTOLOAD=1`` — skip entry points of distributions other than pdplug.
* ``PDPLUG_PLUGINS=a,b`` — load these entry points even when autoload is off.
* ``PDPLUG_DISABLE_PLUGINS=x,y`` — block by entry-point or distribution name (PEP 503), defaults
  included.
* ``PDPLUG_STRICT_PLUGINS=1`` — a plugin that fails to load is fatal.
* ``PDPLUG_CONSENSUS``, ``PDPLUG_KV_SENDER``, ``PDPLUG_PACK_PLANNER``, ``PDPLUG_SCHEDULER`` —
  selected names (defaults ``pp0``, ``nixl``, ``dcp``, ``default``).
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
    "PluginRecord",
    "PluginManager",
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
#: listing keys used by ``pdplug plugins --json`` ("provides")
PROVIDES_KEY = {
    "consensus": "consensus",
    "kv_sender": "kv_senders",
    "pack_planner": "pack_planners",
    "scheduler": "schedulers",
}
DEFAULTS = {"consensus": "pp0", "kv_sender": "nixl", "pack_planner": "dcp", "scheduler": "default"}
ENV_SELECT = {
    "consensus": "PDPLUG_CONSENSUS",
    "kv_sender": "PDPLUG_KV_SENDER",
    "pack_planner": "PDPLUG_PACK_PLANNER",
    "scheduler": "PDPLUG_SCHEDULER",
}
CORE_DIST = "pdplug"


def normalize(name: str) -> str:
    """PEP 503 normalisation: ``Pdplug_Hello`` and ``pdplug-hello`` compare equal."""
    return re.sub(r"[-_.]+", "-", name).lower()


def _env_list(env: Mapping[str, str], key: str) -> set[str]:
    return {normalize(x) for x in env.get(key, "").split(",") if x.strip()}


def _env_flag(env: Mapping[str, str], key: str) -> bool:
    return env.get(key, "").strip().lower() in ("1", "true", "yes", "on")


def load_factory(ref: str) -> Any:
    """Import a lazy ``"module:attr"`` factory reference.

    :raises PluginError: malformed reference, or the import/attribute lookup failed.
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
    """One discovered plugin (entry point) and what it provides.

    :ivar status: ``"loaded"``, ``"blocked"``, ``"skipped: autoload off"`` or ``"failed: …"``.
    :ivar provides: extension point -> names offered.
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


class PluginManager:
    """Discovers plugins and builds one object per extension point, by name.

    :param entry_points: override discovery (tests); default: the ``pdplug`` entry-point group.
    :param env: environment mapping (tests); default ``os.environ``.
    :param strict: make load failures fatal; default from ``PDPLUG_STRICT_PLUGINS``.
    :param plugins: extra ``(name, module_or_object)`` pairs registered as if discovered
        (``pdplug.testing`` uses this for in-test plugins).

    :raises PluginError: in strict mode, when a plugin fails to load.
    """

    def __init__(
        self,
        entry_points: Iterable[md.EntryPoint] | None = None,
        env: Mapping[str, str] | None = None,
        *,
        strict: bool | None = None,
        plugins: Iterable[tuple[str, object]] = (),
    ) -> None:
        self.env: Mapping[str, str] = os.environ if env is None else env
        self.strict = _env_flag(self.env, "PDPLUG_STRICT_PLUGINS") if strict is None else strict
        self.pm = pluggy.PluginManager(PROJECT)
        self.pm.add_hookspecs(PdplugSpecs)
        self.records: list[PluginRecord] = []
        self._registry: dict[str, dict[str, _Entry]] = {k: {} for k in EXTENSION_POINTS}
        self._conflicts: dict[tuple[str, str], str] = {}
        eps = list(md.entry_points(group=PROJECT)) if entry_points is None else list(entry_points)
        self._discover(eps)
        for name, obj in plugins:
            self.register(obj, name=name)
        self._build_registry()

    # ------------------------------------------------------------------ discovery
    def _discover(self, eps: list[md.EntryPoint]) -> None:
        autoload_off = _env_flag(self.env, "PDPLUG_DISABLE_PLUGIN_AUTOLOAD")
        allow = _env_list(self.env, "PDPLUG_PLUGINS")
        block = _env_list(self.env, "PDPLUG_DISABLE_PLUGINS")
        seen: set[str] = set()
        for ep in eps:
            dist = ep.dist.name if ep.dist is not None else "<unknown>"
            version = ep.dist.version if ep.dist is not None else "?"
            if (ep.name, dist) in seen:  # the same dist found twice on sys.path
                continue
            seen.add((ep.name, dist))  # type: ignore[arg-type]
            is_default = normalize(dist) == CORE_DIST
            rec = PluginRecord(
                name=ep.name, distribution=dist, version=version, value=ep.value, default=is_default
            )
            self.records.append(rec)
            if normalize(ep.name) in block or normalize(dist) in block:
                rec.status = "blocked"
                self.pm.set_blocked(ep.name)
                continue
            if autoload_off and not is_default and normalize(ep.name) not in allow:
                rec.status = "skipped: autoload off"
                continue
            try:
                obj = ep.load()
                self.pm.register(obj, name=ep.name)
            except Exception as e:
                rec.status = f"failed: {type(e).__name__}: {e}"
                rec.error = e
                log.warning(
                    "pdplug: plugin %r from %s %s failed to load: %s: %s",
                    ep.name,
                    dist,
                    version,
                    type(e).__name__,
                    e,
                )
                if self.strict:
                    raise PluginError(
                        f"plugin {ep.name!r} from {dist} {version} failed to load "
                        f"(PDPLUG_STRICT_PLUGINS=1): {type(e).__name__}: {e}"
                    ) from e

    def register(self, plugin: object, name: str, distribution: str = "<in-process>") -> None:
        """Register an in-process plugin (tests, embedded hosts) and rebuild the registry."""
        self.pm.register(plugin, name=name)
        self.records.append(
            PluginRecord(name=name, distribution=distribution, version="", value=repr(plugin))
        )
        if any(self._registry.values()):
            self._build_registry()

    def _record(self, plugin_name: str) -> PluginRecord | None:
        for r in self.records:
            if r.name == plugin_name and r.status == "loaded":
                return r
        return None

    def _build_registry(self) -> None:
        self._registry = {k: {} for k in EXTENSION_POINTS}
        self._conflicts = {}
        for r in self.records:
            r.provides = {}
        for point, (hook_name, rec_type) in EXTENSION_POINTS.items():
            hook = getattr(self.pm.hook, hook_name)
            # Call implementations one by one so every record is attributed to its plugin and a
            # raising plugin is isolated like an import failure.
            for impl in reversed(hook.get_hookimpls()):
                rec = self._record(impl.plugin_name)
                dist = rec.distribution if rec else "<in-process>"
                try:
                    specs = list(impl.function() or ())
                except Exception as e:
                    self._fail(impl.plugin_name, rec, f"{hook_name} raised", e)
                    continue
                for spec in specs:
                    if not isinstance(spec, rec_type):
                        self._fail(
                            impl.plugin_name,
                            rec,
                            f"{hook_name} yielded {type(spec).__name__}, expected "
                            f"{rec_type.__name__}",
                            None,
                        )
                        continue
                    if rec is not None:
                        rec.provides.setdefault(point, []).append(spec.name)
                    self._add(point, _Entry(spec=spec, plugin=impl.plugin_name, distribution=dist))

    def _fail(
        self, plugin: str, rec: PluginRecord | None, what: str, e: BaseException | None
    ) -> None:
        msg = f"{what}: {type(e).__name__}: {e}" if e else what
        if rec is not None:
            rec.status = f"failed: {msg}"
            rec.error = e or PluginError(msg)
        log.warning("pdplug: plugin %r: %s", plugin, msg)
        if self.strict:
            raise PluginError(f"plugin {plugin!r}: {msg} (PDPLUG_STRICT_PLUGINS=1)") from e

    def _add(self, point: str, new: _Entry) -> None:
        reg = self._registry[point]
        old = reg.get(new.spec.name)
        if old is None:
            reg[new.spec.name] = new
            return
        old_default = normalize(old.distribution) == CORE_DIST
        new_default = normalize(new.distribution) == CORE_DIST
        if new.spec.overrides and old_default and not new_default:
            reg[new.spec.name] = new
            return
        if old.spec.overrides and new_default and not old_default:
            return
        self._conflicts[(point, new.spec.name)] = (
            f"{point} name {new.spec.name!r} is provided by both {old.distribution} "
            f"(plugin {old.plugin!r}) and {new.distribution} (plugin {new.plugin!r}); only a "
            f"third-party record that declares overrides=True may replace a default"
        )

    # ------------------------------------------------------------------ selection
    def names(self, point: str) -> list[str]:
        """Names available at ``point`` (sorted)."""
        return sorted(self._registry[point])

    def selected(self, point: str, name: str | None = None) -> str:
        """The name selected at ``point``: explicit ``name`` > env var > default."""
        if point not in EXTENSION_POINTS:
            raise ValueError(
                f"unknown extension point {point!r}; known: {sorted(EXTENSION_POINTS)}"
            )
        return name or self.env.get(ENV_SELECT[point], "").strip() or DEFAULTS[point]

    def conflicts(self) -> list[str]:
        """Messages for every duplicate name that no override declaration resolves."""
        return list(self._conflicts.values())

    def resolve(self, point: str, name: str | None = None) -> tuple[ComponentSpec, str, str]:
        """Find the record selected at ``point``: ``(spec, plugin name, distribution)``.

        :raises DuplicateComponentError: two distributions provide the name, no override.
        :raises PluginError: the plugin that would provide it failed to load (re-raised).
        :raises UnknownComponentError: nobody provides it; lists alternatives and failures.
        """
        chosen = self.selected(point, name)
        if (point, chosen) in self._conflicts:
            raise DuplicateComponentError(self._conflicts[(point, chosen)])
        entry = self._registry[point].get(chosen)
        if entry is not None:
            return entry.spec, entry.plugin, entry.distribution
        failed = [r for r in self.records if r.status.startswith("failed")]
        for r in failed:  # a failed plugin whose name matches the selection: re-raise its error
            if normalize(r.name).removeprefix("pdplug-") in (normalize(chosen), normalize(point)):
                raise PluginError(
                    f"{point} {chosen!r} is unavailable: plugin {r.name!r} ({r.distribution} "
                    f"{r.version}) {r.status}"
                ) from r.error
        alts = ", ".join(self.names(point)) or "none"
        fails = "; ".join(f"{r.name} ({r.distribution}): {r.status}" for r in failed) or "none"
        raise UnknownComponentError(
            f"no {point} named {chosen!r}. Available: {alts}. Plugins that failed to load: {fails}"
        )

    def _factory(self, point: str, name: str | None, attr: str = "factory") -> Any:
        spec, _plugin, dist = self.resolve(point, name)
        ref = getattr(spec, attr)
        if not ref:
            raise PluginError(f"{point} {spec.name!r} from {dist} has no {attr}")
        return load_factory(ref)

    def describe(self, point: str, name: str | None = None) -> dict[str, str]:
        """``{"name", "plugin", "distribution", "version"}`` of the selected component."""
        spec, plugin, dist = self.resolve(point, name)
        rec = self._record(plugin)
        return {
            "name": spec.name,
            "plugin": plugin,
            "distribution": dist,
            "version": rec.version if rec else "",
        }

    # ------------------------------------------------------------------ typed facade
    def make_consensus(self, config: ConsensusConfig, name: str | None = None) -> Consensus:
        """Build the selected consensus for one PP rank."""
        return cast(Consensus, self._factory("consensus", name)(config))

    def make_scheduler(self, config: SchedulerConfig, name: str | None = None) -> Scheduler:
        """Build the selected scheduler."""
        return cast(Scheduler, self._factory("scheduler", name)(config))

    def make_pack_planner(
        self, config: PlannerConfig | None = None, name: str | None = None
    ) -> PackPlanner:
        """Build the selected pack planner."""
        return cast(PackPlanner, self._factory("pack_planner", name)(config or PlannerConfig()))

    def make_kv_sender(
        self,
        config: KVConfig,
        planner: PackPlanner | None = None,
        packer: Packer | None = None,
        name: str | None = None,
    ) -> KVSender:
        """Build the selected prefill-side KV sender (with the selected planner by default)."""
        if planner is None:
            planner = self.make_pack_planner()
        return cast(KVSender, self._factory("kv_sender", name)(config, planner, packer))

    def make_kv_receiver(self, config: KVConfig, name: str | None = None) -> KVReceiver:
        """Build the selected decode-side KV receiver."""
        return cast(KVReceiver, self._factory("kv_sender", name, "receiver_factory")(config))

    def check_compat(self, local: PeerInfo, remote: PeerInfo) -> list[str]:
        """Every reason to refuse ``remote``: layout checks plus every plugin's veto."""
        out = layout_mismatches(local.layout, remote.layout)
        for res in self.pm.hook.pdplug_check_compat(local=local, remote=remote):
            out.extend(res or ())
        return out

    def emit(self, event: PdplugEvent) -> None:
        """Broadcast an observer event; observer exceptions are logged, never raised."""
        try:
            self.pm.hook.pdplug_on_event(event=event)
        except Exception:
            log.exception("pdplug: an observer failed on %s", event.kind)

    def configure(self, config: Mapping[str, Any]) -> None:
        """Broadcast the host configuration (historic hook)."""
        self.pm.hook.pdplug_configure.call_historic(kwargs={"config": dict(config)})

    # ------------------------------------------------------------------ listing
    def listing(self, selections: Mapping[str, str | None] | None = None) -> dict[str, Any]:
        """The data behind ``pdplug plugins --json``."""
        sel = {p: self.selected(p, (selections or {}).get(p)) for p in EXTENSION_POINTS}
        plugins = [
            {
                "name": r.name,
                "distribution": r.distribution,
                "version": r.version,
                "status": r.status,
                "default": r.default,
                "provides": {
                    PROVIDES_KEY[p]: list(r.provides.get(p, [])) for p in EXTENSION_POINTS
                },
            }
            for r in self.records
        ]
        served: dict[str, Any] = {}
        for p in EXTENSION_POINTS:
            try:
                served[p] = self.describe(p, sel[p])
            except Exception as e:
                served[p] = {"name": sel[p], "error": str(e)}
        return {
            "plugins": plugins,
            "selected": sel,
            "served_by": served,
            "conflicts": self.conflicts(),
        }


_default: PluginManager | None = None


def get_plugin_manager(refresh: bool = False) -> PluginManager:
    """The process-wide manager (built on first use from entry points and ``os.environ``)."""
    global _default
    if _default is None or refresh:
        _default = PluginManager()
    return _default
