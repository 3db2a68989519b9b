"""The pdplug transfer backend on real SGLang 0.5.23 engines (CPU, tiny random Llama).

One single engine answers the first 16 bundled-trace prompts (the reference); then, per
case, a prefill engine (PP 1 or PP 2) and a decode engine with
``--disaggregation-transfer-backend pdplug`` behind SGLang's router must give the same tokens
for every request, move the KV bytes the prompts need, and (PP 1 over NIXL) survive the decode
engine being SIGKILLed mid-run: every request ends, nothing hangs, the prefill keeps serving.
Minutes of CPU (engine start-up): run under ``flock /tmp/pdplug-heavy.lock`` on a shared host.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from pdplug_engines.tokens import Completion, RequestFailed
from pdplug_host.trace import trace_prompts
from pdplug_sglang.parity import deployment, kill_decode_mid_run, measure, reference

pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]

MAX_TOKENS = 16


@pytest.fixture(scope="module")
def prompts() -> list[list[int]]:
    """16 trace prompts scaled by 32 (63 to 2,725 tokens, shared prefixes)."""
    return trace_prompts(16, 32, 1024)


@pytest.fixture(scope="module")
def ref(
    prompts: list[list[int]], tmp_path_factory: pytest.TempPathFactory
) -> list[Completion | RequestFailed]:
    """The single engine's answers."""
    out = reference(tmp_path_factory.mktemp("single"), prompts, MAX_TOKENS)
    assert all(isinstance(r, Completion) for r in out), [
        r for r in out if isinstance(r, RequestFailed)
    ]
    return out


def _check(res, n: int) -> None:
    assert not res.failed, res.failed
    assert not res.differ, res.differ
    assert res.identical == n
    assert res.bytes_ok, (res.kv_bytes, res.kv_bytes_min, res.kv_bytes_max)


@pytest.mark.nixl
def test_pp1_nixl_parity_then_decode_killed(prompts, ref, tmp_path: Path) -> None:
    with deployment("pdplug-nixl", tmp_path) as dep:
        _check(measure(dep, prompts, MAX_TOKENS, ref), len(prompts))
        kill = kill_decode_mid_run(dep, prompts, MAX_TOKENS, kill_after_s=1.0, timeout_s=120.0)
        assert kill.hung == 0, kill
        assert kill.answered + kill.failed == kill.requests, kill
        assert kill.failed > 0, f"the kill landed after every request ended: {kill}"
        assert kill.ended_s < 90.0, kill
        assert kill.prefill_healthy and kill.prefill_answers, kill
        assert dep.prefill.alive(), dep.prefill.log_tail()


@pytest.mark.mooncake
def test_pp1_mooncake_parity(prompts, ref, tmp_path: Path) -> None:
    with deployment("pdplug-mooncake", tmp_path) as dep:
        _check(measure(dep, prompts, MAX_TOKENS, ref), len(prompts))


@pytest.mark.mooncake
def test_pp2_mooncake_parity(prompts, ref, tmp_path: Path) -> None:
    with deployment("pdplug-mooncake", tmp_path, prefill_pp=2) as dep:
        _check(measure(dep, prompts, MAX_TOKENS, ref), len(prompts))


@pytest.mark.nixl
def test_pp2_nixl_parity(prompts, ref, tmp_path: Path) -> None:
    # SGLang's own nixl backend hangs at PP 2 on this machine (docs/sglang-backend.md)
    with deployment("pdplug-nixl", tmp_path, prefill_pp=2) as dep:
        _check(measure(dep, prompts, MAX_TOKENS, ref), len(prompts))
