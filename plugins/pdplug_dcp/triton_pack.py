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

from pdplug.types import TransferPlan
from pdplug_dcp.packers import check_pack, pack_layout

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
    stream (record an event before posting writes from the region); the launch table (entry
    addresses + slots, int64) goes up through a ring of pinned staging buffers with a
    non-blocking copy, so the host can prepare the next plan while the GPU packs this one.
    Entry geometry is validated once per registered buffer set and cached (the per-entry
    torch view calls would otherwise cost more host time than the kernel takes). On CPU
    tensors it needs ``TRITON_INTERPRET=1`` (set before triton is imported), as in the tests.
    """

    kind = "triton"
    STAGES = 4

    def __init__(self) -> None:
        #: ``{"word_bytes", "vec", "grid", "rows", "cols"}`` of the last launch (tests, benches)
        self.last_launch: dict[str, object] = {}
        self._checked: dict[tuple[object, ...], tuple[np.ndarray, int]] = {}
        self._stages: list[tuple[torch.Tensor, torch.cuda.Event] | None] = [None] * self.STAGES
        self._next = 0

    def _entries(
        self, plan: TransferPlan, entries: Sequence[torch.Tensor], pack_buffer: torch.Tensor
    ) -> tuple[int, np.ndarray, np.ndarray, np.ndarray]:
        """``(n, row_bytes, region offsets, source addresses)``, validated (cached per
        buffer set) as :func:`pdplug_dcp.packers.check_pack` does."""
        try:
            ts = [entries[e] for e in plan.pack_entries]
        except IndexError:
            ts = []
        key = (
            pack_buffer.data_ptr(),
            pack_buffer.numel(),
            plan.pack_row_bytes,
            *((t.data_ptr(), t.nbytes) for t in ts),
        )
        hit = self._checked.get(key)
        if hit is None or len(ts) != len(plan.pack_entries):
            n, rb, off, rows = check_pack(plan, entries, pack_buffer)
            addr = np.array([r.data_ptr() for r in rows], dtype=np.int64)
            hit = (addr, min((r.shape[0] for r in rows), default=0))
            if len(self._checked) > 64:
                self._checked.clear()
            self._checked[key] = hit
            return n, rb, off, addr
        n, rb, off = pack_layout(plan)
        reg = plan.region
        assert reg is not None
        if n * int(rb.sum()) > reg.nbytes or reg.offset + reg.nbytes > pack_buffer.numel():
            check_pack(plan, entries, pack_buffer)  # raises with the full message
        if n:
            slots = np.asarray(plan.pack_src_slots)
            if int(slots.min()) < 0 or int(slots.max()) >= hit[1]:
                check_pack(plan, entries, pack_buffer)  # raises with the full message
        return n, rb, off, hit[0]

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
        n, rb, off, src_addr = self._entries(plan, entries, pack_buffer)
        if n == 0:
            return
        dev = pack_buffer.device
        if dev.type != "cuda" and os.environ.get("TRITON_INTERPRET") != "1":
            raise RuntimeError(
                f"triton packer on {dev} needs CUDA tensors, or TRITON_INTERPRET=1 (CPU tests)"
            )
        base = pack_buffer.data_ptr()
        dst_addr = base + off
        addrs = np.concatenate((src_addr, dst_addr, rb, [base]))
        w, dt = next((w, dt) for w, dt in _WORDS if not (addrs % w).any())
        e = src_addr.shape[0]
        table = np.empty(3 * e + n, dtype=np.int64)
        meta = table[: 3 * e].reshape(e, 3)
        meta[:, 0] = (src_addr - base) // w
        meta[:, 1] = rb // w
        meta[:, 2] = (dst_addr - base) // w
        table[3 * e :] = np.asarray(plan.pack_src_slots, dtype=np.int64)
        vec = 16 // w
        if (meta % vec).any() or base % 16:
            vec = 1
        t = self._upload(table, dev)
        words = pack_buffer[: pack_buffer.numel() // w * w].view(dt)
        rows_t, cols_t = tile_shape(int(meta[:, 1].max()))
        grid = (triton.cdiv(n, rows_t), e)
        gather_rows_kernel[grid](words, t, t[3 * e :], n, ROWS=rows_t, COLS=cols_t, VEC=vec)
        self.last_launch = {
            "word_bytes": w,
            "vec": vec,
            "grid": grid,
            "rows": rows_t,
            "cols": cols_t,
        }
