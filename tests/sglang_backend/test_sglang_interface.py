"""The pdplug backend at SGLang's interface, no model: real processes, real NIXL/Mooncake.

Every rank is a spawned process running :mod:`_ranks` (SGLang's parallel context, SGLang's
``KVArgs`` and ``get_kv_class``, the calls of SGLang's queues in their order); the test
process serves the prefill's rendezvous with the backend's own bootstrap-server class.

* a DCP 2 decode layout (SGLang's CPU attention has none, so DCP is proven here): a cached
  prefix on decode, sends split at the pack capacity, every token on its DCP rank at
  ``i // dcp_size``, metadata rows and state items byte-exact on both decode ranks;
* aborts and timeouts: a decode abort before its metadata ends the prefill room at once, a
  prefill abort mid-send ends the decode room (drained), a decode that never comes fails the
  prefill room at SGLang's bootstrap timeout;
* PP 2 and PP 4 prefill bootstrap agreement through pdplug's consensus: every stage's layers
  land; a room one stage fails is failed on every stage and on decode.
"""

from __future__ import annotations

import multiprocessing as mp
import queue
import sys
import time
from pathlib import Path
from typing import Any

import pytest

from pdplug.ports import free_ports

sys.path.insert(0, str(Path(__file__).parent))
import _ranks

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]


def _senders(in_ci: str) -> Any:
    """Both KV senders; CI runs ``in_ci`` and marks the other long (CI's 50 minutes: the
    adapter above the sender is the same, and py311-all runs every sender test on both)."""
    return pytest.mark.parametrize(
        "sender",
        [
            pytest.param(name, marks=[getattr(pytest.mark, name)]
                         + ([] if name == in_ci else [pytest.mark.long]))
            for name in ("nixl", "mooncake")
        ],
    )  # fmt: skip


def _run(
    configs: list[tuple[Any, dict[str, Any]]], timeout_s: float = 240.0
) -> dict[tuple[str, int], Any]:
    from pdplug.adapters.sglang.conn import PdplugKVBootstrapServer

    port = configs[0][1]["bootstrap_port"]
    server = PdplugKVBootstrapServer("127.0.0.1", port)
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    procs = [ctx.Process(target=fn, args=(cfg, q), daemon=True) for fn, cfg in configs]
    out: dict[tuple[str, int], Any] = {}
    try:
        for p in procs:
            p.start()
        deadline = time.monotonic() + timeout_s
        while len(out) < len(procs) and time.monotonic() < deadline:
            try:
                kind, rank, res = q.get(timeout=1.0)
            except queue.Empty:
                if not any(p.is_alive() for p in procs):
                    break
                continue
            assert not kind.endswith("-error"), f"{kind} rank {rank}:\n{res}"
            out[(kind, rank)] = res
    finally:
        for p in procs:
            p.join(timeout=15)
            if p.is_alive():
                p.kill()
                p.join(timeout=5)
        server.close()
    assert len(out) == len(procs), f"only {sorted(out)} reported"
    return out


def _par(**kw: int) -> dict[str, int]:
    return {"attn_tp_size": 1, "attn_tp_rank": 0, **kw}


