"""The driver of ``pdplug bench cluster``: pdplug KV processes on the hosts of a
:class:`pdplug.testing.netns.Cluster`, the rooms they move, and what became of each.

A :class:`Deployment` starts, on hosts of one cluster, a rendezvous (host ``rdv``), a prefill
instance of ``pp_size`` ranks (hosts ``p0``, ``p1``, …; one process each) and decode
instances (hosts ``d0``, ``d1``, …; one process each, one receiver per DCP rank); each is a
:mod:`pdplug_bench.cluster_worker` process talking JSON lines over its stdin and stdout. The
driver issues rooms (:meth:`Deployment.issue`: every prefill rank serves it, one decode
instance expects it) sized from the reference host's trace, routes each worker's events into
the room's :class:`Room` record, and applies the scenario's faults to the hosts.

A room is **lost** when it never reaches a terminal state on a side that is still alive, when
it ends ``Success`` with any byte wrong, or when a byte lands in its pages after they were
released (the decode worker checks freed pages still hold poison when it takes them again,
and all of them at :meth:`Deployment.check`).
"""

from __future__ import annotations

import os
import secrets
import select
import subprocess
import sys
import time
from collections import Counter
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import msgspec

from pdplug_bench import cluster_kv as kvm
from pdplug_bench.cluster_wire import (
    Bye,
    Check,
    Checked,
    ConsensusLost,
    Done,
    Drained,
    Error,
    Event,
    Expect,
    Found,
    Geometry,
    Join,
    Landed,
    Quit,
    Ready,
    Resolve,
    Serve,
    Spec,
    Stats,
    StatsOf,
    Timeouts,
    decode_event,
    encode,
)

__all__ = [
    "RDV_PORT",
    "CONSENSUS_PORT",
    "WorkerError",
    "Proc",
    "Room",
    "Deployment",
]

#: the rendezvous port on host ``rdv``; every consensus socket's port on its prefill host
RDV_PORT = 17000
CONSENSUS_PORT = 17100
PREFILL = "prefill-0"


class WorkerError(RuntimeError):
    """A worker failed, exited unexpectedly, or did not answer in time (the message names it
    and ends with the tail of its log)."""


class Proc:
    """One worker process on a host: its stdin (commands), stdout (events) and log file.

    :param host: the :class:`pdplug.testing.netns.Host` it runs on.
    :param spec: what it is.
    :param log: its stderr goes there.
    """

    def __init__(self, host: Any, spec: Spec, name: str, log: Path) -> None:
        self.host, self.spec, self.name, self.log_path = host, spec, name, log
        self._log = open(log, "ab")  # noqa: SIM115 - closed in close()
        env = {
            "PYTHONPATH": os.pathsep.join(p for p in sys.path if p),
            "PYTHONUNBUFFERED": "1",
            "OMP_WAIT_POLICY": os.environ.get("OMP_WAIT_POLICY", "PASSIVE"),
        }
        self.proc = host.popen(
            [sys.executable, "-m", "pdplug_bench.cluster_worker"],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=self._log,
            env=env,
        )
        self.expected_dead = False
        self.gone = False
        self.ready: Ready | None = None
        self.replies: list[Event] = []  # answers to ask(), in order
        self._buf = b""
        self.send(spec)

    @property
    def fd(self) -> int:
        """The event stream's file descriptor."""
        assert self.proc.stdout is not None
        return self.proc.stdout.fileno()

    def send(self, msg: msgspec.Struct) -> None:
        """Write one command (ignored once the process is gone)."""
        if self.gone or self.proc.stdin is None:
            return
        try:
            self.proc.stdin.write(encode(msg))
            self.proc.stdin.flush()
        except (BrokenPipeError, OSError):
            self.gone = True

    def read(self) -> list[Event]:
        """Events available now (call when :attr:`fd` is readable)."""
        chunk = os.read(self.fd, 1 << 20)
        if not chunk:
            self.gone = True
            return []
        self._buf += chunk
        *lines, self._buf = self._buf.split(b"\n")
        return [decode_event(ln) for ln in lines if ln.strip()]

    def tail(self, n: int = 40) -> str:
        """The last ``n`` lines of its log."""
        try:
            lines = self.log_path.read_text(errors="replace").splitlines()
        except OSError:
            return ""
        return "\n".join(lines[-n:])

    def close(self) -> None:
        """Ask it to quit (bounded), then kill it."""
        if not self.gone and self.proc.poll() is None:
            self.send(Quit())
            try:
                self.proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                pass
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(timeout=10)
        for f in (self.proc.stdin, self.proc.stdout):
            if f is not None:
                try:
                    f.close()
                except OSError:
                    pass
        self._log.close()


