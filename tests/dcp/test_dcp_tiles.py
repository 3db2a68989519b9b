"""Tile choice of the Triton gather (pure Python: no triton needed): memory efficiency for the
row sizes that matter, and the invariants the kernel relies on for every row size."""

from __future__ import annotations

import pytest

from pdplug_dcp.tiles import MAX_PIECE_BYTES, MAX_ROWS, TILE_BYTES, Tile, tile_shape

#: row bytes -> (rows, cols, reps, mid, tail) in int64 words with 16-byte accesses
EXPECTED = {
    128: (128, 16, 1, 0, 0),
    256: (64, 32, 1, 0, 0),
    576: (32, 64, 1, 8, 0),  # MLA bf16 latent: 64 + 8 words, one phase
    656: (32, 64, 1, 16, 2),  # MLA fp8 (issue 13: was 8-word columns, 11 steps, 37%)
    1152: (16, 128, 1, 16, 0),
    4096: (4, 512, 1, 0, 0),
}


@pytest.mark.parametrize("row_bytes", sorted(EXPECTED))
def test_tile_for_the_measured_row_sizes(row_bytes: int) -> None:
    t = tile_shape(row_bytes // 8, vec=2, word_bytes=8)
    assert (t.rows, t.cols, t.reps, t.mid, t.tail) == EXPECTED[row_bytes]
    assert t.vec == 2 and t.row == row_bytes // 8
    assert t.efficiency == 1.0  # no idle lane: every piece is full
    assert t.phases == 1  # every load of a program issued before its stores
    assert TILE_BYTES / 1.5 <= t.rows * row_bytes <= TILE_BYTES * 1.5  # ~16 KiB per program


def test_656_byte_rows_no_longer_use_narrow_columns() -> None:
    """The old rule (widest column tile wasting <= 1/8) gave 8-word columns for 82-word rows."""
    t = tile_shape(82, vec=2)
    assert t.cols >= 64 and t.phases == 1 and t.lanes == 82


@pytest.mark.parametrize("word_bytes,vec", [(1, 16), (2, 8), (4, 4), (8, 2), (8, 1), (1, 1)])
def test_tile_invariants_for_every_row_size(word_bytes: int, vec: int) -> None:
    """Pieces cover the row exactly once (the last one masked), are powers of two and
    multiples of the access width; >= 7/8 of the lanes carry a word; one phase per
    MAX_PIECE_BYTES of row (the remainder rides with the last)."""
    cap = MAX_PIECE_BYTES // word_bytes
    near_cap = [k * cap + d * vec for k in (1, 2, 3) for d in (-1, 0, 1, 7)]
    for words in [*range(vec, 700 * vec, vec), *near_cap]:
        t = tile_shape(words, vec=vec, word_bytes=word_bytes)
        pieces = [p for p in (t.cols, t.mid, t.tail) if p]
        assert all(p & (p - 1) == 0 and p % vec == 0 for p in pieces), (words, t)
        full = t.reps * t.cols + t.mid
        assert full <= words <= full + t.tail and (t.tail == 0 or full < words), (words, t)
        assert t.tail < 2 * (words - full) or t.tail == 0, (words, t)  # tail rounds up < 2x
        assert t.mid < t.cols and t.tail <= max(t.mid, vec) * 2, (words, t)
        assert t.efficiency >= 0.875, (words, t)
        assert t.phases == max(1, words // cap), (words, t)  # the remainder joins the last
        assert 1 <= t.rows <= MAX_ROWS and t.rows & (t.rows - 1) == 0


def test_generic_tile_for_mixed_row_sizes() -> None:
    t = tile_shape(82, vec=2, uniform=False)
    assert t == Tile(rows=32, cols=128, reps=1, mid=0, tail=0, vec=2, row=0)
    assert tile_shape(3000, uniform=False).cols == MAX_PIECE_BYTES // 8


def test_tile_errors_name_the_values() -> None:
    with pytest.raises(ValueError, match="row_words=0"):
        tile_shape(0)
    with pytest.raises(ValueError, match="vec=2 words does not divide row_words=5"):
        tile_shape(5, vec=2)
    with pytest.raises(ValueError, match="vec=3"):
        tile_shape(6, vec=3)
