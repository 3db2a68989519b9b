"""Entry-point module of the example override: imports only pdplug's public API, nothing heavy.

It offers a consensus named ``pp0`` and declares ``overrides=True``, so it replaces the default
``pp0`` of the ``pdplug`` distribution instead of colliding with it. Without the declaration the
manager would refuse both with an error naming the two distributions.
"""

from __future__ import annotations

from collections.abc import Iterator

from pdplug import ConsensusSpec, hookimpl


@hookimpl
def pdplug_register_consensus() -> Iterator[ConsensusSpec]:
    """Offer ``pp0``: the default pp0, wrapped to log every decision (see :mod:`.wrapper`)."""
    yield ConsensusSpec(
        name="pp0",
        factory="pdplug_logging_consensus.wrapper:make_logging_pp0",
        summary="default pp0, logging every vote and decision",
        overrides=True,
    )
