"""Tile choice of the Triton sub-row gather, from the row size (memory efficiency first).

Whole rows up to ``MAX_PIECE_BYTES`` are copied in one load phase as up to three power-of-two
column pieces (no idle lane except in a last, masked piece: at least 7/8 of the lanes carry a
word), and a program moves about ``TILE_BYTES``. Pure Python.
"""

from __future__ import annotations

import math
from typing import NamedTuple

__all__ = ["Tile", "tile_shape", "TILE_BYTES", "MAX_PIECE_BYTES", "MAX_ROWS"]

#: bytes a program moves (target; the row count is the nearest power of two).
TILE_BYTES = 16384
#: widest column piece (bytes): longer rows take several load phases.
MAX_PIECE_BYTES = 4096
#: most token rows per program.
MAX_ROWS = 256


def _pow2_floor(x: int) -> int:
    return 1 << (x.bit_length() - 1)


def _pow2_ceil(x: int) -> int:
    return 1 << (x - 1).bit_length()


class Tile(NamedTuple):
    """A program's tile: ``rows`` tokens x one sub-row of ``row`` words, copied as ``reps``
    pieces of ``cols`` words, then ``mid`` words, then a masked piece of ``tail`` words (all
    powers of two or 0), ``vec`` words per access. ``row == 0``: row sizes differ within the
    launch; the kernel loops over ``cols``-word pieces up to each gather's row size.
    """

    rows: int
    cols: int
    reps: int
    mid: int
    tail: int
    vec: int
    row: int

    @property
    def lanes(self) -> int:
        """Column lanes a row occupies (words, idle lanes included)."""
        return self.reps * self.cols + self.mid + self.tail

    @property
    def efficiency(self) -> float:
        """Share of the lanes that carry a word (1.0: none idle; generic tiles: of the widest
        row)."""
        return (self.row or self.lanes) / self.lanes if self.row else 1.0

    @property
    def phases(self) -> int:
        """Load phases per program (a phase's loads are all issued before its stores)."""
        return self.reps


def tile_shape(row_words: int, vec: int = 1, word_bytes: int = 8, *, uniform: bool = True) -> Tile:
    """The tile for sub-rows of ``row_words`` words of ``word_bytes`` bytes.

    Memory efficiency first (issue 13: 8-word column tiles, eleven dependent load/store steps
    per 656-byte row, reached 37% of a copy): a whole row (up to ``MAX_PIECE_BYTES``) is one
    load phase, split into power-of-two pieces — the widest fitting piece, the widest piece of
    the rest, and a masked piece rounding the remainder up — so at least 7/8 of the lanes
    carry a word. Rows: the power of two nearest to ``TILE_BYTES / row bytes`` (1 ..
    ``MAX_ROWS``). A 656-byte row in int64 words is 64 + 16 + 2 words in one phase, 32 rows
    (21 KiB) per program.

    :param row_words: words per sub-row (the widest one when not ``uniform``), > 0.
    :param vec: words per access (1, 2, 4, 8 or 16), dividing ``row_words`` when ``uniform``.
    :param uniform: every gather of the launch has ``row_words`` words (the kernel then
        specialises on the row size); else the generic tile loops over ``cols``-word pieces.
    :raises ValueError: a non-positive size, or ``vec`` not dividing a uniform row.
    """
    if row_words <= 0 or word_bytes <= 0 or vec <= 0 or vec & (vec - 1):
        raise ValueError(
            f"tile_shape: row_words={row_words}, word_bytes={word_bytes} must be > 0 and "
            f"vec={vec} a power of two"
        )
    if uniform and row_words % vec:
        raise ValueError(f"tile_shape: vec={vec} words does not divide row_words={row_words}")
    row_bytes = row_words * word_bytes
    rows = 2 ** round(math.log2(max(1.0, TILE_BYTES / row_bytes)))
    rows = max(1, min(MAX_ROWS, rows))
    cap = max(vec, MAX_PIECE_BYTES // word_bytes)
    if not uniform:
        cols = min(_pow2_ceil(row_words), cap)
        return Tile(rows, cols, -(-row_words // cols), 0, 0, vec, 0)
    cols = min(_pow2_floor(row_words), cap)
    reps, rem = divmod(row_words, cols)
    mid = _pow2_floor(rem) if rem else 0
    rem -= mid
    tail = _pow2_ceil(rem) if rem else 0
    return Tile(rows, cols, reps, mid, tail, vec, row_words)
