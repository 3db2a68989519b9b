"""Fewest runs, when to pack, and vLLM-shaped strided tensors end to end at real addresses."""

from __future__ import annotations

import ctypes

import numpy as np
import pytest
import torch
from _layoutsim import POISON, build, expected, fill_source, simulate

from pdplug.geometry import entry_from_tensor, make_layout
from pdplug.heads import routed_heads
from pdplug.packing import pack_regions, run_addresses
from pdplug.registration import resolve_kv
from pdplug.types import SendChunk
from pdplug_dcp.packers import TorchPacker
from pdplug_dcp.planner import make_dcp_planner, make_tp_planner


def _lay(kind: str, page: int, tp: int = 1, rank: int = 0, dcp: int = 1, heads: int = 4):
    split = kind == "hnd_split"
    return make_layout(kind="hnd" if split else kind, page_size=page, num_layers=2,
                       head_bytes=16, num_kv_heads=heads, split_kv=split, tp_size=tp,
                       tp_rank=rank, dcp_size=dcp)  # fmt: skip


@pytest.mark.parametrize(
    ("src", "dst", "packs"),
    [
        (("nhd", 16), ("nhd", 16), False),  # same layout: a run per page
        (("hnd", 16), ("hnd", 16), False),
        (("mla", 16), ("mla", 16, 2, 1), False),  # a replicated latent
        (("hnd", 16), ("hnd", 16, 2, 1), False),  # HND head range: contiguous on both sides
        (("hnd", 32), ("hnd", 16, 2, 1), True),  # ... unless pages split head blocks
        (("hnd", 8), ("hnd", 16, 2, 0), True),
        (("nhd", 16), ("nhd", 16, 2, 1), True),  # NHD head slice: strided source
        (("nhd", 16, 2, 1), ("nhd", 16), False),  # strided destination: packing cannot help
        (("nhd", 16), ("hnd", 16), True),
        (("hnd", 16), ("nhd", 16), True),
        (("mla", 8), ("mla", 16), True),  # two source pages per destination page
        (("mla", 32), ("mla", 16), False),
        (("hnd_split", 16), ("hnd_split", 16, 1, 0, 2), True),  # every DCP destination
    ],
)  # fmt: skip
def test_packs_exactly_when_it_saves_runs(src, dst, packs) -> None:
    """At DCP 1 the planner packs only when a packed send needs fewer runs than a direct one
    (decided once per layout pair); a DCP destination always packs."""
    assert make_dcp_planner().needs_relayout(_lay(*src), _lay(*dst)) is packs
    assert make_tp_planner().needs_relayout(_lay(*src), _lay(*dst)) is False


def test_hnd_tp_1_to_2_with_page_ratio_is_one_run_per_page() -> None:
    """Prefill HND page 64, decode TP 2 page 32: each decode rank's head range of each page is
    one run from the pack region (the ideal), 4 per page without packing."""
    src = make_layout(kind="hnd", page_size=64, num_layers=3, head_bytes=256, num_kv_heads=8)
    planner = make_dcp_planner()
    chunk = SendChunk(room=1, src_pages=np.array([7, 3, 9, 1]), dst_pages=2 * np.arange(8),
                      num_tokens=256)  # fmt: skip
    for rank in range(2):
        dst = make_layout(kind="hnd", page_size=32, num_layers=3, head_bytes=256,
                          num_kv_heads=8, tp_size=2, tp_rank=rank)  # fmt: skip
        region = pack_regions(src, dst_dcp_size=1, depth=1, region_tokens=256)[0]
        plan = planner.plan(chunk, src, dst, 0, region)
        assert plan.packed and plan.num_runs == 8 * 3  # 8 decode pages x 3 layers
        assert set(plan.length.tolist()) == {32 * 4 * 256}  # a page's 4 heads, whole
        direct = planner.plan(chunk, src, dst, 0, None)
        assert direct.num_runs == 8 * 3 * 4 and not direct.packed


def test_the_fewest_runs_check_can_fail() -> None:
    """The simulation's fewest-runs check rejects a planner that does not pack an NHD head
    slice (the ``tp`` planner never packs)."""
    rng = np.random.default_rng(0)
    pages, ntok = 16, 20
    kv = rng.integers(0, 256, (1, 4, ntok, 8), dtype=np.uint8)
    src = build("nhd", 4, 1, 0, 4, 1, 8, pages)
    fill_source(src, kv, np.arange(pages), ntok, rng)
    dst = build("nhd", 4, 2, 1, 4, 1, 8, pages)
    dst.mem[:] = POISON
    with pytest.raises(AssertionError, match="not the fewest runs"):
        simulate([src], dst, np.arange(pages), np.arange(pages), 0, ntok, 8, 2,
                 planner=make_tp_planner())  # fmt: skip
    dst.mem[:] = POISON
    simulate([src], dst, np.arange(pages), np.arange(pages), 0, ntok, 8, 2,
             planner=make_tp_planner(), fewest=False)  # fmt: skip
    assert np.array_equal(dst.mem, expected(dst, kv, np.arange(pages), 0, ntok)[0])


