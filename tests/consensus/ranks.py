"""Multi-process harness for the consensus tests: one spawned process per PP rank.

Each rank process drives one or more consensus *instances* (e.g. a ``pp0`` and a ``ring`` on
separate ports, side by side in the same simulated host loop): at each iteration it performs
the scripted actions that are due (offer good/bad, abort, hold, release), calls ``poll()``
and records every applied decision with its (CLOCK_MONOTONIC, shared by all processes) time.
"""

from __future__ import annotations

import hashlib
import multiprocessing as mp
import os
import queue
import random
import signal
import time
import traceback
from dataclasses import dataclass, field
from typing import Any

import msgspec

STREAMS = ("bootstrap", "release")


# --------------------------------------------------------------------------- plans


class Action(msgspec.Struct, frozen=True, array_like=True):
    t: float  # seconds after start
    kind: str  # good | bad | abort | hold | release
    stream: str
    rid: int


class Instance(msgspec.Struct, frozen=True, kw_only=True):
    impl: str
    endpoints: tuple[str, ...]
    actions: tuple[Action, ...]
    expect: dict[str, int]  # stream -> number of ids that must end decided
    vote_deadline_s: float = 2.0
    peer_timeout_s: float = 10.0
    heartbeat_s: float = 0.2
    hmac_key: bytes | None = None
    max_message_bytes: int = 1 << 20
    relay: bool = False
    init_delay_s: float = 0.0  # sleep before building the consensus (a rank starting late)


class Applied(msgspec.Struct, frozen=True, array_like=True):
    stream: str
    seq: int
    good: tuple[int, ...]
    bad: tuple[int, ...]
    t: float  # monotonic time it was applied


class Result(msgspec.Struct, kw_only=True):
    rank: int
    impl: str
    applied: list[Applied] = []
    error: str | None = None
    error_t: float | None = None
    stats: dict[str, int] = {}
    relay_frames: int = 0
    rss_start_kib: int = 0  # peak resident memory (VmHWM) once started
    rss_end_kib: int = 0  # peak resident memory (VmHWM) at the end


# --------------------------------------------------------------------------- relay


class PipeRelay:
    """A host relay over multiprocessing pipes (PP0 holds one send end per follower)."""

    def __init__(self, conns: list[Any]) -> None:
        self.conns = conns
        self.frames = 0

    def publish(self, frame: bytes) -> None:
        for c in self.conns:
            c.send_bytes(frame)
        self.frames += 1

    def receive(self) -> list[bytes]:
        out = []
        c = self.conns[0]
        while c.poll(0):
            out.append(c.recv_bytes())
        self.frames += len(out)
        return out


# --------------------------------------------------------------------------- rank process


def peak_rss_kib() -> int:
    """This process's peak resident set size (``VmHWM``, KiB; Linux)."""
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmHWM:"):
                return int(line.split()[1])
    return 0


def _make(inst: Instance, rank: int, relay: Any) -> Any:
    from pdplug import ConsensusConfig, WireConfig, get_plugin_manager
    from pdplug.manager import load_factory

    cfg = ConsensusConfig(
        pp_rank=rank,
        pp_size=len(inst.endpoints),
        endpoints=inst.endpoints,
        streams=STREAMS,
        vote_deadline_s=inst.vote_deadline_s,
        peer_timeout_s=inst.peer_timeout_s,
        heartbeat_s=inst.heartbeat_s,
        wire=WireConfig(hmac_key=inst.hmac_key, max_message_bytes=inst.max_message_bytes),
    )
    pm = get_plugin_manager()
    if relay is None:
        return pm.make_consensus(cfg, name=inst.impl)
    spec, _, _ = pm.resolve("consensus", inst.impl)
    return load_factory(spec.factory)(cfg, relay=relay)


