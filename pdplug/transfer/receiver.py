"""Decode side: :class:`KVReceiverSession`, the engine-neutral KV receiver both default
backends use.

One session per decode rank (one per DCP rank). It registers the rank's KV entries with the
engine, connects a DEALER to every prefill rank's control endpoint (handshake:
:class:`~pdplug.transfer.messages.Hello` / ``HelloAck``, compat checked on both sides), sends
one :class:`~pdplug.types.DestInfo` per request to every prefill rank, and completes rooms from
strictly validated :class:`~pdplug.types.ChunkTag` s — engine notifications (NIXL) or
:class:`~pdplug.transfer.messages.Done` frames on the control channel (Mooncake, and failures
for every engine). A tag is accepted only if it names the current lease generation of its room,
comes from the source rank it claims (socket or engine agent name), and is not a duplicate;
anything else is dropped and counted (``stale``, ``unknown_rank``, ``malformed``, ``other``).
A room is ``Success`` once every source rank delivered chunks ``0..last`` (its ``is_last``
chunk included) — counting positives with a negative twin: a ``ChunkTag(ok=False)`` fails the
room at once, a silent source fails it after ``transfer_timeout_s``, and so do the room
deadlines (SGLang ``TransferStatus.is_done`` + generations, prior-art sglang.md §4; vLLM PR
#50754).
"""

from __future__ import annotations

import logging
import random
import time
import uuid
from collections import Counter
from collections.abc import Sequence
from concurrent.futures import Future
from concurrent.futures import TimeoutError as FutureTimeout
from typing import TYPE_CHECKING, Any

import msgspec
import numpy as np
import zmq

from pdplug.bootstrap import rank_of
from pdplug.config import KVConfig
from pdplug.errors import CompatError, TransferError
from pdplug.rooms import Rooms
from pdplug.transfer.engine import TransferEngine, dedup_regions
from pdplug.transfer.loop import EngineLoop
from pdplug.transfer.messages import (
    Abort,
    Done,
    Heartbeat,
    Hello,
    HelloAck,
    control_codec,
    tag_codec,
)
from pdplug.transfer.sender import Compat, Emit, default_compat, default_emit, entries_geometry
from pdplug.transfer.session import RoomSession
from pdplug.types import ChunkTag, DestInfo, KVPoll, PdplugEvent, PeerInfo, pages_to_bytes

if TYPE_CHECKING:
    import torch

__all__ = ["KVReceiverSession"]

log = logging.getLogger(__name__)

_MAX_CHUNKS = 1 << 24  # chunk ids above this are malformed


class _Source(msgspec.Struct, kw_only=True):
    instance: str
    rank: int
    info: PeerInfo
    sock: Any
    agent_name: str
    nonce: int
    last_seen: float
    alive: bool = True
    state: str = "pending"  # pending | accepted | refused
    mismatches: tuple[str, ...] = ()


class _Lease(msgspec.Struct, kw_only=True):
    room: int
    generation: int
    instance: str
    dest: DestInfo
    sources: tuple[int, ...]
    got: dict[int, set[int]] = {}
    last: dict[int, int] = {}
    stopped: set[int] = set()
    failed_at: float = 0.0
    done: bool = False


