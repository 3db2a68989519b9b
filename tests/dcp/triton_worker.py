"""Run in a subprocess with TRITON_INTERPRET=1 (set before triton is imported): compare the
Triton packer with the torch packer and a numpy reference, byte for byte, on random cases.

Usage: ``TRITON_INTERPRET=1 python triton_worker.py SEED`` -> prints one JSON line
``{"cases": N, "mismatches": [...], "words": [...]}``; exit code 1 on any mismatch.
"""

from __future__ import annotations

import json
import os
import sys

assert os.environ.get("TRITON_INTERPRET") == "1", "set TRITON_INTERPRET=1 before starting"

import msgspec  # noqa: E402
import numpy as np  # noqa: E402
import torch  # noqa: E402

from pdplug.types import PackRegion, TransferPlan  # noqa: E402
from pdplug_dcp.packers import TorchPacker, make_packer  # noqa: E402
from pdplug_dcp.triton_pack import TritonPacker, gather_rows_kernel  # noqa: E402

POISON = 0xA5
hits: list[int] = []  # cached geometries per triton packer (1 = the second pack reused it)


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
    hits.append(len(tri._checked))
    if n:  # the cached geometry still range-checks slots
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
    if any(h > 1 for h in hits):
        mismatches.append(f"geometry cache not reused: {hits}")
    print(json.dumps({"cases": len(cases), "mismatches": mismatches, "words": words}))
    return 1 if mismatches else 0


if __name__ == "__main__":
    sys.exit(main(int(sys.argv[1]) if len(sys.argv) > 1 else 0))
