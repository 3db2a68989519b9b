"""``pdplug bench soak``: thousands of rooms through real engines under faults, then checks.

One prefill instance (PP 2, in this process) serves three decode instances: ``dec-A`` (DCP 2,
packed sends), ``dec-B`` (DCP 1, unpacked) and ``dec-K`` (DCP 2, its rank 1 in a child process
that is killed with SIGKILL a third of the way through). Rooms of random lengths and decode
prefixes run ``--concurrency`` at a time; faults are drawn from ``--seed``: decode aborts and
prefill aborts at random moments, a re-handshake of a decode rank every ``--reconnect-every``
rooms, writes delayed by 0-10 ms and, with probability ``--stall-p``, held ``--stall-s``
seconds (past ``transfer_timeout_s``: stuck, then recovering), all through a real NIXL or
Mooncake engine wrapped by :class:`pdplug.transfer.FaultyEngine`.

The host side behaves as a real host must: it frees a room's pages only once every rank says
it is terminal and ``drained``; freed decode pages are filled with poison and checked to be
still poison when reused (and at the end); freed source pages are rewritten at once.

Checks (the command exits 1 when one fails): every room ended on every live rank (none hung);
no engine-loop round raised;
every lease had exactly one outcome event (``transfer_done`` or ``transfer_failed``); every
room that succeeded holds exactly the source bytes sent; no decode page was written after its
release; nothing is left once the rooms ended (leases, queued jobs, writes, stuck writes, pack
regions, undrained rooms, engine handles) and, after ``close()``, no thread or ZMQ socket.
"""

from __future__ import annotations

import gc
import multiprocessing as mp
import os
import random
import signal
import threading
import time
import warnings
from collections import Counter, deque
from typing import Any

import click
import msgspec
import numpy as np

from pdplug import hookimpl
from pdplug_bench.machine import json_option
from pdplug_bench.options import StrictIntRange

__all__ = ["cli", "run_soak"]

P = 16
LAYERS = 4
BPT = (64, 48)
POISON = 0xA5
TIMEOUTS = dict(bootstrap_timeout_s=6.0, waiting_timeout_s=6.0, transfer_timeout_s=2.0)
_enc = msgspec.json.Encoder()


def _layout(*, pp: int = 1, pp_rank: int = 0, dcp: int = 1, dcp_rank: int = 0) -> Any:
    from pdplug import KVLayout

    per = LAYERS // pp
    return KVLayout(
        page_size=P,
        entry_bytes_per_token=BPT * per,
        pp_size=pp,
        pp_rank=pp_rank,
        first_layer=pp_rank * per,
        num_layers=per,
        dcp_size=dcp,
        dcp_rank=dcp_rank,
    )


def _config(role: str, layout: Any, endpoint: str, instance: str) -> Any:
    from pdplug import KVConfig

    return KVConfig(
        instance=instance,
        role=role,
        layout=layout,
        bootstrap_endpoint=endpoint,
        pack_region_tokens=32,
        max_dst_dcp=2,
        **TIMEOUTS,  # type: ignore[arg-type]
    )


