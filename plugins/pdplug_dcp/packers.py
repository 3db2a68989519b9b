"""Packers: execute a plan's gather (``pack_src_slots`` rows of ``pack_entries``) bit-exactly.

* :class:`TorchPacker` — one gather per entry into a preallocated region view, over rows viewed
  as the widest integer type the row size and addresses allow (no per-token loop, no
  allocation): ``numpy.take(..., out=)`` on zero-copy views of CPU tensors (GIL released; the
  entries are split among ``threads`` threads), ``torch.index_select(..., out=)`` on other
  devices. Default on CPU.
* :class:`pdplug_dcp.triton_pack.TritonPacker` — one Triton launch for all entries (SGLang
  ``copy_mla_rows_into_pack``, PR #35762; prior-art sglang.md §3.3). Default on CUDA; runs on
  CPU tensors only under ``TRITON_INTERPRET=1`` (tests).

On CUDA both enqueue on the current stream and return: record an event (or synchronise)
before posting the writes that read the region.
"""

from __future__ import annotations

import logging
import os
import threading
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import torch

from pdplug.protocols import Packer
from pdplug.types import TransferPlan

__all__ = ["TorchPacker", "make_packer", "pack_layout", "entry_rows", "check_pack"]

log = logging.getLogger(__name__)

_WIDE = ((8, torch.int64), (4, torch.int32), (2, torch.int16), (1, torch.uint8))


def entry_rows(t: torch.Tensor, row_bytes: int) -> torch.Tensor:
    """View a contiguous KV entry tensor (any dtype/shape) as uint8 rows ``[slots, row_bytes]``.

    :raises ValueError: not contiguous, or its byte size is not a multiple of ``row_bytes``.
    """
    if not t.is_contiguous():
        raise ValueError(f"KV entry tensor of shape {tuple(t.shape)} is not contiguous")
    flat = t.reshape(-1).view(torch.uint8)
    if row_bytes <= 0 or flat.numel() % row_bytes:
        raise ValueError(
            f"KV entry of {flat.numel()} bytes is not a whole number of {row_bytes}-byte rows"
        )
    return flat.view(-1, row_bytes)


def pack_layout(plan: TransferPlan) -> tuple[int, np.ndarray, np.ndarray]:
    """``(n, row_bytes int64 [E], region byte offset of each pack entry int64 [E])``."""
    n = int(plan.pack_src_slots.shape[0]) if plan.pack_src_slots is not None else 0
    rb = np.asarray(plan.pack_row_bytes, dtype=np.int64)
    base = plan.region.offset if plan.region is not None else 0
    off = base + n * (np.cumsum(rb) - rb)
    return n, rb, off


def check_pack(
    plan: TransferPlan, entries: Sequence[torch.Tensor], pack_buffer: torch.Tensor
) -> tuple[int, np.ndarray, np.ndarray, list[torch.Tensor]]:
    """Validate a packed plan against tensors; return ``pack_layout`` plus the entry rows.

    :raises ValueError: missing region/row sizes, a slot outside an entry, a region outside
        the buffer, the shard larger than the region, or tensors on different devices.
    """
    if plan.region is None or len(plan.pack_row_bytes) != len(plan.pack_entries):
        raise ValueError(
            f"room {plan.room}: packed plan needs a region and pack_row_bytes per pack entry "
            f"(region={plan.region}, {len(plan.pack_row_bytes)} row sizes for "
            f"{len(plan.pack_entries)} entries)"
        )
    if pack_buffer.dtype != torch.uint8 or pack_buffer.dim() != 1:
        raise ValueError(
            f"pack_buffer must be uint8 [nbytes], got {pack_buffer.dtype} "
            f"{tuple(pack_buffer.shape)}"
        )
    n, rb, off = pack_layout(plan)
    reg = plan.region
    need = n * int(rb.sum())
    if need > reg.nbytes or reg.offset + reg.nbytes > pack_buffer.numel():
        raise ValueError(
            f"room {plan.room}: {n} tokens x {int(rb.sum())} bytes = {need} bytes in region "
            f"{reg.index} (offset {reg.offset}, {reg.nbytes} bytes) of a {pack_buffer.numel()}-"
            "byte pack buffer: does not fit"
        )
    rows = []
    for e, b in zip(plan.pack_entries, rb.tolist()):
        if not 0 <= e < len(entries):
            raise ValueError(f"pack entry {e} outside the {len(entries)} KV entries given")
        t = entries[e]
        if t.device != pack_buffer.device:
            raise ValueError(f"entry {e} on {t.device} but pack_buffer on {pack_buffer.device}")
        rows.append(entry_rows(t, b))
    if n:
        slots = np.asarray(plan.pack_src_slots)
        hi, lo = int(slots.max()), int(slots.min())
        short = min(r.shape[0] for r in rows)
        if lo < 0 or hi >= short:
            raise ValueError(
                f"room {plan.room}: source slots span [{lo}, {hi}] but an entry holds only "
                f"{short} token slots"
            )
    return n, rb, off, rows