class KVReceiverSession(RoomSession):
    """Engine-neutral decode-side KV receiver (implements :class:`pdplug.protocols.KVReceiver`).

    :param config: this rank's :class:`~pdplug.config.KVConfig` (``role="decode"``).
    :param engine: the backend adapter (:class:`~pdplug.transfer.engine.TransferEngine`).
    :param compat: handshake check ``(local, remote) -> mismatches``; default
        :func:`~pdplug.transfer.sender.default_compat`.
    :param emit: observer callback for room outcomes (``transfer_done`` /
        ``transfer_failed``, once per room); ``None`` disables.
    :raises ValueError: ``config.role`` is not ``"decode"``.
    """

    def __init__(
        self,
        config: KVConfig,
        engine: TransferEngine,
        *,
        compat: Compat | None = None,
        emit: Emit | None = default_emit,
    ) -> None:
        if config.role != "decode":
            raise ValueError(
                f"KVReceiverSession: KVConfig.role must be 'decode', got {config.role!r}"
            )
        self.config = config
        self.layout = config.layout
        self.engine = engine
        self.compat: Compat = compat or default_compat
        self._emit = emit
        self._events: list[PdplugEvent] = []
        self.rooms = Rooms.from_config(config)
        w = config.wire
        name = f"{config.instance}/d{config.layout.dcp_rank}"
        self._codec = control_codec(w, name=f"{name}/control")
        self._tags = tag_codec(w, name=f"{name}/tags")
        self._hb_s = max(0.05, min(1.0, config.transfer_timeout_s / 5))
        self._peer_timeout_s = config.transfer_timeout_s
        self._sources: dict[str, dict[int, _Source]] = {}
        self._by_sock: dict[Any, _Source] = {}
        self._by_agent: dict[str, _Source] = {}
        self._pending_connect: list[tuple[list[_Source], Future[list[_Source]]]] = []
        self._leases: dict[int, _Lease] = {}
        self._draining: dict[int, _Lease] = {}
        self._num_pages = 0
        self._info: PeerInfo | None = None
        self._next_periodic = 0.0
        self._next_hb = 0.0
        self._hb_seq = 0
        self.counts: Counter[str] = Counter()
        self._closed = False
        self._loop = EngineLoop(
            f"pdplug-{engine.name}-recv-{config.instance}-{config.layout.dcp_rank}",
            self._step,
            lambda: False,
            idle_s=self._idle_s,
        )
        self._loop.start()

    # ================================================================== host-facing API
    def register_kv(self, entries: Sequence[torch.Tensor]) -> None:
        """Register the rank's KV entries (``layout`` order) once.

        Sharded entries hold ``[num_pages * page_size]`` token rows; draft entries hold
        ``[num_pages * page_size * dcp_size]`` (whole virtual pages).

        :raises ValueError: entry count/shape/contiguity (named).
        :raises TransferError: the engine refused the memory.
        """
        lay = self.layout
        drafts = set(lay.draft_entries)
        per_page = [
            lay.page_size * (lay.dcp_size if e in drafts else 1) for e in range(lay.num_entries)
        ]
        base, nbytes, pages = entries_geometry(entries, lay.entry_bytes_per_token, per_page)
        self._loop.call(lambda: self._register(base, nbytes, pages), 60.0)

    def peer_info(self) -> PeerInfo:
        """What this rank sends to prefill ranks at the handshake (after :meth:`register_kv`).

        :raises TransferError: :meth:`register_kv` was not called.
        """
        if self._info is None:
            raise TransferError("KVReceiver.peer_info: call register_kv first")
        return self._info

    def connect(self, prefill: Sequence[PeerInfo], timeout_s: float | None = None) -> None:
        """Handshake with every rank of one prefill instance (from
        :func:`pdplug.bootstrap.resolve`); bounded by ``timeout_s`` (default
        ``bootstrap_timeout_s``).

        :raises CompatError: naming every mismatch, from this side's check and from each
            prefill rank's refusal (page size, bytes per token, dtype, layout version, backend,
            plugin vetoes).
        :raises TransferError: a prefill rank did not answer in time.
        :raises ValueError: ``prefill`` is empty or spans several instances.
        """
        peers = list(prefill)
        if not peers:
            raise ValueError("KVReceiver.connect: prefill is empty; pass every rank's PeerInfo")
        inst = {p.instance for p in peers}
        if len(inst) != 1:
            raise ValueError(f"KVReceiver.connect: peers span several instances {sorted(inst)}")
        instance = peers[0].instance
        local = self.peer_info()
        mine: list[str] = []
        for p in peers:
            for m in self._local_check(local, p):
                mine.append(f"prefill {instance} rank {rank_of(p.layout)}: {m}")
        limit = self.config.bootstrap_timeout_s if timeout_s is None else timeout_s
        fut = self._loop.call(lambda: self._connect(instance, peers), 10.0)
        try:
            sources = fut.result(timeout=limit)
        except FutureTimeout as e:
            missing = self._loop.call(lambda: self._abandon_connect(fut), 10.0)
            raise TransferError(
                f"KVReceiver.connect: prefill {instance} ranks {missing} did not answer the "
                f"handshake in {limit:g} s (KVConfig.bootstrap_timeout_s)"
            ) from e
        theirs = [
            f"prefill {instance} rank {s.rank} refused: {m}"
            for s in sources
            if s.state == "refused"
            for m in s.mismatches
        ]
        fields = {_field(m) for m in theirs}
        merged = theirs + [m for m in mine if _field(m) not in fields]
        if merged:
            self._loop.call(lambda: self._disconnect(instance), 10.0)
            raise CompatError(merged)

    def expect(
        self,
        room: int,
        dst_pages: np.ndarray,
        *,
        decode_prefix_len: int = 0,
        num_tokens: int = 0,
        instance: str | None = None,
    ) -> int:
        """Lease ``room`` and send its DestInfo to every prefill rank; returns the generation.

        :param dst_pages: int64 ``[n]`` destination (virtual) page ids of this rank from
            ``decode_prefix_len`` on; every id must be a registered page.
        :param decode_prefix_len: tokens decode already holds (a multiple of the virtual page,
            ``page_size * dcp_size`` tokens).
        :param num_tokens: the prompt length in tokens (0: unknown, unchecked).
        :param instance: the prefill instance; optional when only one is connected.
        :raises ValueError: a page id out of range, too few pages for ``num_tokens``, an
            unaligned prefix, an unknown instance or an already-leased room (each named).
        """
        lay = self.layout
        vpage = lay.page_size * lay.dcp_size
        inst = self._instance(instance)
        pages = np.asarray(dst_pages, dtype=np.int64).reshape(-1)
        if pages.size and (pages.min() < 0 or pages.max() >= self._num_pages):
            bad = int(pages[(pages < 0) | (pages >= self._num_pages)][0])
            raise ValueError(
                f"KVReceiver.expect: dst_pages has page {bad}, outside [0, {self._num_pages}) "
                f"registered pages (room {room})"
            )
        if decode_prefix_len < 0 or decode_prefix_len % vpage:
            raise ValueError(
                f"KVReceiver.expect: decode_prefix_len={decode_prefix_len} must be a multiple of "
                f"the virtual page ({lay.page_size} x dcp {lay.dcp_size} = {vpage} tokens)"
            )
        if num_tokens:
            need = -(-(num_tokens - decode_prefix_len) // vpage)
            if num_tokens < decode_prefix_len or pages.size < need:
                raise ValueError(
                    f"KVReceiver.expect: num_tokens={num_tokens} with decode_prefix_len="
                    f"{decode_prefix_len} needs {max(need, 0)} pages, got {pages.size}"
                )
        if room in self.rooms:
            raise ValueError(f"KVReceiver.expect: room {room} is already leased; clear it first")
        gen = self.rooms.lease(room, KVPoll.WaitingForInput)
        dest = DestInfo(
            room=room,
            generation=gen,
            decode_instance=self.config.instance,
            dcp_rank=lay.dcp_rank,
            dst_pages=pages_to_bytes(pages),
            decode_prefix_len=decode_prefix_len,
            num_tokens=num_tokens,
        )
        self._loop.submit(lambda: self._expect(inst, dest))
        return gen

    def abort(self, room: int, reason: str = "aborted") -> None:
        """Fail ``room`` here and tell every prefill rank to stop sending it."""
        gen = self.rooms.generation(room)
        if gen is None:
            return
        self.rooms.fail(room, f"aborted on decode dcp {self.layout.dcp_rank}: {reason}", gen)
        self._loop.submit(lambda: self._abort(room, gen, reason))

    def clear(self, room: int) -> None:
        """Forget ``room``; later tags of its generation are dropped as stale. An unfinished
        room is aborted first (the prefill ranks are told)."""
        gen = self.rooms.generation(room)
        if gen is None:
            return
        if self.rooms.status(room) not in (KVPoll.Success, KVPoll.Failed):
            self.abort(room, "cleared before completion")
        self.rooms.clear(room, gen)
        self._loop.submit(lambda: self._clear(room, gen))

    def stats(self) -> dict[str, Any]:
        """Counters: chunks, rooms_ok/failed, sources_dead, and drops by reason for the
        control channel (``control_dropped_*``) and engine notifications (``tags_dropped_*``)."""
        out: dict[str, Any] = {"backend": self.engine.name, "dcp_rank": self.layout.dcp_rank}
        out.update(self.counts)
        out.update({f"control_{k}": v for k, v in self._codec.stats().items()})
        out.update({f"tags_{k}": v for k, v in self._tags.stats().items()})
        out["loop_errors"] = self._loop.errors
        return out

    # ================================================================== helpers
    def _local_check(self, local: PeerInfo, remote: PeerInfo) -> list[str]:
        out: list[str] = []
        if remote.role != "prefill":
            out.append(f"role: expected 'prefill', got {remote.role!r}")
        if remote.backend != self.engine.name:
            out.append(f"backend: local {self.engine.name} vs remote {remote.backend or '?'}")
        if not remote.control_endpoint:
            out.append("control_endpoint: empty")
        try:
            out.extend(self.compat(local, remote))
        except Exception as e:
            out.append(f"compat check raised {type(e).__name__}: {e}")
        return out

    def _instance(self, instance: str | None) -> str:
        names = list(self._sources)
        if instance is None:
            if len(names) != 1:
                raise ValueError(
                    f"KVReceiver.expect: instance is required when {len(names)} prefill "
                    f"instances are connected ({names})"
                )
            return names[0]
        if instance not in self._sources:
            raise ValueError(f"KVReceiver.expect: prefill instance {instance!r} not connected")
        return instance

    def _idle_s(self) -> float:
        return 0.001 if (self.engine.notifications and self._leases) else 0.005

    # ================================================================== engine thread
    def _register(self, base: np.ndarray, nbytes: np.ndarray, pages: int) -> None:
        if self._info is not None:
            raise TransferError("KVReceiver.register_kv: already registered")
        self.engine.register(dedup_regions([(int(b), int(n)) for b, n in zip(base, nbytes)]))
        self._num_pages = pages
        cfg = self.config
        self._info = PeerInfo(
            instance=cfg.instance,
            role="decode",
            layout=cfg.layout,
            backend=self.engine.name,
            agent=self.engine.agent(),
            entry_base=tuple(int(b) for b in base),
            extra={"agent_name": self.engine.agent_name()},
        )

    def _shutdown(self) -> None:
        self._flush_events()
        for inst in list(self._sources):
            self._disconnect(inst)
        self.engine.close()

    def _connect(self, instance: str, peers: list[PeerInfo]) -> Future[list[_Source]]:
        fut: Future[list[_Source]] = Future()
        if instance in self._sources:
            self._disconnect(instance)
        group = []
        now = time.monotonic()
        ctx: Any = zmq.Context.instance()
        hello_peer = self.peer_info()
        table: dict[int, _Source] = {}
        for p in peers:
            sock = ctx.socket(zmq.DEALER)
            sock.setsockopt(zmq.LINGER, 0)
            sock.setsockopt(zmq.IDENTITY, uuid.uuid4().bytes)
            sock.connect(p.control_endpoint)
            src = _Source(
                instance=instance,
                rank=rank_of(p.layout),
                info=p,
                sock=sock,
                agent_name=p.extra.get("agent_name", ""),
                nonce=random.getrandbits(62),
                last_seen=now,
            )
            table[src.rank] = src
            self._by_sock[sock] = src
            self._loop.add_socket(sock, self._on_control)
            self._send(src, Hello(peer=hello_peer, nonce=src.nonce))
            group.append(src)
        self._sources[instance] = table
        self._pending_connect.append((group, fut))
        return fut

    def _abandon_connect(self, fut: Future[list[_Source]]) -> list[int]:
        for group, f in self._pending_connect:
            if f is fut:
                self._pending_connect.remove((group, f))
                missing = [s.rank for s in group if s.state == "pending"]
                if group:
                    self._disconnect(group[0].instance)
                return missing
        return []

    def _disconnect(self, instance: str) -> None:
        for src in self._sources.pop(instance, {}).values():
            src.alive = False
            self._by_sock.pop(src.sock, None)
            if self._by_agent.get(src.agent_name) is src:
                del self._by_agent[src.agent_name]
            self._loop.remove_socket(src.sock)
            src.sock.close(linger=0)

    def _send(self, src: _Source, msg: msgspec.Struct) -> None:
        try:
            src.sock.send(self._codec.encode(msg), zmq.NOBLOCK)
        except zmq.ZMQError as e:
            self.counts["control_send_failed"] += 1
            log.debug("%s: control send failed: %s", self._loop.name, e)

    def _on_control(self, sock: zmq.Socket) -> None:
        src = self._by_sock.get(sock)
        for _ in range(256):
            try:
                frames = sock.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                return
            if src is None:
                continue
            if len(frames) != 1:
                self._codec.drop("malformed")
                continue
            msg = self._codec.decode(frames[0])
            if msg is None:
                continue
            src.last_seen = time.monotonic()
            if isinstance(msg, Done):
                self._on_tag(src, msg.chunk, self._codec, msg.drained)
            elif isinstance(msg, Heartbeat):
                pass
            elif isinstance(msg, HelloAck):
                self._on_ack(src, msg)
            else:
                self._codec.drop("wrong_type")

    def _on_ack(self, src: _Source, ack: HelloAck) -> None:
        if ack.nonce != src.nonce or src.state != "pending":
            self._codec.drop("stale")
            return
        if ack.rank != src.rank:
            self._codec.drop("unknown_rank")
            return
        if ack.accepted:
            src.state = "accepted"
            if src.agent_name:
                self._by_agent[src.agent_name] = src
        else:
            src.state = "refused"
            src.mismatches = tuple(ack.mismatches) or ("refused without a reason",)
        for group, fut in list(self._pending_connect):
            if all(s.state != "pending" for s in group):
                self._pending_connect.remove((group, fut))
                fut.set_result(group)

    def _expect(self, instance: str, dest: DestInfo) -> None:
        room, gen = dest.room, dest.generation
        if self.rooms.generation(room) != gen:
            return
        table = self._sources.get(instance, {})
        lease = _Lease(
            room=room, generation=gen, instance=instance, dest=dest, sources=tuple(sorted(table))
        )
        self._leases[room] = lease
        self._draining.pop(room, None)
        dead = [s.rank for s in table.values() if not s.alive or s.state != "accepted"]
        if dead or not table:
            self._failed(lease, f"prefill {instance} ranks {dead} are not connected")
            return
        for src in table.values():
            self._send(src, dest)
        self.counts["expected"] += 1

    def _abort(self, room: int, gen: int, reason: str) -> None:
        lease = self._leases.get(room)
        if lease is None or lease.generation != gen:
            return
        if not lease.failed_at:
            lease.failed_at = time.monotonic()
        for src in self._sources.get(lease.instance, {}).values():
            if src.alive:
                self._send(src, Abort(room=room, generation=gen, reason=reason[:512]))
        self.counts["aborted"] += 1

    def _clear(self, room: int, gen: int) -> None:
        lease = self._leases.get(room)
        if lease is None or lease.generation != gen:
            return
        del self._leases[room]
        if not self._lease_drained(lease):
            self._draining[room] = lease

    def _drained(self, room: int) -> bool:
        lease = self._leases.get(room) or self._draining.get(room)
        return lease is None or self._lease_drained(lease)

    def _lease_drained(self, lease: _Lease) -> bool:
        if lease.done:
            return True
        st = (
            self.rooms.status(lease.room)
            if self.rooms.generation(lease.room) == lease.generation
            else KVPoll.Failed
        )
        if st != KVPoll.Failed:
            return False
        table = self._sources.get(lease.instance, {})
        quiet = all(
            r in lease.stopped or r not in table or not table[r].alive for r in lease.sources
        )
        if not lease.failed_at:
            lease.failed_at = time.monotonic()
        return quiet or time.monotonic() - lease.failed_at > self.config.transfer_timeout_s

    def _failed(self, lease: _Lease, reason: str, tell: bool = False) -> None:
        if self.rooms.fail(lease.room, reason, lease.generation):
            self.counts["rooms_failed"] += 1
            self._event("transfer_failed", lease, reason=reason)
        if not lease.failed_at:
            lease.failed_at = time.monotonic()
        if tell:
            for src in self._sources.get(lease.instance, {}).values():
                if src.alive:
                    self._send(
                        src,
                        Abort(room=lease.room, generation=lease.generation, reason=reason[:512]),
                    )

    def _on_tag(self, src: _Source, tag: ChunkTag, codec: Any, drained: bool = False) -> None:
        if tag.src_rank != src.rank or src.state != "accepted":
            codec.drop("unknown_rank")
            return
        lease = self._leases.get(tag.room)
        if lease is None or lease.generation != tag.generation:
            lease = None if tag.ok else self._draining.get(tag.room)  # a cleared room's drain
        if lease is None or lease.generation != tag.generation or lease.instance != src.instance:
            codec.drop("stale")
            return
        if not tag.ok:
            if drained:  # this source wrote its last byte into the room's pages
                lease.stopped.add(src.rank)
            self._failed(lease, f"prefill {src.instance} rank {src.rank}: {tag.reason}")
            return
        if not 0 <= tag.chunk_id < _MAX_CHUNKS:
            codec.drop("malformed")
            return
        got = lease.got.setdefault(src.rank, set())
        last = lease.last.get(src.rank)
        if tag.chunk_id in got or (last is not None and (tag.is_last or tag.chunk_id > last)):
            codec.drop("other")  # duplicate, or past this source's last chunk
            return
        if tag.is_last and got and max(got) > tag.chunk_id:
            codec.drop("malformed")
            return
        got.add(tag.chunk_id)
        if tag.is_last:
            lease.last[src.rank] = tag.chunk_id
        self.counts["chunks"] += 1
        if self.rooms.status(lease.room) == KVPoll.Failed:
            return
        self.rooms.advance(lease.room, KVPoll.Transferring, lease.generation)
        self.rooms.touch(lease.room, lease.generation)
        done = all(
            r in lease.last and len(lease.got.get(r, ())) == lease.last[r] + 1
            for r in lease.sources
        )
        if done:
            lease.done = True
            if self.rooms.advance(lease.room, KVPoll.Success, lease.generation) == KVPoll.Success:
                self.counts["rooms_ok"] += 1
                self._event("transfer_done", lease)

    def _step(self, now: float) -> None:
        if self.engine.notifications:
            for name, data in self.engine.poll_notifications():
                src = self._by_agent.get(name)
                if src is None:
                    self._tags.drop("unknown_rank")
                    continue
                tag = self._tags.decode(data)
                if tag is not None:
                    src.last_seen = now
                    self._on_tag(src, tag, self._tags)
        if now >= self._next_periodic:
            self._next_periodic = now + 0.01
            self._periodic(now)

    def _event(self, kind: str, lease: _Lease, **fields: Any) -> None:
        if self._emit is None:
            return
        fields.update(
            dcp_rank=self.layout.dcp_rank,
            generation=lease.generation,
            chunks=sum(len(g) for g in lease.got.values()),
        )
        self._queue_event(kind, lease.room, fields)

    def _periodic(self, now: float) -> None:
        if self._events:
            self._flush_events()
        for room, gen, reason in self.rooms.expire(now):
            lease = self._leases.get(room)
            if lease is not None and lease.generation == gen:
                self._failed(lease, reason, tell=True)
        if now < self._next_hb:
            return
        self._next_hb = now + self._hb_s
        self._hb_seq += 1
        for inst, table in self._sources.items():
            for src in table.values():
                if not src.alive or src.state != "accepted":
                    continue
                silent = now - src.last_seen
                if silent > self._peer_timeout_s:
                    src.alive = False
                    self.counts["sources_dead"] += 1
                    reason = (
                        f"prefill {inst} rank {src.rank} silent for {silent:.1f} s "
                        "(KVConfig.transfer_timeout_s)"
                    )
                    for lease in self._leases.values():
                        if lease.instance == inst and not lease.done:
                            self._failed(lease, reason, tell=True)
                else:
                    self._send(src, Heartbeat(seq=self._hb_seq))
        if self._draining:
            for room in [r for r, ls in self._draining.items() if self._lease_drained(ls)]:
                del self._draining[room]


def _field(mismatch: str) -> str:
    """The field a mismatch line names (text before the first ':' after any prefix)."""
    body = mismatch.split("refused: ", 1)[-1]
    if body.startswith("prefill "):
        body = body.split(": ", 1)[-1]
    return body.split(":", 1)[0].strip()