class _Recorder:
    """A ``pdplug_on_event`` plugin counting outcome events per lease generation."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.outcomes: Counter[int] = Counter()
        self.seen: dict[int, list[str]] = {}

    @hookimpl
    def pdplug_on_event(self, event: Any) -> None:
        """Count ``transfer_done`` / ``transfer_failed`` by generation."""
        if event.kind in ("transfer_done", "transfer_failed"):
            g = int(event.fields.get("generation", -1))
            with self.lock:
                self.outcomes[g] += 1
                self.seen.setdefault(g, []).append(
                    f"{event.kind} {str(event.fields.get('reason', ''))[:160]}"
                )


# ----------------------------------------------------------------------------- the killed rank
def _victim(conn: Any, backend: str, endpoint: str, pages: int) -> None:
    """Child process: decode instance ``dec-K``'s DCP rank 1 (killed by the parent)."""
    import torch

    from pdplug import KVPoll, PluginManager
    from pdplug.bootstrap import resolve

    pm = PluginManager()
    lay = _layout(dcp=2, dcp_rank=1)
    rc = pm.make_kv_receiver(_config("decode", lay, endpoint, "dec-K"), name=backend)
    kv = [torch.full((pages * P, b), POISON, dtype=torch.uint8) for b in lay.entry_bytes_per_token]
    rc.register_kv(kv)
    rc.connect(resolve(endpoint, "prefill-0", timeout_s=60))
    conn.send_bytes(_enc.encode({"event": "ready"}))
    watching: set[int] = set()
    while True:
        while conn.poll(0):
            cmd = msgspec.json.decode(conn.recv_bytes())
            if cmd["op"] == "expect":
                pg = np.asarray(cmd["pages"], dtype=np.int64)
                rc.expect(cmd["room"], pg, decode_prefix_len=cmd["prefix"], num_tokens=cmd["total"])
                watching.add(cmd["room"])
            elif cmd["op"] == "abort":
                rc.abort(cmd["room"], "soak: decode abort")
        for room in list(watching):
            st = rc.poll(room)
            if st in (KVPoll.Success, KVPoll.Failed) and rc.drained(room):
                conn.send_bytes(_enc.encode({"event": "done", "room": room, "status": st.name}))
                rc.clear(room)
                watching.discard(room)
        time.sleep(0.002)


# ----------------------------------------------------------------------------- the driver
class _Inst:
    """A decode instance: its local receivers (rank -> receiver), their KV and free pages."""

    def __init__(self, name: str, dcp: int, pages: int) -> None:
        self.name, self.dcp = name, dcp
        self.recvs: dict[int, Any] = {}
        self.kv: dict[int, list[Any]] = {}
        self.free: dict[int, deque[int]] = {}
        self.pages = pages
        self.remote: Any = None  # the child's pipe (dec-K rank 1)
        self.alive = True


class _Room(msgspec.Struct, kw_only=True):
    room: int
    inst: str
    total: int
    prefix: int
    sp: np.ndarray
    dps: dict[int, np.ndarray]
    deadline: float
    expect_at: float
    expect_first: bool
    decode_abort_at: float = 0.0
    prefill_abort_at: float = 0.0
    started: bool = False
    expected: bool = False
    sent: bool = False
    snap: list[list[np.ndarray]] = []
    p_status: tuple[str, ...] = ()
    d_status: tuple[str, ...] = ()
    remote_done: bool = False
    p_done: bool = False
    d_done: bool = False


