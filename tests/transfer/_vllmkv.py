"""vLLM-shaped KV caches for the multi-process transfer tests, and the per-token-per-head
reference they are checked against.

A model has ``heads`` KV heads of ``head_size`` bf16 elements and ``layers`` layers. Each rank's
cache is one storage holding every layer, as vLLM allocates it:

* ``storage="layer"``: ``(layers, num_blocks, H, block_size, 2 * head_size)`` -- a layer's view
  is ``(num_blocks, H, block_size, 2 * head_size)`` with the strides vLLM reports, e.g.
  ``(32768, 16384, 128, 1)`` for ``(num_blocks, 2, 128, 128)``;
* ``storage="block"``: ``(num_blocks, layers, H, block_size, 2 * head_size)`` -- the layers of a
  block side by side, so a layer's block stride spans every layer.

``form="fused"``: K|V fused per token in the last dim (one ``kv`` entry per layer, the
description the issue cites); ``form="slabs"``: vLLM ``CPU_ATTN``, per (block, head) a K slab of
``block_size`` rows then a V slab (two entries per layer, :func:`pdplug.geometry.slab_views`).
``raw=True`` registers every entry as a raw ``(address, nbytes, page_stride)`` region (SGLang).

The logical KV of layer ``l``, part ``k`` (the fused row, or K / V) is a seeded random array
``G[page, head, offset, bytes]`` over the *prefill* pages; a prefill rank holds its heads of it
(replicas hold the same bytes). The expected decode storage is poison except, for every room
and every token ``i`` in ``[prefix, total)`` this decode rank owns (DCP rank ``(i - prefix) %
dcp`` at local offset ``(i - prefix) // dcp``), each of its heads copied from ``G``.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

from pdplug import KVLayout
from pdplug.geometry import make_layout, slab_views
from pdplug.heads import kv_head_range
from pdplug.registration import KVRegion, page_extent

POISON = 0xA5
MODEL = "tiny-llama-vllm-cpu"


def layout(
    model: dict[str, Any], side: dict[str, Any], tp_rank: int, dcp_rank: int = 0
) -> KVLayout:
    """The :class:`KVLayout` of one rank of ``side`` (``tp``, ``page``, ``blocks``, ``dcp``,
    ``form``, ``storage``)."""
    h, d, nl = model["heads"], model["head_size"], model["layers"]
    lo, hi = kv_head_range(h, side["tp"], tp_rank)
    bs = side["page"]
    slabs = side["form"] == "slabs"
    stride = nl * (hi - lo) * bs * 2 * d * 2 if side["storage"] == "block" else 0
    return make_layout(
        kind="hnd", page_size=bs, num_layers=nl, head_bytes=(d if slabs else 2 * d) * 2,
        num_kv_heads=h, slabs=slabs, tp_size=side["tp"], tp_rank=tp_rank,
        dcp_size=side.get("dcp", 1), dcp_rank=dcp_rank, page_stride=stride, dtype="bfloat16",
        head_size=d, model=MODEL, engine="vllm", engine_version="0.32.0",
    )  # fmt: skip


def storage(model: dict[str, Any], side: dict[str, Any], tp_rank: int) -> torch.Tensor:
    """The rank's whole cache storage (bf16, uninitialised)."""
    h, d, nl = model["heads"], model["head_size"], model["layers"]
    lo, hi = kv_head_range(h, side["tp"], tp_rank)
    nb, bs = side["blocks"], side["page"]
    if side["storage"] == "layer":
        return torch.empty((nl, nb, hi - lo, bs, 2 * d), dtype=torch.bfloat16)
    return torch.empty((nb, nl, hi - lo, bs, 2 * d), dtype=torch.bfloat16)


def layer_view(st: torch.Tensor, side: dict[str, Any], layer: int) -> torch.Tensor:
    """vLLM's per-layer view ``(num_blocks, H, block_size, 2 * head_size)``."""
    return st[layer] if side["storage"] == "layer" else st[:, layer]


def parts(st: torch.Tensor, side: dict[str, Any], layers: int) -> list[torch.Tensor]:
    """Per entry, in layout order: the layer view (fused) or its K and V slab views."""
    out: list[torch.Tensor] = []
    for layer in range(layers):
        v = layer_view(st, side, layer)
        out += list(slab_views(v, side["page"])) if side["form"] == "slabs" else [v]
    return out


def entries(st: torch.Tensor, side: dict[str, Any], lay: KVLayout) -> list[Any]:
    """What the host hands ``register_kv``: the views, or raw regions over them."""
    views = parts(st, side, lay.num_layers)
    if not side.get("raw"):
        return views
    return [
        KVRegion(
            address=v.data_ptr(),
            nbytes=(v.shape[0] - 1) * lay.entry(e).page_stride + page_extent(lay, e),
            page_stride=lay.entry(e).page_stride,
        )
        for e, v in enumerate(views)
    ]


