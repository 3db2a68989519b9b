"""Run in a subprocess with TRITON_INTERPRET=1 (set before triton is imported): compare the
Triton packer with the torch packer and a numpy reference, byte for byte, on random row cases;
then run whole planned sends over real layouts (strided views into shared storages, head
sub-rows, head-major regions) with the Triton packer and compare every destination byte with
the per-token-per-head reference.

Whole segments: every destination DCP rank's plan of random segments (MLA fp8/bf16 rows,
HND head sub-rows in head-major regions, NHD head slices, mixed row sizes, odd rows, misaligned
regions) packed with ``TritonPacker.pack_all`` in exactly one launch, compared byte for byte
with ``TorchPacker.pack_all``, per-rank ``pack`` and a numpy reference; a second pack of the
same shape reuses the cached launch table and still range-checks every token offset.

Usage: ``TRITON_INTERPRET=1 python triton_worker.py SEED`` -> prints one JSON line
``{"cases": N, "layouts": M, "segments": S, "mismatches": [...], "words": [...], "tiles":
[...]}``; exit code 1 on any mismatch.
"""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path

assert os.environ.get("TRITON_INTERPRET") == "1", "set TRITON_INTERPRET=1 before starting"
sys.path.insert(0, str(Path(__file__).parent))

import _layoutsim as ls  # noqa: E402
import msgspec  # noqa: E402
import numpy as np  # noqa: E402
import torch  # noqa: E402

import pdplug_dcp.triton_pack as tp  # noqa: E402
from pdplug import KVLayout  # noqa: E402
from pdplug.geometry import make_layout  # noqa: E402
from pdplug.packing import group_rows, pack_groups, pack_regions  # noqa: E402
from pdplug.types import PackRegion, SendChunk, TransferPlan  # noqa: E402
from pdplug_dcp.packers import TorchPacker, make_packer  # noqa: E402
from pdplug_dcp.planner import make_dcp_planner  # noqa: E402
from pdplug_dcp.triton_pack import TritonPacker, gather_rows_kernel  # noqa: E402

POISON = 0xA5

#: (kind, (prefill TP, decode TP, heads), prefill page / decode page, DCP, interleaved storage)
LAYOUTS = [
    ("hnd", (1, 2, 4), 2.0, 2, True),  # head sub-rows, head-major region, page ratio
    ("hnd_split", (2, 1, 4), 0.5, 4, False),
    ("nhd", (1, 2, 4), 1.0, 1, True),  # NHD head slice: packed at DCP 1
    ("mla", (4, 2, 2), 1.0, 4, True),
    ("hnd", (2, 4, 2), 1.0, 2, False),
]


def case(rng, row_bytes, n, slots_per_entry, region_offset, dtypes):
    entries = []
    for b, dt in zip(row_bytes, dtypes):
        raw = torch.from_numpy(rng.integers(1, 256, slots_per_entry * b, dtype=np.uint8))
        t = (
            raw.view(dt)
            if (b * slots_per_entry) % torch.empty(0, dtype=dt).element_size() == 0
            else raw
        )
        entries.append(t)
    slots = rng.integers(0, slots_per_entry, n).astype(np.int64)
    need = n * sum(row_bytes)
    region = PackRegion(index=1, offset=region_offset, nbytes=need + 5, capacity_tokens=n)
    plan = TransferPlan(
        room=1, chunk_id=0, is_last=True, dst_dcp_rank=0, num_tokens=n, packed=True,
        entry=np.zeros(0, np.int64), src_offset=np.zeros(0, np.int64),
        dst_offset=np.zeros(0, np.int64), length=np.zeros(0, np.int64), region=region,
        pack_src_slots=slots, pack_entries=tuple(range(len(row_bytes))),
        pack_row_bytes=tuple(row_bytes),
    )  # fmt: skip
    size = region_offset + region.nbytes + 64
    ref = np.full(size, POISON, dtype=np.uint8)
    off = region_offset
    for t, b in zip(entries, row_bytes):
        rows = t.reshape(-1).view(torch.uint8).numpy().reshape(-1, b)
        ref[off : off + n * b] = rows[slots].reshape(-1)
        off += n * b
    outs = {}
    tri = TritonPacker()
    buf = torch.empty(size, dtype=torch.uint8)  # same buffer: the 2nd triton pack hits the cache
    for name, packer in (("torch", TorchPacker()), ("triton", tri), ("triton-cached", tri)):
        buf.fill_(POISON)
        packer.pack(plan, entries, buf)
        outs[name] = buf.numpy().copy()
    if n:  # slots are range-checked
        bad = msgspec.structs.replace(plan, pack_src_slots=np.full(n, slots_per_entry))
        try:
            tri.pack(bad, entries, buf)
            outs["triton-range-check"] = None
        except ValueError:
            pass
    launch = tri.last_launch
    return ref, outs, (launch.get("word_bytes", 0), launch.get("vec", 0))


