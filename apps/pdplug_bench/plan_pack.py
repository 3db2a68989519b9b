"""Packer part of ``pdplug bench plan``: a whole segment packed as the sender does it.

One full segment (``--chunk-bound`` tokens; ``chunk_bound / dcp`` rows per entry per rank,
every routed decode TP rank) is planned for every destination DCP rank and packed:

* **whole segment** — ``packer.pack_all(plans)``: one call; on CUDA one launch table, one
  upload and one Triton launch;
* **per rank** — ``packer.pack(plan)`` for each plan (the path before ``pack_all``);
* **copy** — ``dst.copy_(src)`` of the same number of bytes, side by side in one run.

A pair the planner sends directly (MLA at DCP 1) is packed as whole rows anyway, so that
the kernel is measured at DCP 1 too (``forced_whole_rows``).

Before timing, both pack paths' bytes are compared with a reference gather into a buffer
filled alike (numpy on CPU, the torch packer on the device with ``--device cuda``); any
difference exits non-zero. Ratios are the median over repeats of each pack paired with the
copy measured right after it.

On CUDA, GPU time excludes host gaps: each timed call is enqueued behind a spin kernel
(``torch.cuda._sleep``) sized from the measured host enqueue time (3x, calibrated in cycles
per second), so the GPU starts the pack only once all of it is queued; the repeats whose
enqueue outlasted the spin are counted. The host-included figure (table build, upload,
launch and the GPU, synchronised) is reported beside it. The Triton packer's host
preparation (checks + launch table, no upload) is timed apart at the full ``--layers`` count:
for a cached segment shape (every segment after the first of its shape) and a new one.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from typing import Any

__all__ = ["packer_bench", "prep_bench", "CUDA_FIELDS"]

#: result fields only ``--device cuda`` measures (besides the common ones)
CUDA_FIELDS = (
    "gpu_time_method",
    "packer_gbps_host_included",
    "host_included_vs_memcpy",
    "enqueue_us_whole",
    "enqueue_us_per_rank",
    "spin_covered",
    "spin_covered_per_rank",
    "prep_us_p50",
    "torch_packer_gbps",
)


def _p50(xs: list[float]) -> float:
    return statistics.median(xs)


def _segment(args: dict[str, Any], layers: int, pool_factor: int = 4) -> dict[str, Any]:
    """Layouts, regions and the plans of one full segment for every destination rank."""
    import numpy as np

    from pdplug import PlannerConfig, get_plugin_manager
    from pdplug.packing import pack_regions, plan_all_ranks
    from pdplug.types import SendChunk
    from pdplug_bench.plan_layouts import bench_layouts

    d = args["dcp"]
    seg_tokens = args["chunk_bound"]
    planner = get_plugin_manager().make_pack_planner(PlannerConfig(), name=args["planner"])
    src, dsts = bench_layouts({**args, "layers": layers})
    forced = False
    if d == 1 and not any(planner.needs_relayout(src, dst) for dst in dsts):
        forced = True  # the planner sends directly: pack whole rows anyway (kernel at DCP 1)
        dsts = dsts[:1]
    else:
        dsts = [dst for dst in dsts if planner.needs_relayout(src, dst)]
    if not dsts:
        return {"planner": planner, "plans": []}
    p = src.page_size
    vp = dsts[0].page_size * d
    regions = pack_regions(src, dst_dcp_size=d * len(dsts), depth=1,
                           region_tokens=-(-seg_tokens // d))  # fmt: skip
    # a region holds whole pages: at a DCP size that does not divide the bound, the segment
    # is what the scheduler would cut at the pack capacity
    seg_tokens = min(seg_tokens, regions[0].capacity_tokens * d)
    pool_pages = pool_factor * seg_tokens // p  # source KV larger than the segment
    rng = np.random.default_rng(1)
    chunk = SendChunk(
        room=1,
        src_pages=rng.permutation(pool_pages)[: seg_tokens // p].astype(np.int64),
        dst_pages=np.arange(-(-seg_tokens // vp), dtype=np.int64),
        num_tokens=seg_tokens,
        is_last=False,
    )
    if forced:
        plans = [_whole_rows(src, chunk, regions[0])]
    else:
        plans = [
            pl
            for i, dst in enumerate(dsts)
            for pl in plan_all_ranks(planner, chunk, src, dst, regions[i * d : (i + 1) * d])
        ]
    return {"planner": planner, "src": src, "dsts": dsts, "regions": regions, "forced": forced,
            "plans": plans, "pool_pages": pool_pages, "chunk": chunk}  # fmt: skip


def _whole_rows(src: Any, chunk: Any, region: Any) -> Any:
    """A packed plan gathering every token's whole row of every entry into ``region``
    (token-major, entry after entry), for a pair the planner sends directly (MLA at DCP 1):
    the pack kernel measured at DCP 1. Its runs are not planned (none are posted here)."""
    import numpy as np

    from pdplug.types import PackGroup, TransferPlan

    p, n = src.page_size, chunk.num_tokens
    t = np.arange(n, dtype=np.int64)
    slots = chunk.src_pages[t // p] * p + t % p
    rb = src.entry_bytes_per_token
    empty = np.zeros(0, dtype=np.int64)
    groups = []
    off = region.offset
    for b in sorted(set(rb)):  # one group per row size (MLA: one)
        es = tuple(e for e in range(src.num_entries) if rb[e] == b)
        offs = off + n * b * np.arange(len(es), dtype=np.int64)
        offs.flags.writeable = False
        groups.append(PackGroup(entries=es, offsets=offs, tokens=slots, cols=(0,), row_bytes=b,
                                unit=b))  # fmt: skip
        off += n * b * len(es)
    order = tuple(e for g in groups for e in g.entries)
    return TransferPlan(
        room=chunk.room, chunk_id=0, is_last=False, dst_dcp_rank=0, num_tokens=n, packed=True,
        entry=empty, src_offset=empty, dst_offset=empty, length=empty, region=region,
        pack_src_slots=empty, pack_entries=order, pack_row_bytes=tuple(rb[e] for e in order),
        pack_groups=tuple(groups),
    )  # fmt: skip


def prep_bench(args: dict[str, Any], repeats: int = 200) -> dict[str, Any]:
    """Host preparation of the Triton packer's whole-segment launch (``prepare``: checks +
    launch table, no upload, no launch) at ``--layers`` entries, on CPU tensors whose memory
    is never touched: p50/min microseconds for a cached segment shape and for a new one.
    Empty when triton is not importable or nothing is packed."""
    import torch

    s = _segment(args, args["layers"], pool_factor=2)
    plans = s["plans"]
    if not plans:
        return {}
    try:
        packer = s["planner"].packer("cpu", "triton")  # prepare() runs without a device
    except RuntimeError as e:
        return {"prep_skipped": str(e)}
    src = s["src"]
    entries = [torch.empty(s["pool_pages"] * src.entry(e).page_stride, dtype=torch.uint8)
               for e in range(src.num_entries)]  # fmt: skip
    last = s["regions"][-1]
    buf = torch.empty(last.offset + last.nbytes, dtype=torch.uint8)
    launch = packer.prepare(plans, entries, buf)
    hit: list[float] = []
    miss: list[float] = []
    for i in range(repeats):
        t0 = time.perf_counter()
        packer.prepare(plans, entries, buf)
        hit.append(time.perf_counter() - t0)
        if i % 10 == 0:  # a shape never seen (the entries' extents computed again too)
            packer.clear_cache()
            t0 = time.perf_counter()
            packer.prepare(plans, entries, buf)
            miss.append(time.perf_counter() - t0)
    return {
        "prep_us_p50": _p50(hit) * 1e6,
        "prep_us_min": min(hit) * 1e6,
        "prep_new_shape_us_p50": _p50(miss) * 1e6,
        "prep_entries": src.num_entries,
        "prep_rows": sum(pl.num_tokens for pl in plans) // len(s["dsts"]),
        "prep_plans": len(plans),
        "prep_gathers": launch.gathers if launch else 0,
        "prep_tile": list(launch.tile) if launch else None,
    }


#: bytes compared at a time by the byte check (bounds its mask: 9 bytes per byte compared)
_CMP_BLOCK = 64 << 20


def _mismatched(ref: Any, buf: Any) -> int:
    """Bytes where ``buf`` differs from ``ref`` (uint8 tensors of one size), compared in blocks
    of :data:`_CMP_BLOCK` bytes so the comparison's temporaries stay small."""
    import torch

    return sum(
        int(torch.count_nonzero(ref[i : i + _CMP_BLOCK] != buf[i : i + _CMP_BLOCK]).item())
        for i in range(0, ref.numel(), _CMP_BLOCK)
    )


