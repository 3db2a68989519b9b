"""The network-namespace harness (pdplug.testing.netns, issue 23), tested with real
namespaces, real processes and real sockets: reachability on the hosts' own addresses only,
link counters, each fault (bucket, loss, partition, host death, CPU starvation) measured
from inside the hosts, and clean-up after an exception, SIGINT, SIGTERM, exit and SIGKILL.

Needs root (skips naming why otherwise; fails instead when PDPLUG_REQUIRE lists netns).
The bulk-throughput and starvation tests measure CPU and bandwidth: on a shared machine run
them under ``flock /tmp/pdplug-heavy.lock``.
"""

from __future__ import annotations

import errno
import json
import os
import select
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from pdplug.testing.netns import Cluster, Host, NetnsError, RunId, list_namespaces, sweep
from pdplug.testing.netns.cleanup import process_start

pytestmark = [pytest.mark.netns, pytest.mark.timeout(60)]

TOOLS = str(Path(__file__).with_name("_nettools.py"))
ROOT = Path(__file__).parents[2]
MakeCluster = Callable[..., Cluster]


class Tool:
    """A ``_nettools.py`` program on a host, read line by line (JSON) with a deadline."""

    def __init__(
        self, host: Host, *args: str, stdin: bool = False, env: dict[str, str] | None = None
    ) -> None:
        self.host = host
        self.proc = host.popen(
            [sys.executable, TOOLS, *args],
            stdout=subprocess.PIPE,
            stdin=subprocess.PIPE if stdin else subprocess.DEVNULL,
            env={"PYTHONPATH": os.pathsep.join(sys.path), **(env or {})},
        )
        self._buf = b""

    def read(self, timeout: float = 10.0) -> dict[str, Any]:
        assert self.proc.stdout is not None
        end = time.monotonic() + timeout
        while True:
            while b"\n" not in self._buf:
                left = end - time.monotonic()
                if left <= 0 or not select.select([self.proc.stdout], [], [], left)[0]:
                    raise AssertionError(f"{self.host.name}: no output within {timeout} s")
                chunk = os.read(self.proc.stdout.fileno(), 65536)
                if not chunk:
                    raise AssertionError(f"{self.host.name}: exited {self.proc.wait()} silently")
                self._buf += chunk
            line, self._buf = self._buf.split(b"\n", 1)
            if line.startswith(b"{"):  # a library's own log lines on stdout (NIXL's) skipped
                return dict(json.loads(line))

    def send(self, line: str) -> None:
        assert self.proc.stdin is not None
        self.proc.stdin.write(line.encode() + b"\n")
        self.proc.stdin.flush()


def _ours_or_stale() -> list[str]:
    """Namespaces made by this process, or by a run whose creator is dead (leftovers)."""
    out = []
    for ns in list_namespaces():
        rid = RunId.parse(ns)
        if rid is not None and (rid.pid == os.getpid() or not rid.creator_alive()):
            out.append(ns)
    return out


@pytest.fixture(autouse=True)
def _nothing_left() -> Iterator[None]:
    yield
    assert _ours_or_stale() == []


@pytest.fixture
def two(netns_cluster: MakeCluster) -> Cluster:
    return netns_cluster(["a", "b"])


def _transfer(src: Host, dst: Host, limit: str, port: str = "5001") -> dict[str, Any]:
    sink = Tool(dst, "tcp-sink", dst.addr, port)
    assert sink.read() == {"ready": True}
    sender = Tool(src, "tcp-send", dst.addr, port, limit)
    sent = sender.read(timeout=30)
    got = sink.read(timeout=30)
    assert got["bytes"] == sent["sent"] and got["peer"] == src.addr == sent["local"]
    return got


# --------------------------------------------------------------------------- topology


def _root_links() -> list[str]:
    out = subprocess.run(["ip", "-j", "link"], capture_output=True, text=True, check=True)
    return sorted(link["ifname"] for link in json.loads(out.stdout))


