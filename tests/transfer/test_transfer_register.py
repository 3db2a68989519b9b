"""``register_kv`` on both sessions takes what engines hand over, without copies: vLLM per-layer
views of one storage (registered once), vLLM CPU's cache under both of its descriptions (K|V
fused per token, and K slab / V slab per block and head), SGLang raw regions; a view whose
strides do not match its entry is refused naming it."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from pdplug import KVConfig, KVLayout, PluginManager
from pdplug.geometry import make_layout, slab_views
from pdplug.registration import KVRegion

pytestmark = pytest.mark.timeout(120)

NB, HEADS, BS, D, LAYERS = 6, 2, 128, 64, 3


class Recorder:
    """A real engine that remembers what it was asked to register."""

    def __init__(self, inner: Any) -> None:
        self.inner = inner
        self.registered: list[tuple[int, int]] = []

    def register(self, regions: Any) -> None:
        self.registered += [(int(a), int(n)) for a, n in regions]
        self.inner.register(regions)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)


def _fused(**kw: Any) -> KVLayout:
    return make_layout(
        kind="hnd", page_size=BS, num_layers=LAYERS, head_bytes=2 * D * 2, num_kv_heads=HEADS,
        head_size=D, **kw,
    )  # fmt: skip


def _slabs(**kw: Any) -> KVLayout:
    return make_layout(
        kind="hnd", page_size=BS, num_layers=LAYERS, head_bytes=D * 2, num_kv_heads=HEADS,
        slabs=True, head_size=D, **kw,
    )  # fmt: skip


def _sessions(pm: PluginManager, backend: str, lay: KVLayout) -> tuple[Any, Any]:
    s = pm.make_kv_sender(
        KVConfig(instance="p", role="prefill", layout=lay, pack_region_tokens=BS), name=backend
    )
    rc = pm.make_kv_receiver(KVConfig(instance="d", role="decode", layout=lay), name=backend)
    s.engine = Recorder(s.engine)
    rc.engine = Recorder(rc.engine)
    return s, rc


def _covered(regions: list[tuple[int, int]], t: torch.Tensor) -> bool:
    a, n = t.data_ptr(), t.numel() * t.element_size()
    return any(r <= a and a + n <= r + m for r, m in regions)


def test_vllm_views_of_one_storage_register_once(backend: str) -> None:
    """Three layers as vLLM views ``(6, 2, 128, 128)`` bf16, strides ``(32768, 16384, 128, 1)``,
    of one ``(3, 6, 2, 128, 128)`` storage: one engine region each side; entry bases are the
    views' addresses."""
    pm = PluginManager()
    lay = _fused()
    src = torch.zeros((LAYERS, NB, HEADS, BS, 2 * D), dtype=torch.bfloat16)
    dst = torch.zeros_like(src)
    views = [src[i] for i in range(LAYERS)]
    assert views[0].shape == (NB, 2, 128, 128) and views[0].stride() == (32768, 16384, 128, 1)
    s, rc = _sessions(pm, backend, lay)
    try:
        s.register_kv(views)
        rc.register_kv([dst[i] for i in range(LAYERS)])
        assert rc.engine.registered == [(dst.data_ptr(), dst.numel() * 2)]
        assert _covered(s.engine.registered, src) and len(s.engine.registered) <= 2  # + pack
        assert s.peer_info().entry_base == tuple(v.data_ptr() for v in views)
    finally:
        s.close()
        rc.close()


def test_cpu_cache_registers_under_both_descriptions(backend: str) -> None:
    """vLLM CPU's ``(num_blocks, H, block_size, 2 * head_size)`` per-layer view, layers of a
    block side by side in one storage: as one K|V-fused entry per layer, and as K and V slab
    entries (V ``block_size * head_size`` elements after K): both register, once per storage."""
    pm = PluginManager()
    store = torch.zeros((NB, LAYERS, HEADS, BS, 2 * D), dtype=torch.bfloat16)
    stride = LAYERS * HEADS * BS * 2 * D * 2
    per_layer = [store[:, i] for i in range(LAYERS)]
    for lay, items in (
        (_fused(page_stride=stride), per_layer),
        (_slabs(page_stride=stride), [x for v in per_layer for x in slab_views(v, BS)]),
    ):
        s, rc = _sessions(pm, backend, lay)
        dst = torch.zeros_like(store)
        mine = [dst[:, i] for i in range(LAYERS)]
        if lay.num_entries == 2 * LAYERS:
            mine = [x for v in mine for x in slab_views(v, BS)]
            assert items[1].data_ptr() - items[0].data_ptr() == BS * D * 2
        try:
            s.register_kv(items)
            rc.register_kv(mine)
            assert rc.engine.registered == [(dst.data_ptr(), dst.numel() * 2)]
            assert _covered(s.engine.registered, store)
            assert rc.peer_info().entry_base == tuple(t.data_ptr() for t in mine)
        finally:
            s.close()
            rc.close()


def test_raw_regions_and_named_errors(backend: str) -> None:
    """SGLang-style ``(address, nbytes, page_stride)`` regions register as given; a view with
    the wrong strides, or a region with another page stride, is refused naming the entry."""
    pm = PluginManager()
    lay = _fused()
    src = torch.zeros((LAYERS, NB, HEADS, BS, 2 * D), dtype=torch.bfloat16)
    ps = lay.entry(0).page_stride
    raw: list[Any] = [(src[i].data_ptr(), NB * ps, ps) for i in range(LAYERS)]
    raw[1] = KVRegion(address=src[1].data_ptr(), nbytes=NB * ps, page_stride=ps)
    s, rc = _sessions(pm, backend, lay)
    try:
        with pytest.raises(ValueError, match=r"entries\[1\] of shape \(6, 1, 128, 128\)"):
            rc.register_kv([src[0], src[1][:, :1], src[2]])  # one head of two
        with pytest.raises(ValueError, match=r"entries\[2\]\.page_stride=4096 bytes differs"):
            s.register_kv([*raw[:2], (src[2].data_ptr(), NB * ps, 4096)])
        s.register_kv(raw)
        assert _covered(s.engine.registered, src)
        assert s.peer_info().entry_base == tuple(src[i].data_ptr() for i in range(LAYERS))
    finally:
        s.close()
        rc.close()
