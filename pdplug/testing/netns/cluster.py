"""A cluster on one machine: hosts as network namespaces on one switch, and the faults of a
data-centre network applied to them (issue 23).

Topology of ``Cluster(["prefill", "decode"])``::

    switch namespace  {run}            bridge br0, ports p0 p1 (nftables: loss, partitions)
      p0 <-veth-> eth0  in {run}-prefill   10.213.0.1/24  (tbf on eth0: what it sends)
      p1 <-veth-> eth0  in {run}-decode    10.213.0.2/24  (tbf on p1: what it receives)

The root namespace gets nothing: each veth is created inside the switch namespace with its
peer end moved straight into the host's namespace, so no address, route or link of the
machine changes and concurrent runs (each with its own switch) may use the same subnet.
"""

from __future__ import annotations

import ipaddress
import json
import math
import os
import re
import subprocess
import sys
import threading
import time
import warnings
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, fields
from types import TracebackType
from typing import Any

from pdplug.testing.netns.cleanup import RunId, new_run_id, sweep, track, untrack
from pdplug.testing.netns.cmd import (
    NetnsError,
    delete_namespaces,
    ip_batch,
    kill_ns_processes,
    list_namespaces,
    nft_apply,
    ns_pids,
    run_cmd,
)
from pdplug.testing.netns.faults import (
    check_burst_bytes,
    check_direction,
    check_latency_ms,
    check_rate_mbit,
    default_burst_bytes,
    loss_threshold,
    switch_ruleset,
    tbf_argv,
)

__all__ = [
    "DEV",
    "BRIDGE",
    "DEFAULT_LATENCY_MS",
    "HOST_RE",
    "LinkCounters",
    "Undo",
    "Starvation",
    "Host",
    "Cluster",
]

#: the device of a host inside its namespace (the host end of its veth)
DEV = "eth0"
#: the bridge inside the switch namespace
BRIDGE = "br0"
#: default for :meth:`Host.limit`'s ``latency_ms``: the most a packet waits in the bucket, ms
DEFAULT_LATENCY_MS = 50.0
#: a host name: 1-32 letters, digits, ``_``, ``.``, ``-``, starting with a letter or digit
HOST_RE = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]{0,31}")
_START_S = 10.0  # seconds a busy loop may take to start spinning


@dataclass(frozen=True)
class LinkCounters:
    """Byte and packet counters of a host's device (``ip -s -j link``, the kernel's 64-bit
    ``stats64``), seen from the host: ``rx`` is what reached it over its link, ``tx`` what
    it sent. Bytes are whole Ethernet frames (headers included), so a TCP payload of N bytes
    moves more than N. Subtract two readings for what moved in between."""

    rx_bytes: int
    rx_packets: int
    tx_bytes: int
    tx_packets: int
    rx_dropped: int
    tx_dropped: int

    def __sub__(self, other: LinkCounters) -> LinkCounters:
        return LinkCounters(*(getattr(self, f.name) - getattr(other, f.name) for f in fields(self)))


@dataclass
class _Faults:
    """What is currently applied to one host (so a revived host gets its faults back)."""

    limit_in: tuple[float, float, int] | None = None  # (rate_mbit, latency_ms, burst_bytes)
    limit_out: tuple[float, float, int] | None = None
    loss: tuple[int, int] = (0, 0)  # (in, out) thresholds out of LOSS_STEPS
    dead: bool = False


class Undo:
    """Handle a fault returns: ``undo()`` (or leaving a ``with`` on it) removes that kind of
    fault from the host or cluster, whatever was set since. Undoing on a closed cluster, or
    twice, does nothing."""

    def __init__(self, fn: Callable[[], None], what: str) -> None:
        self._fn: Callable[[], None] | None = fn
        self._what = what

    def undo(self) -> None:
        """Remove the fault (once)."""
        fn, self._fn = self._fn, None
        if fn is not None:
            fn()

    def __enter__(self) -> Undo:
        return self

    def __exit__(self, *exc: object) -> None:
        self.undo()

    def __repr__(self) -> str:
        return f"Undo({self._what}{', done' if self._fn is None else ''})"


