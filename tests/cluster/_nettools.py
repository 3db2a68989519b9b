"""Small network programs the harness tests run inside host namespaces (``python
_nettools.py TOOL ARGS``). Each prints one JSON object per line on stdout, flushed, so the
test reads them as they come. Stdlib only: they run in a bare interpreter."""

from __future__ import annotations

import json
import select
import socket
import sys
import time
from collections.abc import Callable


def say(**kw: object) -> None:
    print(json.dumps(kw), flush=True)


def tcp_sink(addr: str, port: str) -> None:
    """Accept one connection, count its bytes until EOF: ``{bytes, seconds, peer}`` (seconds
    from the first byte to EOF)."""
    srv = socket.create_server((addr, int(port)))
    say(ready=True)
    conn, peer = srv.accept()
    n, first = 0, None
    while data := conn.recv(1 << 20):
        first = first or time.monotonic()
        n += len(data)
    say(bytes=n, seconds=time.monotonic() - (first or time.monotonic()), peer=peer[0])


def tcp_send(addr: str, port: str, limit: str) -> None:
    """Connect and send: ``Ns`` for N seconds, or N bytes; ``{sent, local}``."""
    s = socket.create_connection((addr, int(port)), timeout=10)
    local = s.getsockname()[0]
    buf = b"\x5a" * (1 << 18)
    sent = 0
    if limit.endswith("s"):
        end = time.monotonic() + float(limit[:-1])
        while time.monotonic() < end:
            s.sendall(buf)
            sent += len(buf)
    else:
        total = int(limit)
        while sent < total:
            chunk = buf[: total - sent]
            s.sendall(chunk)
            sent += len(chunk)
    s.shutdown(socket.SHUT_WR)
    s.recv(1)  # wait for the sink's close: every byte was received
    say(sent=sent, local=local)


def tcp_echo(addr: str, port: str) -> None:
    """Accept connections one after another and echo each until EOF; ``{peer}`` per accept."""
    srv = socket.create_server((addr, int(port)))
    say(ready=True)
    while True:
        conn, peer = srv.accept()
        say(peer=peer[0])
        while data := conn.recv(65536):
            conn.sendall(data)
        conn.close()


def _recv_result(s: socket.socket, timeout: float) -> dict[str, object]:
    s.settimeout(timeout)
    try:
        data = s.recv(65536)
    except TimeoutError:
        return {"result": "timeout"}
    except OSError as e:
        return {"result": "error", "errno": e.errno, "error": str(e)}
    return {"result": "data", "data": data.decode()} if data else {"result": "eof"}


def tcp_client(addr: str, port: str) -> None:
    """Connect, then follow commands on stdin, one per line: ``send MSG TIMEOUT`` (send,
    then wait for the echo) or ``recv TIMEOUT``; answers ``{result: data|timeout|eof|error}``."""
    s = socket.create_connection((addr, int(port)), timeout=10)
    say(connected=True, local=s.getsockname()[0])
    for line in sys.stdin:
        cmd, *args = line.split()
        if cmd == "send":
            s.sendall(args[0].encode())
            say(**_recv_result(s, float(args[1])))
        elif cmd == "recv":
            say(**_recv_result(s, float(args[0])))
        else:
            say(result="unknown command", line=line)


def tcp_rtt(addr: str, port: str, count: str) -> None:
    """Connect to an echo server and time ``count`` one-byte round trips, 20 ms apart:
    ``{rtt_ms: [...]}``."""
    s = socket.create_connection((addr, int(port)), timeout=10)
    s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    rtts = []
    for _ in range(int(count)):
        t0 = time.monotonic()
        s.sendall(b"x")
        s.recv(1)
        rtts.append((time.monotonic() - t0) * 1000)
        time.sleep(0.02)
    say(rtt_ms=rtts)


def tcp_watch(addr: str, port: str, timeout: str) -> None:
    """Accept one connection, read its first message (``{hello}``), then wait ``timeout`` s
    for more: ``{result: timeout|eof|error|data}`` (what a peer of a dying host sees)."""
    srv = socket.create_server((addr, int(port)))
    say(ready=True)
    conn, _ = srv.accept()
    say(hello=conn.recv(100).decode())
    say(**_recv_result(conn, float(timeout)))


def tcp_hello(addr: str, port: str) -> None:
    """Connect, send ``hello``, then sleep (a process with an open connection)."""
    s = socket.create_connection((addr, int(port)), timeout=10)
    s.sendall(b"hello")
    say(sent=True)
    time.sleep(3600)


def udp_sink(addr: str, port: str, idle: str) -> None:
    """Count distinct datagrams until ``idle`` s pass without one (10 s without the first):
    ``{received}``."""
    s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    # 4 MiB whatever rmem_max says (root): a receiver slowed by a busy machine must not drop
    # datagrams itself, or the loss measured would be its own
    s.setsockopt(socket.SOL_SOCKET, getattr(socket, "SO_RCVBUFFORCE", 33), 1 << 22)
    s.bind((addr, int(port)))
    say(ready=True)
    seen: set[bytes] = set()
    wait = 10.0
    while select.select([s], [], [], wait)[0]:
        seen.add(s.recv(64))
        wait = float(idle)
    say(received=len(seen))