def test_hosts_reach_each_other_on_their_own_addresses_only(netns_cluster: MakeCluster) -> None:
    links_before = _root_links()
    c = netns_cluster(["a", "b", "c"], subnet="10.213.7.0/29")
    assert [h.addr for h in c] == ["10.213.7.1", "10.213.7.2", "10.213.7.3"]
    assert set(c.namespaces) <= set(list_namespaces())
    echo = Tool(c["a"], "tcp-echo", c["a"].addr, "6000")
    assert echo.read() == {"ready": True}
    for h in (c["b"], c["c"]):
        client = Tool(h, "tcp-client", c["a"].addr, "6000", stdin=True)
        assert client.read() == {"connected": True, "local": h.addr}
        assert echo.read() == {"peer": h.addr}  # the server saw the peer's own address
        client.send(f"send from-{h.name} 5")
        assert client.read() == {"result": "data", "data": f"from-{h.name}"}
        client.proc.kill()
    # the root namespace has neither the addresses nor a link of the cluster
    assert _root_links() == links_before
    root_addrs = subprocess.run(["ip", "-j", "addr"], capture_output=True, text=True, check=True)
    assert all(h.addr not in root_addrs.stdout for h in c)
    with socket.socket() as s:  # the root namespace may route it somewhere, never to host a
        s.settimeout(0.5)
        if s.connect_ex((c["a"].addr, 6000)) == 0:
            s.sendall(b"root")
    with pytest.raises(AssertionError, match="no output"):
        echo.read(timeout=0.5)  # no further peer
    # each host: lo and its own veth, one route (the subnet), nothing else
    links = json.loads(c["b"].run(["ip", "-j", "link"], capture_output=True, check=True).stdout)
    assert sorted(link["ifname"] for link in links) == ["eth0", "lo"]
    routes = json.loads(c["b"].run(["ip", "-j", "route"], capture_output=True, check=True).stdout)
    assert [r["dst"] for r in routes] == ["10.213.7.0/29"]


def test_counters_count_at_least_the_bytes_a_transfer_moved(two: Cluster) -> None:
    a, b = two["a"], two["b"]
    before_a, before_b = a.counters(), b.counters()
    n = 8 << 20
    got = _transfer(a, b, str(n))
    assert got["bytes"] == n
    moved_a, moved_b = a.counters() - before_a, b.counters() - before_b
    assert moved_a.tx_bytes >= n and moved_b.rx_bytes >= n
    # frames and headers: a little more than the payload, not a copy of it twice
    assert moved_a.tx_bytes < 1.2 * n and moved_b.rx_bytes < 1.2 * n
    assert moved_b.tx_packets > 0 and moved_a.rx_packets > 0  # the ACKs


def test_without_gso_every_frame_is_one_mtu(netns_cluster: MakeCluster) -> None:
    c = netns_cluster(["a", "b"], gso=False)
    before = c["a"].counters()
    n = 2 << 20
    _transfer(c["a"], c["b"], str(n))
    moved = c["a"].counters() - before
    assert moved.tx_packets >= n / 1500  # no frame carries more than one MTU of payload


def test_popen_and_run_add_the_hosts_env(two: Cluster) -> None:
    env = two["b"].env()
    assert env == {"UCX_TLS": "tcp,self", "UCX_NET_DEVICES": "eth0"}
    out = two["b"].run(["sh", "-c", "echo $UCX_TLS $UCX_NET_DEVICES"], capture_output=True)
    assert out.stdout.decode().split() == ["tcp,self", "eth0"]


