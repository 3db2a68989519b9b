"""Packers: torch vs a numpy reference (hypothesis), Triton (interpreted, in a subprocess) vs
torch vs the reference, byte-exact, random data, output poisoned before each run."""

from __future__ import annotations

import json
import os
import re
import select
import signal
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from pdplug import KVLayout, PlannerConfig
from pdplug.packing import pack_regions
from pdplug.protocols import Packer
from pdplug.testing import require
from pdplug.types import PackRegion, SendChunk, TransferPlan
from pdplug_dcp.packers import TorchPacker, make_packer
from pdplug_dcp.planner import make_dcp_planner

POISON = 0xA5
HERE = Path(__file__).parent


def reference_pack(plan: TransferPlan, entries: list[np.ndarray], size: int) -> np.ndarray:
    """Row by row, the obvious way."""
    out = np.full(size, POISON, dtype=np.uint8)
    off = plan.region.offset
    for e, b in zip(plan.pack_entries, plan.pack_row_bytes):
        for s in plan.pack_src_slots.tolist():
            out[off : off + b] = entries[e][s * b : (s + 1) * b]
            off += b
    return out


DTYPES = [torch.uint8, torch.int16, torch.bfloat16, torch.float16, torch.float32, torch.int64]


@settings(max_examples=80, deadline=None)
@given(
    rows=st.lists(st.sampled_from([1, 2, 3, 4, 6, 8, 12, 16, 24, 576]), min_size=1, max_size=4),
    n=st.integers(0, 40),
    slots=st.integers(1, 50),
    region_offset=st.integers(0, 40),
    dtype=st.sampled_from(DTYPES),
    seed=st.integers(0, 2**32 - 1),
    threads=st.sampled_from([1, 2, 3]),
)
def test_torch_packer_matches_reference(
    rows, n, slots, region_offset, dtype, seed, threads
) -> None:
    """Any row size, dtype, region offset and gather thread count (every gather's rows split
    among threads, more threads than rows included)."""
    rng = np.random.default_rng(seed)
    raw = [rng.integers(1, 256, slots * b, dtype=np.uint8) for b in rows]  # never zeros
    es = torch.empty(0, dtype=dtype).element_size()
    entries = [
        torch.from_numpy(r.copy()).view(dtype) if r.size % es == 0 else torch.from_numpy(r.copy())
        for r in raw
    ]
    idx = rng.integers(0, slots, n).astype(np.int64)
    region = PackRegion(index=0, offset=region_offset, nbytes=n * sum(rows), capacity_tokens=n)
    plan = TransferPlan(
        room=1, chunk_id=0, is_last=True, dst_dcp_rank=0, num_tokens=n, packed=True,
        entry=np.zeros(0, np.int64), src_offset=np.zeros(0, np.int64),
        dst_offset=np.zeros(0, np.int64), length=np.zeros(0, np.int64), region=region,
        pack_src_slots=idx, pack_entries=tuple(range(len(rows))), pack_row_bytes=tuple(rows),
    )  # fmt: skip
    size = region_offset + region.nbytes + 32
    buf = torch.full((size,), POISON, dtype=torch.uint8)
    TorchPacker(threads, min_thread_rows=1).pack(plan, entries, buf)  # every row split
    assert np.array_equal(buf.numpy(), reference_pack(plan, raw, size))


@pytest.mark.skipif(not hasattr(os, "fork"), reason="needs fork")
def test_threaded_packer_works_in_a_forked_child() -> None:
    """A packer whose gather threads started before a fork still packs in the child (the
    child starts its own threads instead of queueing work for threads it does not have)."""
    rows = [torch.arange(1, 65, dtype=torch.uint8).repeat(8) for _ in range(4)]  # 8 slots x 64 B
    region = PackRegion(index=0, offset=0, nbytes=3 * 64 * 4, capacity_tokens=3)
    plan = TransferPlan(
        room=1, chunk_id=0, is_last=True, dst_dcp_rank=0, num_tokens=3, packed=True,
        entry=np.zeros(0, np.int64), src_offset=np.zeros(0, np.int64),
        dst_offset=np.zeros(0, np.int64), length=np.zeros(0, np.int64), region=region,
        pack_src_slots=np.array([5, 0, 7]), pack_entries=(0, 1, 2, 3), pack_row_bytes=(64,) * 4,
    )  # fmt: skip
    packer = TorchPacker(2, min_thread_rows=1)
    buf = torch.zeros(region.nbytes, dtype=torch.uint8)
    packer.pack(plan, rows, buf)  # starts the gather thread in this process
    want = bytes(buf)
    r, w = os.pipe()
    ready: list[int] = []
    pid = os.fork()
    if pid == 0:  # child: pack again with the inherited packer, report through the pipe
        code = 1
        try:
            out = torch.zeros(region.nbytes, dtype=torch.uint8)
            packer.pack(plan, rows, out)
            code = 0 if bytes(out) == want else 2
        finally:
            os.write(w, bytes([code]))
            os._exit(0)
    os.close(w)
    try:
        ready, _, _ = select.select([r], [], [], 20)
        assert ready, "forked child did not finish packing within 20 s"
        assert os.read(r, 1) == b"\x00"
    finally:
        if not ready:
            os.kill(pid, signal.SIGKILL)  # a hung child must not hang the test run
        os.waitpid(pid, 0)
        os.close(r)


