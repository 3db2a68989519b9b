"""A decode process for the transfer benchmarks (``bench transfer`` / ``bench pack``).

The benchmark process is the prefill side (a real :class:`~pdplug.protocols.KVSender` from the
plugin manager, plus the raw engine for the side-by-side baseline); this spawned process holds
one real :class:`~pdplug.protocols.KVReceiver` per decode DCP rank of one or more decode
instances, connected through a rendezvous. Commands and events cross a Pipe as msgspec-JSON
(no pickle); PeerInfos cross as msgspec-msgpack bytes (hex). For the byte checks
(:mod:`pdplug_bench.bytecheck`) it poisons expected pages before a checked run and returns
digests of the rows that landed. It also reports when the raw baseline's writes have landed
(:meth:`DecodePeer.landed`: their notifications, from an agent no receiver knows, were taken).
"""

from __future__ import annotations

import multiprocessing as mp
import os
import time
from typing import Any

import msgspec

from pdplug.types import KVLayout, PeerInfo

__all__ = ["DecodeInstance", "DecodePeer"]


class DecodeInstance(msgspec.Struct, frozen=True, kw_only=True):
    """One decode instance: ``layout.dcp_size`` receivers (dcp_rank set per receiver).

    :ivar rows: token rows of every sharded entry (drafts unsupported here).
    :ivar prefill: the prefill instance its receivers connect to ("" = the peer's default).
    :ivar extra: the receivers' ``KVConfig.extra`` (backend options).
    """

    name: str
    layout: KVLayout
    rows: int
    prefill: str = ""
    extra: dict[str, str] = {}


_enc = msgspec.json.Encoder()


def _send(conn: Any, **msg: Any) -> None:
    conn.send_bytes(_enc.encode(msg))


def _fill(kv: list[Any], page: int, pages: list[int], value: int) -> None:
    """Fill every row of ``pages`` (``page`` tokens each) of every entry with ``value``."""
    import torch

    idx = torch.as_tensor(pages, dtype=torch.int64)
    for t in kv:
        t.view(-1, page, t.shape[1])[idx] = value


