"""Placeholder until the feature lands: fails loudly, never a silent stub."""

from __future__ import annotations

from typing import Any


def make_receiver(*args: Any, **kwargs: Any) -> Any:
    """Not implemented yet: pdplug_mooncake 'mooncake' receiver (issue 5: KV transfer)."""
    raise NotImplementedError(
        "pdplug_mooncake 'mooncake' receiver (issue 5: KV transfer) is not implemented yet"
    )