def test_planned_pack_reads_back_the_tokens() -> None:
    """Planner + packer: the region holds each owned token's rows, layer-major."""
    src = KVLayout(page_size=4, entry_bytes_per_token=(8, 24))
    dst = KVLayout(page_size=4, entry_bytes_per_token=(8, 24), dcp_size=3)
    regions = pack_regions(src, dst_dcp_size=3, depth=2, region_tokens=8)
    rng = np.random.default_rng(1)
    kv = [torch.from_numpy(rng.integers(1, 256, 40 * b, dtype=np.uint8)) for b in (8, 24)]
    chunk = SendChunk(room=3, src_pages=np.array([7, 2, 5]), dst_pages=np.array([0]), num_tokens=10)
    plan = make_dcp_planner().plan(chunk, src, dst, 2, regions[5])
    buf = torch.full((regions[-1].offset + regions[-1].nbytes,), POISON, dtype=torch.uint8)
    make_packer("cpu").pack(plan, kv, buf)
    toks = [2, 5, 8]  # rank 2 owns tokens 2, 5, 8 -> slots 30, 9, 20
    assert plan.pack_src_slots.tolist() == [30, 9, 20]
    o = regions[5].offset
    for k, s in enumerate([30, 9, 20]):
        assert bytes(buf[o + 8 * k : o + 8 * k + 8]) == bytes(kv[0][s * 8 : s * 8 + 8])
        b1 = o + 3 * 8 + 24 * k
        assert bytes(buf[b1 : b1 + 24]) == bytes(kv[1][s * 24 : s * 24 + 24])
    assert len(toks) == plan.num_tokens
    written = buf.numpy()
    assert (written[: regions[5].offset] == POISON).all()  # other regions untouched
    assert (written[o + 3 * 32 :] == POISON).all()


@pytest.mark.parametrize("how", ["set_", "data"])
def test_a_packer_reused_after_an_entry_is_repointed_reads_the_new_memory(how: str) -> None:
    """The torch packer caches its row views per registered tensor: a tensor re-pointed in
    place (``set_``, ``.data =``) must be read at its new memory, never through a stale view."""
    src = KVLayout(page_size=4, entry_bytes_per_token=(8,))
    dst = KVLayout(page_size=4, entry_bytes_per_token=(8,), dcp_size=2)
    regions = pack_regions(src, dst_dcp_size=2, depth=1, region_tokens=8)
    rng = np.random.default_rng(3)
    kv = torch.from_numpy(rng.integers(1, 256, 40 * 8, dtype=np.uint8))
    chunk = SendChunk(room=1, src_pages=np.array([7, 2]), dst_pages=np.array([0]), num_tokens=8)
    plan = make_dcp_planner().plan(chunk, src, dst, 1, regions[1])
    packer = TorchPacker(1)
    buf = torch.full((regions[-1].offset + regions[-1].nbytes,), POISON, dtype=torch.uint8)
    size = buf.numel()
    packer.pack(plan, [kv], buf)
    assert (buf.numpy() == reference_pack(plan, [kv.numpy()], size)).all()
    other = torch.from_numpy(rng.integers(1, 256, 40 * 8, dtype=np.uint8))
    if how == "set_":
        kv.set_(other)
    else:
        kv.data = other
    buf.fill_(POISON)
    packer.pack(plan, [kv], buf)
    assert (buf.numpy() == reference_pack(plan, [other.numpy()], size)).all()


