"""The rich Console the reference host's reports print to."""

from __future__ import annotations

import shutil
from typing import Any

__all__ = ["console"]


def console() -> Any:
    """A rich Console that keeps tables readable when output is a pipe or a CI log (at least
    120 columns instead of rich's 80-column fallback)."""
    from rich.console import Console

    return Console(width=max(120, shutil.get_terminal_size((120, 24)).columns))
