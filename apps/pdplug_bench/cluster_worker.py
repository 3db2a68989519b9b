"""A worker process of ``pdplug bench cluster``, run inside one host of the cluster:
``python -m pdplug_bench.cluster_worker`` (the first stdin line is its
:class:`~pdplug_bench.cluster_wire.Spec`).

Roles:

* ``rendezvous``: a :class:`pdplug.bootstrap.RendezvousServer` on the host's address and a
  fixed port.
* ``prefill``: one PP rank of a prefill instance: a real KV sender over its seeded source KV
  (:mod:`pdplug_bench.cluster_kv`) and, after :class:`~pdplug_bench.cluster_wire.Join`, the
  instance's consensus (``pp0`` by default). A served room is voted ``good`` on the
  ``bootstrap`` stream once the rank's sender is ``WaitingForInput`` (``bad`` if it failed);
  a ``good`` decision sends it (the scheduler's segments), a ``bad`` one aborts it. A rank
  whose consensus raised aborts every room not yet admitted, and every later one.
* ``decode``: one decode instance, one KV receiver per DCP rank in this process, over numpy
  KV (raw regions). Pages come from a FIFO free list (a released page is reused as late as
  possible) and are checked to still hold :data:`~pdplug_bench.cluster_kv.POISON` when
  taken; a room that succeeded is byte-checked against the source; any room is released
  (cleared, its pages poisoned and freed) only once every rank says ``drained``.
* ``intruder``: a host that is not a member (no key) forging well-formed frames (sealed, under
  a wrong key and under none) and sending malformed ones to the endpoints it is given.

Every socket binds and advertises the host's address, with the deployment's key
(``WireConfig(bind_host=addr, hmac_key=key)``, ``KVConfig.extra["host"] = addr``). Events go
to the stdout the worker was started with; fd 1 itself is pointed at stderr, so a library's
own prints (NIXL's, UCX's) land in the worker's log, never in the event stream.
"""

from __future__ import annotations

import logging
import os
import secrets
import select
import sys
import time
import traceback
from collections import deque
from collections.abc import Callable, Iterator
from typing import Any

import msgspec
import numpy as np

from pdplug_bench import cluster_kv as kvm
from pdplug_bench.cluster_wire import (
    Attack,
    Attacked,
    Bye,
    Check,
    Checked,
    Command,
    ConsensusLost,
    Done,
    Drained,
    Error,
    Event,
    Expect,
    Found,
    Join,
    Landed,
    Quit,
    Ready,
    Resolve,
    Serve,
    Spec,
    Stats,
    StatsOf,
    decode_command,
    decode_spec,
    encode,
)

__all__ = ["main", "Lines", "RendezvousWorker", "PrefillWorker", "DecodeWorker", "Intruder"]

log = logging.getLogger("pdplug_bench.cluster_worker")

Emit = Callable[[Event], None]
_DRAIN_CHECK_S = 0.02  # how often an unreleased room asks its sessions whether it drained


def _wire(spec: Spec) -> Any:
    from pdplug import WireConfig

    return WireConfig(bind_host=spec.addr, hmac_key=bytes.fromhex(spec.key) if spec.key else None)


def _kv_config(spec: Spec, role: str, layout: Any) -> Any:
    from pdplug import KVConfig

    t, g = spec.timeouts, spec.geometry
    return KVConfig(
        instance=spec.instance,
        role=role,
        layout=layout,
        bootstrap_endpoint=spec.rendezvous,
        bootstrap_timeout_s=t.bootstrap_s,
        rendezvous_timeout_s=30.0,
        rendezvous_refresh_s=t.refresh_s,
        waiting_timeout_s=t.waiting_s,
        transfer_timeout_s=t.transfer_s,
        pack_region_tokens=g.pack_region_tokens,
        max_dst_dcp=g.max_dst_dcp,
        wire=_wire(spec),
        extra={"host": spec.addr},
    )


