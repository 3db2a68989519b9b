"""Factory of the ``mooncake`` KV receiver (decode side)."""

from __future__ import annotations

from pdplug import KVConfig
from pdplug.transfer import Compat, KVReceiverSession


def make_receiver(config: KVConfig, *, compat: Compat | None = None) -> KVReceiverSession:
    """Build the ``mooncake`` receiver: :class:`pdplug.transfer.KVReceiverSession` over a
    Mooncake TransferEngine; completion and failure arrive over the control channel.

    :param compat: handshake check; default: the process-wide manager's ``check_compat``.
    :raises ImportError: mooncake is not installed.
    """
    from pdplug_mooncake.engine import MooncakeEngine

    return KVReceiverSession(config, MooncakeEngine(config), compat=compat)
