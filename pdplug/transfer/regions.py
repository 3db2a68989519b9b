"""Which pack region a job may take: one pool per prefill rank, shared fairly by its peers.

Every region of a pack buffer has the same size (:func:`pdplug.packing.pack_regions`), so any
free region can serve a job for any destination. Two bounds keep one decode peer from starving
the others (a peer whose writes are slow or stuck keeps its regions until they complete, and a
region is never taken back from a write the engine still reports in flight):

* a peer (one decode rank) holds at most ``depth`` regions (double buffering, as when regions
  were fixed per destination rank);
* while ``n`` groups (decode instances) hold or want regions, a group holds at most
  ``max(depth, min(ceil(total / n), total - depth))``, so a stuck instance leaves the others
  their share; and ``total - depth`` even alone: a region is never taken back from a write the
  engine still reports in flight, so an instance that took every region while alone and whose
  writes then stuck (a partition) would starve every instance after it (issue 23, bench
  cluster scenario 3). The pack buffer has ``depth`` regions more than its destination ranks
  need for that reserve (:func:`make_pack_buffer`).
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Hashable
from typing import TYPE_CHECKING

import numpy as np

from pdplug.config import KVConfig
from pdplug.packing import pack_buffer_nbytes, pack_bytes_per_token, pack_regions
from pdplug.types import PackRegion

if TYPE_CHECKING:
    import torch

__all__ = ["RegionPool", "make_pack_buffer"]


def make_pack_buffer(cfg: KVConfig) -> tuple[torch.Tensor | None, list[PackRegion]]:
    """Allocate a prefill rank's pack buffer and cut it into regions.

    The buffer holds ``(max_dst_dcp + 1) * pack_depth`` regions: every rank of the widest
    decode double-buffered, plus one rank's worth that :class:`RegionPool` keeps for another
    decode instance.

    :param cfg: the sender's config: its layout, ``pack_region_tokens``, ``max_dst_dcp``,
        ``pack_depth`` and ``device``.
    :returns: ``(buffer, regions)``: a uint8 tensor ``[nbytes]`` on ``cfg.device``
        (:func:`pdplug.packing.pack_buffer_nbytes`) and its regions
        (:func:`pdplug.packing.pack_regions`); ``(None, [])`` when the layout never needs
        relayout (no packed bytes per token).
    :raises RuntimeError: the device cannot allocate the buffer (from torch).
    """
    import torch

    lay = cfg.layout
    if pack_bytes_per_token(lay) <= 0:
        return None, []
    kw = dict(dst_dcp_size=cfg.max_dst_dcp + 1, depth=cfg.pack_depth)
    nb = pack_buffer_nbytes(lay, region_tokens=cfg.pack_region_tokens, **kw)
    buf = torch.empty(nb, dtype=torch.uint8, device=cfg.device)
    return buf, list(pack_regions(lay, region_tokens=cfg.pack_region_tokens, **kw))


class RegionPool:
    """Free/busy state of ``total`` pack regions and who holds them.

    :param total: number of regions (0 without a pack buffer).
    :param depth: ``KVConfig.pack_depth``: regions a peer may hold per destination rank.
    """

    def __init__(self, total: int, depth: int) -> None:
        self.busy = np.zeros(total, dtype=bool)
        self.depth = depth
        self._free = list(range(total - 1, -1, -1))
        self._by_peer: Counter[Hashable] = Counter()
        self._by_group: Counter[Hashable] = Counter()

    @property
    def total(self) -> int:
        """Number of regions."""
        return int(self.busy.shape[0])

    def held(self, peer: Hashable) -> int:
        """Regions ``peer`` holds now."""
        return self._by_peer[peer]

    def groups(self) -> set[Hashable]:
        """Groups holding at least one region."""
        return set(self._by_group)

    def take(self, peer: Hashable, group: Hashable, wanting: int) -> int:
        """A free region for a job of ``peer`` (of ``group``), or -1 when none may be taken
        now (pool empty, or a bound of the module docstring).

        :param wanting: groups that hold or wait for regions now (``group`` included).
        """
        if not self._free or self._by_peer[peer] >= self.depth:
            return -1
        share = min(-(-self.total // max(1, wanting)), self.total - self.depth)
        if self._by_group[group] >= max(self.depth, share):
            return -1
        region = self._free.pop()
        self.busy[region] = True
        self._by_peer[peer] += 1
        self._by_group[group] += 1
        return region

    def give_back(self, region: int, peer: Hashable, group: Hashable) -> None:
        """Free ``region`` (its write completed or failed, or it was never posted)."""
        if region < 0 or not self.busy[region]:
            return
        self.busy[region] = False
        self._free.append(region)
        for counter, k in ((self._by_peer, peer), (self._by_group, group)):
            counter[k] -= 1
            if counter[k] <= 0:
                del counter[k]
