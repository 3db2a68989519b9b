"""Triton sub-row gather kernel: a whole segment (every rank's plan) in one launch, bit-exact.

Design (after SGLang ``copy_mla_rows_into_pack``, PR #35762, and its word-copy revision; own
code): a launch table (:mod:`pdplug_dcp.tables`) holds, per gather (one pack entry of one
group of one destination rank's plan), the source entry and region addresses as *word
deltas* from one base pointer (the pack buffer), the sub-row length in words, and where its
group's token offsets and column offsets sit in the table. Program ``(b, e, c)`` copies
sub-row ``c`` of tokens ``[b*ROWS, (b+1)*ROWS)`` of gather ``e`` and computes each sub-row's
place in the region (token-major, or head-major per destination page,
:class:`pdplug.kvtypes.PackGroup`) on the device, so the host never expands a per-sub-row
index. Words are the widest of int64/int32/int16/uint8 dividing every row size, offset and
address; ``VEC`` consecutive words are hinted contiguous and aligned so compiled code issues
16-byte accesses. Integer words never convert, so the copy is bit-exact for any KV dtype.

When every gather of a launch has the same row size (MLA latents, K|V heads of one size) the
kernel is specialised on it: the row is copied as up to three power-of-two column pieces
whose loads are all issued before the stores (one memory latency per program), with no idle
lane outside the last, masked piece (:func:`pdplug_dcp.tiles.tile_shape`).

Imported only when the triton packer is selected (triton is an optional dependency).
"""

from __future__ import annotations

import os
from collections.abc import Sequence

import numpy as np
import torch
import triton
import triton.language as tl

from pdplug.types import TransferPlan
from pdplug_dcp.tables import META, Launch, LaunchTables
from pdplug_dcp.tiles import Tile, tile_shape

__all__ = ["TritonPacker", "gather_rows_kernel", "tile_shape", "Tile", "META"]


@triton.jit
def gather_rows_kernel(
    base_ptr,
    meta_ptr,
    idx_ptr,
    ROWS: tl.constexpr,
    COLS: tl.constexpr,
    REPS: tl.constexpr,
    MID: tl.constexpr,
    TAIL: tl.constexpr,
    ROW: tl.constexpr,
    VEC: tl.constexpr,
):
    """Program ``(b, e, c)``: sub-row ``c`` of tokens ``[b*ROWS, (b+1)*ROWS)`` of gather ``e``.
    ``meta`` int64 ``[E, 10]`` = (source delta, row words, region delta, unit words, token
    start, n, columns, page tokens, first offset, column start) in words from ``base_ptr`` /
    indices into ``idx``; ``idx`` int64 = token offsets (units) and column offsets (words).
    ``ROW > 0``: every row has ``ROW`` words, copied as ``REPS`` pieces of ``COLS`` words, one
    of ``MID`` and a masked one of ``TAIL``; ``ROW == 0``: ``COLS``-word pieces up to the
    gather's row size."""
    rb = tl.program_id(0).to(tl.int64)
    e = tl.program_id(1).to(tl.int64)
    c = tl.program_id(2).to(tl.int64)
    m = meta_ptr + e * 10
    ncols = tl.load(m + 6)
    n = tl.load(m + 5)
    if (c < ncols) & (rb * ROWS < n):  # gathers of a launch differ in tokens and columns
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
        if ROW > 0:
            dst_row = base_ptr + dst_delta + r * ROW
            rm = jm[:, None]
            for q in range(REPS - 1):  # rows over MAX_PIECE_BYTES: one phase per piece
                wq = tl.max_contiguous(tl.multiple_of(q * COLS + tl.arange(0, COLS), VEC), VEC)
                vq = tl.load(src_row[:, None] + wq[None, :], mask=rm)
                tl.store(dst_row[:, None] + wq[None, :], vq, mask=rm)
            # last phase: every load issued before the first store
            wa = (REPS - 1) * COLS + tl.arange(0, COLS)
            wa = tl.max_contiguous(tl.multiple_of(wa, VEC), VEC)
            va = tl.load(src_row[:, None] + wa[None, :], mask=rm)
            if MID > 0:
                wb = tl.max_contiguous(tl.multiple_of(REPS * COLS + tl.arange(0, MID), VEC), VEC)
                vb = tl.load(src_row[:, None] + wb[None, :], mask=rm)
            if TAIL > 0:
                wt = REPS * COLS + MID + tl.arange(0, TAIL)
                wt = tl.max_contiguous(tl.multiple_of(wt, VEC), VEC)
                tm = rm & (wt < ROW)[None, :]
                vt = tl.load(src_row[:, None] + wt[None, :], mask=tm)
            tl.store(dst_row[:, None] + wa[None, :], va, mask=rm)
            if MID > 0:
                tl.store(dst_row[:, None] + wb[None, :], vb, mask=rm)
            if TAIL > 0:
                tl.store(dst_row[:, None] + wt[None, :], vt, mask=tm)
        else:
            dst_row = base_ptr + dst_delta + tl.multiple_of(r * row_words, VEC)
            for c0 in range(0, row_words, COLS):
                w = tl.max_contiguous(tl.multiple_of(c0 + tl.arange(0, COLS), VEC), VEC)
                mk = jm[:, None] & (w < row_words)[None, :]
                v = tl.load(src_row[:, None] + w[None, :], mask=mk)
                tl.store(dst_row[:, None] + w[None, :], v, mask=mk)


