"""The reference host end to end: real worker processes, real plugins via entry points."""

from __future__ import annotations

import os
import signal
import threading
import time

import pytest

from pdplug_host.driver import DemoError, DemoOptions, run_demo

pytest.importorskip("nixl_cu12", reason="the demo's default KV sender needs NIXL")
pytestmark = [pytest.mark.slow, pytest.mark.timeout(240)]


def test_short_demo_is_token_identical() -> None:
    rep = run_demo(DemoOptions(requests=6, prefill_pp=2, decode_dcp=2, timeout_s=20.0))
    assert rep["requests"] == 6
    assert rep["parity_ok"] == 6, rep["mismatches"]
    assert rep["mismatches"] == []
    assert {d["name"] for d in rep["plugins"].values()} == {"pp0", "nixl", "dcp", "default"}
    assert all(d["distribution"] == "pdplug" for d in rep["plugins"].values())
    # the decode side is cold: every prompt token crossed the wire, split into segments
    assert rep["tokens_transferred"] > 0
    assert rep["segments"] >= 6
    assert rep["bytes_transferred"] > 0
    assert rep["ttft_ms"]["p50"] > 0


def test_killed_decode_rank_ends_with_a_clear_error() -> None:
    def kill_soon(pids: dict[tuple[str, int], int]) -> None:
        def later() -> None:
            time.sleep(0.3)
            os.kill(pids[("decode", 1)], signal.SIGKILL)

        threading.Thread(target=later, daemon=True).start()

    t0 = time.monotonic()
    with pytest.raises(DemoError) as err:
        run_demo(
            DemoOptions(requests=32, prefill_pp=2, decode_dcp=2, timeout_s=10.0),
            on_ready=kill_soon,
        )
    msg = str(err.value)
    assert "decode rank 1" in msg
    assert "rooms failed" in msg
    assert time.monotonic() - t0 < 180
