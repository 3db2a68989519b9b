"""Segment to chunk: the :class:`pdplug.types.SendChunk` a planner reads for a scheduler segment.

:func:`segment_to_chunk` cuts a send's page list to the pages one
:class:`pdplug.types.Segment` occupies and places it on the decode side (``rel_start`` when it
starts inside a page); :func:`segment_chunks` builds one chunk per destination, sharing one
object between destinations that declared the same pages, as a KV sender does.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

from pdplug.packing.pages import page_array
from pdplug.types import Segment, SendChunk, pages_from_bytes

__all__ = ["segment_to_chunk", "segment_chunks"]


def pages_spanned(token_start: int, num_tokens: int, page_size: int) -> int:
    """Source pages a segment of ``num_tokens`` tokens from ``token_start`` spans, counted from
    the page holding its first token (what ``src_pages`` must hold at least; 0 for no token)."""
    return -(-(token_start % page_size + num_tokens) // page_size) if num_tokens else 0


def segment_to_chunk(
    room: int,
    segment: Segment,
    src_pages: np.ndarray,
    dst_pages: np.ndarray,
    decode_prefix_len: int,
    page_size: int,
    checked: bool = False,
) -> SendChunk:
    """The :class:`SendChunk` a planner needs for one scheduler :class:`Segment`.

    :param src_pages: int64 source page ids from the page holding the segment's first token on
        (as ``KVSender.send`` receives them; from a whole send's list pass
        ``send_pages[segment.token_start // page_size:]``). Only the pages the segment's tokens
        occupy are kept.
    :param dst_pages: int64 destination (virtual) page ids from ``decode_prefix_len`` on.
    :param decode_prefix_len: tokens decode already holds (tokens).
    :param page_size: source page size (tokens). A segment may start inside a source page
        when the decode side's page differs (then ``rel_start`` is set).
    :param checked: both page arrays are int64 ``[n]`` ids already checked by
        :func:`page_array` (a sender's own copies): not checked again.
    :raises ValueError: the segment starts before ``decode_prefix_len``, or ``src_pages`` is
        too short; :func:`page_array`'s errors (``PlanError``) for ids that are not 1-D
        integers in ``[0, 2**40)``.
    """
    start, n = segment.token_start, segment.num_tokens
    rel = start - decode_prefix_len
    if rel < 0:
        raise ValueError(
            f"segment.token_start={start} must be >= decode_prefix_len={decode_prefix_len}"
        )
    if page_size <= 0:
        raise ValueError(f"page_size={page_size} must be > 0")
    skip = start % page_size
    need = pages_spanned(start, n, page_size)
    pages = src_pages if checked else page_array(src_pages, "src_pages", room)
    if pages.shape[0] < need:
        raise ValueError(
            f"segment of {n} tokens from in-page offset {skip} needs {need} "
            f"source pages (page_size={page_size}), got {pages.shape[0]}"
        )
    aligned = not rel % page_size and not decode_prefix_len % page_size
    return SendChunk(
        room=room,
        src_pages=pages[:need],
        dst_pages=dst_pages if checked else page_array(dst_pages, "dst_pages", room),
        decode_prefix_len=decode_prefix_len,
        src_page_offset=rel // page_size,
        num_tokens=n,
        chunk_id=segment.chunk_id,
        is_last=segment.is_last,
        rel_start=-1 if aligned else rel,
    )


def segment_chunks(
    room: int,
    segment: Segment,
    src_pages: np.ndarray,
    dests: Sequence[tuple[bytes | np.ndarray, int]],
    page_size: int,
) -> list[SendChunk]:
    """One :class:`SendChunk` per destination for one segment, as a KV sender builds them:
    destinations that declared the same ``(dst_pages, decode_prefix_len)`` share one chunk
    object (the DCP and TP ranks of one decode instance hold a request in the same block ids),
    so planners tell equal chunks apart by identity instead of comparing page lists.

    :param src_pages: as :func:`segment_to_chunk`.
    :param dests: per destination, its page ids and its ``decode_prefix_len`` (tokens). Page
        ids are wire bytes (:func:`pdplug.types.pages_to_bytes`: int64 little-endian; equal
        bytes share a chunk), or int64 arrays already checked by :func:`page_array` with
        ``src_pages`` checked too (a sender's own; one array object shares a chunk).
    :param page_size: source page size (tokens).
    :raises ValueError: as :func:`segment_to_chunk`; page bytes not a multiple of 8.
    """
    made: dict[Any, SendChunk] = {}
    out = []
    for pages, prefix in dests:
        arrays = isinstance(pages, np.ndarray)
        key = (id(pages) if arrays else pages, prefix)
        chunk = made.get(key)
        if chunk is None:
            dst = pages if isinstance(pages, np.ndarray) else pages_from_bytes(pages)
            chunk = made[key] = segment_to_chunk(
                room, segment, src_pages, dst, prefix, page_size, checked=arrays
            )
        out.append(chunk)
    return out