def test_packer_errors_name_the_values() -> None:
    src = KVLayout(page_size=4, entry_bytes_per_token=(8,))
    dst = KVLayout(page_size=4, entry_bytes_per_token=(8,), dcp_size=2)
    regions = pack_regions(src, dst_dcp_size=2, depth=1, region_tokens=8)
    chunk = SendChunk(room=3, src_pages=np.array([9]), dst_pages=np.array([0]), num_tokens=4)
    plan = make_dcp_planner().plan(chunk, src, dst, 0, regions[0])
    buf = torch.zeros(regions[-1].offset + regions[-1].nbytes, dtype=torch.uint8)
    with pytest.raises(ValueError, match=r"rows 36\.\.38 of 8 bytes.*holds only 128 bytes"):
        TorchPacker().pack(plan, [torch.zeros(16 * 8, dtype=torch.uint8)], buf)
    with pytest.raises(ValueError, match="does not fit"):
        TorchPacker().pack(plan, [torch.zeros(64 * 8, dtype=torch.uint8)], buf[:10])
    with pytest.raises(ValueError, match="pack entry 0 outside the 0 KV entries given"):
        TorchPacker().pack(plan, [], buf)
    with pytest.raises(ValueError, match="'gpu'"):
        make_packer("cpu", "gpu")
    with pytest.raises(ValueError, match="threads must be >= 0, got -1"):
        make_packer("cpu", "torch", -1)
    with pytest.raises(ValueError, match="min_thread_rows must be >= 1, got 0"):
        TorchPacker(1, min_thread_rows=0)
    with pytest.raises(ValueError, match="pack_threads must be >= 0, got -2"):
        PlannerConfig(pack_threads=-2)
    assert make_dcp_planner(PlannerConfig(pack_threads=3)).packer("cpu").threads == 3
    assert TorchPacker().threads == max(1, torch.get_num_threads() - 1)  # a core for the engine
    assert isinstance(make_packer("cpu"), Packer) and make_packer("cpu").kind == "torch"
    assert make_dcp_planner().packer("cpu", "torch").kind == "torch"


@pytest.mark.triton
def test_triton_interpreted_matches_torch_and_reference() -> None:
    """Triton under TRITON_INTERPRET=1 (a fresh process: the flag is read at import): random
    whole-row cases vs torch and numpy, planned sends over HND/NHD/MLA layouts (head
    sub-rows, head-major regions, strided views of shared storages) vs the per-token
    reference, and whole random segments (every DCP rank's plan) in one launch vs the torch
    packer's ``pack_all``, per-rank packs and a numpy reference, cached or not."""
    require("triton")
    env = dict(os.environ, TRITON_INTERPRET="1")
    proc = subprocess.run(
        [sys.executable, str(HERE / "triton_worker.py"), "7"],
        env=env,
        capture_output=True,
        text=True,
        timeout=240,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    res = json.loads(proc.stdout.strip().splitlines()[-1])
    assert res["cases"] >= 12 and res["layouts"] >= 5 and res["segments"] >= 8
    assert res["mismatches"] == []
    # whole segments: (word bytes, rows, cols, reps, mid, tail, vec, row words) per case
    tiles = {name: tuple(t) for name, *t in res["tiles"]}
    assert tiles["mla-fp8-656-dcp4"] == (8, 32, 64, 1, 16, 2, 2, 82)  # specialised, 16-B
    assert tiles["mla-656-misaligned-dcp2"][-2] == 1  # pack buffer 8 bytes off: 8-B accesses
    assert tiles["mixed-rows-dcp3"][-1] == 0  # row sizes differ: the generic loop
    assert tiles["odd-rows-misaligned-dcp2"][0] == 1  # byte words
    # (word bytes, words per vector) of the fixed cases: every word width was exercised
    assert [tuple(w) for w in res["words"][:7]] == [
        (8, 2),
        (8, 2),
        (4, 1),
        (2, 1),
        (1, 1),
        (1, 1),
        (8, 1),
    ]


@pytest.mark.triton
@pytest.mark.filterwarnings("ignore:TRITON_DEFAULT_FP_FUSION")
@pytest.mark.parametrize("row_bytes", [576, 656])
def test_triton_kernel_compiles_for_h200_with_16_byte_accesses(row_bytes: int) -> None:
    """Compile (no GPU needed) for sm_90: aligned int64 rows use 16-byte vector loads/stores,
    and every load of the row's pieces is issued before the first store (one memory latency
    per program)."""
    require("triton")
    if os.environ.get("TRITON_INTERPRET") == "1":
        pytest.skip("TRITON_INTERPRET=1 in this process: kernels are interpreted, not compiled")
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    from pdplug_dcp.triton_pack import gather_rows_kernel, tile_shape

    t = tile_shape(row_bytes // 8, vec=2)  # int64 words, 16-byte accesses
    consts = {"ROWS": t.rows, "COLS": t.cols, "REPS": t.reps, "MID": t.mid, "TAIL": t.tail,
              "ROW": t.row, "VEC": t.vec}  # fmt: skip
    src = ASTSource(
        fn=gather_rows_kernel,
        signature={"base_ptr": "*i64", "meta_ptr": "*i64", "idx_ptr": "*i64",
                   **dict.fromkeys(consts, "constexpr")},
        constexprs=consts,
        attrs={(i,): [["tt.divisibility", 16]] for i in range(3)},
    )  # fmt: skip
    ptx = triton.compile(src, target=GPUTarget("cuda", 90, 32)).asm["ptx"]
    loads = [m.start() for m in re.finditer(r"ld\.global(\.\w+)*\.v2\.b64", ptx)]
    stores = [m.start() for m in re.finditer(r"st\.global(\.\w+)*\.v2\.b64", ptx)]
    assert loads, "no 16-byte loads"
    assert stores, "no 16-byte stores"
    assert max(loads) < min(stores), "a row piece is loaded after another one is stored"
