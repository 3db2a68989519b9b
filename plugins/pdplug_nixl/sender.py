"""Factory of the ``nixl`` KV sender (prefill side)."""

from __future__ import annotations

from pdplug import KVConfig, PackPlanner
from pdplug.protocols import Packer
from pdplug.transfer import Compat, Emit, KVSenderSession


def make_sender(
    config: KVConfig,
    planner: PackPlanner,
    packer: Packer | None = None,
    *,
    compat: Compat | None = None,
    emit: Emit | None = None,
) -> KVSenderSession:
    """Build the ``nixl`` sender: :class:`pdplug.transfer.KVSenderSession` over a
    NIXL agent (UCX).

    :param config: the rank's KVConfig (``role="prefill"``).
    :param planner: the pack planner; ``packer``: the packer (``None``: the planner's).
    :param compat: handshake check (the plugin manager passes its ``check_compat``);
        ``None``: layout checks only.
    :param emit: room-outcome observer (the plugin manager passes its ``emit``); ``None``:
        no events.
    :raises ImportError: NIXL is not installed.
    """
    from pdplug_nixl.engine import NixlEngine

    return KVSenderSession(config, planner, packer, NixlEngine(config), compat=compat, emit=emit)