class Starvation:
    """Busy-looping processes saturating a host's cores (:meth:`Host.starve`).

    :ivar procs: the loops, one per core, each pinned to its core inside the host's namespace.
    """

    def __init__(self, host: Host, procs: list[subprocess.Popen[bytes]]) -> None:
        self.host = host
        self.procs = tuple(procs)

    @property
    def pids(self) -> list[int]:
        """Pids of the loops."""
        return [p.pid for p in self.procs]

    @property
    def running(self) -> bool:
        """Whether any loop is still spinning."""
        return any(p.poll() is None for p in self.procs)

    def stop(self) -> None:
        """SIGKILL the loops and reap them (idempotent)."""
        for p in self.procs:
            if p.poll() is None:
                p.kill()
        for p in self.procs:
            try:
                p.wait(timeout=5)
            except subprocess.TimeoutExpired:  # pragma: no cover - a kernel stuck in D state
                pass
            if p.stdout is not None:
                p.stdout.close()

    def __enter__(self) -> Starvation:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()


def _busy_loop(seconds: float | None) -> str:
    # one byte on stdout once spinning, so starve() returns with the cores already taken
    spin = "while True: pass" if seconds is None else "while time.monotonic() < end: pass"
    return (
        "import sys, time\n"
        f"end = time.monotonic() + {seconds or 0!r}\n"
        "sys.stdout.write('1'); sys.stdout.flush()\n"
        f"{spin}\n"
    )


