"""In-process rig for the integrity tests: prefill (PP senders) and decode (DCP receivers) of one
deployment in this process, over real engines (NIXL, Mooncake) and real sockets on 127.0.0.1.

Geometry: ``LAYERS`` layers x (K, V) entries of ``BPT`` bytes per token, page ``P`` tokens.
Prefill is PP ``pp`` (layers split evenly, one sender each); a decode instance is DCP ``dcp``
(one receiver per DCP rank, all layers). Source KV is seeded random bytes (1..255); destination
KV starts as ``POISON`` so a stray or missing write shows.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Iterator, Sequence
from typing import Any

import numpy as np
import torch

from pdplug import KVConfig, KVLayout, KVPoll, PluginManager, SchedulerConfig
from pdplug.bootstrap import RendezvousServer, resolve

P = 16
LAYERS = 4
BPT = (64, 48)
POISON = 0xA5
TERMINAL = (KVPoll.Success, KVPoll.Failed)


def src_layout(pp: int, rank: int, *, tp: int = 1, tp_rank: int = 0) -> KVLayout:
    per = LAYERS // pp
    return KVLayout(
        page_size=P,
        entry_bytes_per_token=BPT * per,
        pp_size=pp,
        pp_rank=rank,
        tp_size=tp,
        tp_rank=tp_rank,
        first_layer=rank * per,
        num_layers=per,
    )


def dst_layout(dcp: int, rank: int, *, tp: int = 1, tp_rank: int = 0) -> KVLayout:
    return KVLayout(
        page_size=P,
        entry_bytes_per_token=BPT * LAYERS,
        dcp_size=dcp,
        dcp_rank=rank,
        tp_size=tp,
        tp_rank=tp_rank,
        num_layers=LAYERS,
    )


def kv_config(role: str, layout: KVLayout, endpoint: str, instance: str, **kw: Any) -> KVConfig:
    base: dict[str, Any] = dict(
        bootstrap_timeout_s=20.0,
        waiting_timeout_s=20.0,
        transfer_timeout_s=5.0,
        pack_region_tokens=32,
        max_dst_dcp=4,
    )
    base.update(kw)
    return KVConfig(
        instance=instance, role=role, layout=layout, bootstrap_endpoint=endpoint, **base
    )


class Prefill:
    """``pp`` senders of one prefill instance, each with ``pages`` pages of seeded KV."""

    def __init__(
        self,
        pm: PluginManager,
        backend: str,
        endpoint: str,
        *,
        pp: int = 2,
        pages: int = 64,
        instance: str = "prefill-0",
        tp: int = 1,
        **kw: Any,
    ) -> None:
        self.pp, self.instance = pp, instance
        self.planner = pm.make_pack_planner()
        self.sched = pm.make_scheduler(SchedulerConfig(page_size=P, chunk_size=96))
        self.senders: list[Any] = []
        self.kv: list[list[torch.Tensor]] = []
        for t in range(tp):
            for k in range(pp):
                lay = src_layout(pp, k, tp=tp, tp_rank=t)
                cfg = kv_config("prefill", lay, endpoint, instance, **kw)
                s = pm.make_kv_sender(cfg, self.planner, name=backend)
                kv = [
                    torch.randint(
                        1,
                        256,
                        (pages * P, b),
                        dtype=torch.uint8,
                        generator=torch.Generator().manual_seed(1000 * (t * pp + k) + e),
                    )
                    for e, b in enumerate(lay.entry_bytes_per_token)
                ]
                s.register_kv(kv)
                self.senders.append(s)
                self.kv.append(kv)

    def close(self) -> None:
        for s in self.senders:
            s.close()


class Decode:
    """``dcp`` receivers of one decode instance, connected to ``prefill``."""

    def __init__(
        self,
        pm: PluginManager,
        backend: str,
        endpoint: str,
        *,
        dcp: int = 2,
        pages: int = 96,
        instance: str = "decode-0",
        prefill: str = "prefill-0",
        tp: int = 1,
        **kw: Any,
    ) -> None:
        self.dcp, self.instance = dcp, instance
        self.recvs: list[Any] = []
        self.kv: list[list[torch.Tensor]] = []
        self.peers = resolve(endpoint, prefill, timeout_s=20)
        for t in range(tp):
            for r in range(dcp):
                lay = dst_layout(dcp, r, tp=tp, tp_rank=t)
                cfg = kv_config("decode", lay, endpoint, instance, **kw)
                rc = pm.make_kv_receiver(cfg, name=backend)
                kv = [
                    torch.full((pages * P, b), POISON, dtype=torch.uint8)
                    for b in lay.entry_bytes_per_token
                ]
                rc.register_kv(kv)
                rc.connect(self.peers)
                self.recvs.append(rc)
                self.kv.append(kv)

    def agents(self) -> set[str]:
        """Engine agent names of this instance's receivers."""
        return {rc.peer_info().extra["agent_name"] for rc in self.recvs}

    def poison(self) -> None:
        for kv in self.kv:
            for t in kv:
                t.fill_(POISON)

    def close(self) -> None:
        for r in self.recvs:
            r.close()


