"""The shared engine harness (``apps/pdplug_engines``) without an engine: a real server
process started in its own group, awaited on ``/health`` and stopped with every child; token
parity and the byte bounds of a prompt set."""

from __future__ import annotations

import os
import sys
import time
from collections.abc import Mapping

import msgspec
import pytest

pytest.importorskip("httpx")

from pdplug.ports import free_ports
from pdplug_engines.procs import EngineError, launch, running
from pdplug_engines.tiny_model import TinyLlama
from pdplug_engines.tokens import (
    Completion,
    RequestFailed,
    compare_tokens,
    kv_bytes_bounds,
    percentile,
)

# a server answering /health, with a child process that must die with it (its pid printed)
SERVER = """
import http.server, os, subprocess, sys
child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
print("child", child.pid, flush=True)
class H(http.server.BaseHTTPRequestHandler):
    def do_GET(self):
        self.send_response(200 if self.path == "/health" else 404); self.end_headers()
    def log_message(self, *a): pass
http.server.HTTPServer(("127.0.0.1", int(sys.argv[1])), H).serve_forever()
"""


class Spec(msgspec.Struct, frozen=True):
    name: str
    port: int
    code: str = SERVER

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def command(self) -> list[str]:
        return [sys.executable, "-c", self.code, str(self.port)]

    def environment(self, base: Mapping[str, str]) -> dict[str, str]:
        return {**base, "PDPLUG_TEST_SPEC": self.name}


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    with open(f"/proc/{pid}/stat") as f:  # a zombie is dead
        return f.read().split()[2] != "Z"


def test_an_engine_starts_answers_health_and_stops_with_its_children(tmp_path) -> None:
    (port,) = free_ports(1)
    with running([Spec("srv", port)], tmp_path, timeout_s=30.0) as (e,):
        assert e.alive() and e.ready_s > 0
        child = int(e.log_path.read_text().split()[1])
        assert _alive(child)
    assert not e.alive()
    deadline = time.monotonic() + 5.0
    while _alive(child) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not _alive(child), "the server's child outlived the stop"


def test_wait_gone_waits_for_the_whole_group_after_a_kill(tmp_path) -> None:
    (port,) = free_ports(1)
    with running([Spec("srv", port)], tmp_path, timeout_s=30.0) as (e,):
        child = int(e.log_path.read_text().split()[1])
        assert not e.wait_gone(0.3)  # alive: the group stays
        e.kill()
        assert e.wait_gone(10.0)
        assert not _alive(child) and not e.alive()
        # the port is free again: a new server can take it at once (a restart on the same ports)
        with running([Spec("srv-again", port)], tmp_path, timeout_s=30.0) as (again,):
            assert again.alive()


def test_an_engine_that_exits_before_ready_is_named_with_its_log(tmp_path) -> None:
    (port,) = free_ports(1)
    e = launch(Spec("boom", port, code="print('no model here'); raise SystemExit(3)"), tmp_path)
    with pytest.raises(EngineError, match=r"engine boom exited with 3 .*\n.*no model here"):
        e.wait_ready(timeout_s=20.0)
    e.stop()


def test_token_parity_names_failures_and_the_first_difference() -> None:
    ref = [Completion(index=0, tokens=(1, 2, 3), ttft_s=0.1, latency_s=0.2),
           Completion(index=1, tokens=(4, 5, 6), ttft_s=0.1, latency_s=0.2),
           RequestFailed(2, "HTTP 500")]  # fmt: skip
    got = [Completion(index=0, tokens=(1, 2, 3), ttft_s=0.1, latency_s=0.2),
           Completion(index=1, tokens=(4, 9, 6), ttft_s=0.1, latency_s=0.2),
           Completion(index=2, tokens=(7,), ttft_s=0.1, latency_s=0.2)]  # fmt: skip
    p = compare_tokens(ref, got, [[1] * 10, [2] * 20, [3] * 30])
    assert p.identical == 1 and p.failed == [(2, "single: HTTP 500")]
    assert p.differ == [(1, 1, 20)]
    assert percentile([3.0, 1.0, 2.0], 50) == 2.0 and percentile([], 99) == 0.0


def test_kv_bytes_bounds_count_shared_full_blocks_once() -> None:
    spec = TinyLlama()
    per_token = spec.num_hidden_layers * spec.num_key_value_heads * 2 * spec.head_dim * 4
    a = list(range(3, 3 + 70))
    b = a[:64] + [9] * 6  # shares two full 32-token blocks with a
    lo, hi, unit = kv_bytes_bounds([a, b], spec, 32, 32)
    assert unit == 32 * per_token
    assert hi == (96 + 96) * per_token and lo == (96 + 32) * per_token


# a server that shuts down slowly on SIGTERM (as vLLM's api_server drains), so a second signal
# to the harness lands while it is still stopping the first engine
SLOW_STOP = SERVER.replace(
    "class H(",
    "import signal, threading\n"
    "signal.signal(signal.SIGTERM, lambda *a: threading.Timer(2.0, os._exit, (0,)).start())\n"
    "class H(",
)
HARNESS = """
import json, sys, time
sys.path[:0] = json.loads(sys.argv[3])
from test_core_engines_harness import SLOW_STOP, Spec
from pdplug_engines.procs import running, sigterm_as_interrupt
ports = json.loads(sys.argv[2])
specs = [Spec(f"srv{i}", p, SLOW_STOP) for i, p in enumerate(ports)]
with sigterm_as_interrupt():
    with running(specs, sys.argv[1], 60.0) as es:
        print(json.dumps([e.proc.pid for e in es]), flush=True)
        time.sleep(600)
"""


def test_a_second_sigterm_while_stopping_still_stops_every_engine(tmp_path) -> None:
    """A harness interrupted again while it stops its engines (``timeout`` and a CI runner
    both signal it; the first engine takes seconds to drain) still stops all of them."""
    import json
    import signal
    import subprocess

    ports = free_ports(3)
    path = [os.path.dirname(os.path.abspath(__file__)), *sys.path]
    proc = subprocess.Popen(
        [sys.executable, "-c", HARNESS, str(tmp_path), json.dumps(ports), json.dumps(path)],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True,
    )  # fmt: skip
    try:
        assert proc.stdout is not None
        line = proc.stdout.readline()
        assert line.startswith("["), f"the engines never came up: {proc.stderr.read()[-2000:]}"
        leaders = json.loads(line)
        children = [int((tmp_path / f"srv{i}.log").read_text().split()[1]) for i in range(3)]
        proc.send_signal(signal.SIGTERM)
        time.sleep(0.5)  # the harness is now waiting for srv0 to drain
        proc.send_signal(signal.SIGTERM)
        proc.wait(timeout=60)
        deadline = time.monotonic() + 10.0
        while any(_alive(p) for p in leaders + children) and time.monotonic() < deadline:
            time.sleep(0.05)
        left = [p for p in leaders + children if _alive(p)]
        for p in left:  # do not leak them into the rest of the run
            os.kill(p, signal.SIGKILL)
        assert not left, f"processes left after the harness stopped: {left}"
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