def udp_send(addr: str, port: str, count: str) -> None:
    """Send ``count`` numbered datagrams, paced (50 per ms at most): ``{sent}``."""
    s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    n = int(count)
    for i in range(n):
        s.sendto(str(i).encode(), (addr, int(port)))
        if i % 50 == 49:
            time.sleep(0.001)
    say(sent=n)


def udp_flood(addr: str, port: str, mbit: str, seconds: str) -> None:
    """Send 1400-byte datagrams at ``mbit`` Mbit/s for ``seconds`` s: ``{sent}``."""
    s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    payload = b"\0" * 1400
    per_ms = float(mbit) * 1e6 / 8 / len(payload) / 1000
    t0 = time.monotonic()
    sent = 0
    while (now := time.monotonic()) < t0 + float(seconds):
        while sent < (now - t0) * 1000 * per_ms:
            s.sendto(payload, (addr, int(port)))
            sent += 1
        time.sleep(0.001)
    say(sent=sent)


def cpu_loop(iterations: str) -> None:
    """A fixed amount of CPU work: ``{wall, cpu}`` seconds."""
    t0, c0 = time.monotonic(), time.process_time()
    x = 0
    for i in range(int(iterations)):
        x += i
    say(wall=time.monotonic() - t0, cpu=time.process_time() - c0)


def nixl_write(role: str, folder: str, nbytes: str) -> None:
    """One NIXL (UCX) WRITE of ``nbytes`` from the ``initiator`` into the ``target``'s
    buffer, agent metadata exchanged through files in ``folder``: the target answers
    ``{ok}`` (every byte landed, the notification came), the initiator ``{state}``."""
    import pathlib

    import numpy as np

    from pdplug.testing import probe_module

    api, why = probe_module("nixl")
    assert api is not None, why
    n = int(nbytes)
    agent = api.nixl_agent(role, api.nixl_agent_config(backends=["UCX"]))
    pattern = (np.arange(n, dtype=np.uint64) % 251 + 1).astype(np.uint8)
    buf = np.zeros(n, dtype=np.uint8) if role == "target" else pattern.copy()
    agent.register_memory(agent.get_reg_descs([(buf.ctypes.data, n, 0, "")], "DRAM"))
    info = pathlib.Path(folder, "target.json")
    end = time.monotonic() + 30
    if role == "target":
        meta = bytes(agent.get_agent_metadata()).hex()
        tmp = info.with_suffix(".tmp")
        tmp.write_text(json.dumps({"meta": meta, "addr": buf.ctypes.data}))
        tmp.rename(info)
        say(ready=True)
        while not agent.get_new_notifs() and time.monotonic() < end:
            time.sleep(0.001)
        say(ok=bool((buf == pattern).all()))
        return
    while not info.exists():
        assert time.monotonic() < end, "no target"
        time.sleep(0.01)
    target = json.loads(info.read_text())
    peer = agent.add_remote_agent(bytes.fromhex(target["meta"]))
    local = agent.get_xfer_descs([(buf.ctypes.data, n, 0)], "DRAM")
    remote = agent.get_xfer_descs([(target["addr"], n, 0)], "DRAM")
    handle = agent.initialize_xfer("WRITE", local, remote, peer, b"done")
    state = agent.transfer(handle)
    while state not in ("DONE", "ERR") and time.monotonic() < end:
        state = agent.check_xfer_state(handle)
        time.sleep(0.001)
    say(state=str(state))
    time.sleep(0.5)  # keep the agent up while the target reads its notification


def make_cluster(prefix: str, mode: str) -> None:
    """Build a two-host cluster with a sleeping process on host ``b`` and report
    ``{namespaces, sleeper, start}``; then ``hold`` (sleep until signalled) or ``exit``
    (``sys.exit(3)`` without closing: the atexit hook must clean up)."""
    from pdplug.testing.netns import Cluster
    from pdplug.testing.netns.cleanup import process_start

    c = Cluster(["a", "b"], prefix=prefix).start()
    sleeper = c["b"].popen(["sleep", "3600"])
    while sleeper.pid not in c["b"].pids():  # it entered the namespace
        time.sleep(0.005)
    say(namespaces=c.namespaces, sleeper=sleeper.pid, start=process_start(sleeper.pid))
    if mode == "exit":
        sys.exit(3)
    time.sleep(3600)


TOOLS: dict[str, Callable[..., None]] = {
    "tcp-sink": tcp_sink,
    "tcp-send": tcp_send,
    "tcp-echo": tcp_echo,
    "tcp-client": tcp_client,
    "tcp-watch": tcp_watch,
    "tcp-rtt": tcp_rtt,
    "tcp-hello": tcp_hello,
    "udp-sink": udp_sink,
    "udp-send": udp_send,
    "udp-flood": udp_flood,
    "cpu-loop": cpu_loop,
    "make-cluster": make_cluster,
    "nixl-write": nixl_write,
}

if __name__ == "__main__":
    tool, *argv = sys.argv[1:]
    TOOLS[tool](*argv)
