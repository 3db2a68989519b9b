"""Triton row-gather kernel: every pack entry of a plan in one launch, bit-exact.

Design (after SGLang ``copy_mla_rows_into_pack``, PR #35762, and its word-copy revision;
prior-art sglang.md §3.3; own code): a metadata table holds, per pack entry, the source entry
and destination (region) addresses as *word deltas* from one base pointer (the pack buffer)
plus the row length in words; program ``(b, e)`` copies a block of ``ROWS`` packed rows of
entry ``e`` (source row ``slots[row]``) in ``COLS``-word column tiles, so no per-element
division is needed. Words are the widest of int64/int32/int16/uint8 that
divides every row size and address; ``VEC`` consecutive words are hinted contiguous and
aligned so compiled code issues 16-byte accesses. Integer words never convert, so the copy is
bit-exact for any KV dtype (bf16, fp8, …).

Imported only when the triton packer is selected (triton is an optional dependency).
"""

from __future__ import annotations

import os
from collections.abc import Sequence

import numpy as np
import torch
import triton
import triton.language as tl

from pdplug import TransferPlan
from pdplug_dcp.packers import check_pack

__all__ = ["TritonPacker", "gather_rows_kernel", "tile_shape"]

_WORDS = ((8, torch.int64), (4, torch.int32), (2, torch.int16), (1, torch.uint8))


@triton.jit
def gather_rows_kernel(
    base_ptr, meta_ptr, slots_ptr, n, ROWS: tl.constexpr, COLS: tl.constexpr, VEC: tl.constexpr
):
    """Program ``(b, e)`` copies rows ``[b*ROWS, (b+1)*ROWS)`` of entry ``e`` in ``COLS``-word
    column tiles. ``meta`` int64 ``[E, 3]`` = (source delta, row words, region delta) in words
    from ``base_ptr``; ``slots`` int64 ``[n]`` = source row of each packed row."""
    rb = tl.program_id(0).to(tl.int64)
    e = tl.program_id(1).to(tl.int64)
    src_delta = tl.multiple_of(tl.load(meta_ptr + e * 3), VEC)
    row_words = tl.multiple_of(tl.load(meta_ptr + e * 3 + 1), VEC)
    dst_delta = tl.multiple_of(tl.load(meta_ptr + e * 3 + 2), VEC)
    r = rb * ROWS + tl.arange(0, ROWS)
    rmask = r < n
    slot = tl.load(slots_ptr + r, mask=rmask, other=0)
    src_row = base_ptr + src_delta + tl.multiple_of(slot * row_words, VEC)
    dst_row = base_ptr + dst_delta + tl.multiple_of(r * row_words, VEC)
    for c0 in range(0, row_words, COLS):
        c = tl.max_contiguous(tl.multiple_of(c0 + tl.arange(0, COLS), VEC), VEC)
        m = rmask[:, None] & (c < row_words)[None, :]
        v = tl.load(src_row[:, None] + c[None, :], mask=m)
        tl.store(dst_row[:, None] + c[None, :], v, mask=m)


def tile_shape(row_words: int, tile_words: int = 1024) -> tuple[int, int]:
    """``(ROWS, COLS)``: the widest power-of-two column tile (<= 128 words) wasting at most
    1/8 of a row in its last iteration, and rows filling ``tile_words`` words."""
    cols = 1
    for c in (128, 64, 32, 16, 8, 4, 2, 1):
        if (-(-row_words // c) * c - row_words) * 8 <= row_words:
            cols = c
            break
    return max(1, tile_words // cols), cols


class TritonPacker:
    """One Triton launch per plan for all pack entries (CUDA default).

    Satisfies :class:`pdplug.protocols.Packer`. On CUDA the launch is enqueued on the current
    stream (record an event before posting writes from the region). On CPU tensors it needs
    ``TRITON_INTERPRET=1`` (set before triton is imported), which the test suite uses.
    """

    kind = "triton"

    def __init__(self) -> None:
        #: ``{"word_bytes", "vec", "grid", "rows", "cols"}`` of the last launch (tests, benches)
        self.last_launch: dict[str, object] = {}

    def pack(
        self, plan: TransferPlan, entries: Sequence[torch.Tensor], pack_buffer: torch.Tensor
    ) -> None:
        """Gather ``plan.pack_src_slots`` rows of ``plan.pack_entries`` into the region.

        :param entries: one contiguous tensor per source KV entry, on ``pack_buffer``'s device.
        :param pack_buffer: uint8 ``[nbytes]``.
        :raises ValueError: see :func:`pdplug_dcp.packers.check_pack`.
        :raises RuntimeError: CPU tensors without ``TRITON_INTERPRET=1``.
        """
        if not plan.packed:
            return
        n, rb, off, rows = check_pack(plan, entries, pack_buffer)
        if n == 0:
            return
        dev = pack_buffer.device
        if dev.type != "cuda" and os.environ.get("TRITON_INTERPRET") != "1":
            raise RuntimeError(
                f"triton packer on {dev} needs CUDA tensors, or TRITON_INTERPRET=1 (CPU tests)"
            )
        base = pack_buffer.data_ptr()
        src_addr = np.array([r.data_ptr() for r in rows], dtype=np.int64)
        dst_addr = base + off
        addrs = np.concatenate((src_addr, dst_addr, rb, [base]))
        w, dt = next((w, dt) for w, dt in _WORDS if not (addrs % w).any())
        meta = np.empty((len(rows), 3), dtype=np.int64)
        meta[:, 0] = (src_addr - base) // w
        meta[:, 1] = rb // w
        meta[:, 2] = (dst_addr - base) // w
        vec = 16 // w
        if (meta % vec).any() or base % 16:
            vec = 1
        table = np.concatenate((meta.reshape(-1), np.asarray(plan.pack_src_slots, dtype=np.int64)))
        t = torch.from_numpy(table)
        if dev.type != "cpu":
            t = t.to(dev)
        words = pack_buffer[: pack_buffer.numel() // w * w].view(dt)
        rows_t, cols_t = tile_shape(int(meta[:, 1].max()))
        grid = (triton.cdiv(n, rows_t), len(rows))
        gather_rows_kernel[grid](words, t, t[meta.size :], n, ROWS=rows_t, COLS=cols_t, VEC=vec)
        self.last_launch = {
            "word_bytes": w,
            "vec": vec,
            "grid": grid,
            "rows": rows_t,
            "cols": cols_t,
        }
