"""Placeholder until the feature lands: fails loudly, never a silent stub."""

from __future__ import annotations

from typing import Any


def make_pp0(*args: Any, **kwargs: Any) -> Any:
    """Not implemented yet: pdplug_consensus 'pp0' (issue 3: PP0-centric consensus)."""
    raise NotImplementedError(
        "pdplug_consensus 'pp0' (issue 3: PP0-centric consensus) is not implemented yet"
    )
