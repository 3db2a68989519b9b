"""What ``pdplug plugins --json`` prints: one document of plugins, selections and conflicts."""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

from pdplug.manager.discovery import PluginRecord
from pdplug.manager.points import EXTENSION_POINTS
from pdplug.manager.registry import Registry

__all__ = ["listing_document"]


def listing_document(
    records: Iterable[PluginRecord], registry: Registry, selected: Mapping[str, str]
) -> dict[str, Any]:
    """The listing as plain JSON-ready data.

    :param records: every plugin record, in discovery order.
    :param registry: the settled registry (for conflicts).
    :param selected: extension point -> selected name.
    :returns: ``{"plugins": [{"name", "distribution", "version", "status", "provides":
        {"consensus", "kv_senders", "pack_planners", "schedulers"}}], "selected": {point:
        name}, "conflicts": [{"point", "name", "plugins", "message"}]}``. A name in conflict is
        listed under every plugin that claims it and once in ``conflicts``.
    """
    plugins = [
        {
            "name": r.name,
            "distribution": r.distribution,
            "version": r.version,
            "status": r.status,
            "provides": {
                pt.listing: list(r.provides.get(p, [])) for p, pt in EXTENSION_POINTS.items()
            },
        }
        for r in records
    ]
    conflicts = [
        {"point": p, "name": n, "plugins": registry.claims[(p, n)], "message": msg}
        for (p, n), msg in sorted(registry.conflicts.items())
    ]
    return {"plugins": plugins, "selected": dict(selected), "conflicts": conflicts}
