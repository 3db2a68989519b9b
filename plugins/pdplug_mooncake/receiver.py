"""Factory of the ``mooncake`` KV receiver (decode side)."""

from __future__ import annotations

from pdplug import KVConfig
from pdplug.transfer import Compat, Emit, KVReceiverSession, default_emit


def make_receiver(
    config: KVConfig, *, compat: Compat | None = None, emit: Emit | None = default_emit
) -> KVReceiverSession:
    """Build the ``mooncake`` receiver: :class:`pdplug.transfer.KVReceiverSession` over a
    Mooncake TransferEngine; completion and failure arrive over the control channel.

    :param compat: handshake check; default: the process-wide manager's ``check_compat``.
    :param emit: room-outcome observer; default: the process-wide manager's ``emit``
        (``pdplug_on_event``); ``None`` disables.
    :raises ImportError: mooncake is not installed.
    """
    from pdplug_mooncake.engine import MooncakeEngine

    return KVReceiverSession(config, MooncakeEngine(config), compat=compat, emit=emit)
