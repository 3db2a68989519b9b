"""Plugin discovery: entry points in, blocking / allow list / autoload / strict applied, registered.

Every plugin, the defaults included, is found through the ``pdplug`` entry-point group; the
core never imports a plugin. Environment switches (explicit arguments beat the environment;
the block list always beats the allow list):

* ``PDPLUG_DISABLE_PLUGIN_AUTOLOAD=1``: skip entry points of distributions other than
  ``pdplug`` (the defaults still load; pytest's switch name).
* ``PDPLUG_PLUGINS=a,b``: allow list of third-party plugins (entry-point or distribution
  names): these load even when autoload is off, and when the list is set, unlisted third-party
  plugins are skipped (vLLM's ``VLLM_PLUGINS``).
* ``PDPLUG_DISABLE_PLUGINS=x,y``: block by entry-point or distribution name, defaults included.
* ``PDPLUG_STRICT_PLUGINS=1``: a plugin that fails to load, or a duplicate name, is fatal.

Names are compared after PEP 503 normalisation (``pdplug_hello`` equals ``pdplug-hello``).
Import errors are isolated (logged with plugin, distribution, version and exception) unless
strict.
"""

from __future__ import annotations

import importlib.metadata as md
import logging
import re
from collections.abc import Iterable, Mapping

import msgspec
import pluggy

from pdplug import hookspecs
from pdplug.errors import PluginError
from pdplug.hookspecs import PROJECT

__all__ = [
    "CORE_DIST",
    "Switches",
    "PluginRecord",
    "normalize",
    "discover_entry_points",
    "admit",
    "load_entry_points",
    "fail",
]

log = logging.getLogger("pdplug.manager")

#: the distribution whose entry points are the defaults
CORE_DIST = "pdplug"


def normalize(name: str) -> str:
    """PEP 503 normalisation: ``Pdplug_Hello`` and ``pdplug-hello`` compare equal.

    :param name: a distribution or entry-point name.
    :returns: the name lower-cased, runs of ``-``, ``_`` and ``.`` replaced by one ``-``.
    """
    return re.sub(r"[-_.]+", "-", name).lower()


def _names(value: str | Iterable[str] | None) -> frozenset[str]:
    if value is None:
        return frozenset()
    items = value.split(",") if isinstance(value, str) else value
    return frozenset(normalize(x.strip()) for x in items if x.strip())


def _flag(env: Mapping[str, str], key: str) -> bool:
    return env.get(key, "").strip().lower() in ("1", "true", "yes", "on")


class Switches(msgspec.Struct, frozen=True, kw_only=True):
    """The loading switches in force (normalised names).

    :ivar strict: load failures and duplicate names are fatal.
    :ivar autoload: third-party entry points load without being allow-listed.
    :ivar allow: allow-listed third-party plugins.
    :ivar block: blocked plugins, defaults included.
    """

    strict: bool = False
    autoload: bool = True
    allow: frozenset[str] = frozenset()
    block: frozenset[str] = frozenset()

    @classmethod
    def from_env(
        cls,
        env: Mapping[str, str],
        *,
        strict: bool | None = None,
        autoload: bool | None = None,
        allow: Iterable[str] | None = None,
        block: Iterable[str] = (),
    ) -> Switches:
        """Read the ``PDPLUG_*`` switches; an explicit argument beats its variable, and
        ``block`` joins ``PDPLUG_DISABLE_PLUGINS`` (a block is never lifted by an argument).

        :param env: the environment mapping (``os.environ`` or a host's own).
        """
        return cls(
            strict=_flag(env, "PDPLUG_STRICT_PLUGINS") if strict is None else strict,
            autoload=not _flag(env, "PDPLUG_DISABLE_PLUGIN_AUTOLOAD")
            if autoload is None
            else autoload,
            allow=_names(env.get("PDPLUG_PLUGINS") if allow is None else allow),
            block=_names(env.get("PDPLUG_DISABLE_PLUGINS")) | _names(block),
        )


