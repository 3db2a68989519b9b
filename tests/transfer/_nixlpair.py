"""Two real NIXL engines on one host for the engine-level tests: a prefill engine over one
tensor per entry and a decode engine over the same entries, registered and connected (the
decode publishes its regions), and a wait that a write ended ``DONE`` with its tag after it."""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import Any

import torch

from pdplug import KVConfig, KVLayout
from pdplug.testing import require
from pdplug.types import PeerInfo


def nixl_engine(layout: KVLayout, role: str, **extra: str) -> Any:
    """A :class:`~pdplug_nixl.engine.NixlEngine` for ``role`` (``"prefill"``/``"decode"``)."""
    from pdplug_nixl.engine import NixlEngine

    return NixlEngine(KVConfig(instance=role[0], role=role, layout=layout, extra=extra))


class NixlPair:
    """``a`` (prefill) over ``src`` and ``b`` (decode) over ``dst``: one uint8 tensor per entry
    of ``layout``, ``src_pages`` / ``dst_pages`` pages each (source random, seeded; destination
    zero); ``peer``: ``a``'s handle of ``b``."""

    def __init__(self, layout: KVLayout, src_pages: int, dst_pages: int, seed: int) -> None:
        require("nixl")
        self.layout = layout
        self.a = nixl_engine(layout, "prefill")
        self.b = nixl_engine(layout, "decode")
        g = torch.Generator().manual_seed(seed)
        rows: Sequence[int] = layout.entry_bytes_per_token
        page = layout.page_size
        self.src = [torch.randint(1, 256, (src_pages * page * n,), generator=g,
                                  dtype=torch.uint8) for n in rows]  # fmt: skip
        self.dst = [torch.zeros(dst_pages * page * n, dtype=torch.uint8) for n in rows]
        self.a.register([(t.data_ptr(), t.numel()) for t in self.src])
        self.b.register([(t.data_ptr(), t.numel()) for t in self.dst])
        info = PeerInfo(instance="d", role="decode", layout=layout, agent=self.b.agent(),
                        extra=self.b.info_extra())  # fmt: skip
        self.peer = self.a.connect(info)

    def finish(self, h: Any, tag: bytes = b"tag") -> None:
        """Wait (at most 10 s) for write ``h`` to end ``DONE``, release it, and check that its
        notification ``tag`` reached the decode (after the bytes)."""
        t_end = time.monotonic() + 10
        got: list[tuple[str, bytes]] = []
        while (st := self.a.check(h)) == "PROC" and time.monotonic() < t_end:
            got.extend(self.b.poll_notifications())
        self.a.release(h)
        assert st == "DONE"
        while not got and time.monotonic() < t_end:
            got.extend(self.b.poll_notifications())
        assert [m for _, m in got] == [tag]  # the tag comes after the bytes

    def close(self) -> None:
        self.a.close()
        self.b.close()