@dataclass
class Room:
    """One room and what became of it.

    :ivar dest: the decode host it went to; ``t0``: when it was issued (monotonic s).
    :ivar d: the decode's outcome; ``p``: each prefill rank's, by PP rank.
    :ivar d_drained / p_drained: when each side released it.
    :ivar landed: bytes that landed in its pages after release.
    """

    room: int
    tokens: int
    dest: str
    t0: float
    prefill: tuple[str, ...]
    d: Done | None = None
    p: dict[int, Done] = field(default_factory=dict)
    d_drained: float | None = None
    p_drained: dict[int, float] = field(default_factory=dict)
    landed: int = 0

    @property
    def ok(self) -> bool:
        """Success on every side that reported."""
        return (
            self.d is not None
            and self.d.ok
            and len(self.p) == len(self.prefill)
            and all(x.ok for x in self.p.values())
        )

    def reason(self) -> str:
        """The first failure reason (decode's first)."""
        if self.d is not None and not self.d.ok:
            return self.d.reason
        for x in self.p.values():
            if not x.ok:
                return x.reason
        return ""


def classify(reason: str) -> str:
    """A short name for a failure reason (the table's ``failed`` column)."""
    r = reason.lower()
    for key, name in (
        ("consensus", "consensus"),
        ("silent", "silent peer"),
        ("could not connect prefill", "prefill not found"),
        ("not connected", "prefill not found"),
        ("probe", "probe"),
        ("a pp rank voted bad", "voted bad"),
        ("aborted", "aborted"),
        ("out of pages", "out of pages"),
        ("bootstrapping", "bootstrap timeout"),
        ("waitingforinput", "waiting timeout"),
        ("transferring", "transfer timeout"),
        ("not done after", "write timeout"),
        ("failed", "write failed"),
    ):
        if key in r:
            return name
    return reason[:40] or "unknown"


