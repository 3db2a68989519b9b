"""Factory of the ``mooncake`` KV receiver (decode side)."""

from __future__ import annotations

from pdplug import KVConfig
from pdplug.transfer import Compat, Emit, KVReceiverSession


def make_receiver(
    config: KVConfig, *, compat: Compat | None = None, emit: Emit | None = None
) -> KVReceiverSession:
    """Build the ``mooncake`` receiver: :class:`pdplug.transfer.KVReceiverSession` over a
    Mooncake TransferEngine (``KVConfig.extra["protocol"]``: tcp or rdma); completion and
    failure arrive over the control channel.

    :param config: the rank's KVConfig (``role="decode"``).
    :param compat: handshake check (the plugin manager passes its ``check_compat``);
        ``None``: layout checks only.
    :param emit: room-outcome observer (the plugin manager passes its ``emit``); ``None``:
        no events.
    :raises ImportError: mooncake is not installed.
    """
    from pdplug_mooncake.engine import MooncakeEngine

    return KVReceiverSession(config, MooncakeEngine(config), compat=compat, emit=emit)
