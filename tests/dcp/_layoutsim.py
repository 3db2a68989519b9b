"""Byte-level simulation of prefill -> decode sends over real layouts (helper for the tests).

A model has ``E`` entries (layers x K|V/K/V/latent) of ``H`` global KV heads; its logical KV is
``G[e, g, t, :hb]`` (random bytes). Each prefill TP rank's memory holds its heads of every
entry at the addresses its :class:`~pdplug.kvtypes.KVLayout` says (every other byte random);
each decode rank's memory starts poisoned. :func:`simulate` plans every send the way a KV
sender does (scheduler split at the pack capacity, one plan per segment and destination rank,
pack, write runs) and counts every byte written; :func:`expected` is the per-token-per-head
reference.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import numpy as np
import torch

from pdplug import KVLayout, PlannerConfig, SchedulerConfig
from pdplug.geometry import make_layout
from pdplug.heads import kv_head_range, routed_heads
from pdplug.packing import (
    pack_regions,
    region_index,
    run_addresses,
    segment_to_chunk,
    send_capacity_tokens,
)
from pdplug_dcp.packers import TorchPacker
from pdplug_dcp.planner import make_dcp_planner
from pdplug_scheduler.scheduler import make_scheduler

POISON = 0xA5
PACK = 1 << 40  # source addresses at or above this read the pack buffer

KINDS = ("nhd", "hnd", "hnd_split", "mla")
#: (prefill TP, decode TP, KV heads)
TPS = ((1, 1, 4), (1, 2, 4), (2, 1, 4), (4, 2, 2), (2, 4, 2))
#: prefill page / decode page
RATIOS = (1.0, 2.0, 0.5)
DCPS = (1, 2, 4)


@dataclass
class Rank:
    """One rank's layout and memory (``mem`` uint8; entry ``e`` starts at ``base[e]``)."""

    layout: KVLayout
    mem: np.ndarray
    base: list[int]
    count: np.ndarray | None = None
    tensors: list[torch.Tensor] = field(default_factory=list)


def build(
    kind: str, page: int, tp: int, rank: int, heads: int, layers: int, hb: int, pages: int,
    *, dcp: int = 1, dcp_rank: int = 0, interleave: bool = False,
) -> Rank:  # fmt: skip
    """A rank of ``kind`` with ``pages`` pages per entry; ``interleave`` puts every entry's
    page ``p`` side by side in one storage (vLLM cross-layer), else entry after entry."""
    split = kind == "hnd_split"
    k = "hnd" if split else kind
    if k == "mla":
        heads = 1
    probe = make_layout(
        kind=k, page_size=page, num_layers=layers, head_bytes=hb, num_kv_heads=heads,
        split_kv=split, tp_size=tp, tp_rank=rank, dcp_size=dcp, dcp_rank=dcp_rank,
    )  # fmt: skip
    e = probe.num_entries
    pb = page * probe.entry_bytes_per_token[0]
    stride = e * pb if interleave else 0
    lay = make_layout(
        kind=k, page_size=page, num_layers=layers, head_bytes=hb, num_kv_heads=heads,
        split_kv=split, tp_size=tp, tp_rank=rank, dcp_size=dcp, dcp_rank=dcp_rank,
        page_stride=stride,
    )  # fmt: skip
    base = [i * pb if interleave else i * pages * pb for i in range(e)]
    return Rank(lay, np.zeros(e * pages * pb, dtype=np.uint8), base)


def heads_of(lay: KVLayout) -> tuple[int, int]:
    """Global heads ``[lo, hi)`` of a layout's entries."""
    return kv_head_range(lay.num_kv_heads, lay.tp_size, lay.tp_rank)


def addr(r: Rank, e: int, page: np.ndarray, off: np.ndarray, h: int) -> np.ndarray:
    """Byte address in ``r.mem`` of head sub-row ``h`` (local) of tokens at ``(page, off)``."""
    g = r.layout.entry(e)
    return r.base[e] + page * g.page_stride + off * g.token_stride + h * g.head_stride