@pytest.mark.nixl
@pytest.mark.slow  # four NIXL processes: about 7 s
def test_env_makes_nixl_move_its_bytes_over_the_veth(two: Cluster, tmp_path: Path) -> None:
    """One 32 MiB NIXL WRITE between two hosts: with Host.env() (UCX over TCP on eth0) the
    target's link carries every byte; with UCX's defaults it carries almost none (shared
    memory and CMA cross namespaces: no network fault would ever touch those bytes)."""
    p, d = two["a"], two["b"]
    n = 32 << 20
    moved = {}
    for name, extra in (
        ("env", {}),
        ("ucx-defaults", {"UCX_TLS": "all", "UCX_NET_DEVICES": "all"}),
    ):
        folder = tmp_path / name
        folder.mkdir()
        before = d.counters()
        target = Tool(d, "nixl-write", "target", str(folder), str(n), env=extra)
        initiator = Tool(p, "nixl-write", "initiator", str(folder), str(n), env=extra)
        assert target.read(timeout=30) == {"ready": True}
        assert initiator.read(timeout=30) == {"state": "DONE"}
        assert target.read(timeout=30) == {"ok": True}  # byte-exact, notification seen
        moved[name] = (d.counters() - before).rx_bytes
    assert moved["env"] >= n, moved
    assert moved["ucx-defaults"] < n // 100, moved


# --------------------------------------------------------------------------- faults


def test_limit_caps_throughput_both_ways(two: Cluster) -> None:
    """Hold /tmp/pdplug-heavy.lock: a bulk TCP transfer, unlimited then through 200 Mbit/s."""
    a, b = two["a"], two["b"]
    free = _transfer(a, b, "0.6s")
    free_mbit = free["bytes"] * 8 / free["seconds"] / 1e6
    with b.limit(200, latency_ms=20):
        into = _transfer(a, b, "1.2s")  # shaped at b's switch port
        out = _transfer(b, a, "1.2s", port="5002")  # shaped at b's own device
    rates = [r["bytes"] * 8 / r["seconds"] / 1e6 for r in (into, out)]
    for mbit in rates:
        assert 100 < mbit < 250, (rates, free_mbit)
    assert free_mbit > 2 * max(rates), (rates, free_mbit)
    qdisc = b.run(["tc", "-j", "qdisc", "show", "dev", "eth0"], capture_output=True, check=True)
    assert "tbf" not in qdisc.stdout.decode()  # the handle's undo removed it