class Deployment:
    """pdplug processes on the hosts of ``cluster`` (see the module docstring).

    :param cluster: an open cluster with hosts ``rdv``, ``p0..p{pp-1}`` and every name in
        ``decodes``.
    :param backend: KV sender name.
    :param decodes: decode hosts (one decode instance each, named ``dec-<host>``).
    :param log_dir: where each worker's log goes.
    """

    def __init__(
        self,
        cluster: Any,
        backend: str,
        *,
        geometry: Geometry,
        timeouts: Timeouts,
        decodes: Sequence[str] = ("d0", "d1"),
        log_dir: Path,
    ) -> None:
        self.cluster, self.backend = cluster, backend
        self.g, self.t = geometry, timeouts
        self.decodes = tuple(decodes)
        self.log_dir = log_dir
        self.key = secrets.token_bytes(32).hex()
        self.rdv = f"tcp://{cluster['rdv'].addr}:{RDV_PORT}"
        self.prefill_hosts = tuple(f"p{k}" for k in range(geometry.pp_size))
        self.consensus = tuple(
            f"tcp://{cluster[h].addr}:{CONSENSUS_PORT}" for h in self.prefill_hosts
        )
        self.procs: dict[str, Proc] = {}  # name -> the current process of that role
        self.rooms: dict[int, Room] = {}
        self.lost_consensus: list[tuple[str, ConsensusLost]] = []
        self.problems: list[str] = []
        self._next_room = 1
        self._starts: Counter[str] = Counter()
        self._bank: dict[str, int] = {}  # host -> rx bytes of earlier incarnations
        self._base: dict[str, Any] = {}

    # ------------------------------------------------------------------ processes
    def _spec(self, role: str, host: str, **kw: Any) -> Spec:
        return Spec(
            role=role,
            backend=self.backend,
            addr=self.cluster[host].addr,
            key=self.key,
            rendezvous=self.rdv,
            geometry=self.g,
            timeouts=self.t,
            **kw,
        )

    def _start(self, name: str, host: str, spec: Spec) -> Proc:
        self._starts[name] += 1
        log = self.log_dir / f"{self.backend}-{name}-{self._starts[name]}.log"
        p = Proc(self.cluster[host], spec, name, log)
        self.procs[name] = p
        return p

    def start_rendezvous(self) -> Proc:
        """Start the rendezvous on host ``rdv`` (its fixed port)."""
        return self._start("rdv", "rdv", self._spec("rendezvous", "rdv", port=RDV_PORT))

    def start_prefill(self) -> list[Proc]:
        """Start every PP rank of the prefill instance (not joined yet)."""
        return [
            self._start(
                h,
                h,
                self._spec("prefill", h, instance=PREFILL, pp_rank=k, consensus=self.consensus),
            )
            for k, h in enumerate(self.prefill_hosts)
        ]

    def start_decode(self, host: str) -> Proc:
        """Start the decode instance of ``host``."""
        spec = self._spec("decode", host, instance=f"dec-{host}", prefill=PREFILL)
        return self._start(host, host, spec)

    def start_intruder(self, host: str) -> Proc:
        """Start the intruder worker on ``host`` (no key)."""
        spec = msgspec.structs.replace(self._spec("intruder", host), key="")
        return self._start(host, host, spec)

    def wait_ready(self, procs: Iterable[Proc], timeout: float = 180.0) -> None:
        """Pump events until every proc in ``procs`` said :class:`Ready`.

        :raises WorkerError: one failed or did not get ready in time.
        """
        want = list(procs)
        end = time.monotonic() + timeout
        while not all(p.ready for p in want):
            if time.monotonic() > end:
                slow = [p.name for p in want if not p.ready]
                raise WorkerError(f"{slow} not ready after {timeout:g} s\n{self._tails(slow)}")
            self.pump(0.1)

    def join(self, procs: Iterable[Proc]) -> None:
        """Start the consensus of every prefill proc in ``procs`` (all at once)."""
        for p in procs:
            p.send(Join())

    def start(self) -> Deployment:
        """Start everything and wait until it is ready; returns ``self``."""
        for name in ("rdv", *self.prefill_hosts, *self.decodes):
            self._bank.setdefault(name, 0)
        self.meter_start()
        rdv = self.start_rendezvous()
        pre = self.start_prefill()
        dec = [self.start_decode(h) for h in self.decodes]
        self.wait_ready([rdv, *pre, *dec])
        self.join(pre)
        return self

    def close(self) -> None:
        """Stop every worker (quit, then kill)."""
        for p in self.procs.values():
            p.close()

    def _tails(self, names: Iterable[str]) -> str:
        return "\n".join(f"--- {n} log:\n{self.procs[n].tail()}" for n in names if n in self.procs)

    # ------------------------------------------------------------------ events
    def pump(self, timeout: float) -> None:
        """Read and route whatever events arrive within ``timeout`` seconds.

        :raises WorkerError: a worker reported an error, or exited while it should live.
        """
        live = {p.fd: p for p in self.procs.values() if not p.gone}
        if not live:
            time.sleep(timeout)
            return
        ready, _, _ = select.select(list(live), [], [], timeout)
        for fd in ready:
            p = live[fd]
            for ev in p.read():
                self._route(p, ev)
            if p.gone and not p.expected_dead:
                rc = p.proc.wait(timeout=10)
                raise WorkerError(f"{p.name} exited ({rc}) unexpectedly\n{self._tails([p.name])}")

    def _route(self, p: Proc, ev: Event) -> None:
        if isinstance(ev, Error):
            raise WorkerError(f"{p.name} failed:\n{ev.trace}")
        if isinstance(ev, Ready):
            p.ready = ev
            return
        if isinstance(ev, ConsensusLost):
            self.lost_consensus.append((p.name, ev))
            return
        if isinstance(ev, Bye):
            p.expected_dead = True
            return
        if isinstance(ev, (Done, Drained, Landed)):
            room = self.rooms.get(ev.room)
            if room is None:
                if isinstance(ev, Landed):  # a page of a room from before this driver
                    self.problems.append(f"{ev.nbytes} bytes landed in a freed page on {p.name}")
                return
            decode = p.spec.role == "decode"
            if isinstance(ev, Done):
                if decode:
                    room.d = ev
                else:
                    room.p[p.spec.pp_rank] = ev
            elif isinstance(ev, Drained):
                if decode:
                    room.d_drained = ev.t
                else:
                    room.p_drained[p.spec.pp_rank] = ev.t
            else:
                room.landed += ev.nbytes
            return
        p.replies.append(ev)

    def ask(self, name: str, cmd: msgspec.Struct, kind: type, timeout: float = 30.0) -> Any:
        """Send ``cmd`` to worker ``name`` and return its first reply of type ``kind``.

        :raises WorkerError: no such reply within ``timeout`` seconds.
        """
        p = self.procs[name]
        p.replies = [r for r in p.replies if not isinstance(r, kind)]
        p.send(cmd)
        end = time.monotonic() + timeout
        while time.monotonic() < end:
            for i, r in enumerate(p.replies):
                if isinstance(r, kind):
                    return p.replies.pop(i)
            self.pump(0.05)
        raise WorkerError(f"{name}: no {kind.__name__} within {timeout:g} s\n{self._tails([name])}")

    def stats(self, name: str) -> dict[str, dict[str, Any]]:
        """Counters of worker ``name``'s components."""
        got: StatsOf = self.ask(name, Stats(), StatsOf)
        return got.stats

    def resolve(self, via: str, instance: str = PREFILL, timeout_s: float = 5.0) -> Found:
        """What the rendezvous answers decode worker ``via`` for ``instance`` now."""
        got: Found = self.ask(
            via, Resolve(instance=instance, timeout_s=timeout_s), Found, timeout=timeout_s + 10
        )
        return got

    # ------------------------------------------------------------------ rooms
    def live_prefill(self) -> list[Proc]:
        """The prefill procs that are running."""
        return [self.procs[h] for h in self.prefill_hosts if not self.procs[h].expected_dead]

    def issue(self, dest: str, tokens: int, pace_s: float = 0.0) -> Room:
        """A new room of ``tokens`` prompt tokens to decode host ``dest``: every running
        prefill rank serves it (one segment every ``pace_s`` seconds), ``dest``'s decode
        expects it."""
        room = Room(
            room=self._next_room,
            tokens=tokens,
            dest=dest,
            t0=time.monotonic(),
            prefill=tuple(p.name for p in self.live_prefill()),
        )
        self._next_room += 1
        self.rooms[room.room] = room
        for p in self.live_prefill():
            p.send(Serve(room=room.room, tokens=tokens, pace_s=pace_s))
        self.procs[dest].send(Expect(room=room.room, tokens=tokens))
        return room

    def ended(self, room: Room) -> bool:
        """Terminal on every side whose process still runs (or ran to the end)."""
        d_alive = not self.procs[room.dest].expected_dead
        if d_alive and room.d is None:
            return False
        for k, name in enumerate(self.prefill_hosts):
            if name in room.prefill and k not in room.p and self._alive_for(name, room):
                return False
        return True

    def _alive_for(self, name: str, room: Room) -> bool:
        """Whether the process of ``name`` that served ``room`` still runs (a restarted rank's
        new process never heard of it)."""
        p = self.procs[name]
        return not p.expected_dead and (p.ready is not None and p.ready.t <= room.t0)

    def released(self, room: Room) -> bool:
        """Released on every side still alive."""
        if not self.procs[room.dest].expected_dead and room.d_drained is None:
            return False
        return all(
            k in room.p_drained or not self._alive_for(name, room)
            for k, name in enumerate(self.prefill_hosts)
            if name in room.prefill
        )

    def holding(self, room: Room) -> list[str]:
        """The live workers that have not released ``room``."""
        out = [] if self.procs[room.dest].expected_dead or room.d_drained else [room.dest]
        return out + [
            name
            for k, name in enumerate(self.prefill_hosts)
            if name in room.prefill and k not in room.p_drained and self._alive_for(name, room)
        ]

    def in_flight(self) -> list[Room]:
        """Rooms not yet ended."""
        return [r for r in self.rooms.values() if not self.ended(r)]

    def settle(self, timeout: float, *, drained: bool = True) -> bool:
        """Pump until every room ended (and, with ``drained``, was released) or ``timeout``
        seconds passed; True when it did."""
        end = time.monotonic() + timeout
        while time.monotonic() < end:
            rooms = self.rooms.values()
            if all(self.ended(r) and (not drained or self.released(r)) for r in rooms):
                return True
            self.pump(0.05)
        return False

    def check(self) -> dict[str, Checked]:
        """Every live decode checks its free pages; bytes found are added to their rooms."""
        out = {}
        for h in self.decodes:
            if self.procs[h].expected_dead:
                continue
            got: Checked = self.ask(h, Check(), Checked)
            for room, nbytes in got.changed:
                if room in self.rooms:
                    self.rooms[room].landed += nbytes
                else:
                    self.problems.append(f"{nbytes} bytes landed in a freed page on {h}")
            out[h] = got
        return out

    # ------------------------------------------------------------------ hosts
    def meter_start(self) -> None:
        """Take the decode hosts' link counters as the zero of :meth:`rx_bytes`."""
        for h in self.decodes:
            self._bank[h] = 0
            self._base[h] = self.cluster[h].counters()

    def rx_bytes(self) -> int:
        """Bytes the decode hosts' links received since :meth:`meter_start` (over every
        incarnation of a revived host)."""
        total = 0
        for h in self.decodes:
            total += self._bank[h] + (self.cluster[h].counters() - self._base[h]).rx_bytes
        return total

    def kill(self, host: str) -> float:
        """Host death (:meth:`pdplug.testing.netns.Host.kill`); returns when (monotonic)."""
        for p in self.procs.values():
            if p.host.name == host:
                p.expected_dead = True
        t = time.monotonic()
        self.cluster[host].kill()
        return t

    def revive(self, host: str) -> None:
        """Reboot a dead host (its link counters start again from zero)."""
        h = self.cluster[host]
        if host in self._base:
            self._bank[host] += (h.counters() - self._base[host]).rx_bytes
        h.revive()
        if host in self._base:
            self._base[host] = h.counters()

    def stop(self, name: str) -> None:
        """Stop worker ``name`` cleanly (its sockets close: peers see the end)."""
        p = self.procs[name]
        p.expected_dead = True
        p.close()


