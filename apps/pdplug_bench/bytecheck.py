"""Byte checks of the transfer benchmarks: digests of the KV rows a send moved, computed on
the prefill side from the source and on the decode side from what landed.

A send of chunk tokens ``0 .. T - 1`` to decode DCP rank ``r`` of ``D`` moves tokens
``r, r + D, ...`` (SGLang ``build_dcp_token_transfer_plan``, PRs #35762 / #40376): token ``i``
sits in source page ``src_pages[i // Ps]`` at row ``i % Ps`` and lands in destination page
``dst_pages[(i // D) // Pd]`` at row ``(i // D) % Pd``. Both sides hash the rows of every
entry, entry by entry (BLAKE2b, 16 bytes), so a digest matches only if every byte landed where
the plan says. Before a checked run the decode side fills the pages it expects with a poison
byte, so bytes left over from an earlier run cannot pass for this one.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from typing import Any

import numpy as np

__all__ = ["dcp_tokens", "src_rows", "dst_rows", "rows_digest", "POISON"]

#: the byte the decode side writes into expected pages before a checked run
POISON = 0x5A


def dcp_tokens(total: int, rank: int, dcp: int) -> int:
    """Tokens of ``total`` chunk tokens that decode DCP rank ``rank`` of ``dcp`` receives."""
    return max(0, (total - rank + dcp - 1) // dcp)


def src_rows(src_pages: Sequence[int] | np.ndarray, page: int, total: int, rank: int = 0,
             dcp: int = 1) -> np.ndarray:  # fmt: skip
    """Source token rows (int64 ``[n]``, rows of ``page``-token pages) of the tokens that DCP
    rank ``rank`` of ``dcp`` receives from a send of chunk tokens ``0 .. total - 1``."""
    tok = rank + dcp * np.arange(dcp_tokens(total, rank, dcp), dtype=np.int64)
    pages = np.asarray(src_pages, dtype=np.int64)
    return pages[tok // page] * page + tok % page


def dst_rows(dst_pages: Sequence[int] | np.ndarray, page: int, n: int) -> np.ndarray:
    """Destination token rows (int64 ``[n]``) of a rank's local tokens ``0 .. n - 1`` stored in
    ``dst_pages`` of ``page`` tokens."""
    loc = np.arange(n, dtype=np.int64)
    pages = np.asarray(dst_pages, dtype=np.int64)
    return pages[loc // page] * page + loc % page


def rows_digest(entries: Sequence[Any], rows: np.ndarray) -> str:
    """Hex BLAKE2b-128 of ``entries[e][rows]`` for every entry in order.

    :param entries: 2-D ``[rows, bytes per token]`` uint8 tensors or arrays (torch on CPU or
        numpy).
    :param rows: int64 ``[n]`` token rows.
    """
    h = hashlib.blake2b(digest_size=16)
    for t in entries:
        a = t.numpy() if hasattr(t, "numpy") else np.asarray(t)
        h.update(np.ascontiguousarray(a[rows]).data)
    return h.hexdigest()
