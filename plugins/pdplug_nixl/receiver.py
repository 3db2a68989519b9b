"""Factory of the ``nixl`` KV receiver (decode side)."""

from __future__ import annotations

from pdplug import KVConfig
from pdplug.transfer import Compat, Emit, KVReceiverSession


def make_receiver(
    config: KVConfig, *, compat: Compat | None = None, emit: Emit | None = None
) -> KVReceiverSession:
    """Build the ``nixl`` receiver: :class:`pdplug.transfer.KVReceiverSession` over a
    NIXL agent (UCX); completion tags arrive as NIXL notifications.

    :param config: the rank's KVConfig (``role="decode"``).
    :param compat: handshake check (the plugin manager passes its ``check_compat``);
        ``None``: layout checks only.
    :param emit: room-outcome observer (the plugin manager passes its ``emit``); ``None``:
        no events.
    :raises ImportError: NIXL is not installed.
    """
    from pdplug_nixl.engine import NixlEngine

    return KVReceiverSession(config, NixlEngine(config), compat=compat, emit=emit)