def run_for(
    dep: Deployment,
    seconds: float,
    *,
    dests: Sequence[str],
    prompts: Callable[[], int],
    rate: float,
    concurrency: int,
    until: Callable[[], bool] | None = None,
    pace: Mapping[str, float] | None = None,
) -> None:
    """Issue rooms for ``seconds`` (or until ``until()``): one every ``1 / rate`` s to the
    next of ``dests`` in turn, at most ``concurrency`` in flight per destination; rooms to
    a destination in ``pace`` send one segment every ``pace[dest]`` seconds."""
    end = time.monotonic() + seconds
    gap = 1.0 / rate
    nxt = time.monotonic()
    turn = 0
    while time.monotonic() < end and not (until and until()):
        now = time.monotonic()
        if now >= nxt and dests:
            dest = dests[turn % len(dests)]
            busy = sum(1 for r in dep.rooms.values() if r.dest == dest and not dep.ended(r))
            if busy < concurrency:
                dep.issue(dest, prompts(), (pace or {}).get(dest, 0.0))
                turn += 1
            nxt = now + gap
        dep.pump(max(0.0, min(nxt, end) - time.monotonic()))


def prompt_cycle(n: int = 64, scale: int | None = None) -> Callable[[], int]:
    """A function returning the trace's prompt lengths in turn (cycled)."""
    lens = kvm.demo_prompts(n, scale)
    state = {"i": 0}

    def nxt() -> int:
        i = state["i"]
        state["i"] = i + 1
        return lens[i % len(lens)]

    return nxt
