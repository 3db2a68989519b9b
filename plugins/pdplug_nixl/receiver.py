"""Factory of the ``nixl`` KV receiver (decode side)."""

from __future__ import annotations

from pdplug import KVConfig
from pdplug.transfer import Compat, KVReceiverSession


def make_receiver(config: KVConfig, *, compat: Compat | None = None) -> KVReceiverSession:
    """Build the ``nixl`` receiver: :class:`pdplug.transfer.KVReceiverSession` over a NIXL
    agent (completion tags arrive as NIXL notifications).

    :param compat: handshake check; default: the process-wide manager's ``check_compat``.
    :raises ImportError: NIXL is not installed.
    """
    from pdplug_nixl.engine import NixlEngine

    return KVReceiverSession(config, NixlEngine(config), compat=compat)