def rank_main(
    rank: int,
    plan: bytes,
    up_q: Any,
    out_q: Any,
    start: Any,
    stop: Any,
    relay_conns: list[Any] | None,
    loop_s: float,
    max_s: float,
) -> None:
    """Entry point of one rank process (spawned)."""
    from pdplug import ConsensusError

    insts = msgspec.msgpack.decode(plan, type=list[Instance])
    time.sleep(max((i.init_delay_s for i in insts), default=0.0))
    try:
        objs = [
            _make(i, rank, PipeRelay(relay_conns) if i.relay and relay_conns else None)
            for i in insts
        ]
    except Exception:
        up_q.put(("init_error", rank, traceback.format_exc()))
        return
    up_q.put(("up", rank, ""))
    if not start.wait(60):
        return
    t0 = start_time = time.monotonic()
    res = [Result(rank=rank, impl=i.impl, rss_start_kib=peak_rss_kib()) for i in insts]
    nxt = [0] * len(insts)
    decided = [{s: 0 for s in STREAMS} for _ in insts]
    aborted: list[set[int]] = [set() for _ in insts]
    live = [True] * len(insts)
    done_sent = False
    while not stop.is_set() and time.monotonic() - start_time < max_s:
        now = time.monotonic() - t0
        for k, (inst, c) in enumerate(zip(insts, objs)):
            if not live[k]:
                continue
            acts = inst.actions
            while nxt[k] < len(acts) and acts[nxt[k]].t <= now:
                a = acts[nxt[k]]
                nxt[k] += 1
                if a.kind == "abort":
                    aborted[k].add(a.rid)
                    c.abort(a.rid)
                elif a.rid in aborted[k]:
                    continue  # an aborted request is gone from this rank's queues
                elif a.kind == "good":
                    c.offer(a.stream, good=[a.rid])
                elif a.kind == "bad":
                    c.offer(a.stream, bad=[a.rid])
                elif a.kind == "hold":
                    c.hold(a.rid)
                elif a.kind == "release":
                    c.release_hold(a.rid)
            try:
                ds = c.poll()
            except ConsensusError as e:
                res[k].error, res[k].error_t, live[k] = str(e), time.monotonic(), False
                continue
            t = time.monotonic()
            for d in ds:
                res[k].applied.append(Applied(d.stream, d.seq, d.good, d.bad, t))
                decided[k][d.stream] += len(d.good) + len(d.bad)
        finished = all(
            not live[k]
            or (
                nxt[k] == len(inst.actions)
                and all(decided[k][s] >= n for s, n in inst.expect.items())
            )
            for k, inst in enumerate(insts)
        )
        if finished and not done_sent:
            out_q.put(("done", rank, b""))
            done_sent = True
        time.sleep(loop_s)
    for k, c in enumerate(objs):
        res[k].rss_end_kib = peak_rss_kib()
        res[k].stats = c.stats()
        relay = getattr(c, "_relay", None)
        res[k].relay_frames = relay.frames if relay is not None else 0
        c.close()
    out_q.put(("result", rank, msgspec.msgpack.encode(res)))


# --------------------------------------------------------------------------- parent side


@dataclass
class Group:
    """Outcome of :func:`run_group`: per rank, per instance results (``None`` if killed)."""

    results: dict[int, list[Result] | None]
    start_t: float
    kill_t: float | None = None
    events: list[tuple[str, int]] = field(default_factory=list)

    def instance(self, k: int) -> dict[int, Result]:
        return {r: res[k] for r, res in self.results.items() if res is not None}


