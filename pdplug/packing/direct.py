"""Direct whole-page sends: a pair's :class:`pdplug.types.DirectPages` bound to one peer.

A KV sender binds the template its pack planner declared for a (prefill rank, decode rank) pair
to the two sides' entry bases once, at the first send to that peer, and then turns each
page-aligned chunk into absolute descriptors with two multiplications and two additions, with no
plan object and no per-run gather (issue 24: the fixed cost of a small send). What it computes
is exactly what ``PackPlanner.plan`` followed by :func:`pdplug.packing.plan_addresses` gives for
the same chunk (tested against it); any chunk it does not cover returns ``None`` and is planned
as before.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from pdplug.packing.pages import PageIds
from pdplug.types import DirectPages, PageGrid, SendChunk

__all__ = ["DirectRuns"]

#: int64 ``[R]`` absolute source addresses, destination addresses and lengths (bytes)
Runs = tuple[np.ndarray, np.ndarray, np.ndarray]
#: source and destination page ids (``P`` each: int64 ``[P]`` arrays, or lists of Python ints as
#: a sender's direct lane carries short ones) of one send and the tokens on its last page
Span = tuple[PageIds, PageIds, int]

#: run-length arrays kept per peer, one per (pages, tokens on the last page)
_LENGTHS_MAX = 64


class DirectRuns:
    """A :class:`~pdplug.types.DirectPages` template bound to one peer's memory.

    :param template: the pair's template (``PackPlanner.direct_pages``).
    :param src_base: int64 ``[E_src]`` base address of every source entry (bytes).
    :param dst_table: int64 ``[E_src]`` destination base address of every *source* entry's
        destination entry (``dst_entry_base[entry_map]``), as a sender keeps per peer.
    :raises ValueError: a template entry outside ``src_base``/``dst_table``.
    """

    def __init__(self, template: DirectPages, src_base: np.ndarray, dst_table: np.ndarray) -> None:
        ent = np.asarray(template.entries, dtype=np.int64)
        n = min(src_base.shape[0], dst_table.shape[0])
        if ent.shape[0] and (int(ent.min()) < 0 or int(ent.max()) >= n):
            raise ValueError(
                f"DirectPages.entries {template.entries} outside the {n} registered entries"
            )
        self.template = template
        # per entry, the address of page 0's first moved byte: a send adds its page offsets
        self._src = (np.asarray(src_base, dtype=np.int64)[ent] + template.src_offset)[:, None]
        self._dst = (np.asarray(dst_table, dtype=np.int64)[ent] + template.dst_offset)[:, None]
        self._lengths: dict[tuple[int, int], np.ndarray] = {}
        #: the engine's descriptor lists of :meth:`grid` (``TransferEngine.prepare_pages``), once
        #: a sender prepared them, and that engine; ``None``: sends post addresses
        self.lists: Any = None
        self.lists_of: Any = None
        #: that engine takes a short send's page ids as lists of Python ints
        #: (``TransferEngine.page_id_lists``); else they are handed to it as int64 arrays
        self.id_lists = False

    def runs(self, chunk: SendChunk) -> Runs | None:
        """Absolute int64 ``[E * P]`` ``(src_addr, dst_addr, length)`` of ``chunk`` (entry-major,
        one run per page and entry; ``length`` read-only), or ``None`` when the chunk does not
        start a page on both sides or has too few pages (the planner handles it).

        :param chunk: a chunk whose page ids a sender checked (int64 ``[n]``).
        """
        span = self.chunk_pages(chunk)
        return None if span is None else self.addresses(*span)

    def chunk_pages(self, chunk: SendChunk) -> Span | None:
        """The pages ``chunk`` moves: int64 ``[P]`` source and destination page ids (views)
        and the tokens on its last page; ``None`` as :meth:`runs`."""
        if chunk.rel_start != -1 or chunk.decode_prefix_len % self.template.page_size:
            return None
        return self._span(chunk.src_pages, chunk.dst_pages, chunk.src_page_offset, chunk.num_tokens)

    def segment_pages(
        self, token_start: int, num_tokens: int, src_pages: PageIds, dst_pages: PageIds,
        decode_prefix_len: int,
    ) -> Span | None:  # fmt: skip
        """:meth:`chunk_pages` of the chunk a segment ``[token_start, token_start +
        num_tokens)`` (tokens) makes for a destination holding ``decode_prefix_len`` tokens
        and ``dst_pages`` from there on, without making the chunk (a sender's direct lane);
        ``None`` wherever :func:`pdplug.packing.segment_to_chunk` and :meth:`runs` would not
        give runs (a start off a page boundary, too few pages).

        :param src_pages/dst_pages: page ids a sender checked (int64 ``[n]`` arrays or lists of
            Python ints; the span's are slices of the same kind).
        """
        ps = self.template.page_size
        rel = token_start - decode_prefix_len
        if rel < 0 or rel % ps or decode_prefix_len % ps:
            return None
        return self._span(src_pages, dst_pages, rel // ps, num_tokens)

    def _span(self, sp: PageIds, dp: PageIds, q0: int, n: int) -> Span | None:
        ps = self.template.page_size
        pages = -(-n // ps)
        if n <= 0 or q0 < 0 or len(sp) < pages or len(dp) < q0 + pages:
            return None
        return sp[:pages], dp[q0 : q0 + pages], n - (pages - 1) * ps

    def addresses(self, src_pages: PageIds, dst_pages: PageIds, tail: int) -> Runs:
        """Absolute int64 ``[E * P]`` runs of a :class:`Span` (``tail``: tokens on the last
        page)."""
        t = self.template
        src = np.add(self._src, np.multiply(src_pages, t.src_page_bytes)).reshape(-1)
        dst = np.add(self._dst, np.multiply(dst_pages, t.dst_page_bytes)).reshape(-1)
        return src, dst, self._length(len(src_pages), tail)

    def nbytes(self, pages: int, tail: int) -> int:
        """Bytes a span of ``pages`` pages with ``tail`` tokens on the last one moves."""
        t = self.template
        return self._src.shape[0] * ((pages - 1) * t.page_size + tail) * t.row_bytes

    def grid(self) -> PageGrid:
        """This template's pages in both sides' memory (for ``TransferEngine.prepare_pages``)."""
        t = self.template
        return PageGrid(
            src_first=tuple(self._src[:, 0].tolist()),
            dst_first=tuple(self._dst[:, 0].tolist()),
            src_stride=t.src_page_bytes,
            dst_stride=t.dst_page_bytes,
            run_bytes=t.page_size * t.row_bytes,
        )

    def _length(self, pages: int, tail: int) -> np.ndarray:
        key = (pages, tail)
        out = self._lengths.get(key)
        if out is None:
            t = self.template
            one = np.full(pages, t.page_size * t.row_bytes, dtype=np.int64)
            one[-1] = tail * t.row_bytes
            out = np.tile(one, self._src.shape[0])
            out.flags.writeable = False
            if len(self._lengths) >= _LENGTHS_MAX:
                self._lengths.clear()
            self._lengths[key] = out
        return out
