"""The four extension points in one table: hook, record type, env var, default, factories.

The manager, ``pdplug plugins`` and the applications (the reference host's workers, driver and
CLI) all read this table; nothing else lists the extension points.
"""

from __future__ import annotations

from collections.abc import Mapping
from types import MappingProxyType

import msgspec

from pdplug.types import (
    ComponentSpec,
    ConsensusSpec,
    KVSenderSpec,
    PackPlannerSpec,
    SchedulerSpec,
)

__all__ = ["ExtensionPoint", "EXTENSION_POINTS", "extension_point", "choose"]


class ExtensionPoint(msgspec.Struct, frozen=True, kw_only=True):
    """One extension point: how plugins offer it and how a host selects it.

    :ivar name: the point's name in the facade and in ``select=`` (``"kv_sender"``).
    :ivar label: words for messages and help (``"KV sender"``).
    :ivar hook: the registry hook plugins implement (``"pdplug_register_kv_senders"``).
    :ivar spec: the record type that hook yields (:class:`~pdplug.types.KVSenderSpec`).
    :ivar env: the environment variable that selects a name (``"PDPLUG_KV_SENDER"``).
    :ivar default: the name selected when neither the host nor the environment names one.
    :ivar factories: the record's factory attributes (``("factory", "receiver_factory")``).
    :ivar listing: key of this point in ``pdplug plugins`` (JSON ``provides`` and table column).
    """

    name: str
    label: str
    hook: str
    spec: type[ComponentSpec]
    env: str
    default: str
    factories: tuple[str, ...] = ("factory",)
    listing: str

    @property
    def option(self) -> str:
        """The command-line option that selects a name at this point (``--kv-sender``)."""
        return "--" + self.name.replace("_", "-")


#: name -> :class:`ExtensionPoint`, in listing order (read-only).
EXTENSION_POINTS: Mapping[str, ExtensionPoint] = MappingProxyType(
    {
        p.name: p
        for p in (
            ExtensionPoint(
                name="consensus",
                label="consensus",
                hook="pdplug_register_consensus",
                spec=ConsensusSpec,
                env="PDPLUG_CONSENSUS",
                default="pp0",
                listing="consensus",
            ),
            ExtensionPoint(
                name="kv_sender",
                label="KV sender",
                hook="pdplug_register_kv_senders",
                spec=KVSenderSpec,
                env="PDPLUG_KV_SENDER",
                default="nixl",
                factories=("factory", "receiver_factory"),
                listing="kv_senders",
            ),
            ExtensionPoint(
                name="pack_planner",
                label="pack planner",
                hook="pdplug_register_pack_planners",
                spec=PackPlannerSpec,
                env="PDPLUG_PACK_PLANNER",
                default="dcp",
                listing="pack_planners",
            ),
            ExtensionPoint(
                name="scheduler",
                label="scheduler",
                hook="pdplug_register_schedulers",
                spec=SchedulerSpec,
                env="PDPLUG_SCHEDULER",
                default="default",
                listing="schedulers",
            ),
        )
    }
)


def extension_point(name: str) -> ExtensionPoint:
    """The table row of ``name``.

    :param name: ``"consensus"``, ``"kv_sender"``, ``"pack_planner"`` or ``"scheduler"``.
    :raises ValueError: unknown extension point (the message lists the known ones).
    """
    try:
        return EXTENSION_POINTS[name]
    except KeyError:
        raise ValueError(
            f"unknown extension point {name!r}; known: {sorted(EXTENSION_POINTS)}"
        ) from None


def choose(
    point: str, name: str | None, select: Mapping[str, str], env: Mapping[str, str]
) -> tuple[str, str]:
    """Apply the selection rule at ``point``: the call's ``name`` > the host's ``select`` > the
    point's environment variable > its default.

    :returns: ``(name, what chose it)``; the second is ``"the caller"``, ``"explicit
        selection"``, the variable's name or ``"default"`` (for error messages).
    :raises ValueError: unknown extension point.
    """
    p = extension_point(point)
    if name:
        return name, "the caller"
    if select.get(p.name):
        return select[p.name], "explicit selection"
    if env.get(p.env, "").strip():
        return env[p.env].strip(), p.env
    return p.default, "default"