def main(seed: int) -> int:
    rng = np.random.default_rng(seed)
    assert isinstance(make_packer("cpu", "triton"), TritonPacker)
    assert type(gather_rows_kernel).__name__ == "InterpretedFunction"
    assert tp.gather_rows_kernel is gather_rows_kernel
    mismatches = []
    words = []
    fp8 = getattr(torch, "float8_e4m3fn", torch.uint8)
    cases = [
        # (row bytes per entry, n, slots, region offset, dtypes)
        ((576, 576, 576), 70, 300, 0, (fp8, fp8, fp8)),  # MLA fp8 rows: int64 words, VEC 2
        ((1152, 64), 33, 100, 256, (torch.bfloat16, torch.float32)),  # K/V-like, two sizes
        ((12, 20, 4), 50, 80, 4, (torch.float32, torch.int32, torch.float32)),  # int32 words
        ((6, 10), 41, 60, 2, (torch.bfloat16, torch.float16)),  # int16 words
        ((7, 3, 5), 29, 40, 0, (torch.uint8,) * 3),  # odd rows: byte words
        ((16, 16), 64, 64, 3, (torch.float32, torch.float32)),  # misaligned region -> bytes
        ((8,), 1, 5, 0, (torch.float64,)),  # one row
        ((32, 8), 0, 5, 0, (torch.float32, torch.int64)),  # no rows: nothing written
    ]
    for _ in range(4):  # random extra cases
        m = int(rng.integers(1, 5))
        rb = tuple(int(x) for x in rng.choice([1, 2, 3, 4, 8, 12, 16, 24, 40, 72], m))
        cases.append(
            (rb, int(rng.integers(1, 90)), 120, int(rng.integers(0, 17)), (torch.uint8,) * m)
        )
    for i, (rb, n, slots, off, dts) in enumerate(cases):
        ref, outs, word = case(rng, rb, n, slots, off, dts)
        words.append(word)
        for name, got in outs.items():
            if got is None:
                mismatches.append(f"case {i} {name}: out-of-range slot accepted")
            elif not np.array_equal(got, ref):
                bad = np.flatnonzero(got != ref)
                mismatches.append(f"case {i} {name}: {bad.size} bytes differ, first at {bad[0]}")
    for kind, tps, ratio, dcp, inter in LAYOUTS:
        for bad in layout_send(kind, tps, ratio, dcp, inter, rng):
            mismatches.append(f"{kind} tp {tps} ratio {ratio} dcp {dcp}: {bad}")
    tiles = []
    for name, src, dst, shift, dtype in SEGMENTS:
        t0 = time.perf_counter()
        bad, tile = segment_case(rng, src, dst, shift, dtype)
        print(f"{name}: {time.perf_counter() - t0:.1f} s", file=sys.stderr)
        mismatches += [f"segment {name}: {b}" for b in bad]
        tiles.append([name, *tile])
    print(
        json.dumps(
            {"cases": len(cases), "layouts": len(LAYOUTS), "segments": len(SEGMENTS),
             "mismatches": mismatches, "words": words, "tiles": tiles}
        )
    )  # fmt: skip
    return 1 if mismatches else 0


def _mla(rb: int, layers: int, page: int, dcp: int = 1) -> KVLayout:
    return make_layout(kind="mla", page_size=page, num_layers=layers, head_bytes=rb,
                       dcp_size=dcp)  # fmt: skip


def _heads(kind: str, hb: int, tp: int, dcp: int, split: bool = False) -> KVLayout:
    return make_layout(kind=kind, page_size=8, num_layers=2, head_bytes=hb, num_kv_heads=4,
                       split_kv=split, tp_size=tp, tp_rank=0, dcp_size=dcp)  # fmt: skip