def check_memory(need: int, device: Any, what: str) -> None:
    """Refuse a benchmark that would not fit: ``need`` bytes against 80% of the memory
    available now (``MemAvailable`` on CPU, free device memory on CUDA).

    :raises click.UsageError: it does not fit (names the sizes and the options to shrink).
    """
    import click
    import torch

    from pdplug_bench.machine import available_bytes

    avail = torch.cuda.mem_get_info(device)[0] if device.type == "cuda" else available_bytes()
    if need > 0.8 * avail:
        raise click.UsageError(
            f"the packer benchmark needs {need / 2**30:.1f} GiB ({what}) but {device} has "
            f"{avail / 2**30:.1f} GiB available; use fewer --pack-layers, a smaller "
            "--chunk-bound or fewer decode ranks (--tp, --dcp)"
        )


def packer_bench(args: dict[str, Any], device: str, repeats: int) -> dict[str, Any]:
    """Whole-segment pack vs per-rank packs vs a copy (see module docstring)."""
    import torch

    from pdplug.packing import pack_segment
    from pdplug_bench.plan_layouts import reference_pack

    cuda = device.startswith("cuda")
    layers = args["pack_layers"] or (args["layers"] if cuda else 16)
    s = _segment(args, layers)
    plans = s["plans"]
    if not plans:
        return {"packer": None, "why": "no decode rank of this layout pair needs packing"}
    src, planner = s["src"], s["planner"]
    dev = torch.device(device)
    gen = torch.Generator(device=dev).manual_seed(0)
    entries = [
        torch.randint(0, 256, (s["pool_pages"] * src.entry(e).page_stride,), dtype=torch.uint8,
                      device=dev, generator=gen)
        for e in range(src.num_entries)
    ]  # fmt: skip
    last = s["regions"][-1]
    nbytes = sum(pl.num_tokens * sum(pl.pack_row_bytes) for pl in plans)  # bytes packed
    entry_bytes = s["pool_pages"] * sum(src.entry(e).page_stride for e in range(src.num_entries))
    buf_bytes = last.offset + last.nbytes
    # the byte check holds a reference buffer as large as the buffer (compared block by block)
    check_memory(entry_bytes + 2 * buf_bytes + 2 * nbytes + 2 * _CMP_BLOCK, dev,
                 f"{src.num_entries} KV entries of {s['pool_pages']} pages, a {buf_bytes:,}-byte "
                 f"pack buffer and its reference, and a {nbytes:,}-byte copy")  # fmt: skip
    buf = torch.empty(last.offset + last.nbytes, dtype=torch.uint8, device=dev)
    copy_src = torch.randint(0, 256, (nbytes,), dtype=torch.uint8, device=dev, generator=gen)
    copy_dst = torch.empty_like(copy_src)
    packer = planner.packer(device)

    def whole() -> None:
        pack_segment(packer, plans, entries, buf)

    def per_rank() -> None:
        for pl in plans:
            packer.pack(pl, entries, buf)

    def copy() -> None:
        copy_dst.copy_(copy_src)

    res: dict[str, Any] = {"packer": getattr(packer, "kind", type(packer).__name__)}
    # correctness before timing: buffers filled alike, every byte compared, both pack paths
    ref = torch.full_like(buf, 0xA5)
    if cuda:  # Triton vs the torch packer on the device
        torch_packer = planner.packer(device, "torch")
        pack_segment(torch_packer, plans, entries, ref)
        res["reference"] = "torch packer on the device"
    else:  # the packer vs a numpy gather
        ref_np = ref.numpy()
        src_np = [t.numpy() for t in entries]
        for pl in plans:
            reference_pack(pl, src_np, ref_np)
        res["reference"] = "numpy sub-row gather"
    bad = {}
    for name, fn in (("whole", whole), ("per_rank", per_rank)):
        buf.fill_(0xA5)
        fn()
        bad[name] = _mismatched(ref, buf)
    res["mismatched_bytes"] = bad["whole"] + bad["per_rank"]
    res["mismatched_bytes_by_path"] = bad
    res["bit_exact"] = res["mismatched_bytes"] == 0
    res["launch"] = {k: (list(v) if isinstance(v, tuple) else v)
                     for k, v in getattr(packer, "last_launch", {}).items()}  # fmt: skip
    timer: _CpuTimer = _CudaTimer(repeats) if cuda else _CpuTimer(repeats)
    t_whole, t_rank, t_copy = timer.run(whole, per_rank, copy)
    res.update(
        packer_gbps=nbytes / t_whole / 1e9,
        per_rank_gbps=nbytes / t_rank / 1e9,
        memcpy_gbps=nbytes / t_copy / 1e9,
        pack_ms_p50=t_whole * 1e3,
        per_rank_ms_p50=t_rank * 1e3,
        memcpy_ms_p50=t_copy * 1e3,
        # the headline ratio pairs each pack with the copy right after it (memory bandwidth
        # drifts between repeats); the ratio of the medians is kept alongside
        packer_vs_memcpy=_p50(timer.ratios[0]),
        packer_vs_memcpy_range=[min(timer.ratios[0]), max(timer.ratios[0])],
        per_rank_vs_memcpy=_p50(timer.ratios[1]),
        packer_vs_memcpy_of_medians=t_copy / t_whole,
        whole_vs_per_rank=t_rank / t_whole,
        packed_bytes=nbytes,
        forced_whole_rows=s["forced"],
        pack_layers=layers,
        pack_plans=len(plans),
        pack_rows_per_entry=sum(pl.num_tokens for pl in plans) // len(s["dsts"]),
        pack_subrows=sum(len(g.tokens) * len(g.cols) for pl in plans for g in pl.pack_groups),
        source_slots_per_entry=s["pool_pages"] * src.page_size,
        pack_threads=getattr(packer, "threads", None),
        device=device,
    )
    if isinstance(timer, _CudaTimer):
        res.update(timer.extra(whole, per_rank, nbytes, t_copy))
        prepare = getattr(packer, "prepare", None)  # the Triton packer's host work alone
        if prepare is not None:
            prep: list[float] = []
            for _ in range(max(repeats, 50)):
                t0 = time.perf_counter()
                prepare(plans, entries, buf)
                prep.append(time.perf_counter() - t0)
            res["prep_us_p50"] = _p50(prep) * 1e6

        ts = []  # the torch packer (index_select per entry): host included, a few repeats
        for _ in range(3):
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            pack_segment(torch_packer, plans, entries, ref)
            torch.cuda.synchronize()
            ts.append(time.perf_counter() - t0)
        res["torch_packer_gbps"] = nbytes / min(ts) / 1e9
    return res


