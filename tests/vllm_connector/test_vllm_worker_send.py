"""The prefill worker posts a step's segments with one ``KVSender.send_many`` call (one hand-off
per engine step, issue 24), and the bytes land exactly: a prefill :class:`PushWorker` and a
decode :class:`PushWorker` in this process over real NIXL engines and sockets on 127.0.0.1,
holding vLLM CPU-shaped KV caches (``(num_blocks, H, block_size, 2 * head_size)`` float32, K slab
then V slab per block and head). The sender is the real one, wrapped only to count its calls.
"""

from __future__ import annotations

import time
from typing import Any

import numpy as np
import pytest

from pdplug.testing import require

# whichever NIXL build is installed (importing nixl_cu12 beside an imported nixl_cu13 fails)
require("nixl")
torch = pytest.importorskip("torch")

from pdplug.adapters.placement import RankPlacement  # noqa: E402
from pdplug.adapters.push import SendJob  # noqa: E402
from pdplug.adapters.vllm.scheduler import RecvJob, StepPlan  # noqa: E402
from pdplug.adapters.vllm.worker import PushWorker  # noqa: E402
from pdplug.bootstrap import RendezvousServer  # noqa: E402
from pdplug.config import WireConfig  # noqa: E402
from pdplug.types import KVPoll  # noqa: E402

pytestmark = [pytest.mark.nixl, pytest.mark.timeout(120)]

BS, HEADS, HEAD, LAYERS, BLOCKS = 32, 2, 32, 2, 24


class _Counting:
    """The real sender; counts ``send`` and ``send_many`` calls and the items they carried."""

    def __init__(self, inner: Any, many: bool = True) -> None:
        self._inner = inner
        self.calls: list[tuple[str, int]] = []
        if not many:  # a sender without send_many (a third-party plugin's)
            self.send_many = None

    def __getattr__(self, name: str) -> Any:
        return getattr(self._inner, name)

    def send(self, *a: Any, **kw: Any) -> None:
        self.calls.append(("send", 1))
        self._inner.send(*a, **kw)

    def send_many(self, items: Any) -> None:  # type: ignore[no-redef]
        self.calls.append(("send_many", len(items)))
        self._inner.send_many(items)


def _caches(fill: float | None, seed: int) -> dict[str, Any]:
    g = torch.Generator().manual_seed(seed)
    out = {}
    for i in range(LAYERS):
        shape = (BLOCKS, HEADS, BS, 2 * HEAD)
        t = torch.rand(shape, generator=g) if fill is None else torch.full(shape, fill)
        out[f"model.layers.{i}.self_attn.attn"] = t
    return out


def _where(side: str, bootstrap: str) -> RankPlacement:
    return RankPlacement(
        side=side, instance=f"{side}-0", model="tiny", engine_version="0.32.0",
        num_kv_heads=HEADS, head_size=HEAD, block_size=BS, bootstrap=bootstrap,
        kv_sender="nixl", chunk_tokens=64, pack_region_tokens=64, bootstrap_timeout_s=20.0,
        transfer_timeout_s=10.0, waiting_timeout_s=20.0, wire=WireConfig(),
    )  # fmt: skip


@pytest.mark.parametrize("many", [True, False], ids=["send_many", "send"])
def test_one_send_many_per_step_and_every_block_lands(many: bool) -> None:
    rdv = RendezvousServer(WireConfig(), port=0).start()
    endpoint = rdv.endpoint
    pre, dec = PushWorker(_where("prefill", endpoint)), PushWorker(_where("decode", ""))
    try:
        src, dst = _caches(None, 1), _caches(-1.0, 2)
        pre.register(src)
        dec.register(dst)
        spy = _Counting(pre.session, many)
        pre.session = spy
        # three rooms: prompts of 70, 100 and 33 tokens; decode holds the first 32 of room 2
        rooms = {11: (70, 0), 12: (100, 32), 13: (33, 0)}
        src_blocks = {11: (0, 1, 2), 12: (3, 4, 5, 6), 13: (7, 8)}
        dst_blocks = {11: (10, 11, 12), 12: (13, 14, 15), 13: (16, 17)}
        dec.on_plan(StepPlan(recv=tuple(
            RecvJob(req_id=f"d{r}", room=r, block_ids=dst_blocks[r], decode_prefix_len=p,
                    num_prompt_tokens=n, prefill_instance="prefill-0", bootstrap=endpoint)
            for r, (n, p) in rooms.items()
        )))  # fmt: skip
        pre.on_plan(StepPlan(send=tuple(
            SendJob(req_id=f"p{r}", room=r, page_ids=src_blocks[r], token_start=0,
                    token_end=n, num_prompt_tokens=n, is_last=True)
            for r, (n, _) in rooms.items()
        )))  # fmt: skip
        for r in rooms:  # every DestInfo in, so the step posts all three rooms at once
            assert spy.wait(r, (KVPoll.WaitingForInput,), 20.0) == KVPoll.WaitingForInput
        pre.post()
        # room 12 needs blocks 4..6 (its first block is the decode's prefix); each room's
        # tokens are split at min(grid 64, pack capacity): at least one segment per room
        if many:
            assert [c[0] for c in spy.calls] == ["send_many"] and spy.calls[0][1] >= 3, spy.calls
        else:
            assert {c[0] for c in spy.calls} == {"send"} and len(spy.calls) >= 3, spy.calls
        done: set[str] = set()
        deadline = time.monotonic() + 30
        while len(done) < 3 and time.monotonic() < deadline:
            res = dec.results(())
            assert not res.failed_recving, res
            done |= res.finished_recving
            pre.results({f"p{r}" for r in rooms})
            time.sleep(0.005)
        assert done == {f"d{r}" for r in rooms}
        for r, (_, p) in rooms.items():
            sb = list(src_blocks[r])[p // BS :]
            for name in src:
                got = dst[name][list(dst_blocks[r])].numpy()
                assert np.array_equal(got, src[name][sb].numpy()), (r, name)
        # nothing else written: the untouched decode blocks still hold the fill
        used = {b for bs in dst_blocks.values() for b in bs}
        rest = [b for b in range(BLOCKS) if b not in used]
        assert all(bool((dst[n][rest] == -1.0).all()) for n in dst)
    finally:
        pre.close()
        dec.close()
        rdv.stop()
