"""A write the engine reports ended inside its post call (``done_at_post``, issue 24) completes
at once: its room turns ``Success`` before ``send`` returns, the session never asks the engine
about it again, its handle is released, and the bytes are the ones the reference says."""

from __future__ import annotations

import time
from typing import Any

import numpy as np
from _rig import Decode, Prefill, exact, expected, rendezvous, send_room

from pdplug import KVPoll, PluginManager
from pdplug.testing import require

P = 16


class _EndsAtPost:
    """Wraps the real NIXL engine: ``post`` returns only once the write has ended (its own
    status calls), and says so through ``done_at_post``; asking about such a write again
    fails the test."""

    def __init__(self, inner: Any) -> None:
        self.inner = inner
        self.name = inner.name
        self.notifications = inner.notifications
        self.ended: set[int] = set()
        self.released: set[int] = set()
        self.asked_again: list[int] = []

    def post(self, peer: Any, src: Any, dst: Any, length: Any, tag: bytes) -> Any:
        h = self.inner.post(peer, src, dst, length, tag)
        while self.inner.check(h) == "PROC":
            self.inner.progress()
        assert self.inner.check(h) == "DONE"
        self.ended.add(id(h))
        return h

    def done_at_post(self, xfer: Any) -> bool:
        return id(xfer) in self.ended

    def check(self, xfer: Any) -> str:
        if id(xfer) in self.ended:
            self.asked_again.append(id(xfer))
        return str(self.inner.check(xfer))

    def release(self, xfer: Any) -> None:
        self.released.add(id(xfer))
        self.inner.release(xfer)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)


def test_a_write_ended_at_post_completes_in_send_and_is_never_polled() -> None:
    require("nixl")
    pm = PluginManager()
    with rendezvous() as server:
        pre = Prefill(pm, "nixl", server.endpoint, pp=1)
        dec = Decode(pm, "nixl", server.endpoint, dcp=1)
        try:
            sender = pre.senders[0]
            eng = _EndsAtPost(sender.engine)
            sender.engine = eng
            rng = np.random.default_rng(7)
            for room, total in ((1, 5 * P + 3), (2, P)):  # a partial last page, one page
                sp = rng.permutation(64)[:8].astype(np.int64)
                dp = rng.permutation(96)[:8].astype(np.int64)
                dec.recvs[0].expect(room, dp, num_tokens=total)
                sender.start(room)
                send_room(pre, room, sp)
                # ended inside the post call: Success before any poll reaped anything
                assert sender.rooms.status(room) == KVPoll.Success, sender.failure_reason(room)
                want = expected(pre, dec, total, 0, sp, [dp])
                for _ in range(500):
                    if dec.recvs[0].poll(room) in (KVPoll.Success, KVPoll.Failed):
                        break
                    time.sleep(0.01)
                assert dec.recvs[0].poll(room) == KVPoll.Success
                assert exact(dec, want, [dp])
                assert sender.wait(room, timeout_s=1.0) == KVPoll.Success
            assert eng.ended and not eng.asked_again
            assert eng.released == eng.ended  # every handle went back to the engine
            st = sender.stats()
            assert st["xfers"] == 0 and st["posts"] == len(eng.ended)
        finally:
            dec.close()
            pre.close()
