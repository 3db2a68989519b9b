"""A process that used a KV sender and a KV receiver exits with status 0 after ``close()``: no
``hard_exit``, no native crash at interpreter exit (NIXL 1.5.1 crashed with SIGSEGV there)."""

from __future__ import annotations

import subprocess
import sys

import pytest

pytestmark = pytest.mark.timeout(180)

_SCRIPT = r"""
import sys

import numpy as np
import torch

from pdplug import KVConfig, KVLayout, KVPoll, PluginManager
from pdplug.types import Segment
from pdplug.bootstrap import RendezvousServer, resolve

backend = sys.argv[1]
pm = PluginManager()
lay = KVLayout(page_size=16, entry_bytes_per_token=(64,))

# the issue's script: make the sender, register, close
alone = pm.make_kv_sender(KVConfig(instance="alone", role="prefill", layout=lay), name=backend)
alone.register_kv([torch.zeros(16 * 4, 64, dtype=torch.uint8)])
alone.close()

# a sender and a receiver that moved one room
server = RendezvousServer().start()
cfg = dict(bootstrap_endpoint=server.endpoint, transfer_timeout_s=10.0)
src = torch.randint(1, 256, (16 * 4, 64), dtype=torch.uint8)
dst = torch.zeros(16 * 4, 64, dtype=torch.uint8)
s = pm.make_kv_sender(KVConfig(instance="p", role="prefill", layout=lay, **cfg), name=backend)
s.register_kv([src])
r = pm.make_kv_receiver(KVConfig(instance="d", role="decode", layout=lay, **cfg), name=backend)
r.register_kv([dst])
r.connect(resolve(server.endpoint, "p", timeout_s=20))
s.start(1)
r.expect(1, np.arange(2), num_tokens=32)
assert s.wait(1, (KVPoll.WaitingForInput,), timeout_s=20) == KVPoll.WaitingForInput
seg = Segment(token_start=0, token_end=32, page_start=0, num_tokens=32, chunk_id=0, is_last=True)
s.send(1, seg, np.arange(2))
assert r.wait(1, timeout_s=20) == KVPoll.Success, r.failure_reason(1)
assert torch.equal(dst[:32], src[:32])
r.close()
s.close()
server.stop()
print("closed", flush=True)
"""


def test_a_process_that_used_a_sender_and_a_receiver_exits_0(backend: str) -> None:
    proc = subprocess.run(
        [sys.executable, "-c", _SCRIPT, backend],
        capture_output=True,
        text=True,
        timeout=150,
    )
    assert "closed" in proc.stdout, proc.stderr[-3000:]
    assert proc.returncode == 0, (proc.returncode, proc.stderr[-3000:])
