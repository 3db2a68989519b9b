"""``pdplug demo --engine sglang`` fails when a printed check fails: every request
token-identical and the bytes SGLang reports moving within what the prompts need. The run is
replaced by its result: this tests the command's verdict (the engines' own runs are in
test_sglang_engines.py)."""

from __future__ import annotations

import pytest
from click.testing import CliRunner

from pdplug.cli import main
from pdplug_sglang.parity import ParityResult

pytestmark = pytest.mark.timeout(60)


def _result(identical: int, kv_bytes: int) -> ParityResult:
    return ParityResult(
        backend="pdplug", prefill_pp=1, requests=4, prompt_tokens=64, max_tokens=4,
        identical=identical, failed=[], differ=[], start_s=1.0, disagg_run_s=1.0,
        ttft_p50_s=0.1, ttft_p99_s=0.2, single_ttft_p50_s=0.1, throughput_rps=1.0,
        kv_bytes=kv_bytes, kv_bytes_min=1000, kv_bytes_max=2000,
    )  # fmt: skip


@pytest.mark.parametrize(
    ("identical", "kv_bytes", "code", "needle"),
    [
        (4, 1500, 0, "all 4 requests token-identical"),
        (3, 1500, 1, "3 of 4 requests identical"),
        (4, 5000, 1, "bytes moved outside what the prompts need"),
    ],
)
def test_the_sglang_demo_fails_on_parity_or_on_the_bytes_check(
    monkeypatch: pytest.MonkeyPatch, identical: int, kv_bytes: int, code: int, needle: str
) -> None:
    import pdplug_host.sglang_demo

    res = _result(identical, kv_bytes)
    monkeypatch.setattr(pdplug_host.sglang_demo, "run_sglang_demo", lambda *a, **k: res)
    out = CliRunner().invoke(main, ["demo", "--engine", "sglang", "--requests", "4"])
    assert out.exit_code == code, out.output
    assert needle in out.output, out.output
    assert ("OUTSIDE" in out.output) == (kv_bytes > 2000), out.output