class Host:
    """One host of a :class:`Cluster`: a network namespace with one link to the switch.

    Made by the cluster, never directly. Attributes:

    :ivar name: the host's name in the cluster.
    :ivar ns: its network namespace (``ip netns exec NS ...`` runs a command there).
    :ivar addr: its IPv4 address on the link (exists only inside its namespace).
    :ivar prefixlen: the subnet's prefix length (``addr/prefixlen`` is on ``dev``).
    :ivar dev: its device inside the namespace (``eth0``).
    :ivar switch_dev: its port on the switch (the other end of the veth, in the switch namespace).
    :ivar mac: the MAC address of ``dev`` (kept across :meth:`revive`, as a rebooted host keeps
        its NIC's).
    :ivar cpus: the cores its processes are pinned to by default (and :meth:`starve` takes).
    """

    def __init__(
        self,
        cluster: Cluster,
        index: int,
        name: str,
        addr: str,
        prefixlen: int,
        cpus: frozenset[int],
    ) -> None:
        self.cluster = cluster
        self.index = index
        self.name = name
        self.ns = cluster.run_id.host_ns(name)
        self.addr = addr
        self.prefixlen = prefixlen
        self.dev = DEV
        self.switch_dev = f"p{index}"
        self.mac = f"02:70:64:00:{index >> 8:02x}:{index & 0xFF:02x}"
        self.cpus = cpus
        self._faults = _Faults()
        self._procs: list[subprocess.Popen[Any]] = []

    def __repr__(self) -> str:
        state = " dead" if self._faults.dead else ""
        return f"Host({self.name!r}, ns={self.ns!r}, addr={self.addr!r}{state})"

    # ------------------------------------------------------------------ processes

    @property
    def alive(self) -> bool:
        """False after :meth:`kill` until :meth:`revive`."""
        return not self._faults.dead

    def env(self) -> dict[str, str]:
        """Environment variables a pdplug process on this host needs: UCX restricted to TCP
        (and ``self``) over this host's device, so NIXL moves KV bytes over the veth (where the
        faults act and the counters count) instead of shared memory or CMA, which cross
        namespaces untouched. :meth:`popen` and :meth:`run` add them by themselves."""
        return {"UCX_TLS": "tcp,self", "UCX_NET_DEVICES": self.dev}

    def _argv(self, argv: Sequence[str], cpus: Iterable[int] | None) -> list[str]:
        if isinstance(argv, str):
            raise ValueError(f"argv={argv!r}: expected a sequence of arguments, not one string")
        use = self.cpus if cpus is None else self.cluster._check_cpus(f"cpus of {self.name}", cpus)
        self.cluster._check_open()
        if self._faults.dead:
            raise NetnsError(f"host {self.name!r} is dead (kill()); revive() it first")
        cmd = ["ip", "netns", "exec", self.ns]
        if use != self.cluster.all_cpus:
            cmd += ["taskset", "-c", ",".join(map(str, sorted(use)))]
        return [*cmd, *argv]

    def _env(self, env: Mapping[str, str] | None) -> dict[str, str]:
        return {**os.environ, **self.env(), **(env or {})}

    def popen(
        self,
        argv: Sequence[str],
        *,
        cpus: Iterable[int] | None = None,
        env: Mapping[str, str] | None = None,
        **kw: Any,
    ) -> subprocess.Popen[Any]:
        """Start a process on this host (``ip netns exec``, which execs it: ``.pid`` is the
        process itself). The cluster kills it, and reaps it, at close and at :meth:`kill`.

        :param argv: the command.
        :param cpus: cores to pin it to (default :attr:`cpus`; no pinning when those are all
            the machine's).
        :param env: variables added to ``os.environ`` and :meth:`env` (unlike
            :class:`subprocess.Popen`, it never replaces the environment).
        :param kw: passed to :class:`subprocess.Popen` (``stdout=``, ``text=`` ...).
        :raises NetnsError: the host is dead or the cluster is not open.
        :raises ValueError: a bad ``cpus`` or a string ``argv``.
        """
        cmd = self._argv(argv, cpus)
        with self.cluster._lock:
            proc = subprocess.Popen(cmd, env=self._env(env), **kw)
            self._procs.append(proc)
        return proc

    def run(
        self,
        argv: Sequence[str],
        *,
        cpus: Iterable[int] | None = None,
        env: Mapping[str, str] | None = None,
        timeout: float = 60.0,
        **kw: Any,
    ) -> subprocess.CompletedProcess[Any]:
        """Run a command on this host to completion (:func:`subprocess.run` inside the
        namespace), killed after ``timeout`` seconds.

        :param argv: the command; ``cpus``, ``env``: as :meth:`popen`.
        :param timeout: seconds (:class:`subprocess.TimeoutExpired` after it).
        :param kw: passed to :func:`subprocess.run` (``capture_output=``, ``check=`` ...).
        :raises NetnsError: the host is dead or the cluster is not open.
        """
        return subprocess.run(self._argv(argv, cpus), env=self._env(env), timeout=timeout, **kw)

    def pids(self) -> list[int]:
        """Every process now inside this host's namespace (``ip netns pids``), ascending."""
        return ns_pids(self.ns)

    def counters(self) -> LinkCounters:
        """The counters of :attr:`dev` now (bytes, packets; see :class:`LinkCounters`).

        :raises NetnsError: ``ip`` failed (the cluster is closed).
        """
        out = run_cmd(["ip", "-n", self.ns, "-s", "-j", "link", "show", "dev", self.dev])
        stats = json.loads(out)[0]["stats64"]
        rx, tx = stats["rx"], stats["tx"]
        return LinkCounters(
            rx["bytes"], rx["packets"], tx["bytes"], tx["packets"], rx["dropped"], tx["dropped"]
        )

    def _reap(self) -> None:
        """Kill (by pid) and reap every process this host started that is still running: one
        caught between ``fork`` and entering the namespace escapes :func:`kill_ns_processes`."""
        with self.cluster._lock:
            procs, self._procs = self._procs, []
        for p in procs:
            if p.poll() is None:
                p.kill()
            try:
                p.wait(timeout=5)
            except subprocess.TimeoutExpired:  # pragma: no cover - stuck in the kernel
                warnings.warn(
                    f"pid {p.pid} on {self.name} did not exit after SIGKILL", stacklevel=2
                )

    # ------------------------------------------------------------------ faults

    def limit(
        self,
        rate_mbit: float,
        *,
        latency_ms: float = DEFAULT_LATENCY_MS,
        burst_bytes: int | None = None,
        direction: str = "both",
    ) -> Undo:
        """Cap this host's link with a token bucket (``tc-tbf``): on :attr:`dev`'s egress for
        what it sends (``out``) and on :attr:`switch_dev`'s egress for what it receives
        (``in``). Replaces an earlier limit in the same direction.

        A saturated link queues packets: each waits up to ``latency_ms`` and a packet that
        would wait longer is dropped. An idle link adds no delay (there is no netem here,
        so no fixed latency), and one TCP flow seldom fills the queue (the receiver's window
        autotuning keeps it short); traffic above the rate keeps it full, and every packet
        through it then waits about ``latency_ms``.

        :param rate_mbit: rate, Mbit/s (10**6 bit/s).
        :param latency_ms: the most a packet waits in the bucket's queue, ms.
        :param burst_bytes: bucket size, bytes (default :func:`~.faults.default_burst_bytes`:
            1 ms at the rate, at least two frames).
        :param direction: ``both``, ``in`` or ``out``.
        :returns: a handle whose ``undo()`` is :meth:`unlimit` in ``direction``.
        :raises ValueError: ``rate_mbit <= 0``, a bad ``latency_ms``, ``burst_bytes`` or
            ``direction`` (the message names it).
        :raises NetnsError: ``tc`` failed.
        """
        rate = check_rate_mbit(rate_mbit)
        latency = check_latency_ms(latency_ms)
        burst = default_burst_bytes(rate) if burst_bytes is None else check_burst_bytes(burst_bytes)
        check_direction(direction)
        with self.cluster._lock:
            self.cluster._check_open()
            if direction in ("both", "out"):
                self._faults.limit_out = (rate, latency, burst)
            if direction in ("both", "in"):
                self._faults.limit_in = (rate, latency, burst)
            self._apply_limits(direction)
        return Undo(lambda: self.unlimit(direction=direction), f"{self.name}.limit")

    def unlimit(self, *, direction: str = "both") -> None:
        """Remove :meth:`limit`'s bucket in ``direction`` (nothing when there is none).

        :raises ValueError: a bad ``direction``.
        """
        check_direction(direction)
        with self.cluster._lock:
            if not self.cluster.is_open:
                return
            if direction in ("both", "out"):
                self._faults.limit_out = None
            if direction in ("both", "in"):
                self._faults.limit_in = None
            self._apply_limits(direction)

    def _apply_limits(self, direction: str = "both") -> None:
        sides = [("out", self.ns, self.dev, self._faults.limit_out)]
        sides.append(("in", self.cluster.switch_ns, self.switch_dev, self._faults.limit_in))
        for side, ns, dev, lim in sides:
            if direction not in ("both", side):
                continue
            if lim is not None:
                rate, latency, burst = lim
                run_cmd(tbf_argv(ns, dev, rate_mbit=rate, latency_ms=latency, burst_bytes=burst))
            else:
                qdisc = json.loads(run_cmd(["tc", "-n", ns, "-j", "qdisc", "show", "dev", dev]))
                if any(q.get("kind") == "tbf" and q.get("root") for q in qdisc):
                    run_cmd(["tc", "-n", ns, "qdisc", "del", "dev", dev, "root"])

    def loss(self, percent: float, *, direction: str = "both") -> Undo:
        """Drop ``percent`` % of the frames on this host's link, at random, in the switch
        (nftables ``numgen random``, each frame drawn on its own): frames it receives
        (``in``), sends (``out``) or both. ``loss(0)`` removes it; an earlier value in the
        same direction is replaced. With GSO on (``Cluster(gso=True)``, the default) one TCP
        "frame" may be a super-packet of up to 64 KiB: use ``gso=False`` for per-wire-frame
        loss.

        :param percent: 0-100, in steps of 0.01.
        :param direction: ``both``, ``in`` or ``out``.
        :returns: a handle whose ``undo()`` is ``loss(0, direction=direction)``.
        :raises ValueError: ``percent`` outside 0-100 or a bad ``direction``.
        """
        n = loss_threshold(percent)
        check_direction(direction)
        with self.cluster._lock:
            self.cluster._check_open()
            n_in, n_out = self._faults.loss
            if direction in ("both", "in"):
                n_in = n
            if direction in ("both", "out"):
                n_out = n
            self._faults.loss = (n_in, n_out)
            self.cluster._apply_switch()
        return Undo(lambda: self._unloss(direction), f"{self.name}.loss")

    def _unloss(self, direction: str) -> None:
        if self.cluster.is_open:
            self.loss(0, direction=direction)

    def partition(self, *, direction: str = "both") -> Undo:
        """Cut this host off from every other host: the switch drops its frames (nftables,
        see :mod:`~pdplug.testing.netns.faults`), its link stays up, its stack sees nothing
        (no carrier change, no route change, no error on ``send``), as when a switch or
        cable beyond the NIC fails. TCP connections survive a partition shorter than their
        retransmission give-up (minutes) and resume after :meth:`heal`; a new ``connect``
        times out, or fails with EHOSTUNREACH once ARP gives up (about 3 s).

        :param direction: ``both``; ``out``: what it sends is dropped, what it receives
            arrives; ``in``: the reverse.
        :returns: a handle whose ``undo()`` is :meth:`heal`.
        :raises ValueError: a bad ``direction``.
        """
        check_direction(direction)
        others = [h.name for h in self.cluster.hosts if h is not self]
        pairs: set[tuple[str, str]] = set()
        if direction in ("both", "out"):
            pairs |= {(self.name, o) for o in others}
        if direction in ("both", "in"):
            pairs |= {(o, self.name) for o in others}
        with self.cluster._lock:
            self.cluster._check_open()
            self.cluster._blocked |= pairs
            self.cluster._apply_switch()
        return Undo(self.heal, f"{self.name}.partition")

    def heal(self) -> None:
        """Lift every partition involving this host (from :meth:`partition` or
        :meth:`Cluster.partition`). A dead host stays cut: see :meth:`revive`."""
        with self.cluster._lock:
            if not self.cluster.is_open:
                return
            self.cluster._blocked = {p for p in self.cluster._blocked if self.name not in p}
            self.cluster._apply_switch()

    def clear(self) -> None:
        """Remove this host's bucket, loss and partitions (death stays: see :meth:`revive`)."""
        self.unlimit()
        self._unloss("both")
        self.heal()

    def starve(self, seconds: float | None = None, *, procs: int | None = None) -> Starvation:
        """Saturate this host's cores, as an engine's OpenMP threads do: ``procs`` busy loops
        (default one per core of :attr:`cpus`), each pinned to one of those cores, inside the
        namespace (so :meth:`kill` and the cluster's close take them too). Returns once every
        loop is spinning.

        :param seconds: each loop exits by itself after this many seconds (also when the
            harness is gone); ``None``: until :meth:`Starvation.stop`.
        :param procs: number of loops (cores reused round-robin when more than the cores).
        :returns: the loops; ``stop()`` or leaving a ``with`` on it ends them.
        :raises ValueError: ``seconds <= 0`` or ``procs < 1``.
        :raises NetnsError: the host is dead, or a loop did not start within 10 s.
        """
        if seconds is not None:
            s = float(seconds) if isinstance(seconds, int | float) else math.nan
            if isinstance(seconds, bool) or not (math.isfinite(s) and s > 0):
                raise ValueError(f"seconds={seconds!r}: expected a finite number > 0 or None")
        cores = sorted(self.cpus)
        n = len(cores) if procs is None else procs
        if isinstance(n, bool) or not isinstance(n, int) or n < 1:
            raise ValueError(f"procs={procs!r}: expected an integer >= 1 or None")
        loops: list[subprocess.Popen[bytes]] = []
        try:
            for i in range(n):
                loops.append(
                    self.popen(
                        [sys.executable, "-c", _busy_loop(seconds)],
                        cpus=[cores[i % len(cores)]],
                        stdout=subprocess.PIPE,
                        stdin=subprocess.DEVNULL,
                    )
                )
            end = time.monotonic() + _START_S
            for p in loops:
                assert p.stdout is not None
                if not _read_ready(p.stdout, end):
                    raise NetnsError(f"host {self.name}: busy loop pid {p.pid} did not start")
        except BaseException:
            Starvation(self, loops).stop()
            raise
        return Starvation(self, loops)

    def kill(self) -> int:
        """Host death: cut its link at the switch first (so no FIN or RST its kernel sends as
        the sockets close can reach a peer), then SIGKILL every process of its namespace
        until none is left. Peers see silence, as from a host that lost power: their
        ``recv`` times out, it never returns EOF.

        The host stays dead-but-present: its namespace exists, nothing runs in it, its link
        stays cut (:meth:`heal` does not lift it) until :meth:`revive`.

        :returns: how many processes were killed.
        :raises NetnsError: a process survived SIGKILL for 5 s.
        """
        with self.cluster._lock:
            self.cluster._check_open()
            self._faults.dead = True
            self.cluster._apply_switch()
        n = kill_ns_processes(self.ns)
        self._reap()
        return n

    def revive(self) -> None:
        """Bring a dead host back as a rebooted machine: a fresh namespace of the same name
        (no socket, no TCP state of the old one survives: a peer's old connection gets an
        RST), the same address and MAC, its bucket re-applied, its link restored (loss and
        partitions still apply). New processes may then start at the same address, as in a
        rolling restart. Nothing happens to a live host.

        :raises NetnsError: the cluster is not open, or a command failed.
        """
        with self.cluster._lock:
            self.cluster._check_open()
            if not self._faults.dead:
                return
            kill_ns_processes(self.ns)
            self._reap()
            # deleting one end takes the pair with it at once (a deleted namespace's devices
            # go asynchronously, and the new pair reuses the names)
            ip_batch([f"link del {self.switch_dev}"], ns=self.cluster.switch_ns)
            delete_namespaces([self.ns])
            ip_batch([f"netns add {self.ns}"])
            _quiet(self.ns)
            self.cluster._wire(self)
            self._faults.dead = False
            self.cluster._apply_switch()


