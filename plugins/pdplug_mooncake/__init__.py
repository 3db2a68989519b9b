"""Default pdplug plugin `pdplug_mooncake`: entry-point module (imports nothing heavy).

Registered through the `pdplug` entry-point group like any third-party plugin.
"""

from __future__ import annotations

from collections.abc import Iterator

from pdplug import KVSenderSpec, hookimpl


@hookimpl(trylast=True)
def pdplug_register_kv_senders() -> Iterator[KVSenderSpec]:
    """Offer this package's components (see pdplug.hookspecs)."""
    yield KVSenderSpec(
        name="mooncake",
        factory="pdplug_mooncake.sender:make_sender",
        receiver_factory="pdplug_mooncake.receiver:make_receiver",
        summary="Mooncake TransferEngine batch writes (P2P handshake), completion over ZMQ",
        capabilities=("sync",),
    )
