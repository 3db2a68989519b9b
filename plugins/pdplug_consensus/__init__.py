"""Default pdplug plugin `pdplug_consensus`: entry-point module (imports nothing heavy).

Registered through the `pdplug` entry-point group like any third-party plugin.
"""

from __future__ import annotations

from collections.abc import Iterator

from pdplug import ConsensusSpec, hookimpl


@hookimpl(trylast=True)
def pdplug_register_consensus() -> Iterator[ConsensusSpec]:
    """Offer this package's components (see pdplug.hookspecs)."""
    yield ConsensusSpec(
        name="pp0",
        factory="pdplug_consensus.pp0:make_pp0",
        summary="PP0-centric: ranks push votes to PP0; PP0 decides and fans out (1 hop in, 1 out)",
    )
    yield ConsensusSpec(
        name="ring",
        factory="pdplug_consensus.ring:make_ring",
        summary="ring intersection baseline (2P-1 hops, one per loop iteration)",
    )