def _quiet(ns: str) -> None:
    """No IPv6 in a fresh namespace: its devices would otherwise send MLD and router
    solicitations of their own, traffic no test made, into the counters."""
    script = (
        "for f in /proc/sys/net/ipv6/conf/default/disable_ipv6 "
        "/proc/sys/net/ipv6/conf/all/disable_ipv6; do [ -e $f ] && echo 1 > $f; done; true"
    )
    run_cmd(["ip", "netns", "exec", ns, "sh", "-c", script])


def _read_ready(stream: Any, end: float) -> bool:
    import select

    while (left := end - time.monotonic()) > 0:
        r, _, _ = select.select([stream], [], [], left)
        if r:
            return stream.read(1) == b"1"
    return False


class Cluster:
    """N hosts as network namespaces joined by veth pairs on one bridge, for tests and
    benchmarks of pdplug across machines on one machine. Needs root (see
    :func:`~pdplug.testing.netns.netns_available`).

    Use as a context manager (or :meth:`start` / :meth:`close`)::

        with Cluster(["prefill", "decode"]) as c:
            d = c["decode"]
            srv = d.popen([sys.executable, "-m", "my.server", "--host", d.addr])
            d.limit(200, latency_ms=20)  # 200 Mbit/s bucket both ways
            c["prefill"].partition()     # ... and c.heal()

    Everything it makes (namespaces, veths, the bridge, nftables tables, qdiscs, the
    processes started on its hosts) lives inside its own namespaces and is removed on
    :meth:`close`: on leaving the ``with`` (also by an exception), on SIGINT/SIGTERM, at
    interpreter exit. After a SIGKILL the next cluster with the same ``prefix`` sweeps it.

    :param hosts: host names (:data:`HOST_RE`), unique; host ``i`` gets the ``i+1``-th
        address of ``subnet``.
    :param subnet: an IPv4 network with room for every host.
    :param prefix: first field of every namespace name (:data:`~.cleanup.PREFIX_RE`); a
        cluster sweeps dead runs of its own prefix only.
    :param cpus: ``host name -> cores`` its processes are pinned to and :meth:`Host.starve`
        saturates (default: every core this process may use, no pinning).
    :param gso: keep the kernel's segmentation offload on the veths (default). ``False``
        makes every skb one wire frame (``gso_max_segs 1``): loss and packet counters are
        then per frame as on a real NIC, at a far higher CPU cost per byte.
    :param sweep: run :func:`~.cleanup.sweep` for ``prefix`` before building.
    :raises ValueError: a bad host name, a duplicate, a bad subnet or one too small, a bad
        prefix, or ``cpus`` naming an unknown host or core (the message names the field).
    """

    def __init__(
        self,
        hosts: Sequence[str],
        *,
        subnet: str = "10.213.0.0/24",
        prefix: str = "pdp",
        cpus: Mapping[str, Iterable[int]] | None = None,
        gso: bool = True,
        sweep: bool = True,
    ) -> None:
        if isinstance(hosts, str) or not isinstance(hosts, Sequence):
            raise ValueError(f"hosts={hosts!r}: expected a sequence of host names")
        names = list(hosts)
        if not names:
            raise ValueError("hosts=[]: a cluster needs at least one host")
        for name in names:
            if not isinstance(name, str) or not HOST_RE.fullmatch(name):
                raise ValueError(
                    f"host name {name!r}: expected 1-32 letters, digits, '_', '.' or '-', "
                    "starting with a letter or digit"
                )
        dup = sorted({n for n in names if names.count(n) > 1})
        if dup:
            raise ValueError(f"hosts={names!r}: duplicate host names {dup}")
        try:
            net = ipaddress.IPv4Network(subnet)
        except (ValueError, TypeError) as e:
            raise ValueError(f"subnet={subnet!r}: not an IPv4 network ({e})") from e
        if net.num_addresses - 2 < len(names):
            raise ValueError(
                f"subnet={subnet!r}: room for {max(0, net.num_addresses - 2)} hosts, "
                f"{len(names)} given"
            )
        self.run_id: RunId = new_run_id(prefix)
        self.prefix = prefix
        self.subnet = net
        self.gso = bool(gso)
        self.all_cpus = frozenset(os.sched_getaffinity(0))
        self._sweep = sweep
        cpu_map = dict(cpus or {})
        unknown = sorted(set(cpu_map) - set(names))
        if unknown:
            raise ValueError(f"cpus names unknown hosts {unknown}; hosts: {', '.join(names)}")
        addrs = list(net.hosts())
        self.hosts: tuple[Host, ...] = tuple(
            Host(
                self,
                i,
                name,
                str(addrs[i]),
                net.prefixlen,
                self._check_cpus(f"cpus[{name!r}]", cpu_map[name])
                if name in cpu_map
                else self.all_cpus,
            )
            for i, name in enumerate(names)
        )
        self._by_name = {h.name: h for h in self.hosts}
        self._blocked: set[tuple[str, str]] = set()
        self._lock = threading.RLock()
        self._state = "new"

    # ------------------------------------------------------------------ access

    @property
    def switch_ns(self) -> str:
        """The switch's namespace (the bridge and every host's port live there)."""
        return str(self.run_id)

    @property
    def namespaces(self) -> list[str]:
        """Every namespace this cluster makes: the switch, then one per host."""
        return [self.switch_ns, *(h.ns for h in self.hosts)]

    @property
    def is_open(self) -> bool:
        """Started and not closed."""
        return self._state == "open"

    def __getitem__(self, name: str) -> Host:
        try:
            return self._by_name[name]
        except KeyError:
            raise KeyError(
                f"no host named {name!r} in this cluster; hosts: {', '.join(self._by_name)}"
            ) from None

    def __iter__(self) -> Iterator[Host]:
        return iter(self.hosts)

    def __len__(self) -> int:
        return len(self.hosts)

    def __repr__(self) -> str:
        return f"Cluster({[h.name for h in self.hosts]!r}, run={self.switch_ns!r}, {self._state})"

    def _check_open(self) -> None:
        if self._state != "open":
            raise NetnsError(f"cluster {self.switch_ns} is {self._state}, not open")

    def _check_cpus(self, field: str, cpus: Iterable[int]) -> frozenset[int]:
        if isinstance(cpus, str | bytes) or not isinstance(cpus, Iterable):
            raise ValueError(f"{field}={cpus!r}: expected core numbers")
        got = list(cpus)
        if not got or any(isinstance(c, bool) or not isinstance(c, int) for c in got):
            raise ValueError(f"{field}={got!r}: expected a non-empty set of core numbers")
        bad = sorted(set(got) - self.all_cpus)
        if bad:
            raise ValueError(
                f"{field}={got!r}: cores {bad} are not among this process's {sorted(self.all_cpus)}"
            )
        return frozenset(got)

    def _hosts_of(self, field: str, group: str | Host | Iterable[str | Host]) -> set[str]:
        if isinstance(group, str | Host):
            group = [group]
        names = set()
        for h in group:
            name = h.name if isinstance(h, Host) else h
            if name not in self._by_name or (isinstance(h, Host) and h.cluster is not self):
                raise ValueError(
                    f"{field}: no host {name!r} in this cluster; hosts: {', '.join(self._by_name)}"
                )
            names.add(name)
        return names

    # ------------------------------------------------------------------ life cycle

    def start(self) -> Cluster:
        """Build the switch and every host (after sweeping dead runs of the prefix).

        :returns: ``self``.
        :raises NetnsError: a command failed (what was made is removed before it propagates)
            or the cluster was started before.
        """
        if self._state != "new":
            raise NetnsError(f"cluster {self.switch_ns} is {self._state}: start() runs once")
        if self._sweep:
            sweep(self.prefix)
        self._state = "open"
        track(id(self), self.close)  # before anything exists: a signal from here on cleans up
        try:
            ip_batch(f"netns add {ns}" for ns in self.namespaces)
            for ns in self.namespaces:
                _quiet(ns)
            ip_batch(
                [
                    "link set lo up",
                    f"link add {BRIDGE} type bridge mcast_snooping 0",
                    f"link set {BRIDGE} up",
                ],
                ns=self.switch_ns,
            )
            for h in self.hosts:
                self._wire(h)
        except BaseException:
            self.close()
            raise
        return self

    def _wire(self, h: Host) -> None:
        """Make ``h``'s veth pair, its address, and the buckets it had."""
        sw_mac = f"02:70:64:01:{h.index >> 8:02x}:{h.index & 0xFF:02x}"
        ip_batch(
            [
                f"link add {h.switch_dev} address {sw_mac} type veth "
                f"peer name {h.dev} address {h.mac} netns {h.ns}",
                f"link set {h.switch_dev} master {BRIDGE} up",
            ],
            ns=self.switch_ns,
        )
        ip_batch(
            [
                "link set lo up",
                *([] if self.gso else [f"link set {h.dev} gso_max_segs 1"]),
                f"addr add {h.addr}/{h.prefixlen} dev {h.dev}",
                f"link set {h.dev} up",
            ],
            ns=h.ns,
        )
        if h._faults.limit_in or h._faults.limit_out:
            h._apply_limits()

    def _apply_switch(self) -> None:
        """Load the switch's rules for the current loss, partitions and dead hosts."""
        port = {h.name: h.switch_dev for h in self.hosts}
        script = switch_ruleset(
            cut=[h.switch_dev for h in self.hosts if h._faults.dead],
            blocked=[(port[a], port[b]) for a, b in self._blocked],
            loss={h.switch_dev: h._faults.loss for h in self.hosts if any(h._faults.loss)},
        )
        nft_apply(self.switch_ns, script)

    def close(self) -> None:
        """Remove everything the cluster made: SIGKILL every process of its namespaces (and
        reap those it started), delete the namespaces (their veths, bridge, qdiscs and
        nftables tables go with them), restore the signal handlers if it was the last open
        cluster. Idempotent, and safe to re-enter from a signal handler.

        :raises NetnsError: something could not be removed (after trying everything; the
            message lists what is left).
        """
        if self._state in ("new", "closed"):
            self._state = "closed"
            return
        self._state = "closing"
        errors = []
        for ns in reversed(self.namespaces):
            try:
                kill_ns_processes(ns)
            except NetnsError as e:
                errors.append(str(e))
        for h in self.hosts:
            h._reap()
        try:
            delete_namespaces(self.namespaces)
        except NetnsError as e:
            errors.append(str(e))
        try:
            left = [ns for ns in list_namespaces() if self.run_id.owns(ns)]
        except NetnsError as e:
            left, errors = [], [*errors, str(e)]
        self._state = "closed"
        untrack(id(self))
        if left or errors:
            raise NetnsError(f"cluster {self.switch_ns}: left {left}; errors: {errors}")

    def __enter__(self) -> Cluster:
        return self.start()

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        try:
            self.close()
        except NetnsError as e:
            if exc is None:
                raise
            warnings.warn(
                f"{e} (while handling {exc_type.__name__ if exc_type else ''})", stacklevel=2
            )

    # ------------------------------------------------------------------ cluster faults

    def partition(self, *groups: str | Host | Iterable[str | Host]) -> Undo:
        """Split the cluster: frames between hosts of different groups are dropped at the
        switch (both ways; see :meth:`Host.partition` for what hosts see); hosts within a
        group still reach each other. Hosts named in no group form one more group. Adds to
        partitions already in place.

        :param groups: each a host (name or :class:`Host`) or an iterable of them.
        :returns: a handle whose ``undo()`` is :meth:`heal`.
        :raises ValueError: an unknown host, a host in two groups, or fewer than two groups.
        """
        sets = [self._hosts_of(f"partition group {i}", g) for i, g in enumerate(groups)]
        seen: set[str] = set()
        for s in sets:
            if s & seen:
                raise ValueError(f"partition: hosts {sorted(s & seen)} are in two groups")
            seen |= s
        rest = set(self._by_name) - seen
        if rest:
            sets.append(rest)
        if len(sets) < 2:
            raise ValueError(f"partition{groups!r}: needs two groups of hosts at least")
        pairs = {
            (a, b)
            for i, sa in enumerate(sets)
            for j, sb in enumerate(sets)
            if i != j
            for a in sa
            for b in sb
        }
        with self._lock:
            self._check_open()
            self._blocked |= pairs
            self._apply_switch()
        return Undo(self.heal, "cluster.partition")

    def heal(self) -> None:
        """Lift every partition of the cluster (dead hosts stay cut: :meth:`Host.revive`)."""
        with self._lock:
            if not self.is_open:
                return
            self._blocked = set()
            self._apply_switch()

    def clear(self) -> None:
        """Remove every bucket, loss and partition of every host (dead hosts stay dead)."""
        for h in self.hosts:
            h.clear()
