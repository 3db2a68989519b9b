"""The registry: each plugin's records, collected through pluggy, with duplicates settled by name.

Override semantics (hatchling and conda register by name the same way): a third-party record
may reuse a default's name only by declaring ``overrides=True``; every other duplicate is a
conflict whose message names every distribution involved. The outcome is decided on the whole
set of claimants at once, so it never depends on entry-point discovery order.
"""

from __future__ import annotations

import importlib
import logging
from collections.abc import Iterable
from typing import Any

import msgspec
import pluggy

from pdplug.errors import DuplicateComponentError, PluginError, UnknownComponentError
from pdplug.manager.discovery import CORE_DIST, PluginRecord, fail, normalize
from pdplug.manager.points import EXTENSION_POINTS
from pdplug.types import ComponentSpec

__all__ = ["Entry", "Registry", "collect", "load_factory", "per_plugin"]

log = logging.getLogger("pdplug.manager")


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


class Entry(msgspec.Struct, frozen=True, kw_only=True):
    """One record and who offered it.

    :ivar spec: the record (a :class:`~pdplug.types.ComponentSpec` subclass).
    :ivar plugin: the plugin's registered name.
    :ivar distribution: the distribution that declares the plugin.
    """

    spec: ComponentSpec
    plugin: str
    distribution: str

    @property
    def is_default(self) -> bool:
        """True for records of the ``pdplug`` distribution (the defaults)."""
        return normalize(self.distribution) == CORE_DIST

    def who(self) -> str:
        """``"dist (plugin 'name'[, declares overrides=True])"`` for messages."""
        extra = ", declares overrides=True" if self.spec.overrides else ""
        return f"{self.distribution} (plugin {self.plugin!r}{extra})"


def per_plugin(pm: pluggy.PluginManager, hook: str) -> list[tuple[str, pluggy.HookCaller]]:
    """One caller per plugin implementing ``hook``, in pluggy's call order.

    Each is ``pm.subset_hook_caller`` with every other plugin removed: the call still goes
    through pluggy (monitoring and tracing see it) and its results belong to that plugin.

    :returns: ``(plugin name, caller)`` pairs.
    """
    impls = list(reversed(getattr(pm.hook, hook).get_hookimpls()))
    return [
        (name, pm.subset_hook_caller(hook, [i.plugin for i in impls if i.plugin_name != name]))
        for name in dict.fromkeys(i.plugin_name for i in impls)
    ]


def collect(
    pm: pluggy.PluginManager, records: Iterable[PluginRecord], strict: bool
) -> dict[str, dict[str, list[Entry]]]:
    """Call every registry hook through pluggy, once per implementing plugin, in call order.

    Each call goes through :func:`per_plugin`, so each record is attributed to its plugin and
    pluggy's monitoring sees the call. A plugin that
    raises or yields the wrong record type is marked failed (see
    :func:`~pdplug.manager.discovery.fail`) and contributes nothing at any point.

    :returns: extension point -> name -> every entry claiming it.
    :raises PluginError: in strict mode, a plugin failed.
    """
    loaded = {r.name: r for r in records if r.status == "loaded"}
    found: dict[str, dict[str, list[Entry]]] = {p: {} for p in EXTENSION_POINTS}
    for point in EXTENSION_POINTS.values():
        for name, call in per_plugin(pm, point.hook):
            rec = loaded.get(name)
            if rec is None or rec.status != "loaded":  # not ours, or failed at another point
                continue
            try:
                specs = [s for out in call() for s in out]
            except Exception as e:
                fail(rec, f"{point.hook} raised", e, strict)
                continue
            bad = [s for s in specs if not isinstance(s, point.spec)]
            if bad:
                what = f"{point.hook} yielded {type(bad[0]).__name__}, expected "
                fail(rec, what + point.spec.__name__, None, strict)
                continue
            for spec in specs:
                entry = Entry(spec=spec, plugin=name, distribution=rec.distribution)
                found[point.name].setdefault(spec.name, []).append(entry)
    return found


