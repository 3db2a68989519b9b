"""Factory of the ``nixl`` KV receiver (decode side)."""

from __future__ import annotations

from pdplug import KVConfig
from pdplug.transfer import Compat, Emit, KVReceiverSession, default_emit


def make_receiver(
    config: KVConfig, *, compat: Compat | None = None, emit: Emit | None = default_emit
) -> KVReceiverSession:
    """Build the ``nixl`` receiver: :class:`pdplug.transfer.KVReceiverSession` over a NIXL
    agent (completion tags arrive as NIXL notifications).

    :param compat: handshake check; default: the process-wide manager's ``check_compat``.
    :param emit: room-outcome observer; default: the process-wide manager's ``emit``
        (``pdplug_on_event``); ``None`` disables.
    :raises ImportError: NIXL is not installed.
    """
    from pdplug_nixl.engine import NixlEngine

    return KVReceiverSession(config, NixlEngine(config), compat=compat, emit=emit)