def agent_of(handle: Any) -> str:
    """The agent name a NIXL or Mooncake peer handle writes to."""
    return str(getattr(handle, "name", None) or getattr(handle, "session", ""))


def rows(pages: np.ndarray) -> np.ndarray:
    """Token rows of the given pages."""
    return (np.asarray(pages)[:, None] * P + np.arange(P)).reshape(-1)


def expected_kv(
    src: list[list[torch.Tensor]],
    dst: list[list[torch.Tensor]],
    total: int,
    prefix: int,
    sp: np.ndarray,
    dps: Sequence[np.ndarray],
) -> list[list[np.ndarray]]:
    """Reference decode KV (per DCP rank, per entry) after sending tokens ``[prefix, total)``
    from ``src`` (per PP rank, per entry) into ``dst`` (per DCP rank): logical token i lives on
    DCP rank ``i % dcp`` at local offset ``i // dcp``; PP rank k holds layers k*L/pp.."""
    dcp, pp = len(dst), len(src)
    per = LAYERS // pp
    want = [[np.full(t.shape, POISON, np.uint8) for t in kv] for kv in dst]
    srcs = [[t.numpy() for t in kv] for kv in src]
    vpage = P * dcp
    tok = np.arange(prefix, total)
    for r in range(dcp):
        mine = tok[tok % dcp == r]
        s_slot = np.asarray(sp)[mine // P] * P + mine % P
        rel = mine - prefix
        d_slot = np.asarray(dps[r])[rel // vpage] * P + (rel % vpage) // dcp
        for k in range(pp):
            for e in range(2 * per):
                want[r][2 * per * k + e][d_slot] = srcs[k][e][s_slot]
    return want


def expected(
    pre: Prefill,
    dec: Decode,
    total: int,
    prefix: int,
    sp: np.ndarray,
    dps: Sequence[np.ndarray],
) -> list[list[np.ndarray]]:
    """:func:`expected_kv` for a prefill instance and a decode instance (TP 1)."""
    return expected_kv(pre.kv, dec.kv, total, prefix, sp, dps)


def exact_kv(
    dst: list[list[torch.Tensor]], want: list[list[np.ndarray]], dps: Sequence[np.ndarray]
) -> bool:
    """Whether every destination page of the room holds exactly ``want``."""
    return all(
        np.array_equal(t.numpy()[rows(dps[r])], w[rows(dps[r])])
        for r in range(len(dst))
        for t, w in zip(dst[r], want[r])
    )


def exact(dec: Decode, want: list[list[np.ndarray]], dps: Sequence[np.ndarray]) -> bool:
    """:func:`exact_kv` for a decode instance."""
    return exact_kv(dec.kv, want, dps)


def written(dec: Decode, dps: Sequence[np.ndarray]) -> bool:
    """Whether any byte of the given pages is no longer poison."""
    return any((t.numpy()[rows(dps[r])] != POISON).any() for r in range(dec.dcp) for t in dec.kv[r])


def wait_all(
    objs: Sequence[Any], room: int, timeout: float, until: tuple[KVPoll, ...] = TERMINAL
) -> list[KVPoll]:
    t_end = time.monotonic() + timeout
    while True:
        st = [o.poll(room) for o in objs]
        if all(s in until for s in st) or time.monotonic() > t_end:
            return st
        time.sleep(0.002)


def wait_true(fn: Any, timeout: float) -> float | None:
    """Seconds until ``fn()`` is true, or ``None`` after ``timeout``."""
    t0 = time.monotonic()
    while time.monotonic() - t0 < timeout:
        if fn():
            return time.monotonic() - t0
        time.sleep(0.005)
    return None


def send_room(
    pre: Prefill, room: int, sp: np.ndarray, *, token_end: int | None = None, timeout: float = 10.0
) -> None:
    """Once every sender is WaitingForInput, split and send ``[prefix, token_end)``."""
    st = wait_all(pre.senders, room, timeout, until=(KVPoll.WaitingForInput, KVPoll.Failed))
    assert all(s == KVPoll.WaitingForInput for s in st), (
        room,
        st,
        [s.failure_reason(room) for s in pre.senders],
    )
    d = pre.senders[0].dest(room)[0]
    end = d.num_tokens if token_end is None else token_end
    for seg in pre.sched.split_send(
        token_start=d.decode_prefix_len,
        token_end=end,
        decode_prefix_len=d.decode_prefix_len,
        is_last_send=True,
        capacity_tokens=pre.senders[0].capacity_tokens(room),
    ):
        for s in pre.senders:
            s.send(room, seg, sp[seg.token_start // P :])


@contextlib.contextmanager
def rendezvous() -> Iterator[RendezvousServer]:
    server = RendezvousServer().start()
    try:
        yield server
    finally:
        server.stop()
