"""Factory of the ``mooncake`` KV sender (prefill side)."""

from __future__ import annotations

from pdplug import KVConfig, PackPlanner
from pdplug.protocols import Packer
from pdplug.transfer import Compat, Emit, KVSenderSession, default_emit


def make_sender(
    config: KVConfig,
    planner: PackPlanner,
    packer: Packer | None = None,
    *,
    compat: Compat | None = None,
    emit: Emit | None = default_emit,
) -> KVSenderSession:
    """Build the ``mooncake`` sender: :class:`pdplug.transfer.KVSenderSession` over a Mooncake
    TransferEngine (``KVConfig.extra["protocol"]``: ``"tcp"`` default, ``"rdma"``).

    :param compat: handshake check; default: the process-wide manager's ``check_compat``.
    :param emit: room-outcome observer; default: the process-wide manager's ``emit``
        (``pdplug_on_event``); ``None`` disables.
    :raises ImportError: mooncake is not installed.
    """
    from pdplug_mooncake.engine import MooncakeEngine

    return KVSenderSession(
        config, planner, packer, MooncakeEngine(config), compat=compat, emit=emit
    )