FP8 = getattr(torch, "float8_e4m3fn", torch.uint8)
#: (name, prefill layout, decode layout, pack-buffer misalignment (bytes), entry dtype)
SEGMENTS = [
    ("mla-fp8-656-dcp4", _mla(656, 20, 8), _mla(656, 20, 8, 4), 0, FP8),
    ("mla-bf16-576-dcp8", _mla(576, 6, 8), _mla(576, 6, 8, 8), 0, torch.bfloat16),
    ("hnd-subrows-tp1:2-dcp2", _heads("hnd", 64, 1, 1), _heads("hnd", 64, 2, 2), 0,
     torch.float16),
    ("nhd-slice-tp1:2-dcp1", _heads("nhd", 32, 1, 1), _heads("nhd", 32, 2, 1), 0,
     torch.float32),
    ("hnd-split-dcp4", _heads("hnd", 48, 1, 1, True), _heads("hnd", 48, 1, 4, True), 0,
     torch.bfloat16),
    ("mixed-rows-dcp3", KVLayout(page_size=4, entry_bytes_per_token=(8, 24, 40)),
     KVLayout(page_size=4, entry_bytes_per_token=(8, 24, 40), dcp_size=3), 0, torch.int64),
    ("odd-rows-misaligned-dcp2", KVLayout(page_size=4, entry_bytes_per_token=(7, 3)),
     KVLayout(page_size=4, entry_bytes_per_token=(7, 3), dcp_size=2), 3, torch.uint8),
    ("mla-656-misaligned-dcp2", _mla(656, 3, 8), _mla(656, 3, 8, 2), 8, FP8),
]  # fmt: skip


class _Count:
    """Counts launches of the kernel (``kernel[grid](...)``)."""

    def __init__(self, kernel) -> None:
        self.kernel, self.launches = kernel, 0

    def __getitem__(self, grid):
        self.launches += 1
        return self.kernel[grid]


def _reference(plans, entries, size) -> np.ndarray:
    out = np.full(size, POISON, dtype=np.uint8)
    for pl in plans:
        for g in pack_groups(pl):
            rows = group_rows(g)
            idx = rows[:, None] + np.arange(g.row_bytes)
            for e, off in zip(g.entries, np.asarray(g.offsets).tolist()):
                out[off : off + idx.size] = entries[e][idx].reshape(-1)
    return out


