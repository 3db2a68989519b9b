"""A direct template's pages as NIXL descriptor lists prepared once per peer, posted by page ids.

A KV sender that binds a pack planner's direct template to a decode peer
(:class:`pdplug.types.PageGrid`: per entry, where page 0 starts on both sides, the page strides
and the bytes of a whole page) asks the engine to prepare the descriptors of *every* page once
(``prep_xfer_dlist`` of compressed, strided rows: one row per entry, whatever the page count);
each send then posts ``make_prepped_xfer`` with page indices, two array additions per side,
instead of building two descriptor lists and an ``initialize_xfer`` per send (vLLM's
NixlConnector prepares its block lists the same way). A send's last page may move fewer bytes
than a whole page: each distinct last-page size gets its own pair of lists, prepared the first
time a send ends with it (whole pages and that tail; a page size bounds how many there are).

Index of page ``p`` of entry ``i`` in a list of kinds ``(whole, tail)``: ``(k * E + i) * C + p``
with ``k`` 0 for a whole page and 1 for the tail, ``E`` entries and ``C`` pages per entry on
that side (:func:`pages_in`). A page id at or beyond ``C`` would index another entry's page, so
:meth:`GridLists.request` refuses it (the sender then posts addresses, which NIXL checks).
NIXL takes its indices as int32: ``C`` is bounded so that every index fits (:data:`INDEX_MAX`;
pages beyond it go by addresses), and large sends hand NIXL int32 arrays, which it reads
without converting them.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

from pdplug.types import PageGrid

__all__ = ["GridLists", "pages_in"]

#: at most this many last-page sizes prepared per grid (each one more pair of lists)
MAX_TAILS = 256
#: a send of at most this many descriptors computes its indices as Python ints: numpy's
#: calls run cold (after the host's forward, or a CPU copy that emptied the caches) cost more
#: than a list of this many ints, measured in place up to here (README, "Fixed cost per
#: send"; issue 24)
LIST_MAX = 128
#: the largest index a list may hold: NIXL reads its indices as int32
INDEX_MAX = 2**31 - 1

_MAX = np.maximum.reduce


def pages_in(
    regions: Sequence[tuple[int, int]], first: Sequence[int], stride: int, run: int
) -> int:
    """Pages every entry holds whole: for each ``first`` address, how many runs of ``run``
    bytes spaced ``stride`` bytes apart from it lie inside the registered region holding it;
    the smallest over the entries (0 when one lies in no region).

    :param regions: ``(address, nbytes)`` registered regions of one side.
    """
    counts = []
    for f in first:
        inside = [a + n for a, n in regions if a <= f < a + n]
        end = max(inside) if inside else f
        counts.append(0 if end - f < run or stride <= 0 else (end - f - run) // stride + 1)
    return min(counts) if counts else 0


class GridLists:
    """One :class:`~pdplug.types.PageGrid`'s prepared lists toward one peer.

    :param agent: the ``nixl_agent``; ``peer_name``: the remote agent's name.
    :param grid: the template's pages on both sides.
    :param local/remote: ``(address, nbytes)`` registered regions of this rank and the peer.
    :param mem: ``"DRAM"``/``"VRAM"``; ``dev``: device id of every descriptor.
    :param local_lists: the engine's cache of local lists (shared by the peers of one grid).
    :raises ValueError: a side holds no whole page of some entry.
    """

    def __init__(
        self,
        agent: Any,
        peer_name: str,
        grid: PageGrid,
        local: Sequence[tuple[int, int]],
        remote: Sequence[tuple[int, int]],
        mem: str,
        dev: int,
        local_lists: dict[tuple[Any, ...], Any],
    ) -> None:
        e = len(grid.src_first)
        # two kinds (whole, tail) of every page of every entry must be int32-indexable: a peer
        # that declares huge regions gets lists of that many pages, its other pages go by address
        cap = INDEX_MAX // max(2 * e, 1)
        self.src_pages = min(pages_in(local, grid.src_first, grid.src_stride, grid.run_bytes), cap)
        self.dst_pages = min(pages_in(remote, grid.dst_first, grid.dst_stride, grid.run_bytes), cap)
        if e == 0 or e != len(grid.dst_first) or not self.src_pages or not self.dst_pages:
            raise ValueError(
                f"PageGrid: no whole page of every entry is registered on both sides "
                f"(source {self.src_pages} pages, destination {self.dst_pages})"
            )
        self._agent, self._peer, self._grid = agent, peer_name, grid
        self._mem, self._dev, self._local = mem, dev, local_lists
        self._entries = e
        # index of page 0 of each entry (whole pages); a tail adds E * C
        self._src0 = (np.arange(e, dtype=np.int32) * self.src_pages)[:, None]
        self._dst0 = (np.arange(e, dtype=np.int32) * self.dst_pages)[:, None]
        self._remote: dict[int, Any] = {}  # by last-page bytes (run_bytes: whole pages only)
        self._pairs: dict[int, tuple[Any, Any]] = {}  # (local, remote) by last-page bytes
        self.released = False

    def _rows(self, first: Sequence[int], stride: int, count: int, kinds: tuple[int, ...]) -> Any:
        out = np.empty((len(kinds), len(first), 5), dtype=np.uint64)
        out[:, :, 0] = np.asarray(first, dtype=np.uint64)
        out[:, :, 1] = np.asarray(kinds, dtype=np.uint64)[:, None]
        out[:, :, 2] = self._dev
        out[:, :, 3] = stride
        out[:, :, 4] = count
        return out.reshape(-1, 5)

    def lists(self, last_bytes: int) -> tuple[Any, Any] | None:
        """The (local, remote) prepared lists for sends whose last page moves ``last_bytes``;
        ``None`` once :data:`MAX_TAILS` sizes are prepared or after :meth:`release`.

        :raises Exception: NIXL refused a list.
        """
        pair = self._pairs.get(last_bytes)
        if pair is not None or self.released:
            return pair
        if len(self._remote) >= MAX_TAILS:
            return None
        g = self._grid
        kinds = (g.run_bytes,) if last_bytes == g.run_bytes else (g.run_bytes, last_bytes)
        key = (g.src_first, g.src_stride, self.src_pages, kinds)
        lh = self._local.get(key)
        if lh is None:
            rows = self._rows(g.src_first, g.src_stride, self.src_pages, kinds)
            lh = self._local[key] = self._agent.prep_xfer_dlist("NIXL_INIT_AGENT", rows, self._mem)
        rows = self._rows(g.dst_first, g.dst_stride, self.dst_pages, kinds)
        rh = self._remote[last_bytes] = self._agent.prep_xfer_dlist(self._peer, rows, self._mem)
        pair = self._pairs[last_bytes] = (lh, rh)
        return pair

    def request(
        self, src_pages: np.ndarray | list[int], dst_pages: np.ndarray | list[int],
        last_bytes: int,
    ) -> tuple[Any, Any, Any, Any] | None:  # fmt: skip
        """``(local list, local indices, remote list, remote indices)`` of a send of pages
        ``src_pages`` -> ``dst_pages`` (``P`` ids >= 0 each: int64 ``[P]`` arrays or lists of
        Python ints), entry-major, for
        ``make_prepped_xfer`` (indices as a list of Python ints up to :data:`LIST_MAX`, else an
        int32 ``[E * P]`` array); ``None`` when a page id lies beyond the pages the lists hold or
        no list can be had for ``last_bytes`` (the caller posts addresses).

        :raises ValueError: ``last_bytes`` outside ``(0, run_bytes]``.
        :raises Exception: NIXL refused a list.
        """
        run = self._grid.run_bytes
        if not 0 < last_bytes <= run:
            raise ValueError(f"post_pages: last_bytes={last_bytes} outside (0, {run}]")
        pair = self._pairs.get(last_bytes) or self.lists(last_bytes)
        if pair is None:
            return None
        e, cs, cd = self._entries, self.src_pages, self.dst_pages
        p = len(src_pages)
        if e * p <= LIST_MAX:
            # Python ints: the first numpy operation after a pause costs more than this
            # whole list (a send's fixed cost is a sum of such first uses; README)
            sl = src_pages if isinstance(src_pages, list) else src_pages.tolist()
            dl = dst_pages if isinstance(dst_pages, list) else dst_pages.tolist()
            if max(sl) >= cs or max(dl) >= cd:
                return None
            li, ri = sl, dl  # entry i: entry 0's ids + i * pages (map: no comprehension frame)
            for i in range(1, e):
                li = li + list(map((i * cs).__add__, sl))
                ri = ri + list(map((i * cd).__add__, dl))
            if last_bytes != run:  # the last page of each entry: the tail kind
                # one entry: the caller's own lists, if it passed lists, stay as they are
                li = li[:] if li is src_pages else li
                ri = ri[:] if ri is dst_pages else ri
                for k in range(p - 1, e * p, p):
                    li[k] += e * cs
                    ri[k] += e * cd
            return pair[0], li, pair[1], ri
        if int(_MAX(src_pages)) >= cs or int(_MAX(dst_pages)) >= cd:
            return None
        # int32 out (every id is below C, so every index fits): NIXL reads int32 arrays as they are
        la = np.add(self._src0, src_pages, dtype=np.int32, casting="same_kind")
        ra = np.add(self._dst0, dst_pages, dtype=np.int32, casting="same_kind")
        if last_bytes != run:
            la[:, -1] += e * cs
            ra[:, -1] += e * cd
        return pair[0], la.reshape(-1), pair[1], ra.reshape(-1)

    def release(self, release_dlist: Any) -> None:
        """Release the remote lists (the peer's agent is about to be removed); the local ones
        stay with the engine. Later :meth:`lists` calls return ``None``."""
        self.released = True
        self._pairs.clear()
        for rh in self._remote.values():
            release_dlist(rh)
        self._remote.clear()
