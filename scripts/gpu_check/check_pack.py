"""Random bit-exact checks of the Triton packer against a numpy reference (the GPU check).

Sections (every packed byte compared with a numpy gather of byte windows at the sub-rows'
byte offsets, into buffers poisoned alike):

* ``random`` — random plans: whole rows and head sub-rows (token- and head-major, random
  columns, units and first in-page offsets), KV of any dtype (fp8 included), entries, pack
  buffer and regions at random byte misalignments, odd rows, 300 tiny entries, and (full mode)
  a 61-entry MLA fp8 plan of 70,000 rows;
* ``segments`` — whole segments planned by the ``dcp`` planner for every destination DCP rank
  (MLA fp8 656 B x 61 entries x 8,229 tokens at DCP 2/4/8, HND head sub-rows at TP 1:2, NHD
  slices, split K/V), packed with ``pack_all`` in one launch, rank by rank, and with the
  torch packer;
* ``back_to_back`` — many segments packed into separate buffers with no synchronisation in
  between (more than the packer's staging ring), checked afterwards;
* ``side_stream`` (CUDA) — KV written and packed on a side stream, and a pack enqueued behind a
  KV write delayed by a spin kernel on the same stream.

Usage: ``python check_pack.py --device cuda [--quick] [--out results.json]``; on CPU
``TRITON_INTERPRET=1 python check_pack.py --device cpu --quick`` (the smoke mode a test runs).
Prints one JSON line; exit status 1 on any mismatch.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from typing import Any

import numpy as np

POISON = 0xA5


def _args() -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", choices=["cuda", "cpu"], default="cuda")
    ap.add_argument("--quick", action="store_true", help="few small cases (CPU smoke mode)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", default=None, help="write the JSON result here too")
    return ap.parse_args()


def reference(plans: list[Any], entries: list[np.ndarray], size: int) -> np.ndarray:
    """Pack ``plans`` the obvious way: for every sub-row, ``row_bytes`` bytes at its byte
    offset in its entry (windows of a byte view), in region order."""
    from pdplug.packing import group_rows, pack_groups

    out = np.full(size, POISON, dtype=np.uint8)
    for pl in plans:
        if not pl.packed:
            continue
        for g in pack_groups(pl):
            rows = group_rows(g)
            if rows.size == 0:
                continue
            for e, off in zip(g.entries, np.asarray(g.offsets).tolist()):
                src = entries[e]
                win = np.lib.stride_tricks.as_strided(
                    src, (src.size - g.row_bytes + 1, g.row_bytes), (1, 1), writeable=False
                )
                out[off : off + rows.size * g.row_bytes] = win[rows].reshape(-1)
    return out


class Checker:
    """Runs cases on one device and collects mismatches."""

    def __init__(self, device: str, seed: int) -> None:
        import torch

        from pdplug_dcp.packers import TorchPacker
        from pdplug_dcp.triton_pack import TritonPacker

        self.torch = torch
        self.dev = torch.device(device)
        self.cuda = self.dev.type == "cuda"
        self.rng = np.random.default_rng(seed)
        self.gen = torch.Generator(device=self.dev).manual_seed(seed)
        self.tri = TritonPacker()
        self.ref_packer = TorchPacker()
        self.mismatches: list[str] = []
        self.counts: dict[str, int] = {}
        self.tiles: set[tuple[int, ...]] = set()

    # ---------------------------------------------------------------- memory

    def entries(self, sizes: list[int], dtypes: list[Any], shift: int = 0) -> tuple[list, list]:
        """Random KV entries (generated on the device): torch tensors ``shift`` bytes past a
        256-byte boundary, viewed as ``dtypes`` where size and address allow, and copies of
        their bytes in numpy."""
        torch = self.torch
        out, raw = [], []
        for size, dt in zip(sizes, dtypes):
            big = torch.randint(0, 256, (size + 512,), dtype=torch.uint8, device=self.dev,
                                generator=self.gen)  # fmt: skip
            at = (-big.data_ptr()) % 256 + shift
            t = big[at : at + size]
            raw.append(t.cpu().numpy())
            es = torch.empty(0, dtype=dt).element_size()
            if size % es == 0 and t.data_ptr() % es == 0:
                t = t.view(dt)
            out.append(t)
        return out, raw

    def buffer(self, size: int, shift: int = 0) -> Any:
        torch = self.torch
        big = torch.empty(size + 512, dtype=torch.uint8, device=self.dev)
        at = (-big.data_ptr()) % 256 + shift
        return big[at : at + size]

    def compare(self, name: str, buf: Any, want: np.ndarray) -> None:
        section = name.split(" ", 1)[0].rstrip(":")
        self.counts[section] = self.counts.get(section, 0) + 1
        got = buf.cpu().numpy()
        if not np.array_equal(got, want):
            diff = np.flatnonzero(got != want)
            self.mismatches.append(f"{name}: {diff.size} bytes differ, first at {diff[0]}")
        t = self.tri.last_launch.get("tile")
        if t is not None:
            self.tiles.add((int(self.tri.last_launch["word_bytes"]), *t))

    def run(self, name: str, plans: list[Any], ents: list, raw: list, size: int, shift: int = 0,
            ways: tuple[str, ...] = ("pack_all", "per_rank")) -> None:  # fmt: skip
        """Pack ``plans`` each way into a poisoned buffer and compare with the reference."""
        want = reference(plans, raw, size)
        buf = self.buffer(size, shift)
        for way in ways:
            buf.fill_(POISON)
            if way == "pack_all":
                self.tri.pack_all(plans, ents, buf)
            elif way == "per_rank":
                for pl in plans:
                    self.tri.pack(pl, ents, buf)
            else:  # the torch packer on the same device
                self.ref_packer.pack_all(plans, ents, buf)
            if self.cuda:
                self.torch.cuda.synchronize()
            self.compare(f"{name}: {way}", buf, want)

    # ---------------------------------------------------------------- cases

    def random_plan(self, quick: bool, tiny: bool = False, mla: bool = False) -> None:
        """One random packed plan of 1-3 groups (see module docstring)."""
        from pdplug.types import PackGroup, PackRegion, TransferPlan

        rng = self.rng
        fp8 = getattr(self.torch, "float8_e4m3fn", self.torch.uint8)
        dts = [fp8, self.torch.bfloat16, self.torch.float32, self.torch.int64, self.torch.uint8]
        if mla:  # 61-entry MLA fp8 rows
            n, spec = (400 if quick else 70_000), [(61, 656, 656, 1, 0, 0)]
        elif tiny:  # 300 tiny entries
            rb = int(rng.choice([1, 2, 3, 4, 8, 16]))
            n, spec = int(rng.integers(1, 40)), [(300, rb, rb, 1, 0, 0)]
        else:
            n = int(rng.integers(1, 60 if quick else 3000))
            spec = []
            for _ in range(int(rng.integers(1, 4))):
                rb = int(rng.choice([1, 2, 3, 4, 6, 8, 12, 16, 24, 64, 128, 256, 576, 656]))
                u = int(rng.choice([1, 2, 4, 8, 16]))
                spec.append((int(rng.integers(1, 4 if quick else 8)), rb, u,
                             int(rng.integers(1, 5)), int(rng.choice([0, 0, rb, 2 * rb])),
                             int(rng.choice([0, 0, 1, 2, 4, 8]))))  # fmt: skip
        shift_e = int(rng.choice([0, 0, 0, 1, 2, 4, 8]))
        shift_b = int(rng.choice([0, 0, 0, 1, 8]))
        region_off = int(rng.choice([0, 0, 256, int(rng.integers(0, 64))]))
        groups: list[Any] = []
        sizes: list[int] = []
        dtypes: list[Any] = []
        pack_row: list[int] = []
        off = region_off
        e0 = 0
        for k, rb, u, c, gap, pt in spec:
            # sub-row i of a token at byte i*(rb+gap) rounded to the unit; the token stride
            # (a unit multiple) leaves 0-2 units spare: sub-rows never overlap
            cols = [-(-i * (rb + gap) // u) * u for i in range(c)]
            ts = -(-(cols[-1] + rb) // u) * u + u * int(rng.integers(0, 3))
            slots = max(n, 16) + int(rng.integers(0, 100))
            tokens = rng.integers(0, slots, n).astype(np.int64) * (ts // u)
            m = n * c
            offs = off + m * rb * np.arange(k, dtype=np.int64)
            off += m * rb * k
            ents = tuple(range(e0, e0 + k))
            e0 += k
            fo = int(rng.integers(0, pt)) if pt else 0
            g = PackGroup(entries=ents, offsets=offs, tokens=tokens, cols=tuple(cols),
                          row_bytes=rb, unit=u, page_tokens=pt, first_offset=fo)  # fmt: skip
            groups.append(g)
            sizes += [slots * ts] * k
            dtypes += [fp8 if mla else dts[int(rng.integers(0, len(dts)))]] * k
            pack_row += [c * rb] * k
        need = off - region_off
        region = PackRegion(index=0, offset=region_off, nbytes=need + 7, capacity_tokens=n)
        empty = np.zeros(0, dtype=np.int64)
        plan = TransferPlan(
            room=1, chunk_id=0, is_last=True, dst_dcp_rank=0, num_tokens=n, packed=True,
            entry=empty, src_offset=empty, dst_offset=empty, length=empty, region=region,
            pack_src_slots=empty, pack_entries=tuple(range(e0)), pack_row_bytes=tuple(pack_row),
            pack_groups=tuple(groups),
        )  # fmt: skip
        ents_t, raw = self.entries(sizes, dtypes, shift_e)
        label = "random-mla" if mla else "random-tiny" if tiny else "random"
        self.run(label, [plan], ents_t, raw, region_off + need + 64, shift_b,
                 ways=("pack_all", "torch"))  # fmt: skip

    def segment(
        self,
        kind: str,
        rb: int,
        layers: int,
        dcp: int,
        tokens: int,
        tp: int = 1,
        ways: tuple[str, ...] = ("pack_all", "per_rank", "torch"),
    ) -> list[Any]:
        """Every destination DCP rank's plan of one random segment, packed ``ways``."""
        from pdplug.geometry import make_layout
        from pdplug.packing import pack_regions
        from pdplug.types import SendChunk
        from pdplug_dcp.planner import make_dcp_planner

        rng = self.rng
        if kind == "mla":
            mk: dict[str, Any] = dict(kind="mla", page_size=64, num_layers=layers, head_bytes=rb)
            src, dst = make_layout(**mk), make_layout(**mk, dcp_size=dcp)
        else:
            split = kind == "hnd_split"
            mk = dict(kind="hnd" if split else kind, page_size=16, num_layers=layers,
                      head_bytes=rb, num_kv_heads=8, split_kv=split)  # fmt: skip
            src, dst = make_layout(**mk), make_layout(**mk, tp_size=tp, dcp_size=dcp)
        p = src.page_size
        pool = 2 * -(-tokens // p)
        regions = pack_regions(src, dst_dcp_size=dcp, depth=2, region_tokens=-(-tokens // dcp) + p)
        slot = int(rng.integers(0, 2))
        chunk = SendChunk(
            room=1, src_pages=rng.permutation(pool)[: -(-tokens // p)].astype(np.int64),
            dst_pages=rng.permutation(8 * pool)[: -(-tokens // (dst.page_size * dcp))],
            num_tokens=tokens, chunk_id=slot,
        )  # fmt: skip
        plans = make_dcp_planner().plan_all(
            chunk, src, dst, [regions[2 * r + slot] for r in range(dcp)]
        )
        if not any(pl.packed for pl in plans):
            return []
        fp8 = getattr(self.torch, "float8_e4m3fn", self.torch.uint8)
        dt = fp8 if kind == "mla" else self.torch.bfloat16
        ents, raw = self.entries([pool * src.entry(e).page_stride for e in range(src.num_entries)],
                                 [dt] * src.num_entries)  # fmt: skip
        size = regions[-1].offset + regions[-1].nbytes
        name = f"segments ({kind} {rb} B x {layers}, DCP {dcp}, TP 1:{tp}, {tokens} tokens)"
        self.run(name, plans, ents, raw, size, ways=ways)
        return [plans, ents, raw, size]

    def back_to_back(self, count: int, tokens: int) -> None:
        """``count`` segments packed into separate buffers with no synchronisation between."""
        cases = []
        for i in range(count):
            kind = ("mla", "hnd", "nhd")[i % 3]
            rb = (656, 128, 64)[i % 3]
            made = self.segment(kind, rb, 3, (2, 4, 1)[i % 3], tokens + 7 * i, tp=1 + (i % 3 > 0),
                                ways=())  # fmt: skip
            if made:
                plans, ents, raw, size = made
                cases.append((plans, ents, reference(plans, raw, size), self.buffer(size)))
        for plans, ents, _, buf in cases:
            buf.fill_(POISON)
            self.tri.pack_all(plans, ents, buf)
        if self.cuda:
            self.torch.cuda.synchronize()
        for i, (_, _, want, buf) in enumerate(cases):
            self.compare(f"back_to_back: segment {i} of {len(cases)}", buf, want)

    def side_stream(self, tokens: int) -> None:
        """KV rewritten and packed on a side stream; a pack behind a delayed KV write."""
        torch = self.torch
        made = self.segment("mla", 656, 8, 4, tokens, ways=())
        if not made:
            return
        plans, ents, raw, size = made
        new = [self.rng.integers(0, 256, r.size, dtype=np.uint8) for r in raw]
        staged = [torch.from_numpy(x).pin_memory() for x in new]
        want = reference(plans, new, size)
        buf = self.buffer(size)
        buf.fill_(POISON)
        torch.cuda.synchronize()
        side = torch.cuda.Stream()
        with torch.cuda.stream(side):
            torch.cuda._sleep(50_000_000)  # the KV write lands late: the pack must wait for it
            for t, s in zip(ents, staged):
                t.view(torch.uint8).copy_(s, non_blocking=True)
            self.tri.pack_all(plans, ents, buf)
        side.synchronize()
        self.compare("side_stream: delayed KV write then pack on a side stream", buf, want)
        buf.fill_(POISON)
        torch.cuda.synchronize()
        with torch.cuda.stream(side):
            torch.cuda._sleep(20_000_000)
            self.tri.pack_all(plans, ents, buf)
        torch.cuda.current_stream().wait_stream(side)
        torch.cuda.synchronize()
        self.compare("side_stream: pack on a side stream, default stream waits", buf, want)


def main() -> int:
    a = _args()
    if a.device == "cpu" and os.environ.get("TRITON_INTERPRET") != "1":
        print("--device cpu needs TRITON_INTERPRET=1 (set before triton is imported)")
        return 2
    import torch

    if a.device == "cuda" and not torch.cuda.is_available():
        print("--device cuda: no CUDA device is available here")
        return 2
    t0 = time.perf_counter()
    c = Checker(a.device, a.seed)
    q = a.quick
    for _ in range(6 if q else 110):
        c.random_plan(q)
    for _ in range(1 if q else 4):
        c.random_plan(q, tiny=True)
    c.random_plan(q, mla=True)
    seg = 64 if q else 8192
    for dcp in (2, 4) if q else (2, 4, 8):  # (MLA at DCP 1 is sent unpacked)
        c.segment("mla", 656, 3 if q else 61, dcp, seg + (0 if q else 37))
    c.segment("hnd", 64 if q else 256, 2, 2, seg, tp=2)
    c.segment("nhd", 32 if q else 128, 2, 1, seg, tp=2)
    c.segment("hnd_split", 48 if q else 192, 2, 4, seg)
    c.back_to_back(4 if q else 40, 48 if q else 2048)
    if c.cuda:
        c.side_stream(8192)
    res = {
        "device": torch.cuda.get_device_name(0) if c.cuda else "cpu (TRITON_INTERPRET=1)",
        "torch": torch.__version__,
        "triton": __import__("triton").__version__,
        "checks": c.counts,
        "tiles": sorted(list(t) for t in c.tiles),
        "mismatches": c.mismatches,
        "launch_tables": {"cached": c.tri.tables.hits, "built": c.tri.tables.misses},
        "seconds": round(time.perf_counter() - t0, 1),
    }
    line = json.dumps(res)
    print(line)
    if a.out:
        with open(a.out, "w") as f:
            f.write(line + "\n")
    return 1 if c.mismatches else 0


if __name__ == "__main__":
    sys.exit(main())
