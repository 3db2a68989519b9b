"""Factory of the ``mooncake`` KV sender (prefill side)."""

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
    """Build the ``mooncake`` sender: :class:`pdplug.transfer.KVSenderSession` over a
    Mooncake TransferEngine (``KVConfig.extra["protocol"]``: tcp or rdma).

    :param config: the rank's KVConfig (``role="prefill"``).
    :param planner: the pack planner; ``packer``: the packer (``None``: the planner's).
    :param compat: handshake check (the plugin manager passes its ``check_compat``);
        ``None``: layout checks only.
    :param emit: room-outcome observer (the plugin manager passes its ``emit``); ``None``:
        no events.
    :raises ImportError: mooncake is not installed.
    """
    from pdplug_mooncake.engine import MooncakeEngine

    return KVSenderSession(
        config, planner, packer, MooncakeEngine(config), compat=compat, emit=emit
    )
