"""Triton sub-row gather kernel: every pack entry of a plan in one launch, bit-exact.

Design (after SGLang ``copy_mla_rows_into_pack``, PR #35762, and its word-copy revision; own
code): a metadata table holds, per pack entry, the source entry and region addresses as *word
deltas* from one base pointer (the pack buffer), the sub-row length in words, and where its
group's token offsets and column offsets sit in the index table. Program ``(b, e, c)`` copies
sub-row ``c`` of tokens ``[b*ROWS, (b+1)*ROWS)`` of entry ``e`` in ``COLS``-word column tiles and
computes each sub-row's place in the region (token-major, or head-major per destination page,
:class:`pdplug.kvtypes.PackGroup`) on the device, so the host never expands a per-sub-row
index. Words are the widest of int64/int32/int16/uint8 dividing every row size, offset and
address; ``VEC`` consecutive words are hinted contiguous and aligned so compiled code issues
16-byte accesses. Integer words never convert, so the copy is bit-exact for any KV dtype.

Imported only when the triton packer is selected (triton is an optional dependency).
"""

from __future__ import annotations

import os
from collections.abc import Sequence

import numpy as np
import torch
import triton
import triton.language as tl

from pdplug.packing import pack_groups
from pdplug.types import TransferPlan
from pdplug_dcp.packers import check_pack, widest

__all__ = ["TritonPacker", "gather_rows_kernel", "tile_shape", "META"]

#: int64 fields per entry in the launch table.
META = 10