class _CpuTimer:
    """p50 wall seconds of each function, interleaved per repeat so drift hits all alike;
    ``ratios[i]`` = per-repeat ``t(last fn) / t(fn i)``."""

    def __init__(self, repeats: int) -> None:
        self.repeats = repeats
        self.ratios: list[list[float]] = []

    def once(self, fn: Callable[[], None]) -> float:
        t0 = time.perf_counter()
        fn()
        return time.perf_counter() - t0

    def run(self, *fns: Callable[[], None]) -> list[float]:
        for fn in fns:
            fn()  # warm-up (Triton JIT, first touch of the output pages)
        ts: list[list[float]] = [[] for _ in fns]
        for _ in range(self.repeats):
            for i, fn in enumerate(fns):
                ts[i].append(self.once(fn))
        if len(fns) > 1:
            self.ratios = [[c / a for a, c in zip(t, ts[-1])] for t in ts[:-1]]
        return [_p50(t) for t in ts]


class _CudaTimer(_CpuTimer):
    """GPU time of each function behind a spin kernel sized from its host enqueue time."""

    def __init__(self, repeats: int) -> None:
        import torch

        super().__init__(repeats)
        self.torch = torch
        self.spin = getattr(torch.cuda, "_sleep", None)
        self.cycles_per_s = 0.0
        self.enqueue_s: dict[int, float] = {}
        self.covered: dict[int, list[bool]] = {}
        if self.spin is not None:  # calibrate: cycles of the spin kernel per second
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(True)
            self.spin(1_000_000)
            start.record()
            self.spin(10_000_000)
            end.record()
            end.synchronize()
            self.cycles_per_s = 10_000_000 / (start.elapsed_time(end) / 1e3)

    def _enqueue(self, fn: Callable[[], None]) -> float:
        """Host seconds to enqueue ``fn`` (p50 of a few, GPU kept busy meanwhile)."""
        ts = []
        for _ in range(5):
            if self.spin is not None:
                self.spin(int(self.cycles_per_s * 0.005))
            t0 = time.perf_counter()
            fn()
            ts.append(time.perf_counter() - t0)
            self.torch.cuda.synchronize()
        return _p50(ts)

    def once(self, fn: Callable[[], None]) -> float:
        torch = self.torch
        key = id(fn)
        if key not in self.enqueue_s:
            self.enqueue_s[key] = self._enqueue(fn)
        spin_s = max(3 * self.enqueue_s[key], 200e-6)
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(True)
        t0 = time.perf_counter()
        if self.spin is not None:
            self.spin(int(self.cycles_per_s * spin_s))
        start.record()
        fn()
        end.record()
        host = time.perf_counter() - t0
        end.synchronize()
        self.covered.setdefault(key, []).append(self.spin is not None and host < spin_s)
        return start.elapsed_time(end) / 1e3

    def extra(
        self,
        whole: Callable[[], None],
        per_rank: Callable[[], None],
        nbytes: int,
        t_copy: float,
    ) -> dict[str, Any]:
        """Host-included time of the whole-segment pack and the spin's coverage."""
        torch = self.torch
        host = []
        for _ in range(self.repeats):
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            whole()
            torch.cuda.synchronize()
            host.append(time.perf_counter() - t0)
        t_host = _p50(host)
        cov = self.covered.get(id(whole), [])
        cov_rank = self.covered.get(id(per_rank), [])
        return {
            "gpu_time_method": (
                "cuda events behind a spin kernel sized from the host enqueue time"
                if self.spin is not None
                else "cuda events (no spin kernel: host gaps included)"
            ),
            "packer_gbps_host_included": nbytes / t_host / 1e9,
            "host_included_vs_memcpy": t_copy / t_host,
            "enqueue_us_whole": self.enqueue_s.get(id(whole), 0.0) * 1e6,
            "enqueue_us_per_rank": self.enqueue_s.get(id(per_rank), 0.0) * 1e6,
            "spin_covered": [sum(cov), len(cov)],
            "spin_covered_per_rank": [sum(cov_rank), len(cov_rank)],
        }
