"""Placeholder until the feature lands: fails loudly, never a silent stub."""

from __future__ import annotations

from typing import Any


def make_ring(*args: Any, **kwargs: Any) -> Any:
    """Not implemented yet: pdplug_consensus 'ring' (issue 3: ring consensus baseline)."""
    raise NotImplementedError(
        "pdplug_consensus 'ring' (issue 3: ring consensus baseline) is not implemented yet"
    )
