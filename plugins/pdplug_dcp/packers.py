"""Packers: execute a plan's gather (whole token rows or head sub-rows) bit-exactly.

* :class:`TorchPacker` — one gather per pack entry into a preallocated region view, over
  sub-rows viewed as the widest integer words the row size and addresses allow (no per-token
  loop, no allocation besides the row index): ``numpy.take(..., out=)`` on zero-copy views of
  CPU memory whose rows lie back to back, ``torch.index_select(..., out=)`` where sub-rows
  leave gaps (numpy would copy the whole entry first) and on other devices (GIL released;
  rows split among ``threads`` threads). Default on CPU.
* :class:`pdplug_dcp.triton_pack.TritonPacker` — one Triton launch for all entries (after
  SGLang ``copy_mla_rows_into_pack``, PR #35762). Default on CUDA; runs on CPU tensors only
  under ``TRITON_INTERPRET=1`` (tests).

Both have ``pack(plan, ...)`` (one destination rank's plan) and ``pack_all(plans, ...)``: a
whole segment, every destination DCP rank's plan into its own region, in one call (one launch
on the Triton packer); :func:`pdplug.packing.pack_segment` picks it when a packer has it.

A KV entry may be a tensor of any dtype and strides (a vLLM per-layer view into a shared
storage included) or, on CPU, a raw address (``int``): the packer reads the bytes the plan's
:class:`~pdplug.kvtypes.PackGroup` offsets name from the entry's page 0. On CUDA both packers
enqueue on the current stream and return: record an event (or synchronise) before posting the
writes that read the region.
"""

from __future__ import annotations

import ctypes
import logging
import os
import threading
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from itertools import pairwise
from typing import Any, NamedTuple

import numpy as np
import torch

from pdplug.kvtypes import PackGroup
from pdplug.packing import group_rows, pack_groups
from pdplug.protocols import Packer
from pdplug.types import TransferPlan

__all__ = [
    "TorchPacker",
    "make_packer",
    "entry_bytes",
    "entry_extent",
    "check_pack",
    "check_disjoint",
    "Gather",
    "widest",
    "default_threads",
]

log = logging.getLogger(__name__)

#: rows below which one more gather thread costs more than it saves (hand-off ~10-20 us)
_MIN_THREAD_ROWS = 2048
_NP_WORD = {8: np.int64, 4: np.int32, 2: np.int16, 1: np.uint8}
_WIDE = ((8, torch.int64), (4, torch.int32), (2, torch.int16), (1, torch.uint8))


def default_threads() -> int:
    """CPU gather threads of a packer by default: ``torch.get_num_threads() - 1``, at least 1
    (one core is left to the transfer engine's copy, which overlaps the gather in a sender)."""
    return max(1, torch.get_num_threads() - 1)


def widest(*values: int) -> tuple[int, torch.dtype]:
    """The widest word (8, 4, 2 or 1 bytes) dividing every value, with its integer dtype."""
    for w, dt in _WIDE:
        if all(v % w == 0 for v in values):
            return w, dt
    return 1, torch.uint8


def entry_extent(t: torch.Tensor | int) -> tuple[int, int]:
    """``(address of the entry's first byte, bytes it spans)`` of a tensor (any strides), or
    ``(address, -1)`` for a raw address (extent unknown: checked at registration).

    :raises ValueError: a negative stride.
    """
    if isinstance(t, int):
        return t, -1
    if any(s < 0 for s in t.stride()):
        raise ValueError(f"KV entry of shape {tuple(t.shape)} has a negative stride {t.stride()}")
    es = t.element_size()
    ext = (sum((n - 1) * s for n, s in zip(t.shape, t.stride())) + 1) * es if t.numel() else 0
    return t.data_ptr(), ext


