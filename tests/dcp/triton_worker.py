"""Run in a subprocess with TRITON_INTERPRET=1 (set before triton is imported): compare the
Triton packer with the torch packer and a numpy reference, byte for byte, on random row cases;
then run whole planned sends over real layouts (strided views into shared storages, head
sub-rows, head-major regions) with the Triton packer and compare every destination byte with
the per-token-per-head reference.

Usage: ``TRITON_INTERPRET=1 python triton_worker.py SEED`` -> prints one JSON line
``{"cases": N, "layouts": M, "mismatches": [...], "words": [...]}``; exit code 1 on any
mismatch.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

assert os.environ.get("TRITON_INTERPRET") == "1", "set TRITON_INTERPRET=1 before starting"
sys.path.insert(0, str(Path(__file__).parent))

import _layoutsim as ls  # noqa: E402
import msgspec  # noqa: E402
import numpy as np  # noqa: E402
import torch  # noqa: E402

from pdplug.types import PackRegion, TransferPlan  # noqa: E402
from pdplug_dcp.packers import TorchPacker, make_packer  # noqa: E402
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
    print(
        json.dumps(
            {"cases": len(cases), "layouts": len(LAYOUTS), "mismatches": mismatches, "words": words}
        )
    )
    return 1 if mismatches else 0


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