class PluginRecord(msgspec.Struct, kw_only=True):
    """One discovered plugin (an entry point, or an in-process registration) and its names.

    :ivar name: entry-point name (``pdplug-consensus``) or the name given to ``register``.
    :ivar distribution: the distribution that declares it (``pdplug`` for the defaults).
    :ivar version: that distribution's version.
    :ivar value: the entry point's ``module`` (or ``repr`` of an in-process plugin).
    :ivar status: ``"loaded"``, ``"blocked"``, ``"skipped: ..."`` or ``"failed: ..."``.
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


def discover_entry_points() -> list[md.EntryPoint]:
    """Every entry point of the ``pdplug`` group in the installed distributions.

    An editable install counts; running from a source tree via ``PYTHONPATH`` has no metadata
    and finds nothing (``pdplug plugins`` then hints at ``pip install -e .``).
    """
    return list(md.entry_points(group=PROJECT))


def _known_hooks() -> list[str]:
    return sorted(n for n in dir(hookspecs) if n.startswith("pdplug_"))


def admit(pm: pluggy.PluginManager, plugin: object, name: str) -> None:
    """Register ``plugin`` under ``name`` and check it, or leave no trace of it.

    :raises pluggy.PluginValidationError: a hook implementation pluggy refuses (an argument
        its spec lacks, a historic hook implemented as a wrapper).
    :raises PluginError: a ``pdplug_*`` function that matches no spec (a typo), or a pluggy
        wrapper/hookwrapper of a pdplug hook (pdplug calls plugins one by one; see
        :mod:`pdplug.hookspecs`). The message names the plugin and the hook.
    """
    try:
        pm.register(plugin, name=name)
        callers = pm.get_hookcallers(plugin) or []
        unknown = sorted(h.name for h in callers if not h.has_spec())
        if unknown:
            raise PluginError(
                f"plugin {name!r} implements unknown hooks {unknown}; known hooks: "
                + ", ".join(_known_hooks())
            )
        for hc in callers:
            for impl in hc.get_hookimpls():
                if impl.plugin is plugin and (impl.hookwrapper or impl.wrapper):
                    kind = "hookwrapper=True" if impl.hookwrapper else "wrapper=True"
                    raise PluginError(
                        f"plugin {name!r} implements {hc.name} with {kind}; pdplug hooks "
                        "take plain implementations only (each plugin is called on its own)"
                    )
    except BaseException:
        if pm.get_plugin(name) is plugin:  # pluggy keeps a plugin whose validation failed
            pm.unregister(name=name)
        raise


def fail(rec: PluginRecord, what: str, e: BaseException | None, strict: bool) -> None:
    """Mark ``rec`` failed and log it, naming plugin, distribution, version and exception.

    :raises PluginError: in strict mode (chained to ``e``).
    """
    msg = f"{what}: {type(e).__name__}: {e}" if e else what
    dist = f"{rec.distribution} {rec.version}".strip()
    rec.status = f"failed: {msg}"
    rec.error = e or PluginError(msg)
    log.warning("pdplug: plugin %r from %s failed: %s", rec.name, dist, msg)
    if strict:
        raise PluginError(
            f"plugin {rec.name!r} from {dist} failed: {msg} (PDPLUG_STRICT_PLUGINS=1)"
        ) from e


def load_entry_points(
    pm: pluggy.PluginManager, eps: Iterable[md.EntryPoint], sw: Switches
) -> list[PluginRecord]:
    """Apply the switches to ``eps``, import and register the admitted ones.

    :returns: one record per distinct entry point (the same distribution found twice on
        ``sys.path`` counts once), with its status.
    :raises PluginError: in strict mode, a plugin failed to import or register, or an
        allow-listed plugin is not installed.
    """
    records: list[PluginRecord] = []
    seen: set[tuple[str, str]] = set()
    for ep in eps:
        dist = ep.dist.name if ep.dist is not None else "<unknown>"
        if (ep.name, dist) in seen:
            continue
        seen.add((ep.name, dist))
        is_default = normalize(dist) == CORE_DIST
        rec = PluginRecord(
            name=ep.name,
            distribution=dist,
            version=ep.dist.version if ep.dist is not None else "?",
            value=ep.value,
            default=is_default,
        )
        records.append(rec)
        keys = {normalize(ep.name), normalize(dist)}
        if keys & sw.block:
            rec.status = "blocked"
            pm.set_blocked(ep.name)
            continue
        if not is_default and not keys & sw.allow:
            if sw.allow:
                rec.status = "skipped: not in PDPLUG_PLUGINS"
                continue
            if not sw.autoload:
                rec.status = "skipped: autoload off"
                continue
        try:
            obj = ep.load()
        except Exception as e:
            fail(rec, "import failed", e, sw.strict)
            continue
        try:
            admit(pm, obj, ep.name)
        except Exception as e:
            fail(rec, "registration failed", e, sw.strict)
    present = {normalize(r.name) for r in records} | {normalize(r.distribution) for r in records}
    missing = sorted(sw.allow - present)
    if missing:
        msg = f"PDPLUG_PLUGINS names {missing}, but no such pdplug plugin is installed"
        log.warning("pdplug: %s", msg)
        if sw.strict:
            raise PluginError(msg + " (PDPLUG_STRICT_PLUGINS=1)")
    return records