def entry_bytes(t: torch.Tensor | int, span: int) -> torch.Tensor:
    """A uint8 tensor over ``span`` bytes of an entry's memory from its first byte, no copy:
    through a tensor's storage (any device), or at a raw CPU address.

    :raises ValueError: a negative stride.
    """
    if isinstance(t, int):
        buf = (ctypes.c_uint8 * span).from_address(t)
        return torch.from_numpy(np.ctypeslib.as_array(buf))
    entry_extent(t)
    flat = torch.empty(0, dtype=torch.uint8, device=t.device)
    flat.set_(t.untyped_storage(), t.storage_offset() * t.element_size(), (span,), (1,))
    return flat


class Gather(NamedTuple):
    """One validated gather of one pack entry.

    :ivar entry: source entry index; ``addr``: address of its page 0.
    :ivar group: the :class:`~pdplug.kvtypes.PackGroup` it belongs to.
    :ivar offset: byte offset of the entry's block from the pack-buffer base.
    :ivar span: bytes of the entry the group reads (from ``addr``).
    """

    entry: int
    addr: int
    group: PackGroup
    offset: int
    span: int


def _bounds(g: PackGroup) -> tuple[int, int]:
    """Byte range ``[lo, hi)`` of an entry that ``g`` reads (``(0, 0)`` when empty)."""
    tok = np.asarray(g.tokens)
    if tok.shape[0] == 0 or not g.cols:
        return 0, 0
    return (
        int(tok.min()) * g.unit + min(g.cols),
        int(tok.max()) * g.unit + max(g.cols) + g.row_bytes,
    )


def check_pack(
    plan: TransferPlan,
    entries: Sequence[torch.Tensor | int],
    pack_buffer: torch.Tensor,
    extents: dict[int, tuple[Any, int, int]] | None = None,
) -> tuple[list[Gather], int]:
    """Validate a packed plan against the memory (no per-row work: bounds come from the
    token offsets' min/max); return one :class:`Gather` per pack entry and the bytes the plan
    writes into its region.

    :param extents: a packer's cache of :func:`entry_extent` by tensor identity (a sender packs
        from the same registered tensors every time; the cache holds them, so an id is never
        reused while cached).
    :raises ValueError: a region outside the buffer or smaller than the shard, an entry index
        outside ``entries``, sub-rows outside their entry's memory, a block outside the
        region, or memory on another device (each names the values).
    """
    if pack_buffer.dtype != torch.uint8 or pack_buffer.dim() != 1:
        raise ValueError(
            f"pack_buffer must be uint8 [nbytes], got {pack_buffer.dtype} "
            f"{tuple(pack_buffer.shape)}"
        )
    groups = pack_groups(plan)
    reg = plan.region
    if reg is None:
        raise ValueError(f"room {plan.room}: packed plan has no region")
    n = len(groups[0].tokens) if groups else 0
    need = n * sum(plan.pack_row_bytes)
    if need > reg.nbytes or reg.offset + reg.nbytes > pack_buffer.numel():
        raise ValueError(
            f"room {plan.room}: {n} tokens x {sum(plan.pack_row_bytes)} bytes = {need} bytes in "
            f"region {reg.index} (offset {reg.offset}, {reg.nbytes} bytes) of a "
            f"{pack_buffer.numel()}-byte pack buffer: does not fit"
        )
    out: list[Gather] = []
    for g in groups:
        m = len(g.tokens) * len(g.cols)
        lo, hi = _bounds(g)
        for e, off in zip(g.entries, np.asarray(g.offsets).tolist()):
            if not 0 <= e < len(entries):
                raise ValueError(f"pack entry {e} outside the {len(entries)} KV entries given")
            if off < reg.offset or off + m * g.row_bytes > reg.offset + reg.nbytes:
                raise ValueError(
                    f"room {plan.room}: entry {e}'s block [{off}, {off + m * g.row_bytes}) lies "
                    f"outside region {reg.index} [{reg.offset}, {reg.offset + reg.nbytes})"
                )
            t = entries[e]
            if not isinstance(t, int) and t.device != pack_buffer.device:
                raise ValueError(f"entry {e} on {t.device} but pack_buffer on {pack_buffer.device}")
            hit = extents.get(id(t)) if extents is not None else None
            if hit is not None and hit[0] is t:
                addr, ext = hit[1], hit[2]
            else:
                addr, ext = entry_extent(t)
                if extents is not None and not isinstance(t, int):
                    if len(extents) > 4096:
                        extents.clear()
                    extents[id(t)] = (t, addr, ext)
            if m and (lo < 0 or 0 <= ext < hi):
                raise ValueError(
                    f"room {plan.room}: source rows span bytes [{lo}, {hi}) of entry {e} "
                    f"(rows {lo // g.row_bytes}..{(hi - 1) // g.row_bytes} of {g.row_bytes} "
                    f"bytes) but the entry holds only {ext} bytes ({ext // g.row_bytes} rows)"
                )
            out.append(Gather(e, addr, g, off, hi))
    return out, need


