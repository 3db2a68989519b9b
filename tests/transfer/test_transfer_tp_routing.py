"""Head routing between prefill and decode TP sizes over real engines (field case C15, vLLM
#45330: TP > number of KV heads, GQA replication, heterogeneous TP).

Model: 2 KV heads of 32 bytes per token per entry, 2 layers x (K, V), page 16. The first test
runs the field case's configurations with its verdict on opaque token rows (no head
information: only equal TP can be mapped, anything else is refused naming why); the second
gives the layouts their heads, and then every configuration is served: each decode TP rank
receives exactly its heads, each once, from the prefill ranks the routing names, and a replica
the routing does not use is never connected to, planned for or written from.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np
import pytest
import torch
from _rig import kv_config, rendezvous, wait_all

from pdplug import CompatError, KVLayout, KVPoll, PluginManager, SchedulerConfig
from pdplug.bootstrap import resolve
from pdplug.geometry import make_layout
from pdplug.heads import fed_ranks, kv_head_range

pytestmark = pytest.mark.timeout(180)

P, H, PAGES, TOTAL = 16, 32, 16, 100
POISON = 0xA5
OK = KVPoll.Success


def head_data(head: int, e: int | str) -> torch.Tensor:
    g = torch.Generator().manual_seed(100 * head + int(e))
    return torch.randint(1, 256, (PAGES * P, H), dtype=torch.uint8, generator=g)


def opaque(tp: int, r: int, heads: int) -> KVLayout:
    """The field case's layout: token rows without head information."""
    per = max(1, heads // tp)
    return KVLayout(
        page_size=P, entry_bytes_per_token=(H * per,) * 4, tp_size=tp, tp_rank=r, num_layers=2
    )


def headed(tp: int, r: int, heads: int) -> KVLayout:
    """The same memory described with its heads (NHD, K and V entries per layer)."""
    return make_layout(
        kind="nhd", page_size=P, num_layers=2, head_bytes=H, num_kv_heads=heads, split_kv=True,
        tp_size=tp, tp_rank=r, head_size=16, dtype="bfloat16",
    )  # fmt: skip


Lay = Callable[[int, int, int], KVLayout]


class Cluster:
    """One prefill instance (``ptp`` ranks) and one decode instance (``dtp`` ranks)."""

    def __init__(
        self, pm: PluginManager, backend: str, endpoint: str, name: str, ptp: int, dtp: int,
        lay: Lay, pick: Callable[[int], set[int]] | None = None,
    ) -> None:  # fmt: skip
        self.senders: list[Any] = []
        self.recvs: list[Any] = []
        self.dkv: list[list[torch.Tensor]] = []
        self.errs: list[str | None] = []
        self.sched = pm.make_scheduler(SchedulerConfig(page_size=P, chunk_size=96))
        planner = pm.make_pack_planner()
        for r in range(ptp):
            lo, hi = kv_head_range(2, ptp, r)
            s = pm.make_kv_sender(
                kv_config("prefill", lay(ptp, r, 2), endpoint, f"p{name}", transfer_timeout_s=30.0),
                planner,
                name=backend,
            )
            s.register_kv([torch.cat([head_data(g, e) for g in range(lo, hi)], 1) for e in "0123"])
            self.senders.append(s)
        peers = resolve(endpoint, f"p{name}", timeout_s=20)
        for r in range(dtp):
            lo, hi = kv_head_range(2, dtp, r)
            rc = pm.make_kv_receiver(
                kv_config("decode", lay(dtp, r, 2), endpoint, f"d{name}", transfer_timeout_s=30.0),
                name=backend,
            )
            kv = [torch.full((PAGES * P, H * (hi - lo)), POISON, dtype=torch.uint8) for _ in "0123"]
            rc.register_kv(kv)
            mine = peers if pick is None else [p for p in peers if p.layout.tp_rank in pick(r)]
            try:
                rc.connect(mine)
                self.errs.append(None)
            except CompatError as e:
                self.errs.append(str(e))
            self.recvs.append(rc)
            self.dkv.append(kv)

    def feeding(self) -> list[Any]:
        """Prefill ranks that feed some decode rank (:func:`pdplug.heads.fed_ranks`)."""
        dst = self.recvs[0].layout
        return [s for s in self.senders if fed_ranks(s.layout, dst.tp_size, dst)]

    def run(self, room: int) -> tuple[list[KVPoll], list[KVPoll]]:
        active = self.feeding()
        for s in active:
            s.start(room)
        pages = np.arange(-(-TOTAL // P), dtype=np.int64)
        for rc in self.recvs:
            rc.expect(room, pages, num_tokens=TOTAL)
        st = wait_all(active, room, 15, until=(KVPoll.WaitingForInput, KVPoll.Failed))
        for s, x in zip(active, st):
            if x == KVPoll.WaitingForInput:
                for seg in self.sched.split_send(
                    token_start=0, token_end=TOTAL, decode_prefix_len=0, is_last_send=True,
                    capacity_tokens=s.capacity_tokens(room),
                ):  # fmt: skip
                    s.send(room, seg, pages[seg.token_start // P :])
        return wait_all(self.recvs, room, 15), wait_all(active, room, 15)

    def exact(self) -> list[bool]:
        """Per decode rank: its own heads in rows ``[0, TOTAL)``, poison after them."""
        out = []
        for r, kv in enumerate(self.dkv):
            lo, hi = kv_head_range(2, len(self.dkv), r)
            ok = True
            for e, t in enumerate(kv):
                want = torch.cat([head_data(g, e) for g in range(lo, hi)], 1)
                ok &= torch.equal(t[:TOTAL], want[:TOTAL]) and bool((t[TOTAL:] == POISON).all())
            out.append(ok)
        return out

    def close(self) -> None:
        for x in self.senders + self.recvs:
            x.close()


def test_c15_opaque_rows_equal_tp_served_other_tp_refused_clearly(backend: str) -> None:
    """The field case's own configurations and verdict: (a) TP 2 -> 1 refused at the handshake;
    (b) TP 2 -> 2 with every decode rank connected to every prefill rank: rank r gets prefill
    rank r's head; (c) TP 4 -> 2 refused naming the missing head information; (c') connecting
    each decode rank to one replica is refused too, and a room expected anyway fails at once
    naming the refusal (it does not raise)."""
    with rendezvous() as srv:
        pm = PluginManager()
        a = Cluster(pm, backend, srv.endpoint, "a", 2, 1, opaque)
        try:
            assert a.errs[0] is not None and "tp_size: prefill 2 vs decode 1" in a.errs[0]
        finally:
            a.close()
        b = Cluster(pm, backend, srv.endpoint, "b", 2, 2, opaque)
        try:
            assert b.errs == [None, None]
            dst, src = b.run(1502)
            assert dst == [OK, OK] and src == [OK, OK], [rc.failure_reason(1502) for rc in b.recvs]
            assert b.exact() == [True, True]
            assert [s.stats()["peers"] for s in b.senders] == [1, 1]  # each fed only its rank
        finally:
            b.close()
        c = Cluster(pm, backend, srv.endpoint, "c", 4, 2, opaque)
        try:
            assert all(e is not None and "needs num_kv_heads" in e for e in c.errs), c.errs
            assert [s.stats().get("peers", 0) for s in c.senders] == [0, 0, 0, 0]
        finally:
            c.close()
        cw = Cluster(pm, backend, srv.endpoint, "cw", 4, 2, opaque, pick=lambda r: {2 * r})
        try:
            assert all(e is not None for e in cw.errs), cw.errs
            for rc in cw.recvs:
                rc.expect(1604, np.arange(7), num_tokens=TOTAL)
                assert rc.poll(1604) == KVPoll.Failed
                assert "refused this decode rank at connect" in (rc.failure_reason(1604) or "")
                assert rc.drained(1604)
            assert all(t.eq(POISON).all() for kv in cw.dkv for t in kv)
        finally:
            cw.close()


@pytest.mark.parametrize(
    ("ptp", "dtp", "pick"),
    [
        (2, 1, None),  # (a): decode rank 0 takes head 0 from prefill 0, head 1 from prefill 1
        (1, 2, None),  # prefill rank 0 feeds both decode ranks (two DestInfos per room)
        (4, 2, None),  # (c): replicas 1 and 3 are not used: never connected, never written
        (4, 2, lambda r: {2 * r}),  # (c'): connecting to the routed replica alone is enough
        (2, 4, None),  # decode replication: each decode rank gets its one head once
    ],
    ids=["2to1", "1to2", "4to2", "4to2-replica", "2to4"],
)
def test_c15_with_heads_every_tp_ratio_is_served_exactly(
    backend: str, ptp: int, dtp: int, pick: Any
) -> None:
    with rendezvous() as srv:
        pm = PluginManager()
        cl = Cluster(pm, backend, srv.endpoint, f"h{ptp}{dtp}", ptp, dtp, headed, pick)
        try:
            assert cl.errs == [None] * dtp
            dst, src = cl.run(1700)
            assert dst == [OK] * dtp, [rc.failure_reason(1700) for rc in cl.recvs]
            assert src == [OK] * len(src)
            assert cl.exact() == [True] * dtp
            dlay = cl.recvs[0].layout
            for s in cl.senders:
                fed = fed_ranks(s.layout, dtp, dlay)
                st = s.stats()
                assert st.get("peers", 0) == len(fed), (s.layout.tp_rank, st)
                if not fed:
                    assert st.get("posts", 0) == 0 and st.get("bytes", 0) == 0
            # every decode rank receives each of its heads once: 2 layers x K, V x 32 B
            held = sum(len(range(*kv_head_range(2, dtp, r))) for r in range(dtp))
            owed = TOTAL * 4 * H * held
            assert sum(s.stats().get("bytes", 0) for s in cl.senders) == owed
        finally:
            cl.close()


def test_a_decode_rank_given_only_an_unrouted_replica_is_refused_naming_the_rank(
    backend: str,
) -> None:
    """Decode TP rank 0 of 2 takes head 0 from prefill TP rank 0 of 4 (not from its replica 1):
    connecting it to rank 1 alone is refused, naming the rank it needs."""
    with rendezvous() as srv:
        pm = PluginManager()
        cl = Cluster(pm, backend, srv.endpoint, "x", 4, 2, headed, pick=lambda r: {2 * r + 1})
        try:
            assert all(e is not None for e in cl.errs)
            assert "(pp_rank, tp_rank) [(0, 0)]" in (cl.errs[0] or ""), cl.errs[0]
            assert "(pp_rank, tp_rank) [(0, 2)]" in (cl.errs[1] or ""), cl.errs[1]
            assert [s.stats().get("peers", 0) for s in cl.senders] == [0, 0, 0, 0]
        finally:
            cl.close()


class _RaisesOnce:
    """The real engine, except that one ``post`` raises inside the call (armed by ``arm``);
    counts the posts made while armed. No page lists: every write goes through ``post``."""

    def __init__(self, inner: Any) -> None:
        self.inner = inner
        self.name = inner.name
        self.notifications = inner.notifications
        self.armed = False
        self.posts_armed = 0

    def post(self, *args: Any) -> Any:
        if self.armed:
            self.posts_armed += 1
            if self.posts_armed == 1:
                raise RuntimeError("refused in the post call (test)")
        return self.inner.post(*args)

    def prepare_pages(self, peer: Any, grid: Any) -> None:
        return None

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)


def test_a_post_failing_in_the_direct_lane_stops_the_segments_other_destinations(
    backend: str,
) -> None:
    """Prefill TP 2 -> decode TP 4 with 2 heads: each prefill rank feeds two decode ranks the
    same whole rows, so a segment has two destinations on the direct lane. When the first one's
    post raises, the room fails and the second destination is not written (a failed room's
    decode ranks are told it drained, so no byte may land after)."""
    with rendezvous() as srv:
        pm = PluginManager()
        c = Cluster(pm, backend, srv.endpoint, "f", 2, 4, headed)
        try:
            assert c.errs == [None] * 4
            dst, src = c.run(1601)  # binds every peer's direct template
            assert dst == [OK] * 4 and src == [OK, OK]
            wrapped = _RaisesOnce(c.senders[0].engine)
            c.senders[0].engine = wrapped
            wrapped.armed = True
            dst, src = c.run(1602)
            assert src[0] == KVPoll.Failed and src[1] == OK, src
            assert "refused in the post call" in c.senders[0].failure_reason(1602)
            assert wrapped.posts_armed == 1  # the other destination's write never went out
            assert c.senders[0].stats()["direct_lane"] >= 1
        finally:
            c.close()
