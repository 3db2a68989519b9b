"""The reference host end to end: real worker processes, real plugins via entry points.

Needs NIXL (the default KV sender) and torch: both follow the PDPLUG_REQUIRE rule (a skip with
the reason, a failure in the ``all`` envs).
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import pytest

from pdplug_host.driver import DemoError, DemoOptions, run_demo

pytestmark = [pytest.mark.torch, pytest.mark.nixl, pytest.mark.slow, pytest.mark.timeout(300)]


def test_short_demo_is_token_identical_reports_progress_and_cleans_up(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))  # where the run's log dir goes
    calls: list[tuple[str, int, int]] = []
    rep = run_demo(
        DemoOptions(requests=6, prefill_pp=2, decode_dcp=2, timeout_s=20.0),
        progress=lambda phase, done, total, note: calls.append((phase, done, total)),
    )
    assert rep["requests"] == 6
    assert rep["parity_ok"] == 6, rep["mismatches"]
    assert rep["mismatches"] == [] and rep["refused"] == []
    assert {d["name"] for d in rep["plugins"].values()} == {"pp0", "nixl", "dcp", "default"}
    assert all(d["distribution"] == "pdplug" for d in rep["plugins"].values())
    # the decode side is cold: every prompt token crossed the wire, split into segments
    assert rep["tokens_transferred"] > 0
    assert rep["segments"] >= 6
    assert rep["bytes_transferred"] > 0
    assert rep["ttft_ms"]["p50"] > 0
    # every phase reported while it ran, workers one by one
    by_phase: dict[str, list[int]] = {}
    for phase, done, total in calls:
        by_phase.setdefault(phase, []).append(done)
        assert 0 <= done <= total
    assert set(by_phase) == {"load", "reference", "start", "replay"}
    for phase in ("reference", "start", "replay"):
        seen = by_phase[phase]
        assert seen == sorted(seen) and seen[0] == 0 and seen[-1] == (4 if phase == "start" else 6)
    assert len(set(by_phase["start"])) >= 3, by_phase["start"]  # a real count, not 0 -> 4
    assert len(set(by_phase["reference"])) == 7
    # the per-run worker-log folder is gone after a clean run
    assert rep["worker_logs"] is None
    assert not list(tmp_path.glob("pdplug-demo-*"))


def test_a_decode_wider_than_eight_dcp_ranks_is_served() -> None:
    """``--decode-dcp`` takes 1..16: the prefill's pack buffer is sized for the decode's DCP
    (it kept KVConfig's default ``max_dst_dcp=8`` and every worker refused DCP 9 at the
    handshake, after the command had accepted it)."""
    rep = run_demo(
        DemoOptions(requests=2, prefill_pp=1, decode_dcp=9, max_output=2, timeout_s=30.0)
    )
    assert rep["parity_ok"] == 2, rep["mismatches"]


def test_requests_wait_for_pages_and_one_that_never_fits_is_refused_alone() -> None:
    """C04 (SGLang #20485): with 48 pages per worker, request 7 (841 tokens, 53 prefill pages)
    can never fit and the others (up to 46 pages each) only a few at a time: they wait for
    pages on both sides; no worker dies, every other request is token-identical."""
    rep = run_demo(
        DemoOptions(
            requests=8, prefill_pp=2, decode_dcp=1, num_pages=48, time_scale=0.0, timeout_s=30.0
        )
    )
    assert rep["refused"] == [7]
    assert rep["parity_ok"] == 7, rep["mismatches"]
    (refused,) = rep["mismatches"]
    assert refused["rid"] == 7 and "53 KV pages on a prefill rank" in refused["error"]
    stats = rep["worker_stats"]
    assert stats["decode0"]["page_waits"] > 0, stats["decode0"]
    # the prefill was short too: it waited, or evicted cached blocks (PP1 the same ones)
    pre = stats["prefill0"]
    assert pre["page_waits"] + pre["evicted_blocks"] > 0, pre
    assert pre["evicted_blocks"] == stats["prefill1"]["evicted_blocks"]


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


GLOG_LINE = re.compile(r"^[IWEF]\d{4} \d\d:\d\d:\d\d")


@pytest.mark.mooncake
def test_piped_demo_prints_a_line_per_phase_and_keeps_worker_output_off_stdout() -> None:
    """stdout a pipe (a CI log): the first line comes at once, one line per phase; with
    ``--log-dir ''`` worker output goes to stderr, and Mooncake's native log only at ERROR."""
    cmd = [sys.executable, "-m", "pdplug.cli", "demo", "--requests", "3", "--no-arrivals"]
    cmd += ["--kv-sender", "mooncake", "--log-dir", ""]
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PDPLUG_", "MC_", "GLOG"))}
    env["PDPLUG_LOG_LEVEL"] = "INFO"  # the workers log; none of it may reach stdout
    t0 = time.monotonic()
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
    err_lines: list[str] = []
    reader = threading.Thread(target=lambda: err_lines.extend(proc.stderr or ()), daemon=True)
    reader.start()
    lines: list[tuple[float, str]] = []
    assert proc.stdout is not None
    for line in proc.stdout:
        lines.append((time.monotonic() - t0, line.rstrip("\n")))
    assert proc.wait(timeout=240) == 0, (lines, err_lines[-20:])
    reader.join(10)
    text = [t for _, t in lines]
    assert text[0].startswith("pdplug demo: 3 requests of the bundled trace sample"), text
    when = {t.split(":")[0]: at for at, t in lines if ": " in t}
    assert "starting workers" in when and "reference run (one process, all layers)" in when
    assert when["pdplug demo"] < when["starting workers"] - 1.0, lines  # talks before workers
    assert any(t.startswith("starting workers: 4 of 4 workers ready in ") for t in text)
    assert any(t.startswith("replaying the trace: 3 of 3 requests ended in ") for t in text)
    assert text[-1] == "all 3 requests token-identical to the reference"
    assert not [t for t in text if GLOG_LINE.match(t) or "pdplug-prefill" in t], text
    assert any("pdplug-prefill-0" in e for e in err_lines), err_lines[-20:]  # the workers' log
    assert not [e for e in err_lines if e.startswith(("I1", "W1"))], err_lines  # ERROR only