def check_disjoint(spans: Sequence[tuple[int, int, int]]) -> None:
    """Check that the plans of one segment write disjoint bytes of the pack buffer.

    :param spans: ``(first byte, end byte, plan index)`` each plan writes.
    :raises ValueError: two spans overlap (names both plans and their byte ranges).
    """
    s = sorted(spans)
    for a, b in pairwise(s):
        if b[0] < a[1]:
            raise ValueError(
                f"plans {a[2]} and {b[2]} of one segment write overlapping pack-buffer bytes "
                f"[{a[0]}, {a[1]}) and [{b[0]}, {b[1]}): give each plan its own region"
            )


class TorchPacker:
    """Gather into preallocated region views (CPU default): ``numpy.take`` on CPU memory's
    zero-copy strided views, ``torch.index_select`` elsewhere.

    Satisfies :class:`pdplug.protocols.Packer`. One gather per pack entry; sub-rows are read as
    int64/int32/int16 words when the row size, the offsets and both addresses allow (bit-exact:
    integer views never convert). On CPU each of ``threads`` threads copies an equal share of
    every gather's rows (the caller's thread takes the first share); ``numpy.take`` releases
    the GIL, so they run in parallel. A row gather is bound by memory latency more than
    bandwidth, so on a machine with idle cores more threads help. Inside a sender the transfer
    engine copies the previous segment on a core of its own at the same time (UCX over shared
    memory copies in the posting thread), so the default leaves it one core: a gather thread
    on that core would only slow the copy it overlaps (``pdplug bench pack --pack-threads``
    compares both).

    :param threads: CPU gather threads, >= 1 (0 = ``default_threads()``: one less than
        ``torch.get_num_threads()``, at least 1).
    :param min_thread_rows: rows (over all gathers of a call) per extra thread: a smaller
        call uses fewer threads, since a hand-off costs more than it saves (>= 1).
    :raises ValueError: ``threads < 0`` or ``min_thread_rows < 1``.
    """

    kind = "torch"

    def __init__(self, threads: int = 0, min_thread_rows: int = _MIN_THREAD_ROWS) -> None:
        if threads < 0:
            raise ValueError(f"TorchPacker threads must be >= 0, got {threads}")
        if min_thread_rows < 1:
            raise ValueError(f"TorchPacker min_thread_rows must be >= 1, got {min_thread_rows}")
        self.threads = threads or default_threads()
        self.min_thread_rows = min_thread_rows
        self._pool: ThreadPoolExecutor | None = None
        self._pool_pid = 0
        self._lock = threading.Lock()
        self._views: dict[tuple[int, int, str], torch.Tensor] = {}
        self._extents: dict[int, tuple[Any, int, int]] = {}
        self._rows: dict[tuple[Any, ...], tuple[Any, Any]] = {}

    def _bytes(self, t: torch.Tensor | int, span: int) -> torch.Tensor:
        """:func:`entry_bytes` of a whole tensor, cached per (address, extent, device) (a sender
        packs from the same registered entries every time; a cached view keeps its storage
        alive, so an address is never reused under it), or ``span`` bytes at a raw address."""
        if isinstance(t, int):
            return entry_bytes(t, span)
        addr, ext = entry_extent(t)
        key = (addr, ext, str(t.device))
        v = self._views.get(key)
        if v is None:
            if len(self._views) > 1024:
                self._views.clear()
            v = self._views[key] = entry_bytes(t, ext)
        return v

    def _cpu_rows(
        self, t: torch.Tensor | int, span: int, rb: int, unit: int, w: int, dt: torch.dtype
    ) -> np.ndarray | torch.Tensor:
        """The entry's memory as ``[rows, rb // w]`` words, a row starting every ``unit``
        bytes (CPU, no copy): a numpy view where rows lie back to back (numpy's row take), a
        torch view where sub-rows leave gaps (numpy's take would copy the whole entry first).
        Cached per tensor (held by the cache, so its id is never reused while cached) and
        shape: the Python work of building views is a fifth of a segment's pack otherwise."""
        if isinstance(t, int):
            key: tuple[Any, ...] = (t, span, rb, unit, w)
        else:  # a tensor re-pointed in place (set_, .data =) gets a new key, never a stale view
            key = (id(t), t.data_ptr(), t.shape, t.stride(), rb, unit, w)
        hit = self._rows.get(key)
        if hit is not None and hit[0] is t:
            return hit[1]
        src = self._bytes(t, span)
        k = (src.numel() - rb) // unit + 1  # rows starting every unit bytes that fit
        words = src[: src.numel() // w * w].view(dt)
        cols, stride = rb // w, unit // w
        v: np.ndarray | torch.Tensor
        if stride == cols:
            a = words.numpy()
            v = np.lib.stride_tricks.as_strided(
                a, (k, cols), (stride * a.itemsize, a.itemsize), writeable=False
            )
        else:
            v = torch.as_strided(words, (k, cols), (stride, 1))
        if not isinstance(t, int):  # a raw address may be freed and reused: never cached
            if len(self._rows) > 1024:
                self._rows.clear()
            self._rows[key] = (t, v)
        return v

    def _executor(self) -> ThreadPoolExecutor:
        # a forked child inherits the pool object but not its threads: start a new one there
        with self._lock:
            if self._pool is None or self._pool_pid != os.getpid():
                self._pool = ThreadPoolExecutor(self.threads - 1, thread_name_prefix="pdplug-pack")
                self._pool_pid = os.getpid()
            return self._pool

    def pack(
        self,
        plan: TransferPlan,
        entries: Sequence[torch.Tensor | int],
        pack_buffer: torch.Tensor,
    ) -> None:
        """Gather the plan's rows or sub-rows of every pack entry into its region, in
        destination order. A plan that is not packed, or has no tokens, is a no-op.

        :param entries: one tensor (any dtype, any strides) per source KV entry (layout
            order), or on CPU its raw address (``int``).
        :param pack_buffer: uint8 ``[nbytes]`` on the entries' device.
        :raises ValueError: see :func:`check_pack`.
        """
        self.pack_all((plan,), entries, pack_buffer)

    def pack_all(
        self,
        plans: Sequence[TransferPlan],
        entries: Sequence[torch.Tensor | int],
        pack_buffer: torch.Tensor,
    ) -> None:
        """Gather a whole segment: every plan of ``plans`` (one per destination DCP rank,
        each into its own region) in one call, the same bytes as :meth:`pack` plan by plan.
        On CPU all plans' gathers are dealt to the gather threads together.

        :param plans: the segment's plans (plans that are not packed are skipped).
        :param entries: as :meth:`pack`.
        :param pack_buffer: uint8 ``[nbytes]`` on the entries' device.
        :raises ValueError: see :func:`check_pack`; plans writing overlapping bytes.
        """
        pb = pack_buffer.data_ptr()
        cpu = pack_buffer.device.type == "cpu"
        pack_np = pack_buffer.numpy() if cpu else None
        views: list[tuple[Any, Any, Any, Any]] = []  # device: (words, shape, out, rows)
        arrays: list[tuple[int, Any, Any, Any]] = []  # cpu: (entry, source rows, rows, out)
        spans: list[tuple[int, int, int]] = []
        for i, plan in enumerate(plans):
            if not plan.packed:
                continue
            gathers, need = check_pack(plan, entries, pack_buffer, self._extents)
            if need == 0:
                continue
            lo = hi = -1
            rows_of: dict[int, np.ndarray] = {}
            for ga in gathers:
                g = ga.group
                rb, unit = g.row_bytes, g.unit
                m = len(g.tokens) * len(g.cols)
                if m == 0:
                    continue
                lo = ga.offset if lo < 0 else min(lo, ga.offset)
                hi = max(hi, ga.offset + m * rb)
                rows = rows_of.get(id(g))
                if rows is None:
                    rows = rows_of[id(g)] = group_rows(g) // unit
                w, dt = widest(rb, unit, ga.addr, pb + ga.offset)
                if pack_np is not None:
                    src_rows = self._cpu_rows(entries[ga.entry], ga.span, rb, unit, w, dt)
                    o = pack_np[ga.offset : ga.offset + m * rb].view(_NP_WORD[w]).reshape(m, -1)
                    if isinstance(src_rows, torch.Tensor):
                        arrays.append((ga.entry, src_rows, torch.from_numpy(rows),
                                       torch.from_numpy(o)))  # fmt: skip
                    else:
                        arrays.append((ga.entry, src_rows, rows, o))
                    continue
                out = pack_buffer[ga.offset : ga.offset + m * rb].view(dt).view(m, rb // w)
                src = self._bytes(entries[ga.entry], ga.span)
                k = (src.numel() - rb) // unit + 1  # rows starting every unit bytes that fit
                words = src[: src.numel() // w * w].view(dt)
                views.append((words, (k, rb // w, unit // w), out, rows))
            if hi > lo:
                spans.append((lo, hi, i))
        check_disjoint(spans)
        if not cpu:
            for words, (k, cols, stride), out, idx in views:
                rows_v = torch.as_strided(words, (k, cols), (stride, 1))
                dev_idx = torch.from_numpy(idx).to(pack_buffer.device, non_blocking=True)
                torch.index_select(rows_v, 0, dev_idx, out=out)
            return
        # entry-major: the ranks' gathers of one entry run back to back, so the segment's rows
        # of that entry, read by the first, are still in cache for the others
        arrays.sort(key=lambda a: a[0])

        def gather(j: int, k: int) -> None:
            # thread j of k copies its share of every gather's rows (not a share of the
            # gathers: equal work for any number of entries, and k streams through each
            # entry). Rows were range-checked, so mode="clip" (no bounds pass, no buffering).
            for _e, s, i, o in arrays:
                m = i.shape[0]
                lo, hi = m * j // k, m * (j + 1) // k
                if hi <= lo:
                    continue
                if isinstance(s, np.ndarray):
                    np.take(s, i[lo:hi], axis=0, out=o[lo:hi], mode="clip")
                else:
                    torch.index_select(s, 0, i[lo:hi], out=o[lo:hi])

        rows = sum(a[2].shape[0] for a in arrays)
        k = min(self.threads, max(1, rows // self.min_thread_rows))
        if k <= 1:
            gather(0, 1)
            return
        futs = [self._executor().submit(gather, j, k) for j in range(1, k)]
        gather(0, k)
        for f in futs:
            f.result()


def make_packer(device: str = "cpu", kind: str = "auto", threads: int = 0) -> Packer:
    """Packer for ``device`` (``"cpu"``, ``"cuda"``, ``"cuda:1"`` …).

    ``kind="auto"``: Triton on CUDA when triton imports (else torch, logged), torch on CPU.
    ``kind="triton"`` on CPU needs ``TRITON_INTERPRET=1`` (checked at ``pack`` time).
    ``threads``: the torch packer's CPU gather threads (0 = :func:`default_threads`).

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