def _widest(row_bytes: int, *addrs: int) -> tuple[int, torch.dtype]:
    for w, dt in _WIDE:
        if row_bytes % w == 0 and all(a % w == 0 for a in addrs):
            return w, dt
    return 1, torch.uint8


class TorchPacker:
    """Gather into preallocated region views (CPU default): ``numpy.take`` on CPU tensors'
    zero-copy views, ``torch.index_select`` elsewhere.

    Satisfies :class:`pdplug.protocols.Packer`. One gather per pack entry; rows are read as
    int64/int32/int16 words when the row size and both addresses allow (bit-exact: integer
    views never convert). On CPU the entries are dealt round-robin to ``threads`` threads (the
    caller's thread takes the first share); ``numpy.take`` releases the GIL, so they
    run in parallel. A row gather is bound by memory latency more than bandwidth, so on a
    machine with idle cores more threads help; a sender whose engine copies on the same cores
    may prefer fewer (``PlannerConfig.pack_threads``).

    :param threads: CPU gather threads, >= 1 (0 = ``torch.get_num_threads()``).
    :raises ValueError: ``threads < 0``.
    """

    kind = "torch"

    def __init__(self, threads: int = 0) -> None:
        if threads < 0:
            raise ValueError(f"TorchPacker threads must be >= 0, got {threads}")
        self.threads = threads or max(1, torch.get_num_threads())
        self._pool: ThreadPoolExecutor | None = None
        self._pool_pid = 0
        self._lock = threading.Lock()

    def _executor(self) -> ThreadPoolExecutor:
        # a forked child inherits the pool object but not its threads: start a new one there
        with self._lock:
            if self._pool is None or self._pool_pid != os.getpid():
                self._pool = ThreadPoolExecutor(self.threads - 1, thread_name_prefix="pdplug-pack")
                self._pool_pid = os.getpid()
            return self._pool

    def pack(
        self, plan: TransferPlan, entries: Sequence[torch.Tensor], pack_buffer: torch.Tensor
    ) -> None:
        """Gather ``plan.pack_src_slots`` rows of every ``plan.pack_entries`` entry into the
        region (layer-major). A plan that is not packed, or has no tokens, is a no-op.

        :param entries: one contiguous tensor per source KV entry (layout order).
        :param pack_buffer: uint8 ``[nbytes]`` on the entries' device.
        :raises ValueError: see :func:`check_pack`.
        """
        if not plan.packed:
            return
        n, rb, off, rows = check_pack(plan, entries, pack_buffer)
        if n == 0:
            return
        slots = np.ascontiguousarray(plan.pack_src_slots, dtype=np.int64)
        pb = pack_buffer.data_ptr()
        views = []
        for src, b, o in zip(rows, rb.tolist(), off.tolist()):
            w, dt = _widest(b, src.data_ptr(), pb + o)
            out = pack_buffer[o : o + n * b]
            if w > 1:
                src = src.view(dt)
                out = out.view(dt)
            views.append((src, out.view(n, b // w)))
        if pack_buffer.device.type != "cpu":
            idx = torch.from_numpy(slots).to(pack_buffer.device, non_blocking=True)
            for src, out in views:
                torch.index_select(src, 0, idx, out=out)
            return
        # slots were range-checked, so mode="clip" (no bounds pass, no buffering)
        arrays = [(src.numpy(), out.numpy()) for src, out in views]

        def gather(part: list[tuple[np.ndarray, np.ndarray]]) -> None:
            for s, o in part:
                np.take(s, slots, axis=0, out=o, mode="clip")

        k = min(self.threads, len(arrays))
        if k <= 1:
            gather(arrays)
            return
        parts = [arrays[i::k] for i in range(k)]
        futs = [self._executor().submit(gather, part) for part in parts[1:]]
        gather(parts[0])
        for f in futs:
            f.result()


def make_packer(device: str = "cpu", kind: str = "auto", threads: int = 0) -> Packer:
    """Packer for ``device`` (``"cpu"``, ``"cuda"``, ``"cuda:1"`` …).

    ``kind="auto"``: Triton on CUDA when triton imports (else torch, logged), torch on CPU.
    ``kind="triton"`` on CPU needs ``TRITON_INTERPRET=1`` (checked at ``pack`` time).
    ``threads``: the torch packer's CPU gather threads (0 = ``torch.get_num_threads()``).

    :raises ValueError: unknown ``kind``, ``threads < 0``.
    :raises RuntimeError: ``kind="triton"`` and triton is not importable.
    """
    if kind not in ("auto", "torch", "triton"):
        raise ValueError(f"packer kind must be 'auto', 'torch' or 'triton', got {kind!r}")
    dev = torch.device(device)
    if kind == "torch" or (kind == "auto" and dev.type != "cuda"):
        return TorchPacker(threads)
    try:
        from pdplug_dcp.triton_pack import TritonPacker
    except ImportError as e:
        if kind == "triton":
            raise RuntimeError(f"packer kind 'triton' requested but triton is unusable: {e}") from e
        log.warning("triton not importable (%s); using the torch packer on %s", e, device)
        return TorchPacker(threads)
    return TritonPacker()
