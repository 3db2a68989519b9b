"""A rank's registered memory regions as text, for ``PeerInfo.extra["nixl_regions"]``.

A NIXL rank publishes the ``(address, nbytes)`` regions it registered so that a peer can
prepare descriptor lists of whole pages inside them (:mod:`pdplug_nixl.grid`); the text form
keeps ``PeerInfo.extra`` a flat string map on the wire.
"""

from __future__ import annotations

from collections.abc import Sequence

__all__ = ["format_regions", "parse_regions"]


def format_regions(regions: Sequence[tuple[int, int]]) -> str:
    """``(address, nbytes)`` regions as ``"addr:nbytes,…"`` (decimal bytes)."""
    return ",".join(f"{int(a)}:{int(n)}" for a, n in regions)


def parse_regions(text: str) -> list[tuple[int, int]]:
    """Inverse of :func:`format_regions` (``""``: no regions).

    :raises ValueError: a malformed item (not two non-negative decimal integers), named.
    """
    out = []
    for item in filter(None, text.split(",")):
        a, _, n = item.partition(":")
        try:
            addr, size = int(a), int(n)
        except ValueError:
            raise ValueError(f"region {item!r} is not address:nbytes") from None
        if addr < 0 or size < 0:
            raise ValueError(f"region {item!r} is negative")
        out.append((addr, size))
    return out