class _Soak:
    def __init__(self, backend: str, rooms: int, concurrency: int, seed: int, opts: Any) -> None:
        self.backend, self.n, self.conc, self.opts = backend, rooms, concurrency, opts
        self.rng = random.Random(seed)
        self.nrng = np.random.default_rng(seed)
        self.counts: Counter[str] = Counter()
        self.problems: dict[str, list[str]] = {}
        self.gens: list[int] = []  # every lease generation handed out in this process
        self.label: dict[int, str] = {}

    def problem(self, check: str, what: str) -> None:
        self.problems.setdefault(check, []).append(what)

    # ------------------------------------------------------------------ set-up
    def setup(self) -> None:
        import torch

        from pdplug import PluginManager, SchedulerConfig
        from pdplug.bootstrap import RendezvousServer, resolve
        from pdplug.transfer import FaultyEngine

        self.server = RendezvousServer().start()
        ep = self.server.endpoint
        self.recorder = _Recorder()
        pm = PluginManager()
        pm.pm.register(self.recorder, name="soak-recorder")
        self.pm = pm
        self.sched = pm.make_scheduler(SchedulerConfig(page_size=P, chunk_size=96))
        planner = pm.make_pack_planner()
        self.src_pages = self.conc * 21 + 32
        self.senders: list[Any] = []
        self.src: list[list[Any]] = []
        for k in range(2):
            lay = _layout(pp=2, pp_rank=k)
            s: Any = pm.make_kv_sender(
                _config("prefill", lay, ep, "prefill-0"), planner, name=self.backend
            )
            s.engine = FaultyEngine(
                s.engine,
                delay=(0.0, 0.01),
                seed=k,
                stall=(self.opts["stall_p"], self.opts["stall_s"]),
            )
            kv = [
                torch.randint(1, 256, (self.src_pages * P, b), dtype=torch.uint8)
                for b in lay.entry_bytes_per_token
            ]
            s.register_kv(kv)
            self.senders.append(s)
            self.src.append(kv)
        self.src_free = deque(range(self.src_pages))
        peers = resolve(ep, "prefill-0", timeout_s=60)
        self.peers = peers
        dpages = self.conc * 12 + 32
        self.insts = {n: _Inst(n, d, dpages) for n, d in (("dec-A", 2), ("dec-B", 1), ("dec-K", 2))}
        for inst in self.insts.values():
            for r in range(inst.dcp):
                if inst.name == "dec-K" and r == 1:
                    continue
                lay = _layout(dcp=inst.dcp, dcp_rank=r)
                rc = pm.make_kv_receiver(_config("decode", lay, ep, inst.name), name=self.backend)
                kv = [
                    torch.full((dpages * P, b), POISON, dtype=torch.uint8)
                    for b in lay.entry_bytes_per_token
                ]
                rc.register_kv(kv)
                rc.connect(peers)
                inst.recvs[r], inst.kv[r] = rc, kv
                inst.free[r] = deque(range(dpages))
        ctx = mp.get_context("spawn")
        parent, child = ctx.Pipe()
        self.victim = ctx.Process(
            target=_victim, args=(child, self.backend, ep, dpages), daemon=True
        )
        self.victim.start()
        if not parent.poll(120):
            raise RuntimeError("soak: the dec-K rank 1 process did not start in 120 s")
        msgspec.json.decode(parent.recv_bytes())
        self.insts["dec-K"].remote = parent
        self.insts["dec-K"].free[1] = deque(range(dpages))

    # ------------------------------------------------------------------ rooms
    def new_room(self, room: int, now: float) -> _Room | None:
        live = [n for n in ("dec-A", "dec-B", "dec-K") if self.insts[n].alive]
        inst = self.insts[self.rng.choices(live, weights=[45, 35, 20][: len(live)])[0]]
        total = self.rng.randint(16, 320)
        vpage = P * inst.dcp
        prefix = vpage if total > vpage and self.rng.random() < 0.2 else 0
        n_src = -(-total // P)
        n_dst = -(-(total - prefix) // vpage)
        if len(self.src_free) < n_src or any(len(f) < n_dst for f in inst.free.values()):
            return None
        sp = np.array([self.src_free.popleft() for _ in range(n_src)], dtype=np.int64)
        dps = {
            r: np.array([f.popleft() for _ in range(n_dst)], dtype=np.int64)
            for r, f in inst.free.items()
        }
        for r, pages in dps.items():  # nothing may have written a released page since
            if r in inst.kv and not self._poisoned(inst, r, pages):
                self.problem(
                    "poison", f"{inst.name} rank {r} pages of room {room} written after release"
                )
        x = self.rng.random()
        slack = sum(TIMEOUTS.values()) * 3 + self.opts["stall_s"] + 30
        return _Room(
            room=room,
            inst=inst.name,
            total=total,
            prefix=prefix,
            sp=sp,
            dps=dps,
            deadline=now + slack,
            expect_at=now + self.rng.uniform(0.0, 0.05),
            expect_first=self.rng.random() < 0.3,
            decode_abort_at=now + self.rng.uniform(0, 0.3) if x < self.opts["abort_p"] else 0.0,
            prefill_abort_at=(
                now + self.rng.uniform(0, 0.3)
                if self.opts["abort_p"] <= x < 2 * self.opts["abort_p"]
                else 0.0
            ),
        )

    def _poisoned(self, inst: _Inst, r: int, pages: np.ndarray) -> bool:
        rows = (pages[:, None] * P + np.arange(P)).reshape(-1)
        return all(bool((t.numpy()[rows] == POISON).all()) for t in inst.kv[r])

    def step(self, st: _Room, now: float) -> None:
        from pdplug import KVPoll

        inst = self.insts[st.inst]
        terminal = (KVPoll.Success, KVPoll.Failed)
        if not st.started and (not st.expect_first or st.expected):
            for k, s in enumerate(self.senders):
                g = s.start(st.room)
                self.gens.append(g)
                self.label[g] = f"room {st.room} prefill rank {k}"
            st.started = True
        if not st.expected and now >= st.expect_at:
            for r, rc in inst.recvs.items():
                g = rc.expect(st.room, st.dps[r], decode_prefix_len=st.prefix, num_tokens=st.total)
                self.gens.append(g)
                self.label[g] = f"room {st.room} {st.inst} rank {r}"
            if inst.remote is not None and inst.alive:
                self._tell(
                    inst,
                    op="expect",
                    room=st.room,
                    pages=st.dps[1].tolist(),
                    prefix=st.prefix,
                    total=st.total,
                )
            st.expected = True
        if st.decode_abort_at and now >= st.decode_abort_at and st.expected:
            st.decode_abort_at = 0.0
            self.counts["decode_aborts"] += 1
            for rc in inst.recvs.values():
                rc.abort(st.room, "soak: decode abort")
            if inst.remote is not None and inst.alive:
                self._tell(inst, op="abort", room=st.room)
        if st.prefill_abort_at and now >= st.prefill_abort_at and st.started:
            st.prefill_abort_at = 0.0
            self.counts["prefill_aborts"] += 1
            for s in self.senders:
                s.abort(st.room, "soak: prefill abort")
        if st.started and not st.sent and not st.p_done:
            polls = [s.poll(st.room) for s in self.senders]
            if all(p == KVPoll.WaitingForInput for p in polls):
                self._send(st)
        if st.started and not st.p_done:
            polls = [s.poll(st.room) for s in self.senders]
            if all(p in terminal for p in polls) and all(s.drained(st.room) for s in self.senders):
                st.p_status = tuple(p.name for p in polls)
                for s in self.senders:
                    s.clear(st.room)
                self._release_src(st.sp)
                st.p_done = True
        if st.expected and not st.d_done:
            polls = [rc.poll(st.room) for rc in inst.recvs.values()]
            remote_ok = inst.remote is None or st.remote_done or not inst.alive
            if all(p in terminal for p in polls) and remote_ok:
                if not st.d_status:
                    st.d_status = tuple(p.name for p in polls)
                    if all(p == KVPoll.Success for p in polls):
                        self._check_bytes(st)
                if all(rc.drained(st.room) for rc in inst.recvs.values()):
                    for r, rc in inst.recvs.items():
                        rc.clear(st.room)
                        self._release_dst(inst, r, st.dps[r])
                    if inst.remote is not None:
                        inst.free[1].extend(st.dps[1].tolist())
                    st.d_done = True

    def _tell(self, inst: _Inst, **cmd: Any) -> None:
        try:
            inst.remote.send_bytes(_enc.encode(cmd))
        except OSError:
            pass

    def _send(self, st: _Room) -> None:
        d = self.senders[0].dest(st.room)
        if not d:
            return
        try:
            cap = self.senders[0].capacity_tokens(st.room)
        except ValueError:
            return
        rows = (st.sp[:, None] * P + np.arange(P)).reshape(-1)
        st.snap = [[t.numpy()[rows].copy() for t in kv] for kv in self.src]
        segs = self.sched.split_send(
            token_start=st.prefix,
            token_end=st.total,
            decode_prefix_len=st.prefix,
            is_last_send=True,
            capacity_tokens=cap,
        )
        for seg in segs:
            for s in self.senders:
                try:
                    s.send(st.room, seg, st.sp[seg.token_start // P :])
                except ValueError:
                    pass  # the room failed meanwhile (an abort); send refuses a non-live room
        st.sent = True

    def _check_bytes(self, st: _Room) -> None:
        inst = self.insts[st.inst]
        if not st.snap:
            self.problem("bytes", f"room {st.room} succeeded on decode but was never sent")
            return
        dcp, vpage, per = inst.dcp, P * inst.dcp, LAYERS // 2
        tok = np.arange(st.prefix, st.total)
        for r, kv in inst.kv.items():
            mine = tok[tok % dcp == r]
            rel = mine - st.prefix
            d_slot = st.dps[r][rel // vpage] * P + (rel % vpage) // dcp
            for k in range(2):
                for e in range(2 * per):
                    if not np.array_equal(kv[2 * per * k + e].numpy()[d_slot], st.snap[k][e][mine]):
                        self.problem(
                            "bytes", f"room {st.room} {st.inst} rank {r} entry {e} of PP {k}"
                        )
                        return
        self.counts["bytes_checked"] += 1

    def _release_src(self, pages: np.ndarray) -> None:
        import torch

        rows = torch.from_numpy((pages[:, None] * P + np.arange(P)).reshape(-1))
        for kv in self.src:
            for t in kv:  # the next request's KV lands here at once
                t[rows] = torch.randint(1, 256, (len(rows), t.shape[1]), dtype=torch.uint8)
        self.src_free.extend(pages.tolist())

    def _release_dst(self, inst: _Inst, r: int, pages: np.ndarray) -> None:
        rows = (pages[:, None] * P + np.arange(P)).reshape(-1)
        for t in inst.kv[r]:
            t.numpy()[rows] = POISON
        inst.free[r].extend(pages.tolist())

    # ------------------------------------------------------------------ the run
    def run(self) -> dict[str, Any]:
        t0 = time.monotonic()
        active: dict[int, _Room] = {}
        started = done = 0
        next_reconnect = self.opts["reconnect_every"]
        killed_at = self.n // 3
        while done < self.n:
            now = time.monotonic()
            while len(active) < self.conc and started < self.n:
                st = self.new_room(10_000 + started, now)
                if st is None:
                    break
                active[st.room] = st
                started += 1
            k = self.insts["dec-K"]
            if k.alive and started >= killed_at:
                os.kill(self.victim.pid, signal.SIGKILL)  # type: ignore[arg-type]
                k.alive = False
                self.counts["killed_rank_rooms"] = sum(
                    1 for s in active.values() if s.inst == "dec-K"
                )
            if started >= next_reconnect:
                next_reconnect += self.opts["reconnect_every"]
                inst = self.insts[self.rng.choice(["dec-A", "dec-B"])]
                rc = inst.recvs[self.rng.choice(list(inst.recvs))]
                rc.connect(self.peers)
                self.counts["reconnects"] += 1
            self._poll_victim(active)
            for room, st in list(active.items()):
                self.step(st, now)
                if st.p_done and st.d_done:
                    del active[room]
                    done += 1
                    self.counts[
                        "ok" if set(st.p_status + st.d_status) == {"Success"} else "failed"
                    ] += 1
                elif now > st.deadline:
                    self.problem(
                        "ended",
                        f"room {room} ({st.inst}) did not end: p={st.p_status} d={st.d_status}",
                    )
                    del active[room]
                    done += 1
            time.sleep(0.001)
        seconds = round(time.monotonic() - t0, 1)
        out = self.finish()
        out["counts"]["seconds"] = seconds
        return out

    def _poll_victim(self, active: dict[int, _Room]) -> None:
        k = self.insts["dec-K"]
        if not k.alive:
            return
        try:
            while k.remote.poll(0):
                ev = msgspec.json.decode(k.remote.recv_bytes())
                st = active.get(ev.get("room", -1))
                if st is not None:
                    st.remote_done = True
        except (EOFError, OSError):
            pass

    def finish(self) -> dict[str, Any]:
        # what is left once every room ended (early aborts and early DestInfos expire after
        # bootstrap_timeout_s; everything else must be gone already)
        fields = (
            "leases",
            "draining",
            "inbox",
            "early_aborts",
            "queued",
            "packing",
            "xfers",
            "stuck_writes",
            "busy_regions",
            "undrained",
        )
        t_end = time.monotonic() + TIMEOUTS["bootstrap_timeout_s"] + 5
        sessions = self.senders + [rc for i in self.insts.values() for rc in i.recvs.values()]
        while True:
            left = {
                f"{getattr(s, 'rank', 'd')}/{i}": {
                    k: v for k, v in s.stats().items() if k in fields and v
                }
                for i, s in enumerate(sessions)
            }
            left = {k: v for k, v in left.items() if v}
            handles = sum(len(s.engine.inflight) + s.engine.pending() for s in self.senders)
            if (not left and not handles) or time.monotonic() > t_end:
                break
            time.sleep(0.2)
        for k, v in left.items():
            self.problem("leaks", f"session {k}: {v}")
        if handles:
            self.problem("leaks", f"{handles} engine write handles not released")
        errors = {
            f"{getattr(s, 'rank', 'd')}/{i}": s.stats()["loop_errors"]
            for i, s in enumerate(sessions)
        }
        for k, v in errors.items():
            if v:
                self.problem("errors", f"session {k}: {v} engine-loop rounds raised")
        stats = [s.stats() for s in self.senders]
        self.counts["writes_stuck"] = sum(s.get("writes_stuck", 0) for s in stats)
        self.counts["writes_stalled"] = sum(s.engine.stalled for s in self.senders)
        self.counts["room_conflicts"] = sum(s.get("room_conflicts", 0) for s in stats)
        for i in self.insts.values():  # every free page is still poison
            for r in i.kv:
                if not self._poisoned(i, r, np.array(sorted(i.free[r]), dtype=np.int64)):
                    self.problem("poison", f"{i.name} rank {r}: a free page was written")
        self.close()
        with self.recorder.lock:
            outcomes = dict(self.recorder.outcomes)
        once = sum(1 for g in self.gens if outcomes.get(g, 0) == 1)
        for g in self.gens:
            if outcomes.get(g, 0) != 1:
                seen = self.recorder.seen.get(g, [])
                self.problem("once", f"{self.label[g]}: {outcomes.get(g, 0)} outcome events {seen}")
        for g in set(outcomes) - set(self.gens):
            self.problem("once", f"outcome event for unknown lease {g}")
        self.counts["leases_ended_once"] = once
        self.counts["leases"] = len(self.gens)
        counts: dict[str, Any] = dict(self.counts)
        return {"counts": counts, "problems": self.problems}

    def close(self) -> None:
        """Close every session, the rendezvous and the killed rank's process (also after a
        set-up or a run that raised: an engine left open at interpreter exit aborted the
        process, NIXL's threads calling ``std::terminate``, rc 134 instead of the error)."""
        recvs = [rc for i in getattr(self, "insts", {}).values() for rc in i.recvs.values()]
        for s in [*getattr(self, "senders", []), *recvs]:
            try:
                s.close()
            except Exception:  # the next one still closes
                pass
        if getattr(self, "server", None) is not None:
            self.server.stop()
        victim = getattr(self, "victim", None)
        if victim is not None:
            if victim.is_alive():
                victim.kill()
            victim.join(10)


def _threads_and_sockets() -> tuple[int, int]:
    import zmq

    gc.collect()
    with warnings.catch_warnings():  # isinstance() on every object touches deprecated ones
        warnings.simplefilter("ignore")
        socks = sum(1 for o in gc.get_objects() if isinstance(o, zmq.Socket) and not o.closed)
    return threading.active_count(), socks


def run_soak(
    backend: str, *, rooms: int, concurrency: int, seed: int, **opts: Any
) -> dict[str, Any]:
    """Drive ``rooms`` rooms through ``backend`` with faults; returns ``{"counts", "problems"}``
    (``problems``: check name -> what failed; empty when every check passed)."""
    base = _threads_and_sockets()
    soak = _Soak(backend, rooms, concurrency, seed, opts)
    try:
        soak.setup()
        out = soak.run()
    except BaseException:
        soak.close()
        raise
    del soak
    t_end = time.monotonic() + 10
    while (now := _threads_and_sockets()) > base and time.monotonic() < t_end:
        time.sleep(0.2)
    if now[0] > base[0]:
        names = sorted(t.name for t in threading.enumerate())
        out["problems"].setdefault("leaks", []).append(f"{now[0] - base[0]} threads left: {names}")
    if now[1] > base[1]:
        out["problems"].setdefault("leaks", []).append(f"{now[1] - base[1]} ZMQ sockets left open")
    return out


CHECKS = ("ended", "once", "bytes", "poison", "leaks", "errors")


@click.command()
@click.option(
    "--backend", default="nixl,mooncake", show_default=True, help="Comma-separated KV sender names."
)
@click.option(
    "--rooms",
    default=2000,
    show_default=True,
    type=StrictIntRange(1, 10**6),
    help="Rooms per backend.",
)
@click.option(
    "--concurrency",
    default=48,
    show_default=True,
    type=StrictIntRange(1, 4096),
    help="Rooms in flight.",
)
@click.option(
    "--seed", default=0, show_default=True, help="Seed of every random draw (faults, sizes)."
)
@click.option(
    "--abort-p",
    default=0.08,
    show_default=True,
    type=click.FloatRange(0, 0.5),
    help="Probability of a decode abort, and of a prefill abort, per room.",
)
@click.option(
    "--stall-p",
    default=0.01,
    show_default=True,
    type=click.FloatRange(0, 1),
    help="Probability that a write is held --stall-s seconds.",
)
@click.option(
    "--stall-s",
    default=3.0,
    show_default=True,
    type=click.FloatRange(0, 60),
    help="How long a stalled write is held (seconds; > transfer_timeout_s 2 s makes it stuck).",
)
@click.option(
    "--reconnect-every",
    default=200,
    show_default=True,
    type=StrictIntRange(1),
    help="Rooms between two re-handshakes of a decode rank.",
)
@json_option
def cli(
    backend: str,
    rooms: int,
    concurrency: int,
    seed: int,
    abort_p: float,
    stall_p: float,
    stall_s: float,
    reconnect_every: int,
    json_path: str | None,
) -> None:
    """Rooms under random aborts, re-handshakes, slow, stuck writes and a killed decode rank;
    then: every room ended once on every rank, no page written after release, nothing leaked."""
    from rich.console import Console
    from rich.table import Table

    from pdplug_bench.machine import machine_line, write_json

    backends = [b.strip() for b in backend.split(",") if b.strip()]
    if not backends:
        raise click.BadParameter("name at least one backend", param_hint="--backend")
    console = Console(width=150)
    console.print(machine_line())
    console.print(
        f"soak: {rooms} rooms per backend, {concurrency} in flight, seed {seed}; prefill PP 2 -> "
        "dec-A DCP 2, dec-B DCP 1, dec-K DCP 2 (rank 1 killed after a third); "
        f"aborts {abort_p:.0%} decode + {abort_p:.0%} prefill, writes 0-10 ms late, "
        f"{stall_p:.1%} held {stall_s:g} s, a re-handshake every {reconnect_every} rooms; "
        f"timeouts {TIMEOUTS}"
    )
    results: dict[str, Any] = {}
    for b in backends:
        results[b] = run_soak(
            b,
            rooms=rooms,
            concurrency=concurrency,
            seed=seed,
            abort_p=abort_p,
            stall_p=stall_p,
            stall_s=stall_s,
            reconnect_every=reconnect_every,
        )
    t = Table(
        title="pdplug bench soak (ok/failed: rooms; aborts: decode/prefill; stalled/stuck: "
        "writes held past the timeout / reported stuck; rehs: re-handshakes; killed: rooms in "
        "flight on the killed rank; once: leases with exactly one outcome; bytes: rooms "
        "checked byte-exact)"
    )
    cols = (
        "backend",
        "ok",
        "failed",
        "aborts d/p",
        "stalled/stuck",
        "rehs",
        "killed",
        "once",
        "bytes",
        "s",
        *CHECKS,
    )
    for c in cols:
        t.add_column(c, justify="right")
    bad = False
    for b, r in results.items():
        c, probs = r["counts"], r["problems"]
        bad |= bool(probs)
        t.add_row(
            b,
            str(c.get("ok", 0)),
            str(c.get("failed", 0)),
            f"{c.get('decode_aborts', 0)}/{c.get('prefill_aborts', 0)}",
            f"{c.get('writes_stalled', 0)}/{c.get('writes_stuck', 0)}",
            str(c.get("reconnects", 0)),
            str(c.get("killed_rank_rooms", 0)),
            f"{c.get('leases_ended_once', 0)}/{c.get('leases', 0)}",
            str(c.get("bytes_checked", 0)),
            str(c.get("seconds", 0)),
            *("FAIL" if probs.get(k) else "ok" for k in CHECKS),
        )
    console.print(t)
    for b, r in results.items():
        for check, items in r["problems"].items():
            console.print(f"{b}: {check}: {len(items)} problem(s); first: {items[:3]}")
    if json_path:
        write_json(
            json_path,
            {"rooms": rooms, "concurrency": concurrency, "seed": seed, "results": results},
        )
    if bad:
        raise SystemExit(1)
