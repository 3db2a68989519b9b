"""The layout model: head routing, entry geometry validation, registration of strided tensors
and raw regions, and the compatibility check."""

from __future__ import annotations

import itertools

import msgspec
import numpy as np
import pytest
import torch

from pdplug import KVLayout
from pdplug.geometry import entry_from_tensor, hnd_entry, make_layout, nhd_entry
from pdplug.heads import (
    expected_sources,
    head_routes,
    kv_head_range,
    routed_heads,
)
from pdplug.layout import layout_mismatches
from pdplug.registration import KVRegion, dedup_regions, resolve_kv
from pdplug.types import KVEntry, PeerInfo
from pdplug.wire import Codec

# --------------------------------------------------------------------------- heads


def test_kv_head_range_follows_the_tp_convention() -> None:
    assert [kv_head_range(8, 4, r) for r in range(4)] == [(0, 2), (2, 4), (4, 6), (6, 8)]
    # TP > heads: consecutive ranks hold the same head (GQA replication, vLLM #45330)
    assert [kv_head_range(2, 4, r) for r in range(4)] == [(0, 1), (0, 1), (1, 2), (1, 2)]
    assert [kv_head_range(1, 3, r) for r in range(3)] == [(0, 1)] * 3  # an MLA latent
    with pytest.raises(ValueError, match="num_kv_heads=6 is not a multiple of tp_size=4"):
        kv_head_range(6, 4, 0)
    with pytest.raises(ValueError, match="tp_size=6 is not a multiple of num_kv_heads=4"):
        kv_head_range(4, 6, 0)
    with pytest.raises(ValueError, match=r"tp_rank=2 in \[0, tp_size\)"):
        kv_head_range(4, 2, 2)


@pytest.mark.parametrize(
    ("src_tp", "dst_tp", "heads"),
    [(1, 1, 4), (1, 2, 4), (2, 1, 4), (4, 2, 2), (2, 4, 2), (8, 2, 2), (2, 8, 2), (4, 4, 1),
     (3, 6, 1), (4, 8, 8)],
)  # fmt: skip
def test_head_routes_cover_each_decode_head_once(src_tp, dst_tp, heads) -> None:
    routes = head_routes(src_tp, dst_tp, heads)
    for d in range(dst_tp):
        got = sorted(g for r in routes if r.dst_rank == d for g in range(r.head_lo, r.head_hi))
        lo, hi = kv_head_range(heads, dst_tp, d)
        assert got == list(range(lo, hi)), "each head of the decode rank exactly once"
        for r in (x for x in routes if x.dst_rank == d):
            s_lo, s_hi = kv_head_range(heads, src_tp, r.src_rank)
            assert s_lo <= r.head_lo < r.head_hi <= s_hi, "sent by a rank that holds it"
        kind = "mla" if heads == 1 else "hnd"
        dst = make_layout(kind=kind, page_size=1, num_layers=1, head_bytes=4,
                          num_kv_heads=heads, tp_size=dst_tp, tp_rank=d)  # fmt: skip
        srcs = expected_sources(dst, src_tp)
        assert srcs == tuple(sorted({r.src_rank for r in routes if r.dst_rank == d}))
    assert head_routes(src_tp, dst_tp, heads) == routes  # deterministic (and cached)


def test_replicated_heads_spread_over_replicas() -> None:
    """Prefill TP 4 with 2 heads -> decode TP 2 (C15): decode 0 takes head 0 from prefill 0,
    decode 1 head 1 from prefill 2; prefill 1 and 3 send nothing. An MLA latent at prefill TP
    2 -> decode TP 4 alternates replicas."""
    routes = head_routes(4, 2, 2)
    assert [(r.src_rank, r.dst_rank, r.head_lo, r.head_hi) for r in routes] == [
        (0, 0, 0, 1),
        (2, 1, 1, 2),
    ]
    assert [(r.src_rank, r.dst_rank) for r in head_routes(2, 4, 1)] == [(0, 0), (1, 1), (0, 2),
                                                                        (1, 3)]  # fmt: skip
    src = [make_layout(kind="hnd", page_size=4, num_layers=1, head_bytes=8, num_kv_heads=2,
                       tp_size=4, tp_rank=r) for r in range(4)]  # fmt: skip
    dst = [make_layout(kind="hnd", page_size=4, num_layers=1, head_bytes=8, num_kv_heads=2,
                       tp_size=2, tp_rank=r) for r in range(2)]  # fmt: skip
    assert [[routed_heads(s, d) for d in dst] for s in src] == [
        [(0, 1), None],
        [None, None],
        [None, (1, 2)],
        [None, None],
    ]
    assert [expected_sources(d, 4, src[0]) for d in dst] == [(0,), (2,)]


