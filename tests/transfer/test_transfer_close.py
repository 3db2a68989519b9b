"""A prefill sender that closes with rooms live ends them at once on both sides (helper-33's
finding, issue 24's stop 52): every room not ended fails with "sender closed on prefill rank N",
its observers hear ``transfer_failed`` once, and its decode ranks are told before the socket
goes, so a decode fails the room in a round trip, not at its own timeout (60 s here); a decode
whose DestInfo waits for a room the prefill never started is refused too."""

from __future__ import annotations

import time
from typing import Any

import numpy as np
import pytest
import torch

from pdplug import KVConfig, KVLayout, KVPoll, PluginManager
from pdplug.bootstrap import RendezvousServer, resolve
from pdplug.testing import EventLog, require
from pdplug.types import Segment

pytestmark = pytest.mark.timeout(120)

LAYOUT = KVLayout(page_size=16, entry_bytes_per_token=(4096,))
SLOW = dict(bootstrap_timeout_s=60.0, waiting_timeout_s=60.0, transfer_timeout_s=60.0)


def _seg(tokens: int) -> Segment:
    return Segment(
        token_start=0, token_end=tokens, page_start=0, num_tokens=tokens, chunk_id=0, is_last=True
    )


def test_closing_the_sender_fails_its_live_rooms_on_both_sides_at_once(backend: str) -> None:
    require(backend)
    seen = EventLog()
    pm = PluginManager(env={}, plugins=[("observer", seen)])
    pages = 64
    src = [torch.randint(0, 256, (16 * pages, 4096), dtype=torch.uint8)]
    dst = [torch.zeros(16 * (pages + 8), 4096, dtype=torch.uint8)]
    with RendezvousServer() as server:
        cfg = KVConfig(
            instance=f"p-close-{backend}",
            role="prefill",
            layout=LAYOUT,
            bootstrap_endpoint=server.endpoint,
            **SLOW,  # type: ignore[arg-type]
        )
        s = pm.make_kv_sender(cfg, name=backend)
        r = PluginManager(env={}).make_kv_receiver(
            KVConfig(instance="d", role="decode", layout=LAYOUT, **SLOW),  # type: ignore[arg-type]
            name=backend,
        )
        try:
            s.register_kv(src)
            r.register_kv(dst)
            r.connect(resolve(server.endpoint, cfg.instance, timeout_s=10), timeout_s=10)
            # room 1: leased on both sides, nothing sent; room 2: the decode asked, the prefill
            # never started it; room 3: a 4 MiB send posted right before the close
            s.start(1)
            r.expect(1, np.arange(0, 2), num_tokens=32)
            r.expect(2, np.arange(2, 4), num_tokens=32)
            s.start(3)
            r.expect(3, np.arange(8, 72), num_tokens=16 * 64)
            for room in (1, 3):
                assert s.wait(room, (KVPoll.WaitingForInput,), timeout_s=20) == (
                    KVPoll.WaitingForInput
                ), s.failure_reason(room)
            deadline = time.monotonic() + 10  # the decode's early DestInfo reached the prefill
            while time.monotonic() < deadline and s.stats().get("inbox", 0) < 1:
                time.sleep(0.01)
            assert s.stats()["inbox"] == 1, s.stats()
            s.send(3, _seg(16 * 64), np.arange(0, 64))
            s.close()
            closed = time.monotonic()
            want = f"sender closed on prefill rank {s.rank}"
            for room in (1, 2):
                assert r.wait(room, timeout_s=20) == KVPoll.Failed
                assert want in (r.failure_reason(room) or ""), (room, r.failure_reason(room))
            end3 = r.wait(3, timeout_s=20)
            took = time.monotonic() - closed
            assert took < 5.0, f"the decode learned it after {took:.1f} s"
            if end3 == KVPoll.Success:  # the write ended inside its post, before the close
                assert torch.equal(dst[0][16 * 8 : 16 * 72], src[0][: 16 * 64])
            else:
                assert end3 == KVPoll.Failed and want in (r.failure_reason(3) or ""), (
                    end3,
                    r.failure_reason(3),
                )
            # the prefill's own outcomes: room 1 (and room 3 unless it succeeded) failed once,
            # with the reason; room 2 was never its lease
            mine: dict[int, list[Any]] = {}
            for e in seen.events:
                mine.setdefault(e.room, []).append((e.kind, e.fields.get("reason")))
            assert mine[1] == [("transfer_failed", want)], seen.events
            assert 2 not in mine, seen.events
            assert mine[3] in ([("transfer_done", None)], [("transfer_failed", want)]), mine
            assert s.poll(1) == KVPoll.Failed and want in (s.failure_reason(1) or "")
        finally:
            r.close()
            s.close()
