"""The soak, small: ``pdplug bench soak`` over both backends (random aborts, re-handshakes, slow
and stuck writes, a killed decode rank) exits 0 only when every integrity check passes."""

from __future__ import annotations

import subprocess
import sys

import pytest

from pdplug.testing import require

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]


def test_a_small_soak_passes_every_check() -> None:
    for backend in ("nixl", "mooncake"):
        require(backend)
    cmd = [
        sys.executable,
        "-m",
        "pdplug.cli",
        "bench",
        "soak",
        "--rooms",
        "150",
        "--concurrency",
        "24",
        "--reconnect-every",
        "50",
        "--seed",
        "7",
    ]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=540)
    out = proc.stdout + proc.stderr[-2000:]
    assert proc.returncode == 0, out
    assert "pdplug bench soak" in proc.stdout and "FAIL" not in proc.stdout, out
