"""Whole-page writes as indices into NIXL descriptor lists prepared once per peer (pure numpy).

NIXL can prepare a descriptor list once (``prep_xfer_dlist``) and make a request from indices
into it (``make_prepped_xfer``), which skips the per-request descriptor set-up and checks of
``initialize_xfer``; with NIXL's compressed (strided, ``N x 5``) lists a list of every page of
every registered region costs one row per region, whatever the number of pages. This module
turns a write's absolute runs into such indices.

Index space. A :class:`UnitSpace` cuts every registered region into ``unit``-byte units (the
greatest common divisor of both layouts' page bytes, so every whole page of every entry is a
whole number of units, whatever the entries' interleaving inside a region). A list prepared
for *kinds* ``(unit, t1, t2, …)`` (:meth:`UnitSpace.rows`) holds, for each kind ``j`` and
region ``r``, ``count[r]`` descriptors of ``kinds[j]`` bytes starting at each unit of the
region: kind 0 is a whole unit, a kind ``t < unit`` is the first ``t`` bytes of a unit (a
partial last page: the exact bytes, nothing past them). Descriptor ``(j, r, u)`` has index
``j * total + first[r] + u``.

A run maps (:func:`page_indices`; both sides looked up at once in a :class:`PairSpace`) when on
both sides it starts on a unit boundary inside a
registered region and ends inside that region: ``length // unit`` whole units, then, when
``length % unit`` is not 0, one descriptor of that kind. A write whose every run maps becomes
one request over one list pair; one that does not (a packed gather, a DCP relayout, runs not on
unit boundaries) keeps ``initialize_xfer``. Both move exactly the same bytes.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence

import numpy as np

__all__ = [
    "UnitSpace",
    "PairSpace",
    "page_indices",
    "page_unit",
    "parse_regions",
    "format_regions",
]

#: remote addresses are looked up shifted by this (both sides in one sorted table)
SIDE = 1 << 56
#: below every region: a run found there fails the check
_FLOOR = -(1 << 62)


def page_unit(page_bytes: Iterable[int]) -> int:
    """The unit of a peer pair: the greatest common divisor of every entry's page bytes of both
    layouts (``page_size * entry_bytes_per_token[e]``), in bytes; 0 for none."""
    g = 0
    for b in page_bytes:
        g = math.gcd(g, int(b))
    return g


def format_regions(regions: Sequence[tuple[int, int]]) -> str:
    """``(address, nbytes)`` regions as ``"addr:nbytes,…"`` (decimal), for ``PeerInfo.extra``."""
    return ",".join(f"{int(a)}:{int(n)}" for a, n in regions)


def parse_regions(text: str) -> list[tuple[int, int]]:
    """Inverse of :func:`format_regions`.

    :raises ValueError: a malformed item (not two non-negative integers).
    """
    out = []
    for item in filter(None, text.split(",")):
        a, _, n = item.partition(":")
        addr, size = int(a), int(n)
        if addr < 0 or size < 0:
            raise ValueError(f"region {item!r} is negative")
        out.append((addr, size))
    return out


class UnitSpace:
    """Registered regions cut into ``unit``-byte units (see the module docstring).

    :param regions: ``(address, nbytes)`` of every registered region (any order; overlapping
        regions are not expected: a run is placed in the region with the greatest start at or
        below it).
    :param unit: bytes per unit (> 0).
    :raises ValueError: ``unit`` <= 0.
    """

    def __init__(self, regions: Sequence[tuple[int, int]], unit: int) -> None:
        if unit <= 0:
            raise ValueError(f"UnitSpace: unit must be > 0, got {unit}")
        reg = sorted((int(a), int(n)) for a, n in regions if n > 0)
        self.unit = int(unit)
        self.start = np.array([a for a, _ in reg], dtype=np.int64)
        self.end = np.array([a + n for a, n in reg], dtype=np.int64)
        self.count = np.array([n // unit for _, n in reg], dtype=np.int64)
        self.first = np.concatenate([[0], np.cumsum(self.count)[:-1]]).astype(np.int64)
        self.total = int(self.count.sum())

    def rows(self, kinds: Sequence[int], device: int) -> np.ndarray:
        """uint64 ``[len(kinds) * regions, 5]``: NIXL's strided rows ``(address, bytes, device,
        stride, count)`` of a list prepared for ``kinds`` (``kinds[0]`` is :attr:`unit`)."""
        n = self.start.shape[0]
        out = np.empty((len(kinds), n, 5), dtype=np.uint64)
        out[:, :, 0] = self.start
        out[:, :, 1] = np.asarray(kinds, dtype=np.uint64)[:, None]
        out[:, :, 2] = device
        out[:, :, 3] = self.unit
        out[:, :, 4] = self.count
        return out.reshape(-1, 5)


class PairSpace:
    """Both sides of a peer pair in one lookup table: the local regions, then the remote ones
    with addresses shifted by :data:`SIDE` (so one ``searchsorted`` places a write's sources
    and destinations together).

    :param local/remote: the two sides' :class:`UnitSpace` (same unit).
    :raises ValueError: the units differ, or a region lies at or above :data:`SIDE`.
    """

    def __init__(self, local: UnitSpace, remote: UnitSpace) -> None:
        if local.unit != remote.unit:
            raise ValueError(f"PairSpace: units differ ({local.unit} != {remote.unit})")
        for sp in (local, remote):
            if sp.end.shape[0] and int(sp.end.max()) >= SIDE:
                raise ValueError(f"PairSpace: a region ends at or above {SIDE:#x}")
        self.local, self.remote, self.unit = local, remote, local.unit
        # index r of searchsorted(start, x, "right") is the region at or below x, shifted by one
        # (slot 0: below every region, no units)
        self.start = np.concatenate([local.start, remote.start + SIDE])
        # rows (start, count, first) of every region, gathered for a write's runs at once
        self.table = np.stack(
            [
                np.concatenate([[_FLOOR], self.start]),
                np.concatenate([[0], local.count, remote.count]),
                np.concatenate([[0], local.first, remote.first]),
            ]
        )


def page_indices(
    pair: PairSpace, src: np.ndarray, dst: np.ndarray, length: np.ndarray
) -> tuple[np.ndarray, np.ndarray, tuple[int, ...]] | None:
    """Indices of a write's runs in the local and remote lists prepared for ``kinds``, and the
    partial kinds those lists need (``kinds = (unit, *partial)``); ``None`` when a run does not
    map (then the write keeps ``initialize_xfer``).

    :param pair: the two sides' regions (:class:`PairSpace`).
    :param src/dst/length: int64 ``[R]`` absolute run addresses and bytes (> 0).
    :returns: ``(local_idx, remote_idx, partial)``: int64 ``[D]`` indices, one per whole unit
        and per partial tail, in run order; ``partial``: the sorted distinct tail sizes (bytes).
    """
    n = length.shape[0]
    if n == 0:
        return None
    unit = pair.unit
    x = np.concatenate((src, dst))
    x[n:] += SIDE
    t = pair.table[:, pair.start.searchsorted(x, "right")]  # (start, count, first) per run
    u, rem = np.divmod(x - t[0], unit)
    if (length == unit).all():  # the commonest write: one whole unit per run
        # on a unit boundary (rem 0), and that unit inside its region (u < count)
        if int(np.minimum(t[1] - u, 1 - rem).min()) < 1:
            return None
        idx = t[2] + u
        return idx[:n], idx[n:], ()
    whole, tail = np.divmod(length, unit)
    per_run = whole + (tail > 0)  # descriptors of each run
    slack = t[1] - u
    slack[:n] -= per_run
    slack[n:] -= per_run
    # every run on a unit boundary (rem 0) with all its units in its region (slack >= 0)
    if int(np.minimum(slack, -rem).min()) < 0:
        return None
    idx = t[2] + u
    li, ri = idx[:n], idx[n:]
    tails = set(tail.tolist())
    tails.discard(0)
    partial = tuple(sorted(tails))
    kind = np.zeros(n, dtype=np.int64)
    if partial:
        has = tail > 0
        kind[has] = np.searchsorted(np.asarray(partial, dtype=np.int64), tail[has]) + 1
    if int(per_run.max()) == 1:  # each run one whole unit or one partial tail
        return li + kind * pair.local.total, ri + kind * pair.remote.total, partial
    run = np.repeat(np.arange(n), per_run)
    pos = np.arange(run.shape[0]) - np.repeat(np.cumsum(per_run) - per_run, per_run)
    # the tail is the last descriptor of its run: kind > 0 there, 0 for the whole units
    k = np.where(pos < whole[run], 0, kind[run])
    return (
        k * pair.local.total + li[run] + pos,
        k * pair.remote.total + ri[run] + pos,
        partial,
    )
