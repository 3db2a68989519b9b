"""Fixtures of the transfer tests: ``backend`` runs a test once per KV backend (NIXL, Mooncake);
a missing backend skips, or fails when ``PDPLUG_REQUIRE`` lists it."""

from __future__ import annotations

import pytest


@pytest.fixture(
    params=[
        pytest.param("nixl", marks=pytest.mark.nixl),
        pytest.param("mooncake", marks=pytest.mark.mooncake),
    ]
)
def backend(request: pytest.FixtureRequest) -> str:
    """The KV backend under test."""
    return str(request.param)