def run_group(
    plans: dict[int, list[Instance]],
    *,
    loop_s: float = 0.004,
    max_s: float = 30.0,
    kill: tuple[int, float] | None = None,
    relay: bool = False,
    timeout_s: float = 60.0,
    during: Any = None,
) -> Group:
    """Spawn one process per rank, start them together, wait until every rank is done (or the
    killed rank's peers all reported errors), stop them and collect results.

    ``kill=(rank, after_s)`` SIGKILLs that rank's process ``after_s`` after the start;
    ``during(group)`` runs in the parent right after the start (e.g. to inject frames)."""
    ctx = mp.get_context("spawn")
    up_q, out_q = ctx.Queue(), ctx.Queue()
    start, stop = ctx.Event(), ctx.Event()
    size = len(plans)
    conns: dict[int, list[Any]] = {}
    if relay:
        for r in range(1, size):
            rx, tx = ctx.Pipe(duplex=False)
            conns.setdefault(0, []).append(tx)
            conns[r] = [rx]
    procs = {}
    for r, insts in plans.items():
        blob = msgspec.msgpack.encode(insts)
        p = ctx.Process(
            target=rank_main,
            args=(r, blob, up_q, out_q, start, stop, conns.get(r), loop_s, max_s),
            daemon=True,
        )
        p.start()
        procs[r] = p
    deadline = time.monotonic() + timeout_s
    try:
        ups = 0
        while ups < size:
            try:
                kind, rank, info = up_q.get(timeout=0.2)
            except queue.Empty:
                dead = [r for r, p in procs.items() if not p.is_alive()]
                if dead or time.monotonic() > deadline:
                    raise RuntimeError(f"ranks {dead} exited before start (or timeout)") from None
                continue
            if kind != "up":
                raise RuntimeError(f"rank {rank} failed to start:\n{info}")
            ups += 1
        group = Group(results={}, start_t=time.monotonic())
        start.set()
        done: set[int] = set()
        want = set(plans)
        if during is not None:
            during(group)
        if kill is not None:
            victim, after = kill
            time.sleep(after)
            os.kill(procs[victim].pid or 0, signal.SIGKILL)
            group.kill_t = time.monotonic()
            procs[victim].join(5)
            group.results[victim] = None
            want.discard(victim)
        while done < want and time.monotonic() < deadline:
            try:
                kind, rank, blob = out_q.get(timeout=0.2)
            except queue.Empty:
                continue
            group.events.append((kind, rank))
            if kind == "done":
                done.add(rank)
            elif kind == "result":
                group.results[rank] = msgspec.msgpack.decode(blob, type=list[Result])
        stop.set()
        while len(group.results) < size and time.monotonic() < deadline + 10:
            try:
                kind, rank, blob = out_q.get(timeout=0.5)
            except queue.Empty:
                continue
            if kind == "result":
                group.results[rank] = msgspec.msgpack.decode(blob, type=list[Result])
        missing = set(plans) - set(group.results)
        if missing:
            raise RuntimeError(f"ranks {sorted(missing)} returned no result before the timeout")
        return group
    finally:
        stop.set()
        start.set()
        for p in procs.values():
            p.join(5)
            if p.is_alive():
                p.kill()
                p.join(2)


# --------------------------------------------------------------------------- scenarios


@dataclass
class Scenario:
    """Per-rank actions plus what the parent expects."""

    actions: dict[int, list[Action]]
    expect: dict[str, int]
    bad_voted: dict[str, set[int]]
    missing: dict[str, set[int]]
    aborted_first: set[int]  # aborted on a rank before that rank's own good vote
    aborted: set[int]
    clean: dict[str, set[int]]  # voted good everywhere, never bad / aborted / missing
    held: dict[str, tuple[int, float]] = field(default_factory=dict)


