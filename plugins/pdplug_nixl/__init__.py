"""Default pdplug plugin `pdplug_nixl`: entry-point module (imports nothing heavy).

Registered through the `pdplug` entry-point group like any third-party plugin.
"""

from __future__ import annotations

from collections.abc import Iterator

from pdplug import KVSenderSpec, hookimpl


@hookimpl(trylast=True)
def pdplug_register_kv_senders() -> Iterator[KVSenderSpec]:
    """Offer this package's components (see pdplug.hookspecs)."""
    yield KVSenderSpec(
        name="nixl",
        factory="pdplug_nixl.sender:make_sender",
        receiver_factory="pdplug_nixl.receiver:make_receiver",
        summary="NIXL (UCX) WRITEs with strict completion/failure notifications",
        capabilities=("async", "notifications"),
    )