def test_a_saturated_bucket_delays_packets_up_to_its_latency(two: Cluster) -> None:
    """Hold /tmp/pdplug-heavy.lock: a UDP flood at twice the rate keeps b's inbound bucket
    full; round trips through the same queue wait about ``latency_ms`` in it (no netem: an
    idle bucket adds nothing)."""
    a, b = two["a"], two["b"]
    echo = Tool(b, "tcp-echo", b.addr, "6006")
    assert echo.read() == {"ready": True}
    b.limit(20, latency_ms=100)  # 20 Mbit/s, a packet waits at most 100 ms
    idle = sorted(Tool(a, "tcp-rtt", b.addr, "6006", "10").read()["rtt_ms"])
    flood = Tool(a, "udp-flood", b.addr, "7100", "40", "1.6")
    time.sleep(0.3)  # the queue at b's switch port fills
    busy = sorted(Tool(a, "tcp-rtt", b.addr, "6006", "8").read(timeout=20)["rtt_ms"])
    flood.read(timeout=20)
    assert idle[len(idle) // 2] < 10, idle
    assert 60 < busy[len(busy) // 2] < 250, busy


def _udp(src: Host, dst: Host, n: int, port: str) -> int:
    sink = Tool(dst, "udp-sink", dst.addr, port, "0.3")
    assert sink.read() == {"ready": True}
    Tool(src, "udp-send", dst.addr, port, str(n)).read()
    return int(sink.read()["received"])


def test_loss_drops_a_share_of_datagrams_in_each_direction(two: Cluster) -> None:
    a, b = two["a"], two["b"]
    n = 2000
    # no loss yet: every datagram arrives (and ARP is resolved before frames start to vanish)
    assert _udp(a, b, n, "7001") / n > 0.99 and _udp(b, a, n, "7002") / n > 0.99
    b.loss(20)
    into, out = _udp(a, b, n, "7003") / n, _udp(b, a, n, "7004") / n
    assert 0.7 < into < 0.9 and 0.7 < out < 0.9, (into, out)
    b.loss(0, direction="out")  # "in" stays at 20 %
    into, out = _udp(a, b, n, "7005") / n, _udp(b, a, n, "7006") / n
    assert 0.7 < into < 0.9 and out > 0.99, (into, out)


def test_partition_blocks_a_connection_and_heal_lets_it_continue(two: Cluster) -> None:
    a, b = two["a"], two["b"]
    echo = Tool(a, "tcp-echo", a.addr, "6001")
    assert echo.read() == {"ready": True}
    client = Tool(b, "tcp-client", a.addr, "6001", stdin=True)
    assert client.read()["connected"]
    client.send("send before 5")
    assert client.read() == {"result": "data", "data": "before"}
    a0, b0 = a.counters(), b.counters()
    cut = b.partition()
    client.send("send during 1.0")
    assert client.read() == {"result": "timeout"}  # no error, no EOF: silence
    # b still sends (retransmissions), nothing reaches a: the frames vanish at the switch
    assert (b.counters() - b0).tx_packets > 0 and (a.counters() - a0).rx_packets == 0
    cut.undo()
    client.send("recv 15")  # TCP's next retransmission delivers "during"
    assert client.read(timeout=20) == {"result": "data", "data": "during"}
    client.send("send after 5")
    assert client.read() == {"result": "data", "data": "after"}


def test_a_cluster_partition_splits_groups_and_keeps_each_group_whole(
    netns_cluster: MakeCluster,
) -> None:
    c = netns_cluster(["a", "b", "c"])
    echo_a = Tool(c["a"], "tcp-echo", c["a"].addr, "6002")
    echo_b = Tool(c["b"], "tcp-echo", c["b"].addr, "6002")
    assert echo_a.read() == echo_b.read() == {"ready": True}
    with c.partition(["a", "c"]):  # {a, c} | {b}
        to_a = Tool(c["c"], "tcp-client", c["a"].addr, "6002", stdin=True)
        assert to_a.read()["connected"]
        to_b = Tool(c["c"], "tcp-client", c["b"].addr, "6002", stdin=True)
        with pytest.raises(AssertionError, match="no output"):
            to_b.read(timeout=1.5)  # the SYN never arrives
        to_b.proc.kill()
    with pytest.raises(ValueError, match="two groups"):
        c.partition(["a"], ["a", "b"])
    with pytest.raises(ValueError, match="no host 'zz'"):
        c.partition(["zz"])


def test_kill_cuts_first_so_the_peer_sees_silence_not_eof(two: Cluster) -> None:
    a, b = two["a"], two["b"]
    # control: a plain SIGKILL lets b's kernel close the socket, and a sees EOF
    watch = Tool(a, "tcp-watch", a.addr, "6003", "3")
    assert watch.read() == {"ready": True}
    victim = Tool(b, "tcp-hello", a.addr, "6003")
    assert victim.read() == {"sent": True} and watch.read() == {"hello": "hello"}
    victim.proc.kill()
    assert watch.read()["result"] in ("eof", "error")
    # host death: cut, then SIGKILL: nothing escapes
    watch = Tool(a, "tcp-watch", a.addr, "6004", "1.5")
    assert watch.read() == {"ready": True}
    victim = Tool(b, "tcp-hello", a.addr, "6004")
    assert victim.read() == {"sent": True} and watch.read() == {"hello": "hello"}
    bystander = b.popen(["sleep", "60"])
    assert b.kill() >= 2
    assert b.pids() == [] and victim.proc.poll() == -signal.SIGKILL
    assert bystander.poll() == -signal.SIGKILL
    assert watch.read() == {"result": "timeout"}
    assert not b.alive
    with pytest.raises(NetnsError, match="dead"):
        b.popen(["true"])
    b.heal()  # a partition heal does not revive a dead host
    assert not b.alive and b.ns in list_namespaces()
    # rolling restart: a new process at the same address serves a again
    b.revive()
    echo = Tool(b, "tcp-echo", b.addr, "6004")
    assert echo.read() == {"ready": True}
    client = Tool(a, "tcp-client", b.addr, "6004", stdin=True)
    assert client.read()["connected"] and echo.read() == {"peer": a.addr}
    client.send("send again 5")
    assert client.read() == {"result": "data", "data": "again"}


def test_revive_is_a_reboot_an_old_connection_gets_a_reset(two: Cluster) -> None:
    a, b = two["a"], two["b"]
    echo = Tool(b, "tcp-echo", b.addr, "6005")
    assert echo.read() == {"ready": True}
    client = Tool(a, "tcp-client", b.addr, "6005", stdin=True)
    assert client.read()["connected"]
    client.send("send one 5")
    assert client.read() == {"result": "data", "data": "one"}
    b.kill()
    b.revive()  # no socket of the old namespace survives: b's kernel answers with an RST
    client.send("send two 10")
    assert client.read(timeout=15) == {
        "result": "error",
        "errno": errno.ECONNRESET,
        "error": "[Errno 104] Connection reset by peer",
    }


def test_revive_keeps_the_bucket_and_the_loss(two: Cluster) -> None:
    b = two["b"]
    b.limit(300)
    b.loss(5)
    b.kill()
    b.revive()
    qdisc = b.run(["tc", "qdisc", "show", "dev", "eth0"], capture_output=True, text=True)
    assert "tbf" in qdisc.stdout and "rate 300Mbit" in qdisc.stdout, qdisc.stdout
    rules = b.run(
        ["ip", "netns", "exec", two.switch_ns, "nft", "list", "ruleset"],
        capture_output=True,
        text=True,
    ).stdout
    assert "numgen random mod 10000 < 500" in rules and 'iifname "p1" counter drop' not in rules


def test_starve_slows_a_cpu_bound_loop_on_the_hosts_cores(netns_cluster: MakeCluster) -> None:
    """Hold /tmp/pdplug-heavy.lock: it saturates a core. The loop's wall time over its CPU
    time is the share of its core it did not get: about 1 alone on an idle core, about 2
    beside one busy loop (other load on the machine only raises it)."""
    core = max(os.sched_getaffinity(0))
    c = netns_cluster(["a", "b"], cpus={"b": [core]})
    b = c["b"]

    def stretch() -> float:
        r = Tool(b, "cpu-loop", "6000000").read(timeout=30)
        return float(r["wall"]) / float(r["cpu"])

    base = min(stretch(), stretch())
    with b.starve() as st:
        assert len(st.procs) == 1 and st.running
        assert all(os.sched_getaffinity(pid) == {core} for pid in st.pids)
        assert set(st.pids) <= set(b.pids())
        starved = stretch()
    assert not st.running and not set(st.pids) & set(b.pids())
    assert starved > 1.6 and starved > base, (base, starved)
    # a timed starvation ends by itself
    timed = b.starve(seconds=0.3, procs=2)
    end = time.monotonic() + 10
    while timed.running and time.monotonic() < end:
        time.sleep(0.05)
    assert not timed.running
    timed.stop()


def test_popen_pins_to_the_hosts_cores(netns_cluster: MakeCluster) -> None:
    core = min(os.sched_getaffinity(0))
    c = netns_cluster(["a", "b"], cpus={"a": [core]})
    p = c["a"].popen(["sleep", "30"])
    q = c["b"].popen(["sleep", "30"], cpus=[core])
    r = c["b"].popen(["sleep", "30"])
    end = time.monotonic() + 5
    for proc in (p, q, r):  # past ``ip netns exec`` and ``taskset``, both exec'ed
        while Path(f"/proc/{proc.pid}/comm").read_text().strip() != "sleep":
            assert time.monotonic() < end
            time.sleep(0.01)
    assert os.sched_getaffinity(p.pid) == os.sched_getaffinity(q.pid) == {core}
    assert os.sched_getaffinity(r.pid) == os.sched_getaffinity(0)
    assert p.pid in c["a"].pids() and q.pid in c["b"].pids()


# --------------------------------------------------------------------------- clean-up


def test_an_exception_inside_with_removes_everything() -> None:
    with pytest.raises(RuntimeError, match="boom"), Cluster(["a", "b"]) as c:
        names = c.namespaces
        sleeper = c["b"].popen(["sleep", "60"])
        c["b"].limit(100)
        c["a"].partition()
        raise RuntimeError("boom")
    assert not set(names) & set(list_namespaces())
    assert sleeper.poll() == -signal.SIGKILL
    assert not c.is_open
    with pytest.raises(NetnsError, match="not open"):
        c["a"].popen(["true"])


def test_signal_handlers_are_restored_after_the_last_cluster() -> None:
    def mine(signum: int, frame: object) -> None:
        pass

    before = signal.signal(signal.SIGTERM, mine)
    try:
        with Cluster(["a"]):
            assert signal.getsignal(signal.SIGTERM) is not mine
            with Cluster(["a"]):
                pass
            assert signal.getsignal(signal.SIGTERM) is not mine  # one still open
        assert signal.getsignal(signal.SIGTERM) is mine
    finally:
        signal.signal(signal.SIGTERM, before)


def test_an_ignored_signal_stays_ignored() -> None:
    """A process started in the background ignores SIGINT: a cluster neither removes itself
    nor ends the process on one (nothing is installed for it)."""
    before = signal.signal(signal.SIGINT, signal.SIG_IGN)
    try:
        with Cluster(["a"]):
            assert signal.getsignal(signal.SIGINT) == signal.SIG_IGN
    finally:
        signal.signal(signal.SIGINT, before)


def _default_signals() -> None:
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, signal.SIG_DFL)


def _child(mode: str) -> tuple[subprocess.Popen[bytes], dict[str, Any]]:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
    proc = subprocess.Popen(
        [sys.executable, TOOLS, "make-cluster", "pdptst", mode],
        stdout=subprocess.PIPE,
        env=env,
        cwd=ROOT,
        # default dispositions: a test run started in the background (nohup, &) ignores SIGINT,
        # and a child inheriting that ignores it too (the harness then leaves it alone)
        preexec_fn=_default_signals,
    )
    assert proc.stdout is not None
    ready, _, _ = select.select([proc.stdout], [], [], 20)
    assert ready, "the child built no cluster within 20 s"
    info = dict(json.loads(proc.stdout.readline()))
    assert set(info["namespaces"]) <= set(list_namespaces())
    return proc, info


def _dead(pid: int, start: int) -> bool:
    """Whether process (pid, start) is gone or a zombie, within 5 s (an orphan killed by a
    sweep is reaped by init in its own time)."""
    end = time.monotonic() + 5
    while time.monotonic() < end:
        if process_start(pid) != start:
            return True
        try:
            if Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] == "Z":
                return True
        except OSError:
            return True
        time.sleep(0.02)
    return False