class Lines:
    """Lines from a file descriptor without blocking past a timeout (stdin of the worker)."""

    def __init__(self, fd: int) -> None:
        self.fd = fd
        self.eof = False
        self._buf = b""

    def read(self, timeout: float) -> list[bytes]:
        """Complete lines that arrived within ``timeout`` seconds (``[]`` if none)."""
        if not self.eof and select.select([self.fd], [], [], timeout)[0]:
            chunk = os.read(self.fd, 1 << 16)
            if not chunk:
                self.eof = True
            self._buf += chunk
        *lines, self._buf = self._buf.split(b"\n")
        return [ln for ln in lines if ln.strip()]

    def first(self, timeout: float) -> bytes:
        """The first line, waiting up to ``timeout`` seconds.

        :raises TimeoutError: none came.
        """
        end = time.monotonic() + timeout
        while time.monotonic() < end and not self.eof:
            lines = self.read(0.1)
            if lines:
                rest, self._buf = lines[1:], self._buf
                self._buf = b"".join(ln + b"\n" for ln in rest) + self._buf
                return lines[0]
        raise TimeoutError(f"no spec line on stdin within {timeout} s")


# ----------------------------------------------------------------------------- roles


class RendezvousWorker:
    """The deployment's rendezvous on the host's address, port ``spec.port``."""

    def __init__(self, spec: Spec, emit: Emit) -> None:
        from pdplug.bootstrap import RendezvousServer

        self.server = RendezvousServer(_wire(spec), port=spec.port).start()
        emit(
            Ready(
                pid=os.getpid(),
                t=time.monotonic(),
                endpoints=(("rendezvous", self.server.endpoint),),
            )
        )

    def handle(self, cmd: Command, emit: Emit) -> None:
        """Answer :class:`Stats`."""
        if isinstance(cmd, Stats):
            emit(StatsOf(stats={"rendezvous": dict(self.server.stats())}))

    def step(self, now: float, emit: Emit) -> None:
        """Nothing: the server runs on its own thread."""

    def close(self) -> None:
        """Stop the server."""
        self.server.stop()


class _PRoom(msgspec.Struct, kw_only=True):
    room: int
    tokens: int
    pace_s: float = 0.0
    segs: list[Any] = []
    next_seg: float = 0.0
    voted: bool = False
    admitted: bool = False
    decided: bool = False
    reported: bool = False
    next_check: float = 0.0


