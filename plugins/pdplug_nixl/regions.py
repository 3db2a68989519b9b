"""A rank's registered memory regions as text, for ``PeerInfo.extra["nixl_regions"]``.

A NIXL rank publishes the ``(address, nbytes)`` regions it registered so that a peer can
prepare descriptor lists of whole pages inside them (:mod:`pdplug_nixl.grid`); the text form
keeps ``PeerInfo.extra`` a flat string map on the wire.
"""

from __future__ import annotations

import re
from collections.abc import Sequence

__all__ = ["format_regions", "parse_regions"]

_DIGITS = re.compile(r"[0-9]+")


def format_regions(regions: Sequence[tuple[int, int]]) -> str:
    """``(address, nbytes)`` regions as ``"addr:nbytes,…"`` (decimal bytes)."""
    return ",".join(f"{int(a)}:{int(n)}" for a, n in regions)


def parse_regions(text: str) -> list[tuple[int, int]]:
    """Inverse of :func:`format_regions` (``""``: no regions).

    Strict: each item is exactly two runs of ASCII digits around one ``:`` (what
    :func:`format_regions` writes); ``int()``'s leniencies (signs, spaces, ``_``, other
    scripts' digits) are refused, so a peer's text is either what a pdplug rank wrote or
    rejected.

    :raises ValueError: a malformed item (not two non-negative decimal integers), named.
    """
    out = []
    for item in filter(None, text.split(",")):
        a, sep, n = item.partition(":")
        if not (sep and _DIGITS.fullmatch(a) and _DIGITS.fullmatch(n)):
            raise ValueError(f"region {item!r} is not address:nbytes (decimal digits)")
        out.append((int(a), int(n)))
    return out