def test_rows_without_heads_route_only_between_equal_tp() -> None:
    assert [(r.src_rank, r.dst_rank) for r in head_routes(2, 2, 0)] == [(0, 0), (1, 1)]
    with pytest.raises(ValueError, match="tp_size: prefill 2 vs decode 1 needs num_kv_heads"):
        head_routes(2, 1, 0)


# --------------------------------------------------------------------------- entry geometry


def test_builders_give_nhd_hnd_and_vllm_strides() -> None:
    assert nhd_entry(4, 16, 8) == KVEntry(content="kv", heads=4, head_bytes=16, head_stride=16,
                                          token_stride=64, page_stride=512)  # fmt: skip
    assert hnd_entry(4, 16, 8) == KVEntry(content="kv", heads=4, head_bytes=16, head_stride=128,
                                          token_stride=16, page_stride=512)  # fmt: skip
    # vLLM HND per-layer view (num_blocks, H, block_size, C) bf16, strides (32768, 16384, 128, 1)
    t = torch.empty((4, 2, 128, 128), dtype=torch.bfloat16)
    assert entry_from_tensor(t, "PHTC") == hnd_entry(2, 256, 128)
    assert entry_from_tensor(t, "PHTC").layout_kind == "hnd"
    # an SGLang K buffer (slots, H, D) paged by 16
    k = torch.empty((64, 4, 8), dtype=torch.float16)
    assert entry_from_tensor(k, "SHC", content="k", page_size=16) == nhd_entry(
        4, 16, 16, content="k"
    )
    mla = torch.empty((64, 576), dtype=torch.uint8)
    assert entry_from_tensor(mla, "SC", content="latent", page_size=16).layout_kind == "row"
    with pytest.raises(ValueError, match="dims='PHT' must name each of the 4 dimensions"):
        entry_from_tensor(t, "PHT")


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"entries": (hnd_entry(2, 8, 4),)}, r"entries has 1 items for 2 entry_bytes_per_token"),
        ({"entries": (hnd_entry(2, 8, 4), hnd_entry(1, 16, 4))},
         r"entries\[1\]: .* heads=1 .*differs"),  # heads x head_bytes vs 16: fine; see below
        ({"entries": (nhd_entry(2, 8, 4), msgspec.structs.replace(nhd_entry(2, 8, 4),
                                                                   token_stride=8))},
         r"entries\[1\]\.token_stride=8 overlaps"),
        ({"entries": (nhd_entry(2, 8, 4), msgspec.structs.replace(nhd_entry(2, 8, 4),
                                                                   page_stride=32))},
         r"entries\[1\]\.page_stride=32 is below one page's extent of 64 bytes"),
        ({"entries": (nhd_entry(2, 8, 4), msgspec.structs.replace(nhd_entry(2, 8, 4),
                                                                   content="kv2"))},
         r"entries\[1\]\.content='kv2' is not one of"),
        ({"entries": (nhd_entry(2, 8, 4),) * 2, "num_kv_heads": 8, "tp_size": 2},
         r"entries\[0\]\.heads=2, but num_kv_heads=8 over tp_size=2 puts heads \[0, 4\)"),
        ({"entries": (nhd_entry(2, 8, 4),) * 2, "num_kv_heads": 0},
         r"entries\[0\] holds 'kv' heads: set num_kv_heads"),
    ],
)  # fmt: skip
def test_layout_geometry_errors_name_entry_field_and_value(kwargs, match) -> None:
    base = {"page_size": 4, "entry_bytes_per_token": (16, 16), "num_kv_heads": 2}
    if "heads=1" in match:  # 1 head x 16 bytes is fine; 1 x 8 is not
        kwargs = {"entries": (hnd_entry(2, 8, 4), hnd_entry(1, 8, 4))}
        match = r"entries\[1\]: heads=1 x head_bytes=8 = 8 bytes differs from .*\[1\]=16"
    with pytest.raises(ValueError, match=match):
        KVLayout(**{**base, **kwargs})


