"""The plugin manager: discovery, the registry of names, and the typed facade hosts call.

* :mod:`pdplug.manager.points`: the four extension points in one table;
* :mod:`pdplug.manager.discovery`: entry points, switches (block / allow / autoload / strict);
* :mod:`pdplug.manager.registry`: records collected through pluggy, duplicates settled;
* :mod:`pdplug.manager.facade`: :class:`PluginManager`, ``make_*``, ``check_compat``, ``emit``;
* :mod:`pdplug.manager.default`: ``get_plugin_manager()``, for hosts only.
"""

from __future__ import annotations

from pdplug.manager.default import get_plugin_manager
from pdplug.manager.discovery import (
    CORE_DIST,
    PluginRecord,
    Switches,
    discover_entry_points,
    normalize,
)
from pdplug.manager.facade import PluginManager, load_factory
from pdplug.manager.points import EXTENSION_POINTS, ExtensionPoint, extension_point

__all__ = [
    "EXTENSION_POINTS",
    "ExtensionPoint",
    "extension_point",
    "CORE_DIST",
    "Switches",
    "PluginRecord",
    "PluginManager",
    "discover_entry_points",
    "get_plugin_manager",
    "load_factory",
    "normalize",
]