def _worker(conn: Any, backend: str, endpoint: str, prefill: str, spec: bytes) -> None:
    import numpy as np
    import torch

    from pdplug import KVConfig, KVPoll, PluginManager
    from pdplug.bootstrap import resolve
    from pdplug_bench.bytecheck import dst_rows, rows_digest

    insts = msgspec.msgpack.decode(spec, type=list[DecodeInstance])
    pm = PluginManager()
    recvs: dict[str, list[Any]] = {}
    keep: list[Any] = []
    infos: dict[str, list[str]] = {}
    kvs: dict[str, list[list[Any]]] = {}
    pages_of: dict[str, int] = {}
    for inst in insts:
        kvs[inst.name] = []
        pages_of[inst.name] = inst.layout.page_size
        peers = resolve(endpoint, inst.prefill or prefill, timeout_s=60)
        recvs[inst.name] = []
        for r in range(inst.layout.dcp_size):
            lay = msgspec.structs.replace(inst.layout, dcp_rank=r)
            cfg = KVConfig(
                instance=inst.name,
                role="decode",
                layout=lay,
                bootstrap_timeout_s=60,
                waiting_timeout_s=120,
                transfer_timeout_s=60,
                extra=inst.extra,
            )
            rc = pm.make_kv_receiver(cfg, name=backend)
            kv = [torch.empty((inst.rows, b), dtype=torch.uint8) for b in lay.entry_bytes_per_token]
            for t in kv:
                t.fill_(0x5A)  # touch the pages so the first transfer does not fault them in
            keep.append(kv)
            kvs[inst.name].append(kv)
            rc.register_kv(kv)
            rc.connect(peers)
            recvs[inst.name].append(rc)
        infos[inst.name] = [msgspec.msgpack.encode(rc.peer_info()).hex() for rc in recvs[inst.name]]
    _send(conn, event="ready", infos=infos, pid=os.getpid())
    watching: dict[int, str] = {}
    landing: dict[int, tuple[str, int]] = {}  # reply id -> (instance, foreign notifications)
    while True:
        while conn.poll(0):
            cmd = msgspec.json.decode(conn.recv_bytes())
            if cmd["op"] == "quit":
                for rs in recvs.values():
                    for rc in rs:
                        rc.close()
                _send(conn, event="bye")
                return
            if cmd["op"] == "expect":
                name, room = cmd["instance"], cmd["room"]
                for r, rc in enumerate(recvs[name]):
                    if cmd.get("poison") is not None:  # before expect: nothing lands yet
                        _fill(kvs[name][r], pages_of[name], cmd["pages"][r], cmd["poison"])
                    pages = np.asarray(cmd["pages"][r], dtype=np.int64)
                    rc.expect(room, pages, num_tokens=cmd["num_tokens"])
                watching[room] = name
            elif cmd["op"] == "fill":
                name = cmd["instance"]
                for r, pages in enumerate(cmd["pages"]):
                    _fill(kvs[name][r], pages_of[name], pages, cmd["value"])
                _send(conn, event="filled", id=cmd["id"])
            elif cmd["op"] == "digest":
                name = cmd["instance"]
                out = []
                for r, (pages, n) in enumerate(zip(cmd["pages"], cmd["tokens"])):
                    kv = kvs[name][r]
                    rows = dst_rows(pages, pages_of[name], n)
                    if cmd.get("corrupt") and n and r == 0:  # test hook: one wrong byte landed
                        kv[0][int(rows[n // 2]), 0] ^= 0xFF
                    out.append(rows_digest(kv, rows))
                _send(conn, event="digest", id=cmd["id"], digests=out)
            elif cmd["op"] == "landed":
                landing[cmd["id"]] = (cmd["instance"], cmd["count"])
            elif cmd["op"] == "clear":
                for rc in recvs[cmd["instance"]]:
                    rc.clear(cmd["room"])
                watching.pop(cmd["room"], None)  # a room cleared before its verdict has none
        for room, name in list(watching.items()):
            polls = [rc.poll(room) for rc in recvs[name]]
            if all(p in (KVPoll.Success, KVPoll.Failed) for p in polls):
                _send(
                    conn,
                    event="done",
                    room=room,
                    ok=all(p == KVPoll.Success for p in polls),
                    reasons=[rc.failure_reason(room) for rc in recvs[name]],
                )
                del watching[room]
        for ident, (name, count) in list(landing.items()):
            # a NIXL notification arrives after its write's bytes: a raw write that notified
            # a receiver (dropped there as from an unknown rank) has landed
            seen = sum(rc.stats().get("tags_dropped_unknown_rank", 0) for rc in recvs[name])
            if seen >= count:
                _send(conn, event="landed", id=ident, seen=seen)
                del landing[ident]
        time.sleep(0.0005)


def _main(conn: Any, backend: str, endpoint: str, prefill: str, spec: bytes) -> None:
    try:
        _worker(conn, backend, endpoint, prefill, spec)
    except KeyboardInterrupt:
        # a terminal's Ctrl-C reaches this process too: the bench, its parent, says so (it
        # stops at the lost pipe); a traceback from here would only bury that line
        return
    except BaseException as e:
        _send(conn, event="error", error=f"{type(e).__name__}: {e}")
        raise
    conn.close()


class DecodePeer:
    """Spawn the decode process and talk to it.

    :param backend: KV sender name (``"nixl"``, ``"mooncake"``).
    :param endpoint: rendezvous endpoint; ``prefill``: the prefill instance to connect to.
    :param instances: the decode instances to build.
    """

    def __init__(
        self, backend: str, endpoint: str, prefill: str, instances: list[DecodeInstance]
    ) -> None:
        ctx = mp.get_context("spawn")
        self.conn, child = ctx.Pipe()
        spec = msgspec.msgpack.encode(instances)
        self.proc = ctx.Process(
            target=_main, args=(child, backend, endpoint, prefill, spec), daemon=True
        )
        self.proc.start()
        self.infos: dict[str, list[PeerInfo]] = {}
        self._seq = 0
        self._backlog: list[dict[str, Any]] = []  # events that came while waiting for another

    def _recv(self, timeout: float) -> dict[str, Any]:
        if not self.conn.poll(timeout):
            raise TimeoutError(f"decode process: no answer in {timeout} s")
        msg = msgspec.json.decode(self.conn.recv_bytes())
        if msg.get("event") == "error":
            raise RuntimeError(f"decode process failed: {msg['error']}")
        return msg  # type: ignore[no-any-return]

    def wait_ready(self, timeout: float = 120.0) -> None:
        """Block until every receiver connected; keeps their PeerInfos in ``infos``."""
        msg = self._recv(timeout)
        self.infos = {
            k: [msgspec.msgpack.decode(bytes.fromhex(h), type=PeerInfo) for h in v]
            for k, v in msg["infos"].items()
        }

    def expect(
        self,
        instance: str,
        room: int,
        pages: list[list[int]],
        num_tokens: int,
        poison: int | None = None,
    ) -> None:
        """Every receiver of ``instance`` expects ``room`` (``pages[r]`` for DCP rank r); with
        ``poison``, their pages are first filled with that byte (for a byte check)."""
        _send(
            self.conn,
            op="expect",
            instance=instance,
            room=room,
            pages=pages,
            num_tokens=num_tokens,
            poison=poison,
        )

    def _next(self, event: str, key: str, value: Any, timeout: float) -> dict[str, Any]:
        """The first event named ``event`` whose ``key`` is ``value``; others are kept."""
        for i, msg in enumerate(self._backlog):
            if msg.get("event") == event and msg.get(key) == value:
                return self._backlog.pop(i)
        while True:
            msg = self._recv(timeout)
            if msg.get("event") == event and msg.get(key) == value:
                return msg
            self._backlog.append(msg)

    def _reply(self, event: str, ident: int, timeout: float) -> dict[str, Any]:
        return self._next(event, "id", ident, timeout)

    def fill(
        self, instance: str, pages: list[list[int]], value: int, timeout: float = 120.0
    ) -> None:
        """Fill ``pages[r]`` of DCP rank r of ``instance`` with byte ``value`` (returns once
        done)."""
        self._seq += 1
        _send(self.conn, op="fill", instance=instance, pages=pages, value=value, id=self._seq)
        self._reply("filled", self._seq, timeout)

    def digest(
        self,
        instance: str,
        pages: list[list[int]],
        tokens: list[int],
        corrupt: bool = False,
        timeout: float = 120.0,
    ) -> list[str]:
        """Digests (:func:`pdplug_bench.bytecheck.rows_digest`) of the first ``tokens[r]`` local
        tokens in ``pages[r]`` of DCP rank r of ``instance``. ``corrupt`` (tests only) flips one
        landed byte first, as a faulty write would."""
        self._seq += 1
        _send(self.conn, op="digest", instance=instance, pages=pages, tokens=tokens,
              corrupt=corrupt, id=self._seq)  # fmt: skip
        return list(self._reply("digest", self._seq, timeout)["digests"])

    def landed(self, instance: str, count: int, timeout: float = 60.0) -> int:
        """Block until the receivers of ``instance`` have taken ``count`` engine notifications
        in all from agents they do not know (the raw baseline's NIXL writes, whose notification
        follows their bytes); returns how many they took.

        :raises TimeoutError: not within ``timeout`` seconds.
        """
        self._seq += 1
        _send(self.conn, op="landed", instance=instance, count=count, id=self._seq)
        return int(self._reply("landed", self._seq, timeout)["seen"])

    def done(self, room: int, timeout: float = 120.0) -> dict[str, Any]:
        """The decode side's verdict on ``room`` (verdicts of other rooms are kept)."""
        return self._next("done", "room", room, timeout)

    def clear(self, instance: str, room: int) -> None:
        """Forget ``room`` on every receiver of ``instance``."""
        _send(self.conn, op="clear", instance=instance, room=room)

    def close(self) -> None:
        """Stop the process (bounded)."""
        try:
            _send(self.conn, op="quit")
            self.proc.join(10)
        finally:
            if self.proc.is_alive():
                self.proc.kill()
                self.proc.join(5)