def test_layouts_travel_in_peer_info() -> None:
    lay = make_layout(kind="hnd", page_size=16, num_layers=2, head_bytes=256, num_kv_heads=8,
                      split_kv=True, tp_size=2, tp_rank=1, model="llama-3-8b", engine="vllm",
                      engine_version="0.33.0", head_size=128)  # fmt: skip
    codec = Codec(PeerInfo)
    back = codec.decode(codec.encode(PeerInfo(instance="p", role="prefill", layout=lay)))
    assert back is not None and back.layout == lay
    assert back.layout.entry(3).content == "v" and back.layout.entry(0).heads == 4
    legacy = KVLayout(page_size=16, entry_bytes_per_token=(64,))
    assert legacy.entry(0) == KVEntry(content="row", heads=1, head_bytes=64, head_stride=64,
                                      token_stride=64, page_stride=1024)  # fmt: skip


# --------------------------------------------------------------------------- registration


def _vllm_layout(num_layers: int, stride: int = 0) -> KVLayout:
    return make_layout(kind="hnd", page_size=128, num_layers=num_layers, head_bytes=256,
                       num_kv_heads=2, page_stride=stride, dtype="bfloat16")  # fmt: skip


def test_vllm_layers_in_one_storage_register_once() -> None:
    """vLLM: (num_blocks, 2, 128, 128) bf16 views with strides (32768, 16384, 128, 1), several
    layers in one storage (layer-major), and interleaved per block (cross-layer)."""
    blocks, layers = 16, 3
    store = torch.zeros((layers, blocks, 2, 128, 128), dtype=torch.bfloat16)
    views = [store[i] for i in range(layers)]
    assert views[0].stride() == (32768, 16384, 128, 1)
    reg = resolve_kv(_vllm_layout(layers), views)
    assert reg.base == tuple(v.data_ptr() for v in views)
    assert reg.pages == (blocks,) * layers and reg.num_pages == blocks
    assert reg.regions == ((store.data_ptr(), store.numel() * 2),)  # one storage, once
    cross = torch.zeros((blocks, layers, 2, 128, 128), dtype=torch.bfloat16)
    views = [cross[:, i] for i in range(layers)]
    assert views[1].stride() == (layers * 32768, 16384, 128, 1)
    reg = resolve_kv(_vllm_layout(layers, stride=layers * 65536), views)
    assert reg.num_pages == blocks and reg.regions == ((cross.data_ptr(), cross.numel() * 2),)
    # the strides do not match the declared geometry: named, with both axis lists
    with pytest.raises(ValueError, match=r"entries\[0\] of shape \(16, 2, 128, 128\), strides"):
        resolve_kv(_vllm_layout(layers), views)
    with pytest.raises(ValueError, match="got 2 entries, layout has 3"):
        resolve_kv(_vllm_layout(layers), views[:2])


