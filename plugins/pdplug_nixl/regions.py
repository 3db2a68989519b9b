"""A rank's registered memory regions as text, for ``PeerInfo.extra["nixl_regions"]``.

A NIXL rank publishes the ``(address, nbytes)`` regions it registered so that a peer can
prepare descriptor lists of whole pages inside them (:mod:`pdplug_nixl.grid`); the text form
keeps ``PeerInfo.extra`` a flat string map on the wire.
"""

from __future__ import annotations

import re
from collections.abc import Sequence

__all__ = ["format_regions", "parse_regions"]

# ASCII digits, no leading zero, at most 20 (2**64 has 20): int() of a longer run costs
# quadratic time and, past 4,300 digits, raises without naming the item
_NUMBER = re.compile(r"0|[1-9][0-9]{0,19}")
_LIMIT = 1 << 64


def _shown(item: str) -> str:
    """``item`` for an error message: a peer's text, cut to 48 characters."""
    return repr(item) if len(item) <= 48 else f"{item[:48]!r}... ({len(item)} characters)"


def format_regions(regions: Sequence[tuple[int, int]]) -> str:
    """``(address, nbytes)`` regions as ``"addr:nbytes,…"`` (decimal bytes)."""
    return ",".join(f"{int(a)}:{int(n)}" for a, n in regions)


def parse_regions(text: str) -> list[tuple[int, int]]:
    """Inverse of :func:`format_regions` (``""``: no regions).

    Strict about form: each item is two runs of ASCII digits around one ``:``, without
    leading zeros, as :func:`format_regions` writes them; ``int()``'s leniencies (signs,
    spaces, ``_``, other scripts' digits), empty items, numbers of more than 20 digits, an
    address or size that does not fit 64 bits and a region that ends past 2**64 are refused.
    (Whether the regions are sensible for a grid is :mod:`pdplug_nixl.grid`'s check.)

    :raises ValueError: a malformed item, named (cut to 48 characters).
    """
    out = []
    for item in text.split(",") if text else ():
        a, sep, n = item.partition(":")
        if not (sep and _NUMBER.fullmatch(a) and _NUMBER.fullmatch(n)):
            raise ValueError(f"region {_shown(item)} is not address:nbytes (decimal digits)")
        addr, size = int(a), int(n)
        if addr >= _LIMIT or size >= _LIMIT:
            raise ValueError(f"region {_shown(item)}: address and nbytes must fit 64 bits")
        if addr + size > _LIMIT:
            raise ValueError(f"region {_shown(item)} ends past 2**64")
        out.append((addr, size))
    return out