@_senders("nixl")
def test_dcp2_cached_prefix_split_at_pack_capacity(sender: str) -> None:
    (bport,) = free_ports(1)
    page, prompt, prefix, cap = 16, 700, 64, 64
    room = {
        "room": 1234567,
        "prompt": prompt,
        "prefix": prefix,
        "aux_slot": 3,
        "src_pages": list(range(5, 5 + -(-prompt // page))),
        "dst_pages": list(range(3, 3 + -(-(prompt - prefix) // (2 * page)))),
        "state_src": [3, 7],
        "state_dst": [1, 2],
    }
    env = {"PDPLUG_KV_SENDER": sender, "PDPLUG_SGLANG_PACK_REGION_TOKENS": str(cap)}
    base = {"bootstrap_port": bport, "page_size": page, "pool_pages": 64, "state": True, "env": env}
    pre = {**base, "parallel": _par(), "rooms": [room]}
    decs = [
        {
            **base,
            "parallel": _par(attn_tp_size=2, attn_tp_rank=r, dcp_size=2, dcp_rank=r),
            "rooms": [room],
        }
        for r in range(2)
    ]
    out = _run([(_ranks.prefill_rank, pre), *((_ranks.decode_rank, d) for d in decs)])
    p = out[("prefill", 0)][str(room["room"])]
    assert p["bootstrap"] == 2 and p["end"] == 4 and p["prefix"] == prefix, p
    segments, capacity = out[("prefill", 0)]["stats"]["segments"], p["capacity"]
    assert capacity is not None and capacity <= 2 * cap, capacity  # the decode needs relayout
    assert segments == -(-(prompt - prefix) // capacity) > 1, (segments, capacity)
    want = _ranks.expected_kv(pre, room)
    for r in range(2):
        d = out[("decode", r)][str(room["room"])]
        assert d["end"] == 4, d
        got = {int(i): v for i, v in d["kv"].items()}
        assert sorted(got) == [i for i in range(prefix, prompt) if i % 2 == r]
        bad = [i for i in got if got[i] != want[i]]
        assert not bad, f"decode DCP rank {r}: tokens {bad[:8]} differ"
        assert d["aux"][0] == [(room["room"] + 7) % 251] * 64
        assert d["aux"][1] == [room["room"]] * 16
        for i, items in enumerate(d["state"]):
            for j, row in zip(room["state_src"], items):
                assert row == [(j * 13 + i * 5 + room["room"]) % 256] * _ranks.STATE_ITEM[i]


@_senders("mooncake")
def test_aborts_and_timeouts(sender: str) -> None:
    (bport,) = free_ports(1)
    page = 16
    common = {
        "prompt": 200,
        "prefix": 0,
        "src_pages": list(range(1, 14)),
        "dst_pages": list(range(2, 15)),
    }
    declined = {"room": 11, "aux_slot": 1, "decode_abort_before_metadata": True, **common}
    cut = {"room": 12, "aux_slot": 2, "abort_after_first_send": True, **common}
    silent = {"room": 13, "aux_slot": 3, **common}  # no decode ever asks for it
    env = {"PDPLUG_KV_SENDER": sender, "SGLANG_DISAGGREGATION_BOOTSTRAP_TIMEOUT": "4"}
    base = {
        "bootstrap_port": bport,
        "page_size": page,
        "pool_pages": 32,
        "env": env,
        "transfer_wait_s": 30.0,
    }
    pre = {**base, "parallel": _par(), "rooms": [declined, cut, silent], "bootstrap_wait_s": 30.0}
    dec = {**base, "parallel": _par(), "rooms": [declined, cut]}
    t0 = time.monotonic()
    out = _run([(_ranks.prefill_rank, pre), (_ranks.decode_rank, dec)])
    p, d = out[("prefill", 0)], out[("decode", 0)]
    # a decode abort before its metadata: the prefill room ends at once, not at its deadline
    assert p["11"]["bootstrap"] == 0 and p["11"]["bootstrap_s"] < 3.5, p["11"]
    # a prefill abort after its first chunk: the decode room fails, and drains (within 10 s:
    # the failure may come while the prefill's write is in flight, its drained report after)
    assert p["12"]["end"] == 0, p["12"]
    assert d["12"]["end"] == 0 and d["12"]["drained"], d["12"]
    assert "abort" in d["12"]["reason"].lower(), d["12"]
    # nobody asked: failed by SGLang's bootstrap timeout (4 s here), with the reason
    assert p["13"]["bootstrap"] == 0 and 3.5 < p["13"]["bootstrap_s"] < 20.0, p["13"]
    assert p["13"].get("reason"), p["13"]
    assert time.monotonic() - t0 < 200


@pytest.mark.mooncake
# CI runs the default, pp0, at PP 4 (about a minute: five processes importing SGLang); ring,
# selectable for comparison, and the other sizes are marked long (CI's 50 minutes; the ring
# plugin's own agreement tests run in py311-all): tox run -e sglang -- -m long tests/sglang_backend
@pytest.mark.parametrize(
    ("pp", "consensus"),
    [
        pytest.param(2, "ring", marks=pytest.mark.long),
        (4, "pp0"),
        pytest.param(2, "pp0", marks=pytest.mark.long),
        pytest.param(4, "ring", marks=pytest.mark.long),
    ],
)
def test_pp_bootstrap_consensus_with_a_failing_stage(pp: int, consensus: str) -> None:
    bport, dist_port = free_ports(2)
    page, layers = 16, 4
    per = layers // pp
    common = {
        "prompt": 150,
        "prefix": 0,
        "src_pages": list(range(1, 11)),
        "dst_pages": list(range(4, 14)),
    }
    good = {"room": 21, "aux_slot": 1, **common}
    bad = {"room": 22, "aux_slot": 2, **common}
    env = {
        "PDPLUG_KV_SENDER": "mooncake",
        "PDPLUG_CONSENSUS": consensus,
        "SGLANG_DISAGGREGATION_BOOTSTRAP_TIMEOUT": "30",
    }
    base = {
        "bootstrap_port": bport,
        "page_size": page,
        "pool_pages": 16,
        "env": env,
        "transfer_wait_s": 30.0,
    }
    pres = []
    for r in range(pp):
        rooms = [good, {**bad, "fail_here": r == pp - 1}]
        par = _par(pp_size=pp, pp_rank=r) | {"dist_url": f"tcp://127.0.0.1:{dist_port}"}
        pres.append(
            {
                **base,
                "parallel": par,
                "rooms": rooms,
                "layers": per,
                "first_layer": r * per,
                "bootstrap_wait_s": 40.0,
            }
        )
    dec = {
        **base,
        "parallel": _par(),
        "rooms": [good, {**bad, "decode_abort_before_metadata": False}],
        "layers": layers,
        "transfer_wait_s": 40.0,
    }
    out = _run(
        [*((_ranks.prefill_rank, c) for c in pres), (_ranks.decode_rank, dec)], timeout_s=400.0
    )
    for r in range(pp):
        res = out[("prefill", r)]
        assert res["21"]["bootstrap"] == 2 and res["21"]["end"] == 4, (r, res["21"])
        assert res["22"]["bootstrap"] == 0, (r, res["22"])  # decided bad on every stage
    d = out[("decode", 0)]
    assert d["21"]["end"] == 4, d["21"]
    assert d["22"]["end"] == 0, d["22"]
    # every stage's layers landed: decode layer l is stage l // per's local layer l % per
    want = _ranks.expected_kv({**base, "layers": per}, good)
    got = {int(i): v for i, v in d["21"]["kv"].items()}
    for i in range(good["prompt"]):
        for kv in range(2):
            for layer in range(layers):
                assert got[i][kv][layer] == want[i][kv][layer % per], (i, kv, layer)