def test_sglang_raw_regions_register_and_check_page_stride() -> None:
    """SGLang: kv_data_ptrs / kv_data_lens / kv_item_lens, K and V separate per layer."""
    lay = make_layout(kind="nhd", page_size=16, num_layers=2, head_bytes=64, num_kv_heads=4,
                      split_kv=True)  # fmt: skip
    item = 16 * 4 * 64  # one page of one layer
    bufs = [np.zeros(10 * item + 5, dtype=np.uint8) for _ in range(4)]
    ptrs = [b.ctypes.data for b in bufs]
    reg = resolve_kv(lay, [(p, b.nbytes, item) for p, b in zip(ptrs, bufs)])
    assert reg.base == tuple(ptrs) and reg.num_pages == 10
    assert sorted(reg.regions) == sorted((p, b.nbytes) for p, b in zip(ptrs, bufs))
    items: list[object] = [(p, b.nbytes) for p, b in zip(ptrs, bufs)]
    items[2] = KVRegion(address=ptrs[2], nbytes=bufs[2].nbytes, page_stride=item // 2)
    with pytest.raises(ValueError, match=r"entries\[2\]\.page_stride=2048 bytes differs from the "):
        resolve_kv(lay, items)
    with pytest.raises(ValueError, match=r"entries\[0\] has 100 bytes, below one page"):
        resolve_kv(lay, [(ptrs[0], 100)] + [(p, b.nbytes) for p, b in zip(ptrs[1:], bufs[1:])])
    with pytest.raises(ValueError, match=r"entries\[1\]: address=0 and nbytes=5 must be > 0"):
        resolve_kv(lay, [(ptrs[0], bufs[0].nbytes), (0, 5), *[(p, 99999) for p in ptrs[2:]]])


def test_dedup_regions() -> None:
    assert dedup_regions([(100, 10), (100, 10), (105, 20), (125, 5), (200, 0), (300, 1)]) == [
        (100, 30),
        (300, 1),
    ]
    with pytest.raises(ValueError, match=r"region 1 = \(-1, 4\) is negative"):
        dedup_regions([(0, 1), (-1, 4)])


# --------------------------------------------------------------------------- compatibility


def _lay(kind: str, **kw) -> KVLayout:
    args = dict(kind=kind, page_size=16, num_layers=2, head_bytes=256, num_kv_heads=8)
    args.update(kw)
    return make_layout(**args)  # type: ignore[arg-type]


def test_compat_accepts_what_the_planner_maps_and_names_the_rest() -> None:
    for a, b in itertools.product(["nhd", "hnd"], repeat=2):  # NHD <-> HND maps
        assert layout_mismatches(_lay(a), _lay(b, tp_size=2, page_size=32, dcp_size=4)) == []
    mla = _lay("mla", head_bytes=576)
    assert layout_mismatches(mla, _lay("mla", head_bytes=576, tp_size=4, tp_rank=3)) == []
    got = layout_mismatches(
        _lay("hnd", model="a", dtype="bfloat16"),
        _lay("hnd", model="b", dtype="float16", page_size=24, head_bytes=128),
    )
    assert got[:3] == [
        "page_size: local 16 vs remote 24 tokens (neither divides the other)",
        "dtype: local bfloat16 vs remote float16",
        "model: local 'a' vs remote 'b'",
    ]
    assert "entries[0].head_bytes: local 256 vs remote 128" in got
    assert layout_mismatches(_lay("hnd"), _lay("hnd", split_kv=True, head_bytes=128)) == [
        "entries per layer differ: source 1 vs destination 2"
    ]
    assert layout_mismatches(_lay("hnd"), _lay("mla", head_bytes=256)) == [
        "num_kv_heads: local 8 vs remote 1",
        "KV heads routed: local 8 vs remote 1",
        "entries[0].content: local 'kv' vs remote 'latent'",
        "entries[1].content: local 'kv' vs remote 'latent'",
    ]
    replicated = _lay("hnd", num_kv_heads=4, tp_size=8, tp_rank=5)
    assert layout_mismatches(_lay("hnd", num_kv_heads=4), replicated) == []
    assert layout_mismatches(_lay("hnd", num_kv_heads=8), _lay("hnd", num_kv_heads=4)) == [
        "num_kv_heads: local 8 vs remote 4",
        "KV heads routed: local 8 vs remote 4",
    ]
    rows2 = KVLayout(page_size=16, entry_bytes_per_token=(64,), tp_size=2, tp_rank=1)
    assert layout_mismatches(rows2, KVLayout(page_size=16, entry_bytes_per_token=(64,))) == [
        "tp_size: prefill 2 vs decode 1 needs num_kv_heads on both layouts to map heads "
        "(opaque token rows move only between equal TP)"
    ]
    legacy = KVLayout(page_size=16, entry_bytes_per_token=(2048, 2048), num_layers=2)
    assert layout_mismatches(legacy, _lay("nhd")) == [
        "entries: only the remote layout describes its entry geometry (both or neither)"
    ]
