"""Factory of the ``nixl`` KV sender (prefill side)."""

from __future__ import annotations

from pdplug import KVConfig, Packer, PackPlanner
from pdplug.transfer import Compat, KVSenderSession


def make_sender(
    config: KVConfig,
    planner: PackPlanner,
    packer: Packer | None = None,
    *,
    compat: Compat | None = None,
) -> KVSenderSession:
    """Build the ``nixl`` sender: :class:`pdplug.transfer.KVSenderSession` over a NIXL agent.

    :param compat: handshake check; default: the process-wide manager's ``check_compat``.
    :raises ImportError: NIXL is not installed.
    """
    from pdplug_nixl.engine import NixlEngine

    return KVSenderSession(config, planner, packer, NixlEngine(config), compat=compat)