class PrefillWorker:
    """One PP rank of the prefill instance (see the module docstring)."""

    def __init__(self, spec: Spec, emit: Emit) -> None:
        import torch

        from pdplug import PluginManager, SchedulerConfig

        self.spec = spec
        g = spec.geometry
        self.pm = PluginManager()
        planner = self.pm.make_pack_planner()
        self.sched = self.pm.make_scheduler(
            SchedulerConfig(page_size=g.page_size, chunk_size=g.chunk_size)
        )
        cfg = _kv_config(spec, "prefill", kvm.src_layout(g, spec.pp_rank))
        self.sender = self.pm.make_kv_sender(cfg, planner, name=spec.backend)
        self.src = kvm.src_entries(g, spec.pp_rank)
        self.sender.register_kv([torch.from_numpy(a) for a in self.src])  # also registers
        self.consensus: Any = None
        self.lost = ""
        self.rooms: dict[int, _PRoom] = {}
        eps = [("sender", self.sender.peer_info().control_endpoint)]
        if spec.consensus:
            eps.append(("consensus", spec.consensus[spec.pp_rank]))
        emit(Ready(pid=os.getpid(), t=time.monotonic(), endpoints=tuple(eps)))

    def handle(self, cmd: Command, emit: Emit) -> None:
        """:class:`Join`, :class:`Serve`, :class:`Stats`."""
        if isinstance(cmd, Join):
            self._join()
        elif isinstance(cmd, Serve):
            self.sender.start(cmd.room)
            self.rooms[cmd.room] = _PRoom(room=cmd.room, tokens=cmd.tokens, pace_s=cmd.pace_s)
            if self.lost:
                self.sender.abort(cmd.room, f"consensus lost: {self.lost}")
        elif isinstance(cmd, Stats):
            out = {"sender": self.sender.stats()}
            if self.consensus is not None:
                out["consensus"] = dict(self.consensus.stats())
            emit(StatsOf(stats=out))

    def _join(self) -> None:
        from pdplug import ConsensusConfig

        t = self.spec.timeouts
        cfg = ConsensusConfig(
            pp_rank=self.spec.pp_rank,
            pp_size=self.spec.geometry.pp_size,
            endpoints=self.spec.consensus,
            peer_timeout_s=t.peer_s,
            vote_deadline_s=2 * t.peer_s,
            heartbeat_s=t.heartbeat_s,
            wire=_wire(self.spec),
        )
        self.consensus = self.pm.make_consensus(cfg)

    def step(self, now: float, emit: Emit) -> None:
        """Votes, decisions, sends, outcomes and releases of the rank's rooms."""
        from pdplug import ConsensusError, KVPoll

        s, c = self.sender, self.consensus
        for r in self.rooms.values():
            if r.decided or r.reported:
                continue
            st = s.poll(r.room)
            if c is not None and not self.lost and not r.voted:
                if st == KVPoll.Failed:
                    c.offer("bootstrap", bad=[r.room])
                    r.voted = True
                elif st >= KVPoll.WaitingForInput:
                    c.offer("bootstrap", good=[r.room])
                    r.voted = True
        if c is not None and not self.lost:
            try:
                decisions = c.poll()
            except ConsensusError as e:
                decisions = []
                self.lost = str(e)
                emit(ConsensusLost(error=self.lost, t=now))
                for r in self.rooms.values():
                    if not r.decided:
                        s.abort(r.room, f"consensus lost: {self.lost}")
            for d in decisions:
                if d.stream != "bootstrap":
                    continue
                for room in d.good:
                    got = self.rooms.get(room)
                    if got is not None and not got.decided:
                        got.decided = got.admitted = True
                        self._send(got)
                for room in d.bad:
                    got = self.rooms.get(room)
                    if got is not None and not got.decided:
                        got.decided = True
                        s.abort(room, "a PP rank voted bad")
        for room, r in list(self.rooms.items()):
            if r.segs and now >= r.next_seg:
                self._post(r, now)
            st = s.poll(room)
            if not r.reported:
                if st in (KVPoll.Success, KVPoll.Failed):
                    r.reported = True
                    ok = st == KVPoll.Success
                    emit(Done(room=room, ok=ok, t=now, reason=s.failure_reason(room) or ""))
                continue
            if now >= r.next_check:
                r.next_check = now + _DRAIN_CHECK_S
                if s.drained(room):
                    s.clear(room)
                    del self.rooms[room]
                    emit(Drained(room=room, t=time.monotonic()))

    def _send(self, r: _PRoom) -> None:
        """The room was admitted: cut it into the scheduler's segments and post them (all at
        once, or one every ``pace_s``)."""
        try:
            self.sender.dest(r.room)
            cap = self.sender.capacity_tokens(r.room)
        except (KeyError, ValueError):
            return  # failed meanwhile (an abort): the outcome says why
        r.segs = list(
            self.sched.split_send(
                token_start=0,
                token_end=r.tokens,
                decode_prefix_len=0,
                is_last_send=True,
                capacity_tokens=cap,
            )
        )
        self._post(r, time.monotonic())

    def _post(self, r: _PRoom, now: float) -> None:
        g = self.spec.geometry
        pages = kvm.src_pages(g, r.room, r.tokens)
        while r.segs:
            seg = r.segs.pop(0)
            try:
                self.sender.send(r.room, seg, pages[seg.token_start // g.page_size :])
            except (KeyError, ValueError):
                r.segs = []  # failed meanwhile: the outcome says why
                return
            if r.pace_s > 0:
                r.next_seg = now + r.pace_s
                return

    def close(self) -> None:
        """Close the consensus and the sender."""
        if self.consensus is not None:
            self.consensus.close()
        self.sender.close()


class _DRoom(msgspec.Struct, kw_only=True):
    room: int
    tokens: int
    pages: list[Any]
    reported: bool = False
    next_check: float = 0.0


class DecodeWorker:
    """One decode instance: a receiver per DCP rank (see the module docstring)."""

    def __init__(self, spec: Spec, emit: Emit) -> None:
        from pdplug import PluginManager
        from pdplug.bootstrap import resolve

        self.spec = spec
        g = self.g = spec.geometry
        pm = PluginManager()
        rows = g.dst_pages * g.page_size
        entries = 2 * g.num_layers
        self.kv = [
            [np.full((rows, g.entry_bytes), kvm.POISON, dtype=np.uint8) for _ in range(entries)]
            for _ in range(g.dcp_size)
        ]
        self.recvs: list[Any] = []
        for r in range(g.dcp_size):
            rc = pm.make_kv_receiver(
                _kv_config(spec, "decode", kvm.dst_layout(g, r)), name=spec.backend
            )
            rc.register_kv([(a.ctypes.data, a.nbytes) for a in self.kv[r]])
            self.recvs.append(rc)
        peers = resolve(spec.rendezvous, spec.prefill, timeout_s=60.0, wire=_wire(spec))
        for rc in self.recvs:
            rc.connect(peers)
        self.src = [kvm.src_entries(g, k) for k in range(g.pp_size)]
        self.free = [deque(range(g.dst_pages)) for _ in range(g.dcp_size)]
        self.owner = [np.full(g.dst_pages, -1, dtype=np.int64) for _ in range(g.dcp_size)]
        self.rooms: dict[int, _DRoom] = {}
        emit(Ready(pid=os.getpid(), t=time.monotonic()))

    def _rows(self, pages: np.ndarray) -> np.ndarray:
        p = self.g.page_size
        return (pages[:, None] * p + np.arange(p)).reshape(-1)

    def _changed(self, r: int, pages: np.ndarray) -> dict[int, int]:
        """``{room: bytes}`` of ``pages`` (rank ``r``) that are no longer poison, by the room
        that held them last; the pages are poisoned again."""
        if not len(pages):
            return {}
        rows = self._rows(pages)
        per_page = np.zeros(len(pages), dtype=np.int64)
        for a in self.kv[r]:
            bad = (a[rows] != kvm.POISON).reshape(len(pages), -1).sum(axis=1)
            per_page += bad
        out: dict[int, int] = {}
        for i in np.flatnonzero(per_page):
            room = int(self.owner[r][pages[i]])
            out[room] = out.get(room, 0) + int(per_page[i])
        if out:
            for a in self.kv[r]:
                a[rows] = kvm.POISON
        return out

    def handle(self, cmd: Command, emit: Emit) -> None:
        """:class:`Expect`, :class:`Resolve`, :class:`Check`, :class:`Stats`."""
        if isinstance(cmd, Expect):
            self._expect(cmd, emit)
        elif isinstance(cmd, Resolve):
            from pdplug.bootstrap import resolve

            try:
                peers = resolve(
                    self.spec.rendezvous,
                    cmd.instance,
                    timeout_s=cmd.timeout_s,
                    wire=_wire(self.spec),
                )
                emit(
                    Found(instance=cmd.instance, endpoints=tuple(p.control_endpoint for p in peers))
                )
            except Exception as e:
                emit(Found(instance=cmd.instance, error=f"{type(e).__name__}: {e}"))
        elif isinstance(cmd, Check):
            changed: dict[int, int] = {}
            n = 0
            for r in range(self.g.dcp_size):
                pages = np.fromiter(self.free[r], dtype=np.int64)
                n += len(pages)
                for room, b in self._changed(r, pages).items():
                    changed[room] = changed.get(room, 0) + b
            undrained = tuple(sorted(room for room, d in self.rooms.items() if d.reported))
            emit(Checked(pages=n, changed=tuple(changed.items()), undrained=undrained))
        elif isinstance(cmd, Stats):
            emit(StatsOf(stats={f"dcp{r}": rc.stats() for r, rc in enumerate(self.recvs)}))

    def _expect(self, cmd: Expect, emit: Emit) -> None:
        g = self.g
        n = kvm.dst_pages_needed(g, cmd.tokens)
        if any(len(f) < n for f in self.free):
            emit(Done(room=cmd.room, ok=False, t=time.monotonic(), reason="decode: out of pages"))
            return
        pages = [np.array([f.popleft() for _ in range(n)], dtype=np.int64) for f in self.free]
        now = time.monotonic()
        for r, p in enumerate(pages):
            for room, b in self._changed(r, p).items():
                emit(Landed(room=room, nbytes=b, t=now))
        for r, rc in enumerate(self.recvs):
            rc.expect(cmd.room, pages[r], num_tokens=cmd.tokens, instance=self.spec.prefill)
        self.rooms[cmd.room] = _DRoom(room=cmd.room, tokens=cmd.tokens, pages=pages)

    def step(self, now: float, emit: Emit) -> None:
        """Outcomes (byte-checked), then releases of drained rooms."""
        from pdplug import KVPoll

        for room, d in list(self.rooms.items()):
            if not d.reported:
                polls = [rc.poll(room) for rc in self.recvs]
                if not all(p in (KVPoll.Success, KVPoll.Failed) for p in polls):
                    continue
                d.reported = True
                ok = all(p == KVPoll.Success for p in polls)
                reason = next(
                    (
                        rc.failure_reason(room) or ""
                        for rc in self.recvs
                        if rc.poll(room) == KVPoll.Failed
                    ),
                    "",
                )
                g = self.g
                wrong = 0
                if ok:
                    wrong = sum(
                        kvm.wrong_bytes(g, self.kv[r], r, room, d.tokens, d.pages[r], self.src)
                        for r in range(g.dcp_size)
                    )
                emit(
                    Done(
                        room=room,
                        ok=ok,
                        t=now,
                        reason=reason,
                        wrong_bytes=wrong,
                        kv_bytes=kvm.room_kv_bytes(g, d.tokens),
                    )
                )
            if now >= d.next_check:
                d.next_check = now + _DRAIN_CHECK_S
                if all(rc.drained(room) for rc in self.recvs):
                    self._release(d)
                    emit(Drained(room=room, t=time.monotonic()))

    def _release(self, d: _DRoom) -> None:
        del self.rooms[d.room]
        for r, rc in enumerate(self.recvs):
            rc.clear(d.room)
            rows = self._rows(d.pages[r])
            for a in self.kv[r]:
                a[rows] = kvm.POISON
            self.owner[r][d.pages[r]] = d.room
            self.free[r].extend(int(p) for p in d.pages[r])

    def close(self) -> None:
        """Close every receiver."""
        for rc in self.recvs:
            rc.close()


class Intruder:
    """A host that is not a member: no key (see the module docstring)."""

    def __init__(self, spec: Spec, emit: Emit) -> None:
        self.spec = spec
        emit(Ready(pid=os.getpid(), t=time.monotonic()))

    def _forged(self, kind: str, identities: tuple[str, ...]) -> Iterator[bytes]:
        """Well-formed frames of ``kind``: sealed under a wrong key and under none."""
        from pdplug import WireConfig
        from pdplug.bootstrap import Register, Registered, Resolve, Resolved
        from pdplug.transfer.messages import Abort, Heartbeat, Hello, control_codec
        from pdplug.types import Decision, DestInfo, PeerInfo, Vote
        from pdplug.wire import Codec

        g = self.spec.geometry
        fake = f"tcp://{self.spec.addr}:1"
        prefill = PeerInfo(
            instance="prefill-0",
            role="prefill",
            layout=kvm.src_layout(g, 0),
            control_endpoint=fake,
            backend=self.spec.backend,
            agent=b"forged",
        )
        decode = PeerInfo(
            instance="dec-0",
            role="decode",
            layout=kvm.dst_layout(g, 0),
            control_endpoint=fake,
            backend=self.spec.backend,
            agent=b"forged",
            entry_base=(4096,) * (2 * g.num_layers),
        )
        for wire in (WireConfig(hmac_key=secrets.token_bytes(32)), WireConfig()):
            for ident in identities or ("intruder",):
                if kind == "rendezvous":
                    codec: Any = Codec.from_config(
                        wire, Register, Resolve, Registered, Resolved, identity=ident
                    )
                    msgs: list[Any] = [Register(peer=prefill, ref=1), Resolve(instance="prefill-0")]
                elif kind == "sender":
                    codec = control_codec(wire, identity=ident)
                    msgs = [
                        Hello(peer=decode, nonce=1),
                        DestInfo(
                            room=1,
                            generation=1,
                            decode_instance="dec-0",
                            dcp_rank=0,
                            dst_pages=np.arange(4, dtype=np.int64).tobytes(),
                            num_tokens=64,
                        ),
                        Abort(room=1, generation=1),
                        Heartbeat(seq=1),
                    ]
                else:
                    codec = Codec.from_config(wire, Vote, Decision, identity=ident)
                    msgs = [
                        Vote(stream="bootstrap", rank=1, seq=1, good=(1, 2, 3)),
                        Decision(stream="bootstrap", seq=0, bad=(1, 2, 3)),
                    ]
                for m in msgs:
                    yield codec.encode(m)

    def handle(self, cmd: Command, emit: Emit) -> None:
        """:class:`Attack`: send to every target, then answer how many frames went."""
        import socket

        import zmq

        if not isinstance(cmd, Attack):
            return
        ctx: Any = zmq.Context.instance()
        sent: dict[str, int] = {}
        malformed = [
            [b""],
            [b"\xc1"],
            [os.urandom(31)],
            [os.urandom(64)],
            [os.urandom(4096)],
            [b"\x93\x01\x02"],
            [b"a", b"b", b"c"],
            [os.urandom(1 << 20)],
            [b"\x00" * (17 << 20)],  # over the 16 MiB limit: libzmq drops the connection
        ]
        for ep, kind in cmd.targets:
            n = 0
            frames = [[f] for f in self._forged(kind, cmd.identities)] + malformed
            for batch in (frames[:-1], frames[-1:]):  # the oversized one on its own connection
                sock = ctx.socket(zmq.DEALER)
                sock.setsockopt(zmq.LINGER, 2000)
                sock.connect(ep)
                for f in batch:
                    sock.send_multipart(f)
                    n += 1
                time.sleep(0.2)
                sock.close()
            host, port = ep.removeprefix("tcp://").rsplit(":", 1)
            try:  # bytes that are not even ZMTP
                with socket.create_connection((host, int(port)), timeout=2) as raw:
                    raw.sendall(os.urandom(4096))
                    n += 1
            except OSError:
                pass
            sent[ep] = n
        emit(Attacked(sent=sent))

    def step(self, now: float, emit: Emit) -> None:
        """Nothing between attacks."""

    def close(self) -> None:
        """Nothing to close (sockets close after each attack)."""


ROLES: dict[str, Any] = {
    "rendezvous": RendezvousWorker,
    "prefill": PrefillWorker,
    "decode": DecodeWorker,
    "intruder": Intruder,
}


def main() -> None:
    """Read the spec, build the role, serve commands until :class:`Quit` or stdin closes."""
    out = os.fdopen(os.dup(1), "wb", buffering=0)
    os.dup2(2, 1)  # a library's own prints go to the log, never into the event stream
    logging.basicConfig(
        stream=sys.stderr, level=logging.WARNING, format="%(asctime)s %(name)s: %(message)s"
    )

    def emit(ev: Event) -> None:
        out.write(encode(ev))

    lines = Lines(0)
    try:
        spec = decode_spec(lines.first(60.0))
        worker = ROLES[spec.role](spec, emit)
        period = 0.002
        while True:
            for line in lines.read(period):
                cmd = decode_command(line)
                if isinstance(cmd, Quit):
                    worker.close()
                    emit(Bye())
                    return
                worker.handle(cmd, emit)
            if lines.eof:  # the driver is gone
                worker.close()
                return
            worker.step(time.monotonic(), emit)
    except BaseException:
        emit(Error(trace=traceback.format_exc()))
        raise


if __name__ == "__main__":
    main()
