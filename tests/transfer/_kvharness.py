"""Multi-process harness for the KV transfer tests: a prefill process, a decode process, and a
rendezvous in the test process, over real sockets on 127.0.0.1 and real engines.

Geometry: 4 layers x (K 64 B, V 48 B per token), page 16 tokens. Prefill is PP 2 (layers 0-1 and
2-3, one sender each); decode instances hold all 4 layers with DCP 1, 2 or 4 (one receiver per
DCP rank). KV bytes come from seeded generators (values 1..255, never zeros) so the decode
process can recompute the prefill KV and the expected relayout with a slow reference.

Processes talk to the test over a Pipe carrying msgspec-JSON dicts (no pickle): the test sends
commands, the children send events.
"""

from __future__ import annotations

import contextlib
import multiprocessing as mp
import os
import time
import traceback
from typing import Any

import msgspec
import numpy as np

from pdplug import hookimpl

P = 16
LAYERS = 4
BPT = (64, 48)
SRC_PAGES = 64
DST_PAGES = 96
POISON = 0xA5
PREFILL = "prefill-0"
PP = 2

_json_enc = msgspec.json.Encoder()


def send(conn: Any, **msg: Any) -> None:
    conn.send_bytes(_json_enc.encode(msg))


def recv(conn: Any, timeout: float) -> dict[str, Any]:
    if not conn.poll(timeout):
        raise TimeoutError(f"no message from the child within {timeout} s")
    return msgspec.json.decode(conn.recv_bytes())


def layouts(pp_rank: int, *, page_size: int = P, bpt: tuple[int, int] = BPT) -> Any:
    from pdplug import KVLayout

    per = LAYERS // PP
    return KVLayout(
        page_size=page_size,
        entry_bytes_per_token=bpt * per,
        dtype="bfloat16",
        pp_size=PP,
        pp_rank=pp_rank,
        first_layer=pp_rank * per,
        num_layers=per,
    )


def dst_layout(dcp: int, rank: int, *, page_size: int = P, bpt: tuple[int, int] = BPT) -> Any:
    from pdplug import KVLayout

    return KVLayout(
        page_size=page_size,
        entry_bytes_per_token=bpt * LAYERS,
        dtype="bfloat16",
        dcp_size=dcp,
        dcp_rank=rank,
        num_layers=LAYERS,
    )


def src_kv(pp_rank: int) -> list[Any]:
    import torch

    lay = layouts(pp_rank)
    out = []
    for e, b in enumerate(lay.entry_bytes_per_token):
        g = torch.Generator().manual_seed(1000 * pp_rank + e)
        out.append(torch.randint(1, 256, (SRC_PAGES * P, b), dtype=torch.uint8, generator=g))
    return out


def dst_kv(lay: Any) -> list[Any]:
    import torch

    return [
        torch.full((DST_PAGES * P, b), POISON, dtype=torch.uint8) for b in lay.entry_bytes_per_token
    ]


