"""Placeholder until the feature lands: fails loudly, never a silent stub."""

from __future__ import annotations

from typing import Any


def make_scheduler(*args: Any, **kwargs: Any) -> Any:
    """Not implemented yet: scheduler 'default' (issue 4: send splitting, dynamic chunking)."""
    raise NotImplementedError(
        "scheduler 'default' (issue 4: send splitting, dynamic chunking) is not implemented yet"
    )
