"""Real engines moving KV caches shaped and strided exactly like vLLM's, between processes.

Each scenario is one prefill instance and one decode instance (:mod:`_vllmkv`,
:mod:`_vllmharness`): vLLM per-layer views ``(num_blocks, 2, 128, 128)`` bf16 with strides
``(32768, 16384, 128, 1)`` (several layers in one storage, or the layers of a block side by
side), vLLM CPU's K-slab/V-slab form, SGLang-style raw regions, prefill TP 1 -> decode TP 2 and
TP 2 -> 1 (head routing), decode DCP 2 with a page ratio and a prefix inside a prefill page, and
a page ratio the other way. Every byte of every decode storage is compared with a
per-token-per-head reference (poison outside the destination tokens); the prefill ranks' byte
counters add up to exactly what the decode ranks own (no head written twice, nothing to a
decode rank a prefill rank owes nothing).
"""

from __future__ import annotations

from typing import Any

import _vllmharness as vh
import _vllmkv as vk
import pytest
from _kvharness import Child

from pdplug.bootstrap import RendezvousServer

pytestmark = pytest.mark.timeout(240)

OK = 4
VLLM = {"heads": 4, "head_size": 64, "layers": 2}  # (num_blocks, 2, 128, 128) at TP 2
GQA2 = {"heads": 2, "head_size": 64, "layers": 2}  # (num_blocks, 2, 128, 128) at TP 1


def _side(tp: int, page: int, blocks: int, form: str = "fused", storage: str = "layer",
          **kw: Any) -> dict[str, Any]:  # fmt: skip
    return {"tp": tp, "page": page, "blocks": blocks, "form": form, "storage": storage, **kw}


TP_SCENARIOS = [
    {  # decode ranks hold exactly vLLM's (12, 2, 128, 128) / (32768, 16384, 128, 1) views
        "name": "tp1to2", "model": VLLM, "seed": 1, "grid": 256,
        "src": _side(1, 128, 12), "dst": _side(2, 128, 12),
        "rooms": [[11, 700, 0], [12, 300, 128], [13, 129, 0]],
    },
    {  # prefill ranks hold vLLM's views; decode: layers of a block side by side, raw regions
        "name": "tp2to1", "model": VLLM, "seed": 2, "grid": 256,
        "src": _side(2, 128, 12), "dst": _side(1, 128, 12, storage="block", raw=True),
        "rooms": [[21, 700, 0], [22, 300, 128]],
    },
    {  # vLLM CPU_ATTN: per (block, head) a K slab then a V slab
        "name": "slabs1to2", "model": GQA2, "seed": 3, "grid": 128,
        "src": _side(1, 32, 24, "slabs", "block"), "dst": _side(2, 32, 32, "slabs"),
        "rooms": [[31, 333, 0], [32, 200, 64]],
    },
]  # fmt: skip

RATIO_SCENARIOS = [
    {  # prefill page 128 -> decode page 32 x DCP 2 (virtual page 64), prefix inside a page
        "name": "dcp2ratio", "model": GQA2, "seed": 4, "grid": 256,
        "src": _side(1, 128, 12, raw=True), "dst": _side(1, 32, 24, dcp=2),
        "rooms": [[41, 700, 0], [42, 500, 64], [43, 65, 0]],
    },
    {  # prefill page 32 (TP 2, K/V slabs) -> decode page 128 (TP 1, layers side by side)
        "name": "ratioup", "model": GQA2, "seed": 5, "grid": 128,
        "src": _side(2, 32, 48, "slabs"), "dst": _side(1, 128, 12, "slabs", "block"),
        "rooms": [[51, 600, 0], [52, 400, 128]],
    },
]  # fmt: skip


def _run(backend: str, scenarios: list[dict[str, Any]]) -> None:
    spec = {"scenarios": scenarios}
    server = RendezvousServer().start()
    pre = Child(vh.prefill_main, server.endpoint, backend, spec)
    dec = None
    try:
        pre.wait("ready", 120)
        dec = Child(vh.decode_main, server.endpoint, backend, spec)
        dec.wait("ready", 120)
        got = dec.wait("done", 150)["ranks"]
        sent = pre.wait("done", 150)
    finally:
        for c in (dec, pre):
            if c is not None:
                c.stop()
        server.stop()
    assert not sent["timed_out"], sent
    for sc in scenarios:
        name, dst = sc["name"], sc["dst"]
        for r in got[name]:
            assert r["status"] == [OK] * len(sc["rooms"]), (name, r)
            assert r["bad_bytes"] == 0, (name, r)
            assert r["poison_left"] > 0  # the reference leaves bytes no room owns
        srcs = sent["ranks"][name]
        for r in srcs:
            if r["feeds"]:
                assert r["status"] == [OK] * len(sc["rooms"]), (name, r)
                assert r["peers"] == len(r["feeds"]) * dst.get("dcp", 1), (name, r)
            else:  # a replica the routing does not use: never connected, never posted
                assert (r["peers"], r["posts"], r["bytes"]) == (0, 0, 0), (name, r)
        owed = vk.owed_bytes(sc["model"], sc["src"], dst, sc["rooms"])
        assert sum(r["bytes"] for r in srcs) == owed, (name, srcs, owed)


def test_vllm_views_tp1_to_tp2_tp2_to_tp1_and_cpu_slabs(backend: str) -> None:
    _run(backend, TP_SCENARIOS)


def test_vllm_views_dcp2_page_ratio_both_ways(backend: str) -> None:
    _run(backend, RATIO_SCENARIOS)