class _Stage:
    """One slot of the upload ring: a pinned host table, its device copy, and the event
    recorded after the launch that read them."""

    def __init__(self) -> None:
        self.host: torch.Tensor | None = None
        self.host_np: np.ndarray | None = None
        self.dev: torch.Tensor | None = None
        self.event: torch.cuda.Event | None = None

    def table(self, size: int) -> np.ndarray:
        """The pinned host table (grown to ``size`` int64), after its last launch is done."""
        if self.event is not None:
            self.event.synchronize()  # the copy (and launch) that last read this slot
        if self.host is None or self.host.numel() < size:
            self.host = torch.empty(max(size, 1 << 14) * 5 // 4, dtype=torch.int64, pin_memory=True)
            self.host_np = self.host.numpy()
        assert self.host_np is not None
        return self.host_np


class TritonPacker:
    """One Triton launch per segment (:meth:`pack_all`) or per plan (:meth:`pack`) (CUDA
    default).

    Satisfies :class:`pdplug.protocols.Packer`. On CUDA the launch is enqueued on the current
    stream (record an event before posting writes from the region); the launch table is built
    in a ring of ``STAGES`` pinned staging buffers and copied to a device buffer of the same
    slot with one non-blocking copy on the current stream, so the host can prepare the next
    segments while the GPU packs this one (a slot is reused once the launch that read it has
    completed: the host runs at most ``STAGES`` launches ahead). On CPU tensors it needs
    ``TRITON_INTERPRET=1`` (set before triton is imported), as in tests.
    """

    kind = "triton"
    STAGES = 16

    def __init__(self) -> None:
        #: ``{"word_bytes", "vec", "grid", "rows", "cols", "tile", "gathers", "cached"}`` of
        #: the last launch (tests, benches)
        self.last_launch: dict[str, object] = {}
        #: launch tables and their per-shape cache
        self.tables = LaunchTables()
        self._stages = [_Stage() for _ in range(self.STAGES)]
        self._next = 0
        self._words: tuple[torch.Tensor, torch.dtype, torch.Tensor] | None = None

    def prepare(
        self,
        plans: Sequence[TransferPlan],
        entries: Sequence[torch.Tensor | int],
        pack_buffer: torch.Tensor,
    ) -> Launch | None:
        """The host work of :meth:`pack_all` alone (checks and launch table, in a new
        array): what a segment costs the host before its upload and launch (benchmarks).

        :raises ValueError: as :meth:`pack_all`.
        """
        return self.tables.build(plans, entries, pack_buffer)

    def clear_cache(self) -> None:
        """Forget the cached launch tables and the tensors they keep alive (call after
        re-registering KV or the pack buffer; the next segment of each shape rebuilds)."""
        self.tables.clear()
        self._words = None

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
        self.pack_all((plan,), entries, pack_buffer)

    def pack_all(
        self,
        plans: Sequence[TransferPlan],
        entries: Sequence[torch.Tensor | int],
        pack_buffer: torch.Tensor,
    ) -> None:
        """Gather a whole segment — every plan of ``plans`` (one per destination DCP rank,
        each into its own region; every pack group, rows and head sub-rows) — with one launch
        table, one upload and one kernel launch. The bytes equal :meth:`pack` plan by plan.

        :param plans: the segment's plans (plans that are not packed are skipped).
        :param entries: one tensor (any dtype and strides) per source KV entry, on
            ``pack_buffer``'s device.
        :param pack_buffer: uint8 ``[nbytes]``.
        :raises ValueError: see :func:`pdplug_dcp.packers.check_pack`; plans writing
            overlapping bytes.
        :raises RuntimeError: CPU tensors without ``TRITON_INTERPRET=1``.
        """
        dev = pack_buffer.device
        cuda = dev.type == "cuda"
        if not cuda and os.environ.get("TRITON_INTERPRET") != "1":
            raise RuntimeError(
                f"triton packer on {dev} needs CUDA tensors, or TRITON_INTERPRET=1 (CPU tests)"
            )
        stage = self._stages[self._next] if cuda else None
        launch = self.tables.build(
            plans, entries, pack_buffer, stage.table if stage is not None else None
        )
        if launch is None:
            return
        size = launch.table.shape[0]
        if stage is not None:
            self._next = (self._next + 1) % self.STAGES
            assert stage.host is not None
            if stage.dev is None or stage.dev.numel() < size or stage.dev.device != dev:
                stage.dev = torch.empty(stage.host.numel(), dtype=torch.int64, device=dev)
                stage.event = None  # (the last one completed in table(); this device's next)
            t = stage.dev[:size]
            t.copy_(stage.host[:size], non_blocking=True)
        else:
            t = torch.from_numpy(launch.table)
        tile = launch.tile
        gather_rows_kernel[launch.grid](
            self._word_view(pack_buffer, launch.dtype), t, t, ROWS=tile.rows, COLS=tile.cols,
            REPS=tile.reps, MID=tile.mid, TAIL=tile.tail, ROW=tile.row, VEC=tile.vec,
        )  # fmt: skip
        if stage is not None:
            if stage.event is None:
                with torch.cuda.device(dev):
                    stage.event = torch.cuda.Event()
            stage.event.record()  # on the current stream, after the launch
        self.last_launch = {
            "word_bytes": launch.word_bytes,
            "vec": tile.vec,
            "grid": launch.grid,
            "rows": tile.rows,
            "cols": tile.cols,
            "tile": tile,
            "gathers": launch.gathers,
            "cached": launch.cached,
        }

    def _word_view(self, buf: torch.Tensor, dt: torch.dtype) -> torch.Tensor:
        """``buf`` viewed as ``dt`` words (cached for the last buffer and word)."""
        w = self._words
        if w is not None and w[0] is buf and w[1] == dt:
            return w[2]
        es = torch.empty(0, dtype=dt).element_size()
        view = buf[: buf.numel() // es * es].view(dt)
        self._words = (buf, dt, view)
        return view