class Registry:
    """Names per extension point after override resolution.

    :param found: the output of :func:`collect`.
    :param records: the plugin records (failed ones contribute nothing; ``provides`` is
        filled in).
    :param strict: an unresolved duplicate is fatal.
    :raises DuplicateComponentError: in strict mode, two records claim one name unresolved.
    """

    def __init__(
        self, found: dict[str, dict[str, list[Entry]]], records: list[PluginRecord], strict: bool
    ) -> None:
        self.entries: dict[str, dict[str, Entry]] = {p: {} for p in EXTENSION_POINTS}
        self.overridden: dict[tuple[str, str], Entry] = {}
        self.conflicts: dict[tuple[str, str], str] = {}
        self.claims: dict[tuple[str, str], list[str]] = {}
        failed = {r.name for r in records if r.status.startswith("failed")}
        for point, by_name in found.items():
            for name, entries in by_name.items():
                ok = [e for e in entries if e.plugin not in failed]
                if ok:
                    self._settle(point, name, ok)
        self._fill_provides(records)
        if strict and self.conflicts:
            raise DuplicateComponentError(
                "; ".join(self.conflicts.values()) + " (PDPLUG_STRICT_PLUGINS=1)"
            )

    def _settle(self, point: str, name: str, entries: list[Entry]) -> None:
        """Pick the one entry serving ``name``, or record a conflict naming every claimant."""
        if len(entries) == 1:
            self.entries[point][name] = entries[0]
            return
        defaults = [e for e in entries if e.is_default]
        overriders = [e for e in entries if not e.is_default and e.spec.overrides]
        if len(overriders) == 1 and len(defaults) == 1 and len(entries) == 2:
            new, old = overriders[0], defaults[0]
            self.entries[point][name] = new
            self.overridden[(point, name)] = old
            log.info(
                "pdplug: %s %r from %s overrides the default from %s",
                point,
                name,
                new.distribution,
                old.distribution,
            )
            return
        ordered = sorted(entries, key=lambda e: (not e.is_default, e.distribution, e.plugin))
        why = (
            "two records declare overrides=True"
            if len(overriders) > 1
            else "only one third-party record that declares overrides=True may replace a default"
        )
        self.conflicts[(point, name)] = (
            f"{point} name {name!r} is provided by "
            + " and ".join(e.who() for e in ordered)
            + f"; {why}. Block one with PDPLUG_DISABLE_PLUGINS="
            + ",".join(dict.fromkeys(normalize(e.plugin) for e in ordered if not e.is_default))
        )
        self.claims[(point, name)] = [e.plugin for e in ordered]
        self.entries[point][name] = ordered[0]

    def _fill_provides(self, records: list[PluginRecord]) -> None:
        for r in records:
            r.provides = {}
        by_name = {r.name: r for r in records if r.status == "loaded"}
        for point, reg in self.entries.items():
            for name, entry in reg.items():
                for plugin in self.claims.get((point, name), [entry.plugin]):
                    if plugin in by_name:
                        by_name[plugin].provides.setdefault(point, []).append(name)
        for r in records:
            for names in r.provides.values():
                names.sort()

    def overrides(self) -> list[tuple[str, str, str, str]]:
        """``(point, name, overriding distribution, overridden distribution)`` of each override."""
        return [
            (point, name, self.entries[point][name].distribution, old.distribution)
            for (point, name), old in sorted(self.overridden.items())
        ]

    def resolve(self, point: str, name: str, source: str, records: list[PluginRecord]) -> Entry:
        """The entry serving ``name`` at ``point``, or an error that says why there is none.

        :param source: what selected ``name``, for the message (``"PDPLUG_CONSENSUS"`` ...).
        :param records: every plugin record (failed and blocked ones are named).
        :raises DuplicateComponentError: two distributions provide the name, no override.
        :raises PluginError: the plugin that would provide it failed to load (chained to the
            plugin's own exception).
        :raises UnknownComponentError: nobody provides it; lists alternatives and failures.
        """
        if (point, name) in self.conflicts:
            raise DuplicateComponentError(self.conflicts[(point, name)])
        entry = self.entries[point].get(name)
        if entry is not None:
            return entry
        failed = [r for r in records if r.status.startswith("failed")]
        want = {normalize(name), normalize(point)}
        for r in failed:
            # A failed plugin yields no records, so match on its name: "my-consensus" or
            # "pdplug-my-consensus" for a selection "my-consensus"; "pdplug-consensus" for any
            # consensus. Its own exception is chained.
            if {normalize(r.name), normalize(r.name).removeprefix("pdplug-")} & want:
                raise PluginError(
                    f"{point} {name!r} is unavailable: plugin {r.name!r} ({r.distribution} "
                    f"{r.version}) {r.status}"
                ) from r.error
        alts = ", ".join(sorted(self.entries[point])) or "none"
        fails = "; ".join(f"{r.name} ({r.distribution}): {r.status}" for r in failed) or "none"
        blocked = [r.name for r in records if r.status == "blocked"]
        hint = (
            f" Blocked plugins (PDPLUG_DISABLE_PLUGINS / block=): {', '.join(blocked)}."
            if blocked
            else ""
        )
        raise UnknownComponentError(
            f"no {point} named {name!r} (set by {source}). Available: {alts}. "
            f"Plugins that failed to load: {fails}.{hint}"
        )

    def overridden_factory(self, point: str, name: str, attr: str) -> Any:
        """The ``attr`` factory of the default record that an override of ``name`` replaced.

        :raises UnknownComponentError: nothing overrides ``name`` at ``point``.
        """
        old = self.overridden.get((point, name))
        if old is None:
            raise UnknownComponentError(
                f"no override of {point} {name!r} is active, so there is no default to wrap"
            )
        return load_factory(getattr(old.spec, attr))