def segment_case(rng, src, dst, shift, dtype) -> tuple[list[str], list[int]]:
    """One random segment for every destination DCP rank, packed four ways into a pack
    buffer starting ``shift`` bytes past an aligned address."""
    d, p = dst.dcp_size, src.page_size
    seg = int(rng.integers(2, 5)) * dst.page_size * d + int(rng.integers(0, d * 3))  # ragged
    pool = 3 * -(-seg // p)
    regions = pack_regions(src, dst_dcp_size=d, depth=2, region_tokens=-(-seg // d) + p,
                           align=8 if shift else 256)  # fmt: skip
    slot = int(rng.integers(0, 2))
    chunk = SendChunk(
        room=1, src_pages=rng.permutation(pool)[: -(-seg // p)].astype(np.int64),
        dst_pages=rng.permutation(4 * seg)[: -(-seg // (dst.page_size * d))].astype(np.int64),
        num_tokens=seg, chunk_id=slot,
    )  # fmt: skip
    plans = make_dcp_planner().plan_all(chunk, src, dst, [regions[r * 2 + slot] for r in range(d)])
    raw = [rng.integers(0, 256, pool * src.entry(e).page_stride, dtype=np.uint8)
           for e in range(src.num_entries)]  # fmt: skip
    es = torch.empty(0, dtype=dtype).element_size()
    ents = [torch.from_numpy(r).view(dtype) if r.size % es == 0 else torch.from_numpy(r)
            for r in raw]  # fmt: skip
    size = regions[-1].offset + regions[-1].nbytes + 16
    want = _reference(plans, raw, size)
    buf = torch.empty(size + 64, dtype=torch.uint8)
    buf = buf[(-buf.data_ptr()) % 64 + shift :][:size]
    tri = TritonPacker()
    count = _Count(tp.gather_rows_kernel)
    tp.gather_rows_kernel = count
    bad = []
    try:
        runs = [
            ("torch pack_all", lambda: TorchPacker(2).pack_all(plans, ents, buf)),
            ("triton pack_all", lambda: tri.pack_all(plans, ents, buf)),
            ("triton pack_all cached", lambda: tri.pack_all(plans, ents, buf)),
            ("triton per rank", lambda: [tri.pack(pl, ents, buf) for pl in plans]),
        ]
        for name, fn in runs:
            buf.fill_(POISON)
            before = count.launches
            fn()
            got = buf.numpy()
            if not np.array_equal(got, want):
                diff = np.flatnonzero(got != want)
                bad.append(f"{name}: {diff.size} bytes differ, first at {diff[0]}")
            launches = count.launches - before
            if name.startswith("triton pack_all") and launches != 1:
                bad.append(f"{name}: {launches} kernel launches, expected 1")
        if tri.tables.hits < 1:
            bad.append("the second pack_all of one shape did not reuse its launch table")
        # the cached table still range-checks token offsets: same shape, one token too far
        pl = next(x for x in plans if x.num_tokens)
        g = pl.pack_groups[0]
        tok = np.array(g.tokens)
        tok[-1] = pool * src.entry(g.entries[0]).page_stride // g.unit  # past the entry
        far = msgspec.structs.replace(g, tokens=tok)
        bad_plan = msgspec.structs.replace(pl, pack_groups=(far, *pl.pack_groups[1:]))
        hits = tri.tables.hits
        try:
            tri.pack_all([bad_plan if x is pl else x for x in plans], ents, buf)
            bad.append("an out-of-range token offset on a cached shape was accepted")
        except ValueError as e:
            if "holds only" not in str(e):
                bad.append(f"range error does not name the rows: {e}")
        if tri.tables.hits != hits + 1:
            bad.append("the out-of-range check did not run on the cached path")
    finally:
        tp.gather_rows_kernel = count.kernel
    t = tri.last_launch.get("tile")
    return bad, [int(tri.last_launch.get("word_bytes", 0)), *(list(t) if t else [])]


def layout_send(kind, tps, ratio, dcp, interleave, rng) -> list[str]:
    """Every decode rank of one configuration, sent with the Triton packer (torch views of
    each rank's storage as entries), checked against the per-token-per-head reference."""
    ptp, dtp, heads = tps
    pd, hb, layers, pages = 4, 8, 2, 48
    ps = int(pd * ratio)
    prefix = pd * dcp
    total = 3 * pd * dcp + 3  # partial last page
    ntok = prefix + total
    req = rng.permutation(pages)[: -(-ntok // ps)]
    dpages = rng.permutation(pages)[: -(-total // (pd * dcp))]
    e = layers * (2 if kind == "hnd_split" else 1)
    kv = rng.integers(0, 256, (e, heads, ntok, hb), dtype=np.uint8)
    srcs = [
        ls.build(kind, ps, ptp, r, heads, layers, hb, pages, interleave=interleave)
        for r in range(ptp)
    ]
    for src in srcs:
        ls.fill_source(src, kv, req, ntok, rng)
    out = []
    tri = TritonPacker()
    for d in range(dtp):
        for rr in range(dcp):
            dst = ls.build(kind, pd, dtp, d, heads, layers, hb, pages, dcp=dcp, dcp_rank=rr,
                           interleave=interleave)  # fmt: skip
            dst.mem[:] = ls.POISON
            want, mask = ls.expected(dst, kv, dpages, prefix, total)
            # 6-token segments put a rank's first token mid-page (head-major partial pages)
            st = ls.simulate(srcs, dst, req, dpages, prefix, total, 6, 2, packer=tri)
            counts_ok = (dst.count[mask] == 1).all() and (dst.count[~mask] == 0).all()
            if not np.array_equal(dst.mem, want) or not counts_ok:
                out.append(f"decode tp {d} dcp {rr}: {int((dst.mem != want).sum())} bytes differ")
            if st["packed"] == 0 and (dcp > 1 or kind == "nhd"):
                out.append(f"decode tp {d} dcp {rr}: nothing was packed ({st})")
    return out


if __name__ == "__main__":
    sys.exit(main(int(sys.argv[1]) if len(sys.argv) > 1 else 0))