def src_pages(room: int, total: int) -> np.ndarray:
    return np.random.default_rng(room).permutation(SRC_PAGES)[: -(-total // P)].astype(np.int64)


#: rooms served per decode instance: room -> (prompt tokens, decode prefix in virtual pages)
REQUESTS: dict[str, dict[int, tuple[int, int]]] = {
    "dec-tp": {101: (237, 0), 102: (300, 3), 103: (64, 0), 104: (16, 1)},
    "dec-dcp2": {
        201: (237, 0),
        202: (301, 2),
        203: (32, 1),
        211: (400, 0),
        212: (96, 0),
        213: (400, 0),
        214: (200, 0),
        215: (150, 0),
        216: (33, 0),
        217: (150, 0),
        # a host connect racing the decode's own search (kvscenarios.connect_while_found_again)
        218: (150, 0),
        219: (150, 0),
    },
    # 303: the 96-token grid leaves a 1-token last segment: DCP ranks 1-3 own no token of it
    "dec-dcp4": {
        301: (237, 0),
        302: (400, 1),
        303: (97, 0),
        # the prefill found again (kvscenarios.refind_*)
        311: (150, 0),
        312: (150, 0),
        313: (150, 0),
        314: (150, 0),
    },
}
DCP = {"dec-tp": 1, "dec-dcp2": 2, "dec-dcp4": 4}
FAILURE_ROOMS = (211, 212, 213, 214, 215, 216, 217, 218, 219)


def request(room: int) -> tuple[str, int, int, int]:
    """(instance, total tokens, decode_prefix_len tokens, dcp size) of a room."""
    for inst, rooms in REQUESTS.items():
        if room in rooms:
            total, pv = rooms[room]
            dcp = DCP[inst]
            return inst, total, pv * P * dcp, dcp
    raise KeyError(room)


def dst_pages(room: int, rank: int) -> np.ndarray:
    """This rank's destination pages for ``room``: disjoint across the rooms of an instance
    (so a stray write into another room's pages is caught), shuffled, different per rank."""
    inst = request(room)[0]
    vpage = P * DCP[inst]
    need = {r: -(-(t - pv * vpage) // vpage) for r, (t, pv) in REQUESTS[inst].items()}
    rooms = list(REQUESTS[inst])
    off = sum(need[r] for r in rooms[: rooms.index(room)])
    perm = np.random.default_rng(len(inst) * 7 + rank).permutation(DST_PAGES)
    assert off + need[room] <= DST_PAGES
    return perm[off : off + need[room]].astype(np.int64)


def apply_expected(out: list[np.ndarray], room: int, rank: int) -> None:
    """Slow reference: walk every token of the send range and copy its rows into ``out`` (the
    decode rank's KV). DCP rule: logical token i lives on rank i % dcp at local i // dcp."""
    _inst, total, prefix, dcp = request(room)
    srcs = [[t.numpy() for t in src_kv(k)] for k in range(PP)]
    sp = src_pages(room, total)
    vpage = P * dcp
    dp = dst_pages(room, rank)
    per = LAYERS // PP
    for i in range(prefix, total):
        if i % dcp != rank:
            continue
        s_slot = sp[i // P] * P + i % P
        rel = i - prefix
        d_slot = dp[rel // vpage] * P + (rel % vpage) // dcp
        for k in range(PP):
            for e in range(2 * per):
                out[2 * per * k + e][d_slot] = srcs[k][e][s_slot]


def room_rows(room: int, rank: int) -> np.ndarray:
    """Token rows of every destination page of ``room`` on ``rank``."""
    dp = dst_pages(room, rank)
    return (dp[:, None] * P + np.arange(P)).reshape(-1)


# ----------------------------------------------------------------------------- prefill process


class CorruptingEngine:
    """Wraps a real engine; while ``on``, posts write to a bogus destination address (far
    outside the peer's registered memory), so the real engine fails the post."""

    def __init__(self, inner: Any) -> None:
        self.inner = inner
        self.on = False
        self.name = inner.name
        self.notifications = inner.notifications

    def post(self, peer: Any, src: Any, dst: Any, length: Any, tag: bytes) -> Any:
        if self.on:
            dst = dst + (1 << 44)
        return self.inner.post(peer, src, dst, length, tag)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)

    def prepare_pages(self, peer: Any, grid: Any) -> None:
        """No page lists: every write goes through :meth:`post`, which this wrapper changes."""
        return None


def _kv_config(role: str, lay: Any, endpoint: str, opts: dict[str, Any], instance: str) -> Any:
    from pdplug import KVConfig

    t = float(opts.get("timeout", 3.0))
    return KVConfig(
        instance=instance,
        role=role,
        layout=lay,
        bootstrap_endpoint=endpoint,
        bootstrap_timeout_s=float(opts.get("bootstrap", 20.0)),
        waiting_timeout_s=float(opts.get("waiting", 20.0)),
        transfer_timeout_s=t,
        pack_region_tokens=int(opts.get("region_tokens", 32)),
        max_dst_dcp=4,
    )


def prefill_main(conn: Any, endpoint: str, backend: str, opts: dict[str, Any]) -> None:
    try:
        _prefill(conn, endpoint, backend, opts)
    except Exception:
        send(conn, event="error", trace=traceback.format_exc())
        raise
    conn.close()


class Observer:
    """A ``pdplug_on_event`` plugin registered on the manager that builds the sessions."""

    def __init__(self) -> None:
        self.events: list[tuple[str, int, str]] = []

    @hookimpl
    def pdplug_on_event(self, event: Any) -> None:
        """Record every event."""
        self.events.append((event.kind, event.room, event.source))


def _prefill(conn: Any, endpoint: str, backend: str, opts: dict[str, Any]) -> None:
    from pdplug import KVPoll, PluginManager, SchedulerConfig

    obs = Observer()
    pm = PluginManager(plugins=[("test-observer", obs)])  # the sessions' own manager
    planner = pm.make_pack_planner()
    sched = pm.make_scheduler(SchedulerConfig(page_size=P, chunk_size=int(opts.get("grid", 96))))
    senders = []
    for k in range(PP):
        s = pm.make_kv_sender(
            _kv_config("prefill", layouts(k), endpoint, opts, PREFILL), planner, name=backend
        )
        s.engine = CorruptingEngine(s.engine)
        s.register_kv(src_kv(k))
        senders.append(s)
    send(conn, event="ready", endpoints=[s.endpoint for s in senders], pid=os.getpid())
    rooms: dict[int, dict[str, Any]] = {}
    terminal = (KVPoll.Success, KVPoll.Failed)
    while True:
        while conn.poll(0):
            cmd = msgspec.json.decode(conn.recv_bytes())
            op = cmd["op"]
            if op == "quit":
                send(conn, event="stats", stats=[s.stats() for s in senders])
                for s in senders:
                    s.close()
                return
            if op == "serve":
                for room in cmd["rooms"]:
                    total = request(room)[1]
                    for s in senders:
                        s.start(room)
                    rooms[room] = {
                        "total": total,
                        "segs": None,
                        "next": 0,
                        "hold": room in cmd.get("hold", []),
                        "reported": False,
                    }
            elif op == "corrupt":
                for s in senders:
                    s.engine.on = bool(cmd["on"])
            elif op == "release":
                rooms[cmd["room"]]["hold"] = False
            elif op == "abort":
                for s in senders:
                    s.abort(cmd["room"], "prefill test abort")
            elif op == "events":
                send(conn, event="events", events=obs.events)
            elif op == "stats":
                send(conn, event="stats", stats=[s.stats() for s in senders])
            elif op == "clear":
                for s in senders:
                    s.clear(cmd["room"])
                rooms.pop(cmd["room"], None)
        for room, st in rooms.items():
            polls = [s.poll(room) for s in senders]
            if st["segs"] is None and all(p == KVPoll.WaitingForInput for p in polls):
                d = senders[0].dest(room)[0]
                cap = senders[0].capacity_tokens(room)
                st["segs"] = sched.split_send(
                    token_start=d.decode_prefix_len,
                    token_end=st["total"],
                    decode_prefix_len=d.decode_prefix_len,
                    is_last_send=True,
                    capacity_tokens=cap,
                )
                st["pages"] = src_pages(room, st["total"])
                st["cap"] = cap
            segs = st["segs"]
            if segs is not None:
                while st["next"] < len(segs) and not (st["hold"] and st["next"] == len(segs) - 1):
                    seg = segs[st["next"]]
                    for s in senders:
                        s.send(room, seg, st["pages"][seg.token_start // P :])
                    st["next"] += 1
                    if st["next"] == 1:
                        send(conn, event="sent_first", room=room, segments=len(segs))
            if not st["reported"] and all(p in terminal for p in polls):
                st["reported"] = True
                # after a refused run Mooncake ends the session's other queued runs three or
                # four a second (``"FAILING"``); its engine keeps a few runs queued per peer
                # (pdplug_mooncake ``_write_runs``), so a failed room drains in seconds.
                # Bounded below the test's timeout so an undrained room shows its state
                t_fail = time.monotonic()
                t_end = t_fail + 50.0
                while not all(s.drained(room) for s in senders) and time.monotonic() < t_end:
                    time.sleep(0.005)
                send(
                    conn,
                    event="done",
                    room=room,
                    status=[int(p) for p in polls],
                    reasons=[s.failure_reason(room) for s in senders],
                    segments=len(segs or ()),
                    cap=st.get("cap"),
                    drained=[s.drained(room) for s in senders],
                    drain_s=round(time.monotonic() - t_fail, 3),
                    posts=[s.stats().get("posts", 0) for s in senders],
                )
        time.sleep(0.001)


# ----------------------------------------------------------------------------- decode process


def decode_main(conn: Any, endpoint: str, backend: str, opts: dict[str, Any]) -> None:
    try:
        _decode(conn, endpoint, backend, opts)
    except Exception:
        send(conn, event="error", trace=traceback.format_exc())
        raise
    conn.close()


def _decode(conn: Any, endpoint: str, backend: str, opts: dict[str, Any]) -> None:
    from pdplug import CompatError, KVPoll, PluginManager, TransferError
    from pdplug.bootstrap import resolve

    pm = PluginManager()
    recvs: dict[str, list[Any]] = {}
    kvs: dict[str, list[list[Any]]] = {}
    find = bool(opts.get("find"))  # KVReceiverSession.find: connected by the first room
    peers = None if find else resolve(endpoint, PREFILL, timeout_s=20)
    for inst in opts["instances"]:
        dcp = {"dec-tp": 1, "dec-dcp2": 2, "dec-dcp4": 4}[inst]
        recvs[inst], kvs[inst] = [], []
        for r in range(dcp):
            lay = dst_layout(dcp, r)
            rc = pm.make_kv_receiver(_kv_config("decode", lay, endpoint, opts, inst), name=backend)
            kv = dst_kv(lay)
            rc.register_kv(kv)
            if find:
                rc.find(PREFILL, endpoint)
            else:
                rc.connect(peers)
            recvs[inst].append(rc)
            kvs[inst].append(kv)
    send(conn, event="ready", pid=os.getpid())
    watching: dict[int, dict[str, Any]] = {}
    succeeded: dict[str, list[int]] = {}
    failed: dict[str, list[int]] = {}
    terminal = (KVPoll.Success, KVPoll.Failed)
    while True:
        while conn.poll(0):
            cmd = msgspec.json.decode(conn.recv_bytes())
            op = cmd["op"]
            if op == "final_check":
                # every byte of every receiver: poison except the rooms that succeeded
                # (pages of failed rooms may hold partial writes and are skipped)
                ok = True
                for inst, rs in recvs.items():
                    for r in range(len(rs)):
                        want = [np.full(t.shape, POISON, np.uint8) for t in kvs[inst][r]]
                        for room in succeeded.get(inst, []):
                            apply_expected(want, room, r)
                        keep = np.ones(DST_PAGES * P, dtype=bool)
                        for room in failed.get(inst, []):
                            keep[room_rows(room, r)] = False
                        ok &= all(
                            np.array_equal(t.numpy()[keep], x[keep])
                            for t, x in zip(kvs[inst][r], want)
                        )
                send(conn, event="final_check", ok=ok, succeeded=succeeded)
            if op == "quit":
                send(
                    conn,
                    event="stats",
                    stats={i: [r.stats() for r in rs] for i, rs in recvs.items()},
                )
                for rs in recvs.values():
                    for r in rs:
                        r.close()
                return
            if op == "expect":
                # "from": another prefill instance name (found at the rendezvous first)
                source = cmd.get("from", PREFILL if find else None)
                if cmd.get("unnamed"):  # the only instance this rank knows, found or not
                    source = None
                for room in cmd["rooms"]:
                    inst, total, prefix, dcp = request(room)
                    for r, rc in enumerate(recvs[inst]):
                        if cmd.get("from"):
                            rc.find(cmd["from"], endpoint)
                        rc.expect(
                            room, dst_pages(room, r), decode_prefix_len=prefix, num_tokens=total,
                            instance=source,
                        )  # fmt: skip
                    watching[room] = {
                        "inst": inst,
                        "t0": time.monotonic(),
                        "seen": False,
                        "dcp": dcp,
                    }
            elif op == "abort":
                inst = request(cmd["room"])[0]
                for rc in recvs[inst]:
                    rc.abort(cmd["room"], "test abort")
            elif op == "mark":
                watching[cmd["room"]]["t0"] = time.monotonic()
            elif op == "clear":
                room = cmd["room"]
                for rc in recvs[request(room)[0]]:
                    rc.clear(room)
                watching.pop(room, None)
            elif op == "drained":
                room = cmd["room"]
                send(
                    conn,
                    event="drained",
                    room=room,
                    drained=[rc.drained(room) for rc in recvs[request(room)[0]]],
                )
            elif op == "generation":
                room = cmd["room"]
                send(
                    conn,
                    event="generation",
                    room=room,
                    gens=[rc.rooms.generation(room) for rc in recvs[request(room)[0]]],
                )
            elif op == "stats":
                send(
                    conn,
                    event="stats",
                    stats={i: [r.stats() for r in rs] for i, rs in recvs.items()},
                )
            elif op == "connect":  # the host connects an instance's ranks again
                errors = []
                for rc in recvs[cmd["inst"]]:
                    try:
                        rc.connect(peers)
                    except TransferError as e:
                        errors.append(str(e))
                send(conn, event="connect", errors=errors)
            elif op == "bad_connect":
                # a decode rank with another page size and other bytes per token
                lay = dst_layout(1, 0, page_size=32, bpt=(64, 40))
                rc = pm.make_kv_receiver(
                    _kv_config("decode", lay, endpoint, opts, "dec-bad"), name=backend
                )
                rc.register_kv(dst_kv(lay))
                try:
                    rc.connect(peers)
                    send(conn, event="bad_connect", error="")
                except CompatError as e:
                    send(conn, event="bad_connect", error=str(e), mismatches=e.mismatches)
                finally:
                    rc.close()
        for room, w in list(watching.items()):
            rs = recvs[w["inst"]]
            polls = [rc.poll(room) for rc in rs]
            if not w["seen"] and any(p == KVPoll.Transferring for p in polls):
                w["seen"] = True
                send(conn, event="transferring", room=room)
            if all(p in terminal for p in polls):
                ok = None
                if all(p == KVPoll.Success for p in polls):
                    ok = True
                    for r in range(w["dcp"]):
                        got = [t.numpy() for t in kvs[w["inst"]][r]]
                        want = [np.full_like(g, POISON) for g in got]
                        apply_expected(want, room, r)
                        rows = room_rows(room, r)
                        ok &= all(np.array_equal(g[rows], x[rows]) for g, x in zip(got, want))
                    succeeded.setdefault(w["inst"], []).append(room)
                else:
                    failed.setdefault(w["inst"], []).append(room)
                send(
                    conn,
                    event="done",
                    room=room,
                    status=[int(p) for p in polls],
                    reasons=[rc.failure_reason(room) for rc in rs],
                    elapsed=time.monotonic() - w["t0"],
                    bytes_ok=ok,
                )
                del watching[room]
        time.sleep(0.001)


# ----------------------------------------------------------------------------- test side


class Child:
    """A spawned child and its pipe."""

    def __init__(self, target: Any, *args: Any) -> None:
        ctx = mp.get_context("spawn")
        self.conn, child = ctx.Pipe()
        self.proc = ctx.Process(target=target, args=(child, *args), daemon=True)
        self.proc.start()
        self.events: list[dict[str, Any]] = []
        self.info: dict[str, Any] = {}

    def cmd(self, **msg: Any) -> None:
        send(self.conn, **msg)

    def wait(self, event: str, timeout: float = 30.0, **match: Any) -> dict[str, Any]:
        """Next event named ``event`` (matching ``match``); earlier others are kept."""
        for i, e in enumerate(self.events):
            if e.get("event") == event and all(e.get(k) == v for k, v in match.items()):
                return self.events.pop(i)
        deadline = time.monotonic() + timeout
        while True:
            left = deadline - time.monotonic()
            if left <= 0:
                raise TimeoutError(f"no {event} {match} event in {timeout} s; got {self.events}")
            if not self.proc.is_alive() and not self.conn.poll(0):
                raise RuntimeError(f"child died (exit {self.proc.exitcode}); events {self.events}")
            try:
                e = recv(self.conn, min(left, 0.5))
            except TimeoutError:
                continue
            except EOFError as err:
                raise RuntimeError(f"child pipe closed; events {self.events}") from err
            if e.get("event") == "error":
                raise RuntimeError("child failed:\n" + e["trace"])
            if e.get("event") == event and all(e.get(k) == v for k, v in match.items()):
                return e
            self.events.append(e)

    def stop(self) -> None:
        with contextlib.suppress(Exception):
            if self.proc.is_alive():
                self.cmd(op="quit")
                self.wait("stats", timeout=10)
        self.proc.join(5)
        if self.proc.is_alive():
            self.proc.kill()
            self.proc.join(5)
