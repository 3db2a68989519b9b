"""Send splitting at ``min(grid, pack capacity)``.

Rules (SGLang ``compute_grid_segments`` / staging grid, PRs #30545 and #40376), in tokens:

* cut points sit at ``decode_prefix_len + k * cut`` with ``cut = min(grid, capacity)``,
  ``grid = max(1, chunk_size // page_size) * page_size``; cuts are absolute, so later sends of
  the same request stay on the same grid;
* the grid starts at ``decode_prefix_len``, which lies on the decode side's virtual page (the
  receiver checks it), not necessarily on a prefill page: when the prefill page is larger than
  the decode virtual page (a page-size ratio) every cut sits on a multiple of
  ``gcd(page_size, decode virtual page)`` tokens, inside a prefill page, and the segment's
  chunk starts mid-page (:func:`pdplug.packing.segment_to_chunk` sets ``rel_start``);
* a non-last send ends whole pages after ``decode_prefix_len`` (the rest is held back for the
  next send);
  the final segment of the last send carries the exact count of a partial last page;
* only the final segment of the last send has ``is_last`` (state and metadata ride on it);
  a last send with no tokens still yields one empty segment (metadata-only chunk);
* ``capacity_tokens=None`` (peer needs no relayout, e.g. plain TP) never splits.
"""

from __future__ import annotations

import numpy as np

from pdplug.types import Segment

__all__ = ["grid_tokens", "split_send"]


def grid_tokens(chunk_size: int, page_size: int) -> int:
    """The split grid: ``max(1, chunk_size // page_size) * page_size`` tokens (SGLang
    ``staging_grid_tokens``).

    :raises ValueError: ``chunk_size`` or ``page_size`` is not positive.
    """
    if chunk_size <= 0 or page_size <= 0:
        raise ValueError(
            f"grid needs chunk_size > 0 and page_size > 0, got {chunk_size} and {page_size}"
        )
    return max(1, chunk_size // page_size) * page_size


def split_send(
    *,
    token_start: int,
    token_end: int,
    decode_prefix_len: int,
    is_last_send: bool,
    capacity_tokens: int | None,
    page_size: int,
    grid: int,
    first_chunk_id: int = 0,
) -> list[Segment]:
    """Split the send of tokens ``[token_start, token_end)`` into segments.

    :param token_start: first token (>= ``decode_prefix_len``, whole pages after it).
    :param token_end: end token of the send (exclusive); a non-last send is floored to a page.
    :param decode_prefix_len: tokens decode already holds (the grid origin; a multiple of the
        decode virtual page, which may be smaller than ``page_size``).
    :param is_last_send: whether this send ends the request.
    :param capacity_tokens: largest segment the peer's pack regions take (tokens;
        ``pdplug.packing.send_capacity_tokens``), floored to whole pages; None = no split.
    :param page_size: source page size (tokens).
    :param grid: split grid (tokens, a multiple of ``page_size``; :func:`grid_tokens`).
    :param first_chunk_id: ``chunk_id`` of the first segment; the rest count up.
    :returns: segments in order; ``[]`` for a non-last send with no whole page.
    :raises ValueError: naming the bad value (negative prefix, start not whole pages after the
        prefix, end before start, grid not a page multiple, capacity below one page).
    """
    if page_size <= 0 or grid <= 0 or grid % page_size:
        raise ValueError(f"grid={grid} must be a positive multiple of page_size={page_size}")
    if decode_prefix_len < 0:
        raise ValueError(f"decode_prefix_len={decode_prefix_len} must be >= 0")
    if token_start < decode_prefix_len or (token_start - decode_prefix_len) % page_size:
        raise ValueError(
            f"token_start={token_start} must be >= decode_prefix_len={decode_prefix_len} and "
            f"whole pages after it (page_size={page_size})"
        )
    if token_end < token_start:
        raise ValueError(f"token_end={token_end} is before token_start={token_start}")
    if first_chunk_id < 0:
        raise ValueError(f"first_chunk_id={first_chunk_id} must be >= 0")
    end = token_end
    if not is_last_send:
        end = token_start + (token_end - token_start) // page_size * page_size
        if end == token_start:
            return []
    if capacity_tokens is None:
        bounds = np.array([token_start, end], dtype=np.int64)
    else:
        cap = capacity_tokens // page_size * page_size
        if cap <= 0:
            raise ValueError(
                f"capacity_tokens={capacity_tokens} is below one page (page_size={page_size})"
            )
        cut = min(grid, cap)
        base = decode_prefix_len
        k0 = (token_start - base) // cut + 1
        k1 = -(-(end - base) // cut)  # first cut at or after end
        inner = base + cut * np.arange(k0, k1, dtype=np.int64)
        bounds = np.concatenate(([token_start], inner, [end]))
    starts, ends = bounds[:-1].tolist(), bounds[1:].tolist()
    last = len(starts) - 1
    return [
        Segment(
            token_start=s,
            token_end=e,
            page_start=(s - token_start) // page_size,
            num_tokens=e - s,
            chunk_id=first_chunk_id + i,
            is_last=is_last_send and i == last,
        )
        for i, (s, e) in enumerate(zip(starts, ends))
    ]