def _vllm_rank(layers: int, blocks: int, heads: int, tp: int, rank: int, seed: int):
    """vLLM-shaped KV: layers as views of one bf16 storage, (blocks, heads, 128, 128) each."""
    g = torch.Generator().manual_seed(seed)
    store = torch.randint(-(2**15), 2**15, (layers, blocks, heads, 128, 128), generator=g,
                          dtype=torch.int16).view(torch.bfloat16)  # fmt: skip
    views = [store[i] for i in range(layers)]
    entry = entry_from_tensor(views[0], "PHTC")
    lay = make_layout(kind="hnd", page_size=128, num_layers=layers, head_bytes=entry.head_bytes,
                      num_kv_heads=2, tp_size=tp, tp_rank=rank, dtype="bfloat16")  # fmt: skip
    assert lay.entry(0) == entry
    return lay, store, views


@pytest.mark.parametrize(("ptp", "dtp"), [(1, 2), (2, 1)])
def test_vllm_strided_tensors_move_byte_exact_at_real_addresses(ptp, dtp) -> None:
    """Prefill TP 1 -> decode TP 2 and TP 2 -> 1 with vLLM's (num_blocks, H, 128, 128) bf16
    views (element strides (H*16384, 16384, 128, 1)), 3 layers in one storage: registration
    gives the bases and one region per storage; plans, the torch packer and the runs copy
    real memory (memmove at the run addresses); every byte is checked."""
    layers, blocks, prefix, total = 3, 8, 128, 300
    req = np.array([5, 2, 7, 0])  # request tokens 0..427 on prefill blocks
    dpages = np.array([6, 1, 3])  # tokens 128..427 on decode blocks
    pre = [_vllm_rank(layers, blocks, 2 // ptp, ptp, r, 10 + r) for r in range(ptp)]
    dec = [_vllm_rank(layers, blocks, 2 // dtp, dtp, r, 20 + r) for r in range(dtp)]
    for _, store, _ in dec:
        store.view(torch.uint8).fill_(POISON)
    planner, packer = make_dcp_planner(), TorchPacker(1)
    for lay, store, views in pre:
        reg = resolve_kv(lay, views)
        assert reg.regions == ((store.data_ptr(), store.numel() * 2),)
        pack = torch.empty(1 << 21, dtype=torch.uint8)
        region = pack_regions(lay, dst_dcp_size=1, depth=1, buffer_nbytes=pack.numel())[0]
        for dlay, _dstore, dviews in dec:
            if routed_heads(lay, dlay) is None:
                continue
            dreg = resolve_kv(dlay, dviews)
            chunk = SendChunk(room=1, src_pages=req[1:], dst_pages=dpages,
                              decode_prefix_len=prefix, src_page_offset=0, rel_start=0,
                              num_tokens=total)  # fmt: skip
            plan = planner.plan(chunk, lay, dlay, 0, region)
            packer.pack(plan, views, pack)
            src, dst, ln = run_addresses(plan, reg.base, dreg.base, np.arange(layers),
                                         pack.data_ptr())  # fmt: skip
            for s, d, n in zip(src.tolist(), dst.tolist(), ln.tolist()):
                ctypes.memmove(d, s, n)
    t = np.arange(prefix, prefix + total)
    sb, so = req[t // 128], t % 128
    db, do = dpages[(t - prefix) // 128], (t - prefix) % 128
    for d, (_dlay, dstore, _) in enumerate(dec):
        for h in range(2 // dtp):
            g = d * (2 // dtp) + h  # global head
            r, sh = g // (2 // ptp), g % (2 // ptp)
            want = pre[r][1][:, sb, sh, so].view(torch.int16)
            got = dstore[:, db, h, do].view(torch.int16)
            assert torch.equal(got, want), f"decode rank {d} head {g}"
        untouched = torch.ones(blocks, dtype=torch.bool)
        untouched[torch.from_numpy(dpages)] = False
        assert (dstore[:, untouched].view(torch.uint8) == POISON).all()
        tail = dstore[:, dpages[-1], :, 300 - 256 :].view(torch.uint8)
        assert (tail == POISON).all(), "bytes after the partial last block were written"


def test_plans_of_one_shape_share_read_only_region_offsets() -> None:
    """Region offsets and lengths depend on the shape alone: plans of one shape share them
    (read-only); another region or token count gets its own."""
    src = make_layout(kind="mla", page_size=16, num_layers=4, head_bytes=64)
    dst = make_layout(kind="mla", page_size=16, num_layers=4, head_bytes=64, dcp_size=2)
    regions = pack_regions(src, dst_dcp_size=2, depth=2, region_tokens=64)
    planner = make_dcp_planner()

    def plan(pages: list[int], region: int, n: int = 64):
        chunk = SendChunk(room=1, src_pages=np.array(pages), dst_pages=np.array([9, 4]),
                          num_tokens=n)  # fmt: skip
        return planner.plan(chunk, src, dst, 1, regions[region])

    a, b = plan([1, 2, 3, 4], 2), plan([8, 7, 6, 5], 2)
    assert a.src_offset is b.src_offset and a.length is b.length
    assert not a.src_offset.flags.writeable and not a.length.flags.writeable
    assert not np.array_equal(a.pack_src_slots, b.pack_src_slots)
    c = plan([1, 2, 3, 4], 3)
    assert np.array_equal(c.src_offset - a.src_offset, np.full(a.num_runs, regions[3].offset
                                                               - regions[2].offset))  # fmt: skip
    d = plan([1, 2, 3, 4], 2, n=50)
    assert d.src_offset is not a.src_offset and d.length[-1] != a.length[-1]