def scenario(
    size: int,
    n: int,
    *,
    seed: int,
    span_s: float = 1.0,
    bad_frac: float = 0.05,
    missing_frac: float = 0.03,
    abort_frac: float = 0.0,
    jitter_s: float = 0.3,
    hold: bool = False,
    streams: tuple[str, ...] = STREAMS,
) -> Scenario:
    """Random votes for ``n`` request ids per stream on ``size`` ranks.

    Id ``i`` arrives at a random time ``a_i`` in ``[0, span_s]``; every rank votes good for it
    at ``a_i + U(0, jitter_s)`` (keep ``jitter_s`` below the vote deadline), except:
    ``bad_frac`` of them one random rank votes bad instead; ``missing_frac`` one random rank
    never votes (deadline); ``abort_frac`` (ids of the first stream) are aborted on a random
    rank at ``a_i + U(-0.1, 1.5 jitter_s)``. With ``hold``, the last rank holds id ``10**6`` of
    the first stream from t=0 until ``span_s / 2``.
    """
    rng = random.Random(seed)
    arrive = [[rng.uniform(0, span_s) for _ in range(n)] for _ in streams]
    acts: dict[int, list[Action]] = {r: [] for r in range(size)}
    expect: dict[str, int] = {}
    bad_voted: dict[str, set[int]] = {}
    missing: dict[str, set[int]] = {}
    clean: dict[str, set[int]] = {}
    aborted: set[int] = set()
    aborted_first: set[int] = set()
    abort_at: dict[int, tuple[int, float]] = {}
    for i in range(n):
        if rng.random() < abort_frac:
            r = rng.randrange(size)
            t = max(0.0, arrive[0][i] + rng.uniform(-0.1, 1.5 * jitter_s))
            abort_at[i] = (r, t)
            aborted.add(i)
            acts[r].append(Action(t, "abort", streams[0], i))
    for si, s in enumerate(streams):
        base = si * 10 * n  # disjoint ids per stream (aborts touch stream 0's ids only)
        bad_voted[s], missing[s], clean[s] = set(), set(), set()
        for i in range(n):
            rid = base + i
            kind = rng.random()
            odd = rng.randrange(size)
            times = {r: arrive[si][i] + rng.uniform(0, jitter_s) for r in range(size)}
            for r in range(size):
                if kind < bad_frac and r == odd:
                    acts[r].append(Action(times[r], "bad", s, rid))
                elif bad_frac <= kind < bad_frac + missing_frac and r == odd:
                    continue
                else:
                    acts[r].append(Action(times[r], "good", s, rid))
            if kind < bad_frac:
                bad_voted[s].add(rid)
            elif kind < bad_frac + missing_frac:
                missing[s].add(rid)
            if si == 0 and i in abort_at:
                r, t = abort_at[i]
                if t < times[r]:
                    aborted_first.add(rid)
            elif kind >= bad_frac + missing_frac:
                clean[s].add(rid)
        expect[s] = n
    held = {}
    if hold:
        s, rid, t_rel = streams[0], 10**6, span_s / 2
        acts[size - 1].append(Action(0.0, "hold", s, rid))
        acts[size - 1].append(Action(t_rel, "release", s, rid))
        for r in range(size):
            acts[r].append(Action(0.05, "good", s, rid))
        expect[s] += 1
        clean[s].add(rid)
        held[s] = (rid, t_rel)
    for r in acts:
        acts[r].sort(key=lambda a: a.t)
    return Scenario(acts, expect, bad_voted, missing, aborted_first, aborted, clean, held)


def sequence_hash(applied: list[Applied]) -> str:
    """Hash of the applied (stream, seq, good, bad) sequence (times excluded)."""
    h = hashlib.sha256()
    for a in applied:
        h.update(msgspec.msgpack.encode((a.stream, a.seq, a.good, a.bad)))
    return h.hexdigest()


def check_agreement(res: dict[int, Result], sc: Scenario) -> dict[str, dict[int, str]]:
    """Assert the invariants every run must satisfy; return per stream ``rid -> outcome``."""
    errors = {r: x.error for r, x in res.items() if x.error}
    assert not errors, f"ranks raised: {errors}"
    hashes = {r: sequence_hash(x.applied) for r, x in res.items()}
    assert len(set(hashes.values())) == 1, f"decision sequences differ across ranks: {hashes}"
    ref = next(iter(res.values())).applied
    outcome: dict[str, dict[int, str]] = {}
    for s, n in sc.expect.items():
        ds = [a for a in ref if a.stream == s]
        assert [a.seq for a in ds] == list(range(len(ds))), f"stream {s}: seqs not gap-free"
        seen: dict[int, str] = {}
        for a in ds:
            for rid, o in [(x, "good") for x in a.good] + [(x, "bad") for x in a.bad]:
                assert rid not in seen, f"stream {s}: rid {rid} decided twice"
                seen[rid] = o
        assert len(seen) == n, f"stream {s}: {len(seen)} ids decided, expected {n}"
        for rid in sc.bad_voted[s]:
            assert seen[rid] == "bad", f"stream {s}: rid {rid} voted bad but decided good"
        for rid in sc.missing[s]:
            assert seen[rid] == "bad", f"stream {s}: rid {rid} missing a vote but decided good"
        for rid in sc.clean[s]:
            if rid not in sc.aborted:
                assert seen[rid] == "good", f"stream {s}: clean rid {rid} decided bad"
        for rid in sc.aborted_first:
            if rid in seen:
                assert seen[rid] == "bad", f"stream {s}: rid {rid} aborted first, decided good"
        outcome[s] = seen
    return outcome
