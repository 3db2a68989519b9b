"""The optional process-wide manager: for hosts that want one; nothing in pdplug calls it.

Sessions, consensus objects and every other part get their plugins from the
:class:`~pdplug.manager.facade.PluginManager` that built them, never from here.
"""

from __future__ import annotations

from pdplug.manager.facade import PluginManager

__all__ = ["get_plugin_manager"]

_default: PluginManager | None = None


def get_plugin_manager(refresh: bool = False) -> PluginManager:
    """A process-wide manager for hosts that want one, built on first use from entry points
    and ``os.environ``. A convenience only: pdplug itself never calls it, and a host that
    builds its own :class:`PluginManager` gets exactly that manager's plugins everywhere.

    :param refresh: rebuild it (after changing the environment or installing a plugin).
    :raises PluginError: as :class:`PluginManager` (strict mode).
    """
    global _default
    if _default is None or refresh:
        _default = PluginManager()
    return _default
