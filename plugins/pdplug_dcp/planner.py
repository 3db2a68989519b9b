"""Placeholder until the feature lands: fails loudly, never a silent stub."""

from __future__ import annotations

from typing import Any


def make_dcp_planner(*args: Any, **kwargs: Any) -> Any:
    """Not implemented yet: the 'dcp' pack planner (issue 4)."""
    raise NotImplementedError("pdplug_dcp 'dcp' pack planner (issue 4) is not implemented yet")


def make_tp_planner(*args: Any, **kwargs: Any) -> Any:
    """Not implemented yet: the 'tp' identity planner (issue 4)."""
    raise NotImplementedError("pdplug_dcp 'tp' identity planner (issue 4) is not implemented yet")