def as_bytes(v: torch.Tensor) -> torch.Tensor:
    """A uint8 view ``(num_blocks, H, block_size, row bytes)`` of a bf16 view."""
    return v.view(torch.uint8)


def logical(model: dict[str, Any], src: dict[str, Any], e: int, seed: int) -> torch.Tensor:
    """``G`` of entry ``e``: uint8 ``(prefill blocks, heads, prefill page, row bytes)``."""
    per = 2 if src["form"] == "slabs" else 1
    row = (model["head_size"] * 2) * (1 if per == 2 else 2)
    g = torch.Generator().manual_seed(seed * 1009 + e)
    shape = (src["blocks"], model["heads"], src["page"], row)
    return torch.randint(0, 256, shape, dtype=torch.uint8, generator=g)


def fill_source(model: dict[str, Any], src: dict[str, Any], st: torch.Tensor, tp_rank: int,
                seed: int) -> None:  # fmt: skip
    """Random bytes everywhere, then this rank's heads of the logical KV."""
    flat = st.view(-1).view(torch.uint8)
    g = torch.Generator().manual_seed(seed * 7919 + tp_rank)
    flat.copy_(torch.randint(0, 256, flat.shape, dtype=torch.uint8, generator=g))
    lo, hi = kv_head_range(model["heads"], src["tp"], tp_rank)
    for e, v in enumerate(parts(st, src, model["layers"])):
        as_bytes(v).copy_(logical(model, src, e, seed)[:, lo:hi])


def src_pages(src: dict[str, Any], room: int, total: int) -> np.ndarray:
    """The request's prefill pages (the same on every prefill TP rank)."""
    need = -(-total // src["page"])
    return np.random.default_rng(room).permutation(src["blocks"])[:need].astype(np.int64)


def dst_pages(dst: dict[str, Any], rooms: list[list[int]], room: int, rank: int) -> np.ndarray:
    """This decode rank's pages for ``room`` from its prefix on: disjoint across the rooms,
    shuffled, different per rank (a stray write into another room's pages shows)."""
    vpage = dst["page"] * dst.get("dcp", 1)
    need = {r: -(-(t - p) // vpage) for r, t, p in rooms}
    order = [r for r, _t, _p in rooms]
    off = sum(need[r] for r in order[: order.index(room)])
    perm = np.random.default_rng(1000 + rank).permutation(dst["blocks"])
    return perm[off : off + need[room]].astype(np.int64)


def expected_storage(model: dict[str, Any], src: dict[str, Any], dst: dict[str, Any],
                     rooms: list[list[int]], tp_rank: int, dcp_rank: int,
                     seed: int) -> torch.Tensor:  # fmt: skip
    """The decode rank's whole storage after every room succeeded (poison elsewhere)."""
    want = storage(model, dst, tp_rank)
    want.view(-1).view(torch.uint8).fill_(POISON)
    lo, hi = kv_head_range(model["heads"], dst["tp"], tp_rank)
    dcp, pd, ps = dst.get("dcp", 1), dst["page"], src["page"]
    rank = tp_rank * dcp + dcp_rank
    views = [as_bytes(v) for v in parts(want, dst, model["layers"])]
    for room, total, prefix in rooms:
        sp = src_pages(src, room, total)
        dp = dst_pages(dst, rooms, room, rank)
        tok = np.arange(prefix, total)
        tok = tok[(tok - prefix) % dcp == dcp_rank]
        local = (tok - prefix) // dcp
        s_page, s_off = torch.from_numpy(sp[tok // ps]), torch.from_numpy(tok % ps)
        d_page, d_off = torch.from_numpy(dp[local // pd]), torch.from_numpy(local % pd)
        for e, v in enumerate(views):
            g = logical(model, src, e, seed)
            for h in range(lo, hi):
                v[d_page, h - lo, d_off] = g[s_page, h, s_off]
    return want


def owed_bytes(model: dict[str, Any], src: dict[str, Any], dst: dict[str, Any],
               rooms: list[list[int]]) -> int:  # fmt: skip
    """Bytes the decode instance must receive in all (each head of each token once per decode
    rank that holds it): what every prefill rank's ``bytes`` counter must add up to."""
    h, d, nl = model["heads"], model["head_size"], model["layers"]
    per_head = nl * 2 * d * 2  # K and V of one head of one token, every layer
    out = 0
    for t in range(dst["tp"]):
        lo, hi = kv_head_range(h, dst["tp"], t)
        out += sum(total - prefix for _r, total, prefix in rooms) * (hi - lo) * per_head
    return out
