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

import numpy as np

from pdplug.types import DirectPages, SendChunk

__all__ = ["DirectRuns"]

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

    def runs(self, chunk: SendChunk) -> tuple[np.ndarray, np.ndarray, np.ndarray] | None:
        """Absolute int64 ``[E * P]`` ``(src_addr, dst_addr, length)`` of ``chunk`` (entry-major,
        one run per page and entry; ``length`` read-only), or ``None`` when the chunk does not
        start a page on both sides or has too few pages (the planner handles it).

        :param chunk: a chunk whose page ids a sender checked (int64 ``[n]``).
        """
        t = self.template
        ps, n = t.page_size, chunk.num_tokens
        q0 = chunk.src_page_offset
        if chunk.rel_start != -1 or chunk.decode_prefix_len % ps or n <= 0 or q0 < 0:
            return None
        pages = -(-n // ps)
        sp, dp = chunk.src_pages, chunk.dst_pages
        if sp.shape[0] < pages or dp.shape[0] < q0 + pages:
            return None
        src = np.add(self._src, np.multiply(sp[:pages], t.src_page_bytes)).reshape(-1)
        dst = np.add(self._dst, np.multiply(dp[q0 : q0 + pages], t.dst_page_bytes)).reshape(-1)
        return src, dst, self._length(pages, n - (pages - 1) * ps)

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
