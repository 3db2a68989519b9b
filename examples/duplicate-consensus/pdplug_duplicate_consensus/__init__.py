"""A plugin that reuses the default name ``pp0`` WITHOUT ``overrides=True``.

Installed next to pdplug, selecting ``pp0`` fails with a DuplicateComponentError that names
both distributions; ``pdplug plugins`` exits 1. Used by the integration tests.
"""

from __future__ import annotations

from collections.abc import Iterator

from pdplug import ConsensusSpec, hookimpl


@hookimpl
def pdplug_register_consensus() -> Iterator[ConsensusSpec]:
    """Offer a second ``pp0`` (undeclared duplicate)."""
    yield ConsensusSpec(
        name="pp0",
        factory="pdplug_duplicate_consensus:never_built",
        summary="undeclared duplicate of the default pp0 (refused)",
    )


def never_built(config: object) -> None:
    """Never reached: the manager refuses the duplicate name before building anything."""
    raise NotImplementedError("pdplug-duplicate-consensus is an example of a refused duplicate")