def _gone(info: dict[str, Any]) -> bool:
    return not set(info["namespaces"]) & set(list_namespaces()) and _dead(
        info["sleeper"], info["start"]
    )


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT])
def test_a_signal_to_the_creator_removes_everything(sig: signal.Signals) -> None:
    proc, info = _child("hold")
    proc.send_signal(sig)
    assert proc.wait(timeout=20) == -sig  # the signal is passed on: it still ends the process
    assert _gone(info)


def test_exit_without_close_removes_everything() -> None:
    proc, info = _child("exit")
    assert proc.wait(timeout=20) == 3
    assert _gone(info)


def test_sweep_removes_what_a_sigkilled_run_left_and_spares_live_runs() -> None:
    proc, info = _child("hold")
    with Cluster(["live"], prefix="pdptst", sweep=False) as live:
        proc.kill()
        assert proc.wait(timeout=10) == -signal.SIGKILL
        assert set(info["namespaces"]) <= set(list_namespaces())  # SIGKILL ran nothing
        assert process_start(info["sleeper"]) == info["start"]  # its process lives on
        removed = sweep("pdptst")
        assert sorted(removed) == sorted(info["namespaces"])
        assert _gone(info)
        assert set(live.namespaces) <= set(list_namespaces())  # a live run is not touched
        assert sweep("pdptst") == []