@triton.jit
def gather_rows_kernel(
    base_ptr, meta_ptr, idx_ptr, ROWS: tl.constexpr, COLS: tl.constexpr, VEC: tl.constexpr
):
    """Program ``(b, e, c)``: sub-row ``c`` of tokens ``[b*ROWS, (b+1)*ROWS)`` of entry ``e``.
    ``meta`` int64 ``[E, 10]`` = (source delta, row words, region delta, unit words, token
    start, n, columns, page tokens, first offset, column start) in words from ``base_ptr`` /
    indices into ``idx``; ``idx`` int64 = token offsets (units) and column offsets (words)."""
    rb = tl.program_id(0).to(tl.int64)
    e = tl.program_id(1).to(tl.int64)
    c = tl.program_id(2).to(tl.int64)
    m = meta_ptr + e * 10
    ncols = tl.load(m + 6)
    n = tl.load(m + 5)
    if c < ncols:
        src_delta = tl.multiple_of(tl.load(m), VEC)
        row_words = tl.multiple_of(tl.load(m + 1), VEC)
        dst_delta = tl.multiple_of(tl.load(m + 2), VEC)
        unit = tl.multiple_of(tl.load(m + 3), VEC)
        tok0 = tl.load(m + 4)
        pt = tl.load(m + 7)
        o0 = tl.load(m + 8)
        col = tl.multiple_of(tl.load(idx_ptr + tl.load(m + 9) + c), VEC)
        j = rb * ROWS + tl.arange(0, ROWS)
        jm = j < n
        tok = tl.load(idx_ptr + tok0 + j, mask=jm, other=0)
        # region row of (j, c): token-major j*C + c; head-major: the page's first token s,
        # its token count cnt, then s*C + c*cnt + (j - s)
        p = tl.maximum(pt, 1)
        k = (o0 + j) // p
        s = tl.maximum(k * p - o0, 0)
        cnt = tl.minimum((k + 1) * p - o0, n) - s
        r = tl.where(pt > 0, s * ncols + c * cnt + (j - s), j * ncols + c)
        src_row = base_ptr + src_delta + col + tl.multiple_of(tok * unit, VEC)
        dst_row = base_ptr + dst_delta + tl.multiple_of(r * row_words, VEC)
        for c0 in range(0, row_words, COLS):
            w = tl.max_contiguous(tl.multiple_of(c0 + tl.arange(0, COLS), VEC), VEC)
            mk = jm[:, None] & (w < row_words)[None, :]
            v = tl.load(src_row[:, None] + w[None, :], mask=mk)
            tl.store(dst_row[:, None] + w[None, :], v, mask=mk)


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
    stream (record an event before posting writes from the region); the launch table (int64
    metadata, token and column offsets) goes up through a ring of pinned staging buffers with a
    non-blocking copy, so the host can prepare the next plan while the GPU packs this one. On
    CPU tensors it needs ``TRITON_INTERPRET=1`` (set before triton is imported), as in tests.
    """

    kind = "triton"
    STAGES = 4

    def __init__(self) -> None:
        #: ``{"word_bytes", "vec", "grid", "rows", "cols"}`` of the last launch (tests, benches)
        self.last_launch: dict[str, object] = {}
        self._stages: list[tuple[torch.Tensor, torch.cuda.Event] | None] = [None] * self.STAGES
        self._next = 0
        self._extents: dict[int, tuple[object, int, int]] = {}

    def _upload(self, table: np.ndarray, dev: torch.device) -> torch.Tensor:
        """Launch table to ``dev``: zero-copy on CPU; pinned ring + non-blocking copy on CUDA."""
        if dev.type != "cuda":
            return torch.from_numpy(table)
        i = self._next
        self._next = (i + 1) % self.STAGES
        stage = self._stages[i]
        if stage is not None:
            stage[1].synchronize()  # the copy that last read this staging buffer is done
        host = stage[0] if stage is not None and stage[0].numel() >= table.size else None
        if host is None:
            host = torch.empty(max(table.size, 1 << 14), dtype=torch.int64, pin_memory=True)
        host.numpy()[: table.size] = table
        out = host[: table.size].to(dev, non_blocking=True)
        ev = torch.cuda.Event()
        ev.record()
        self._stages[i] = (host, ev)
        return out

    def pack(
        self, plan: TransferPlan, entries: Sequence[torch.Tensor | int], pack_buffer: torch.Tensor
    ) -> None:
        """Gather the plan's rows or sub-rows of every pack entry into its region.

        :param entries: one tensor (any dtype and strides) per source KV entry, on
            ``pack_buffer``'s device.
        :param pack_buffer: uint8 ``[nbytes]``.
        :raises ValueError: see :func:`pdplug_dcp.packers.check_pack`.
        :raises RuntimeError: CPU tensors without ``TRITON_INTERPRET=1``.
        """
        if not plan.packed:
            return
        gathers, need = check_pack(plan, entries, pack_buffer, self._extents)
        if need == 0:
            return
        dev = pack_buffer.device
        if dev.type != "cuda" and os.environ.get("TRITON_INTERPRET") != "1":
            raise RuntimeError(
                f"triton packer on {dev} needs CUDA tensors, or TRITON_INTERPRET=1 (CPU tests)"
            )
        groups = pack_groups(plan)
        base = pack_buffer.data_ptr()
        src_addr = [g.addr for g in gathers]
        vals = [base, *src_addr, *(base + g.offset for g in gathers)]
        for grp in groups:
            vals += [grp.row_bytes, grp.unit, *grp.cols]
        w, dt = widest(*vals)
        # index table: per group its token offsets (units) then its columns (words)
        pieces: list[np.ndarray] = []
        where: dict[int, tuple[int, int]] = {}
        pos = 0
        for grp in groups:
            tok = np.asarray(grp.tokens, dtype=np.int64)
            cols = np.asarray(grp.cols, dtype=np.int64) // w
            where[id(grp)] = (pos, pos + tok.shape[0])
            pieces += [tok, cols]
            pos += tok.shape[0] + cols.shape[0]
        e = len(gathers)
        table = np.empty(META * e + pos, dtype=np.int64)
        meta = table[: META * e].reshape(e, META)
        # gathers come group by group, entry by entry: per-group columns are broadcast
        meta[:, 0] = (np.asarray(src_addr, dtype=np.int64) - base) // w
        meta[:, 2] = np.fromiter((g.offset for g in gathers), dtype=np.int64, count=e) // w
        i = 0
        for grp in groups:
            t0, c0 = where[id(grp)]
            k = len(grp.entries)
            meta[i : i + k, 1] = grp.row_bytes // w
            meta[i : i + k, 3:] = (grp.unit // w, t0, len(grp.tokens), len(grp.cols),
                                   grp.page_tokens, grp.first_offset, c0)  # fmt: skip
            i += k
        table[META * e :] = np.concatenate(pieces) if pieces else table[:0]
        meta[:, 4] += META * e
        meta[:, 9] += META * e
        vec = 16 // w
        cols_w = np.concatenate([np.asarray(g.cols, dtype=np.int64) // w for g in groups])
        if base % 16 or (meta[:, :4] % vec).any() or (cols_w % vec).any():
            vec = 1
        t = self._upload(table, dev)
        words = pack_buffer[: pack_buffer.numel() // w * w].view(dt)
        rows_t, cols_t = tile_shape(int(meta[:, 1].max()))
        grid = (triton.cdiv(int(meta[:, 5].max()), rows_t), e, int(meta[:, 6].max()))
        gather_rows_kernel[grid](words, t, t, ROWS=rows_t, COLS=cols_t, VEC=vec)
        self.last_launch = {
            "word_bytes": w,
            "vec": vec,
            "grid": grid,
            "rows": rows_t,
            "cols": cols_t,
        }