def fill_source(r: Rank, kv: np.ndarray, req_pages: np.ndarray, n_tokens: int, rng) -> None:
    """Random bytes everywhere, then the model's KV of tokens ``[0, n_tokens)`` at their
    addresses (token ``t`` in ``req_pages[t // page]``)."""
    r.mem[:] = rng.integers(0, 256, r.mem.shape[0], dtype=np.uint8)
    p = r.layout.page_size
    t = np.arange(n_tokens)
    lo, hi = heads_of(r.layout)
    for e in range(r.layout.num_entries):
        hb = r.layout.entry(e).head_bytes
        for h in range(hi - lo):
            a = addr(r, e, req_pages[t // p], t % p, h)
            r.mem[a[:, None] + np.arange(hb)] = kv[e, lo + h, :n_tokens, :hb]
    r.tensors = [torch.from_numpy(r.mem)[b:] for b in r.base]


def expected(
    dst: Rank, kv: np.ndarray, dst_pages: np.ndarray, prefix: int, total: int
) -> tuple[np.ndarray, np.ndarray]:
    """Per-token-per-head reference: poison, then every token this decode rank owns, head by
    head, copied byte by byte from the model's KV.

    :returns: the expected memory and a boolean mask of the bytes the reference wrote.
    """
    lay = dst.layout
    out = np.full_like(dst.mem, POISON)
    mask = np.zeros(dst.mem.shape[0], dtype=bool)
    d, p = lay.dcp_size, lay.page_size
    lo, hi = heads_of(lay)
    for i in range(prefix, prefix + total):
        if i % d != lay.dcp_rank:
            continue
        local = (i - prefix) // d
        page, off = int(dst_pages[local // p]), local % p
        for e in range(lay.num_entries):
            hb = lay.entry(e).head_bytes
            for h in range(hi - lo):
                a = int(addr(dst, e, np.array(page), np.array(off), h))
                out[a : a + hb] = kv[e, lo + h, i, :hb]
                mask[a : a + hb] = True
    return out, mask


def dst_ranges(dst: Rank, entry: np.ndarray, addr: np.ndarray, length: np.ndarray) -> int:
    """Contiguous pieces of the destination bytes written by runs ``(entry, addr, length)``,
    cut at page boundaries: no plan can write them with fewer runs."""
    if addr.shape[0] == 0:
        return 0
    order = np.lexsort((addr, entry))
    a, ln, ent = addr[order], length[order], entry[order]
    base = np.asarray(dst.base)
    ps = np.asarray([dst.layout.entry(e).page_stride for e in range(len(dst.base))])
    page = (a - base[ent]) // ps[ent]
    joined = (a[1:] == a[:-1] + ln[:-1]) & (page[1:] == page[:-1]) & (ent[1:] == ent[:-1])
    return int(a.shape[0] - joined.sum())


def check_run(plan, dst: Rank, src: Rank, e: int, so: int, do: int, ln: int) -> None:
    """A run stays inside one destination page and reads inside its region when packed."""
    g = dst.layout.entry(int(e))
    rel = do - dst.base[int(e)]
    assert ln > 0
    assert rel // g.page_stride == (rel + ln - 1) // g.page_stride, "run crosses a dst page"
    if so >= PACK:
        reg = plan.region
        assert reg.offset <= so - PACK and so - PACK + ln <= reg.offset + reg.nbytes


def simulate(
    src_ranks: list[Rank], dst: Rank, req_pages: np.ndarray, dst_pages: np.ndarray,
    prefix: int, total: int, chunk_size: int, region_pages: int, packer=None, planner=None,
    fewest: bool = True,
) -> dict[str, int]:  # fmt: skip
    """Every prefill rank sends the range ``[prefix, prefix + total)`` to decode rank ``dst``
    as a KV sender would; writes land in ``dst.mem`` and are counted in ``dst.count``.
    ``fewest``: every plan has exactly as many runs as the destination byte ranges it writes
    (inside a page) are contiguous pieces, the least any plan can post."""
    planner = planner or make_dcp_planner(PlannerConfig())
    packer = packer or TorchPacker(1)
    dst.count = np.zeros(dst.mem.shape[0], dtype=np.int32)
    stats = {"plans": 0, "runs": 0, "packed": 0, "sources": 0}
    lay_d = dst.layout
    for src in src_ranks:
        lay = src.layout
        if routed_heads(lay, lay_d) is None:
            continue
        stats["sources"] += 1
        p = lay.page_size
        d = lay_d.dcp_size
        regions = pack_regions(
            lay, dst_dcp_size=d, depth=2, region_tokens=region_pages * p, align=8
        )
        relayout = planner.needs_relayout(lay, lay_d)
        cap = send_capacity_tokens(regions[0], d) if relayout else None
        # the scheduler splits on whole pages from decode_prefix_len; a prefix inside a prefill
        # page (prefill page > decode virtual page) splits on the pages both sides share
        sp = p if prefix % p == 0 else math.gcd(p, lay_d.virtual_page_size)
        sched = make_scheduler(SchedulerConfig(page_size=sp, chunk_size=chunk_size))
        segs = sched.split_send(
            token_start=prefix, token_end=prefix + total, decode_prefix_len=prefix,
            is_last_send=True, capacity_tokens=cap,
        )  # fmt: skip
        pack = torch.full((regions[-1].offset + regions[-1].nbytes,), POISON, dtype=torch.uint8)
        for seg in segs:
            chunk = segment_to_chunk(
                7, seg, req_pages[seg.token_start // p :], dst_pages, prefix, p
            )
            rg = regions[region_index(lay_d.dcp_rank, seg.chunk_id, 2)] if relayout else None
            plan = planner.plan(chunk, lay, lay_d, lay_d.dcp_rank, rg)
            assert plan.packed == (relayout and rg is not None)
            stats["plans"] += 1
            stats["runs"] += plan.num_runs
            if plan.packed:
                stats["packed"] += 1
                packer.pack(plan, src.tensors, pack)
            s, t, ln = run_addresses(plan, src.base, dst.base, np.arange(lay.num_entries), PACK)
            if fewest:
                assert plan.num_runs == dst_ranges(dst, plan.entry, t, ln), "not the fewest runs"
            packed_mem = pack.numpy()
            prev = None
            for e, so, do, n in zip(plan.entry.tolist(), s.tolist(), t.tolist(), ln.tolist()):
                check_run(plan, dst, src, e, so, do, n)
                data = packed_mem[so - PACK : so - PACK + n] if so >= PACK else src.mem[so : so + n]
                dst.mem[do : do + n] = data
                dst.count[do : do + n] += 1
                if prev is not None and prev[0] == e:
                    g = lay_d.entry(e)
                    same_page = (prev[2] - 1 - dst.base[e]) // g.page_stride == (
                        do - dst.base[e]
                    ) // g.page_stride
                    assert not (prev[1] == so and prev[2] == do and same_page), (
                        "two runs should have been merged"
                    )
                prev = (e, so + n, do + n)
    return stats
