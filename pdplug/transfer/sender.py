"""Prefill side: :class:`KVSenderSession`, the engine-neutral KV sender both default backends use.

One session per prefill rank. It owns a control ROUTER socket (decode ranks connect to it), a
:class:`~pdplug.rooms.Rooms` table, the registered KV entries and one pack buffer, and an
engine thread (:class:`~pdplug.transfer.loop.EngineLoop`) that is the only caller of the
:class:`~pdplug.transfer.engine.TransferEngine`.

Per request (room): the host calls :meth:`KVSenderSession.start`; the room is
``Bootstrapping`` until every decode DCP rank of the destination instance sent its
:class:`~pdplug.types.DestInfo`, then ``WaitingForInput``. Each :meth:`KVSenderSession.send`
of a scheduler :class:`~pdplug.types.Segment` becomes one job per destination DCP rank: plan
(``PackPlanner.plan``), pack into a free pack region of that rank if the peer needs relayout
(``Packer.pack``), post the byte runs (``TransferEngine.post``) with the chunk's
:class:`~pdplug.types.ChunkTag`. With ``pack_depth`` regions per rank, the job for segment
``k + 1`` packs into another region while segment ``k``'s write is in flight (double
buffering; :mod:`pdplug.packing`). A rank that owns no token of a chunk still gets a
notification-only chunk (SGLang #32837) so the decode side's count completes. The room turns
``Success`` when the last segment's jobs completed on every destination (never while one is
pending), ``Failed`` on a plan error, a failed or timed-out post, an abort from either side, a
silent decode peer or a room deadline. A failure is reported to every destination as a
``ChunkTag(ok=False)`` once no write of the room is in flight any more (the decode side's
signal that its pages are no longer written by this rank) — the negative twin of a completion
(vLLM PR #50754).
"""

from __future__ import annotations

import logging
import time
from collections import Counter
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

import msgspec
import numpy as np
import zmq

from pdplug import bootstrap
from pdplug.config import KVConfig
from pdplug.errors import PlanError, TransferError
from pdplug.layout import entry_map
from pdplug.packing import (
    pack_buffer_nbytes,
    pack_bytes_per_token,
    pack_regions,
    segment_to_chunk,
    send_capacity_tokens,
)
from pdplug.protocols import Packer, PackPlanner
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
from pdplug.transfer.pipeline import Job, Lease, Peer, SendPipeline
from pdplug.transfer.session import RoomSession
from pdplug.types import (
    ChunkTag,
    DestInfo,
    KVPoll,
    PackRegion,
    PdplugEvent,
    PeerInfo,
    Segment,
    pages_from_bytes,
)

if TYPE_CHECKING:
    import torch

__all__ = [
    "KVSenderSession",
    "Compat",
    "Emit",
    "default_compat",
    "default_emit",
    "entries_geometry",
]

log = logging.getLogger(__name__)

_MAX_INBOX = 65536  # rooms whose DestInfo arrived before start(); older than bootstrap expire

#: ``compat(local, remote) -> mismatches``; the handshake refuses a peer when it is non-empty.
Compat = Callable[[PeerInfo, PeerInfo], Sequence[str]]


def default_compat(local: PeerInfo, remote: PeerInfo) -> list[str]:
    """Layout checks plus every plugin's ``pdplug_check_compat`` veto, through the
    process-wide manager (:meth:`pdplug.manager.PluginManager.check_compat`)."""
    from pdplug.manager import get_plugin_manager

    return get_plugin_manager().check_compat(local, remote)


#: ``emit(event)``: observer callback for room outcomes (once per room and rank).
Emit = Callable[[PdplugEvent], None]


def default_emit(event: PdplugEvent) -> None:
    """Broadcast ``event`` to every plugin's ``pdplug_on_event`` through the process-wide
    manager (:meth:`pdplug.manager.PluginManager.emit`; observer errors are logged)."""
    from pdplug.manager import get_plugin_manager

    get_plugin_manager().emit(event)


def entries_geometry(
    entries: Sequence[torch.Tensor], bytes_per_token: Sequence[int], page_tokens: Sequence[int]
) -> tuple[np.ndarray, np.ndarray, int]:
    """Check KV entry tensors and return ``(base addresses, nbytes, pages)``.

    :param entries: one contiguous tensor per entry (any dtype).
    :param bytes_per_token: bytes of one token row per entry.
    :param page_tokens: tokens per page per entry (``page_size``, or ``page_size * dcp_size``
        for a decode draft entry).
    :returns: int64 ``[E]`` base addresses, int64 ``[E]`` sizes (bytes), and the number of
        whole pages every entry holds (the minimum over entries).
    :raises ValueError: wrong entry count, a non-contiguous tensor, or an entry smaller than
        one page (each names the entry index and the value).
    """
    if len(entries) != len(bytes_per_token):
        raise ValueError(
            f"register_kv: got {len(entries)} entries, layout has {len(bytes_per_token)}"
        )
    base = np.zeros(len(entries), dtype=np.int64)
    nbytes = np.zeros(len(entries), dtype=np.int64)
    pages = None
    for i, t in enumerate(entries):
        if not t.is_contiguous():
            raise ValueError(f"register_kv: entries[{i}] is not contiguous")
        base[i] = t.data_ptr()
        nbytes[i] = t.numel() * t.element_size()
        n = int(nbytes[i]) // (bytes_per_token[i] * page_tokens[i])
        if n <= 0:
            raise ValueError(
                f"register_kv: entries[{i}] has {int(nbytes[i])} bytes, below one page of "
                f"{page_tokens[i]} tokens x {bytes_per_token[i]} bytes"
            )
        pages = n if pages is None else min(pages, n)
    return base, nbytes, int(pages or 0)


class KVSenderSession(RoomSession):
    """Engine-neutral prefill-side KV sender (implements :class:`pdplug.protocols.KVSender`).

    :param config: this rank's :class:`~pdplug.config.KVConfig` (``role="prefill"``).
    :param planner: the pack planner (``needs_relayout``, ``capacity_tokens``, ``plan``).
    :param packer: the packer; ``None`` takes ``planner.packer(config.device)``.
    :param engine: the backend adapter (:class:`~pdplug.transfer.engine.TransferEngine`).
    :param compat: handshake check ``(local, remote) -> mismatches``; default
        :func:`default_compat` (layout checks + every plugin's ``pdplug_check_compat``).
    :param emit: observer callback for room outcomes (``transfer_done`` with bytes and
        seconds, ``transfer_failed`` with the reason; once per room); ``None`` disables.
    :param max_inflight: posts in flight at once (unpacked sends; packed ones are bounded by
        their regions).
    :raises ValueError: ``config.role`` is not ``"prefill"``, or ``pack_depth``/``max_dst_dcp``
        is not > 0.
    """

    def __init__(
        self,
        config: KVConfig,
        planner: PackPlanner,
        packer: Packer | None,
        engine: TransferEngine,
        *,
        compat: Compat | None = None,
        emit: Emit | None = default_emit,
        max_inflight: int = 64,
    ) -> None:
        if config.role != "prefill":
            raise ValueError(
                f"KVSenderSession: KVConfig.role must be 'prefill', got {config.role!r}"
            )
        for name in ("pack_depth", "max_dst_dcp"):
            if getattr(config, name) <= 0:
                raise ValueError(f"KVConfig.{name} must be > 0, got {getattr(config, name)}")
        self.config = config
        self.layout = config.layout
        self.planner = planner
        self._packer = packer
        self.engine = engine
        self.compat: Compat = compat or default_compat
        self._emit = emit
        self._events: list[PdplugEvent] = []
        self.rank = bootstrap.rank_of(config.layout)
        self.rooms = Rooms.from_config(config)
        self.max_inflight = max_inflight
        w = config.wire
        self._codec = control_codec(w, name=f"{config.instance}/p{self.rank}/control")
        self._tags = tag_codec(w, name=f"{config.instance}/p{self.rank}/tags")
        self._sock: Any = zmq.Context.instance().socket(zmq.ROUTER)
        self._sock.setsockopt(zmq.LINGER, 0)
        self.endpoint = bootstrap.bind_random(self._sock, w.bind_host)
        self._hb_s = max(0.05, min(1.0, config.transfer_timeout_s / 5))
        self._peer_timeout_s = config.transfer_timeout_s
        self._peers: dict[bytes, Peer] = {}
        self._by_key: dict[tuple[str, int], bytes] = {}
        self._leases: dict[int, Lease] = {}
        self._draining: list[Lease] = []
        self._inbox: dict[int, dict[tuple[str, int], tuple[DestInfo, float]]] = {}
        self._regions: list[PackRegion] = []
        self._pack: torch.Tensor | None = None
        self._num_pages = 0
        self._info: PeerInfo | None = None
        self._next_periodic = 0.0
        self._next_hb = 0.0
        self._hb_seq = 0
        self.counts: Counter[str] = Counter()
        self._closed = False
        self._loop = EngineLoop(
            f"pdplug-{engine.name}-send-{config.instance}-{self.rank}",
            self._step,
            lambda: self._pipe.busy(),
        )
        self._pipe = SendPipeline(
            engine=engine,
            planner=planner,
            layout=config.layout,
            rank=self.rank,
            tags=self._tags,
            timeout_s=config.transfer_timeout_s,
            max_inflight=max_inflight,
            on_done=self._job_done,
            on_fail=self._fail,
            on_written=self._written,
            on_drained=self._notify_failure,
            waker=self._loop.wake,
        )
        self._loop.add_socket(self._sock, self._on_control)
        self._loop.start()

    @property
    def engine(self) -> TransferEngine:
        """The backend adapter (replaceable before the first send, e.g. to inject faults)."""
        return self._engine

    @engine.setter
    def engine(self, engine: TransferEngine) -> None:
        self._engine = engine
        if hasattr(self, "_pipe"):
            self._pipe.engine = engine

    # ================================================================== host-facing API
    def register_kv(self, entries: Sequence[torch.Tensor]) -> None:
        """Register the rank's KV entries (``layout`` order) and the pack buffer, once; then
        publish this rank at the rendezvous when ``config.bootstrap_endpoint`` is set.

        :param entries: one contiguous tensor per entry holding ``[num_pages * page_size]``
            token rows of ``entry_bytes_per_token[e]`` bytes (any dtype).
        :raises ValueError: entry count/shape/contiguity (named).
        :raises TransferError: the engine refused the memory, or the rendezvous did not
            answer within ``bootstrap_timeout_s``.
        """
        lay = self.layout
        base, nbytes, pages = entries_geometry(
            entries, lay.entry_bytes_per_token, [lay.page_size] * lay.num_entries
        )
        self._loop.call(lambda: self._register(list(entries), base, nbytes, pages), 60.0)
        if self.config.bootstrap_endpoint:
            bootstrap.register(
                self.config.bootstrap_endpoint,
                self.peer_info(),
                timeout_s=self.config.bootstrap_timeout_s,
                wire=self.config.wire,
            )

    def peer_info(self) -> PeerInfo:
        """What this rank publishes at the rendezvous (after :meth:`register_kv`).

        :raises TransferError: :meth:`register_kv` was not called.
        """
        if self._info is None:
            raise TransferError("KVSender.peer_info: call register_kv first")
        return self._info

    def start(self, room: int) -> int:
        """Lease ``room`` on this rank: ``Bootstrapping`` until every decode DCP rank's DestInfo
        arrived (DestInfos that arrived earlier are kept for ``bootstrap_timeout_s``).

        :returns: this rank's lease generation.
        :raises ValueError: ``room`` is already leased here (``clear`` it first).
        """
        if room in self.rooms:
            raise ValueError(f"KVSender.start: room {room} is already leased; clear it first")
        gen = self.rooms.lease(room, KVPoll.Bootstrapping)
        self._loop.submit(lambda: self._start(room, gen))
        return gen

    def dest(self, room: int) -> list[DestInfo]:
        """The DestInfos received for ``room``, one per destination DCP rank (sorted)."""
        return self._loop.call(lambda: self._dest(room), 10.0)

    def capacity_tokens(self, room: int) -> int | None:
        """Largest segment (tokens) a send of ``room`` may have: the pack-region bound for a
        destination that needs relayout (pass it to ``Scheduler.split_send``), ``None`` when
        no destination needs packing (then sends are not split).

        :raises ValueError: ``room`` has no destination yet (not ``WaitingForInput``).
        """
        return self._loop.call(lambda: self._capacity(room), 10.0)

    def send(self, room: int, segment: Segment, src_pages: np.ndarray) -> None:
        """Plan, pack and post the writes of one segment to every destination DCP rank.

        Non-blocking: the work runs on the engine thread. Segments of one room must be sent in
        ``chunk_id`` order, the last with ``is_last``; chunk ids of one rank start at 0 and have
        no gaps (the decode side counts them). A send for a failed room is ignored.

        :param segment: a scheduler segment (tokens ``[token_start, token_end)``).
        :param src_pages: int64 ``[n]`` source page ids from the segment's first page on.
        :raises KeyError: ``room`` is not leased.
        :raises ValueError: the room is not ``WaitingForInput``/``Transferring``, or a source
            page id is outside the registered KV (named).
        """
        status = self.rooms.status(room)
        if status == KVPoll.Failed:
            self.counts["send_after_failure"] += 1
            return
        if status not in (KVPoll.WaitingForInput, KVPoll.Transferring):
            raise ValueError(
                f"KVSender.send: room {room} is {status.name}; send only once it is "
                "WaitingForInput (every decode DestInfo arrived)"
            )
        pages = np.asarray(src_pages, dtype=np.int64).reshape(-1)
        if pages.size and (pages.min() < 0 or pages.max() >= self._num_pages):
            bad = int(pages[(pages < 0) | (pages >= self._num_pages)][0])
            raise ValueError(
                f"KVSender.send: src_pages has page {bad}, outside [0, {self._num_pages}) "
                f"registered pages (room {room})"
            )
        gen = self.rooms.generation(room)
        if gen is None or not self.rooms.add_pending(room, 1, gen):
            return
        self.rooms.advance(room, KVPoll.Transferring, gen)
        if segment.is_last:
            self.rooms.advance(room, KVPoll.Success, gen)  # held until nothing is pending
        self._loop.submit(lambda: self._enqueue(room, gen, segment, pages))

    def abort(self, room: int, reason: str = "aborted") -> None:
        """Fail ``room`` here and tell every destination once in-flight writes drained."""
        gen = self.rooms.generation(room)
        if gen is None:
            return
        self.rooms.fail(room, f"aborted on prefill rank {self.rank}: {reason}", gen)
        self._loop.submit(lambda: self._abort(room, gen))

    def clear(self, room: int) -> None:
        """Forget ``room`` (the host released it). An unfinished room is aborted first."""
        gen = self.rooms.generation(room)
        if gen is None:
            return
        done = self.rooms.status(room) == KVPoll.Success
        if not done:
            self.rooms.fail(room, f"cleared on prefill rank {self.rank} before completion", gen)
        self.rooms.clear(room, gen)
        self._loop.submit(lambda: self._clear(room, gen, done))

    def stats(self) -> dict[str, Any]:
        """Counters: posts, runs, bytes, notify_only, segments, rooms_ok/failed, refused peers,
        peers_dead, pack_s/plan_s/post_s (seconds), and control-channel drops by reason."""
        out: dict[str, Any] = {"backend": self.engine.name, "rank": self.rank}
        out.update(self.counts)
        out.update(self._pipe.counts)
        out.update({k: round(v, 6) for k, v in self._pipe.timings.items()})
        out.update({f"control_{k}": v for k, v in self._codec.stats().items()})
        out.update({f"tags_{k}": v for k, v in self._tags.stats().items()})
        out["loop_errors"] = self._loop.errors
        out["rooms_ignored_events"] = self.rooms.ignored
        return out

    # ================================================================== engine thread
    def _register(
        self, entries: list[torch.Tensor], base: np.ndarray, nbytes: np.ndarray, pages: int
    ) -> None:
        import torch

        if self._info is not None:
            raise TransferError("KVSender.register_kv: already registered")
        cfg, lay = self.config, self.layout
        regions = [(int(b), int(n)) for b, n in zip(base, nbytes)]
        if pack_bytes_per_token(lay) > 0:
            nb = pack_buffer_nbytes(
                lay,
                region_tokens=cfg.pack_region_tokens,
                dst_dcp_size=cfg.max_dst_dcp,
                depth=cfg.pack_depth,
            )
            self._pack = torch.empty(nb, dtype=torch.uint8, device=cfg.device)
            self._regions = pack_regions(
                lay,
                dst_dcp_size=cfg.max_dst_dcp,
                depth=cfg.pack_depth,
                region_tokens=cfg.pack_region_tokens,
            )
            regions.append((int(self._pack.data_ptr()), nb))
        self.engine.register(dedup_regions(regions))
        self._num_pages = pages
        packer = self._packer or self.planner.packer(cfg.device)
        self._pipe.set_memory(entries, base, self._pack, self._regions, cfg.pack_depth, packer)
        self._info = PeerInfo(
            instance=cfg.instance,
            role="prefill",
            layout=lay,
            control_endpoint=self.endpoint,
            backend=self.engine.name,
            agent=self.engine.agent(),
            entry_base=tuple(int(b) for b in base),
            pack_base=0 if self._pack is None else int(self._pack.data_ptr()),
            pack_nbytes=0 if self._pack is None else int(self._pack.numel()),
            extra={"agent_name": self.engine.agent_name(), "rank": str(self.rank)},
        )

    def _shutdown(self) -> None:
        self._flush_events()
        self._pipe.close()
        for p in self._peers.values():
            try:
                self.engine.disconnect(p.handle)
            except Exception:
                pass
        self._loop.remove_socket(self._sock)
        self._sock.close(linger=0)
        self.engine.close()

    # ------------------------------------------------------------------ control channel
    def _send(self, ident: bytes, msg: msgspec.Struct) -> None:
        try:
            self._sock.send_multipart([ident, self._codec.encode(msg)], zmq.NOBLOCK)
        except zmq.ZMQError as e:
            self.counts["control_send_failed"] += 1
            log.debug("%s: control send failed: %s", self._loop.name, e)

    def _on_control(self, sock: zmq.Socket) -> None:
        for _ in range(256):
            try:
                frames = sock.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                return
            if len(frames) != 2:
                self._codec.drop("malformed")
                continue
            ident, frame = frames
            msg = self._codec.decode(frame)
            if msg is None:
                continue
            now = time.monotonic()
            if isinstance(msg, Hello):
                self._on_hello(ident, msg, now)
                continue
            peer = self._peers.get(ident)
            if peer is None:
                self._codec.drop("unknown_rank")
                continue
            peer.last_seen = now
            if isinstance(msg, DestInfo):
                self._on_dest(peer, msg, now)
            elif isinstance(msg, Abort):
                self._on_abort(peer, msg)
            elif isinstance(msg, Heartbeat):
                pass
            else:
                self._codec.drop("wrong_type")

    def _check_peer(self, remote: PeerInfo) -> tuple[list[str], np.ndarray | None, bool]:
        local = self.peer_info()
        out: list[str] = []
        if remote.role != "decode":
            out.append(f"role: expected 'decode', got {remote.role!r}")
        if remote.backend != self.engine.name:
            out.append(f"backend: local {self.engine.name} vs remote {remote.backend or '?'}")
        try:
            out.extend(self.compat(local, remote))
        except Exception as e:  # a plugin's veto hook failing is a refusal, not a crash
            out.append(f"compat check raised {type(e).__name__}: {e}")
        if out:
            return out, None, False
        rl = remote.layout
        if len(remote.entry_base) != rl.num_entries:
            out.append(
                f"entry_base: {len(remote.entry_base)} addresses for {rl.num_entries} entries"
            )
        try:
            emap = entry_map(self.layout, rl)
            relayout = self.planner.needs_relayout(self.layout, rl)
            if relayout:
                if rl.dcp_size > self.config.max_dst_dcp:
                    out.append(
                        f"dcp_size: remote {rl.dcp_size} exceeds this prefill rank's "
                        f"KVConfig.max_dst_dcp={self.config.max_dst_dcp}"
                    )
                elif self._regions:
                    self.planner.capacity_tokens(self.layout, rl, self._regions[0].nbytes)
                else:
                    out.append("pack buffer: none (no sharded entry) but the peer needs relayout")
        except (PlanError, ValueError) as e:
            out.append(str(e))
            return out, None, False
        return out, emap, relayout

    def _on_hello(self, ident: bytes, msg: Hello, now: float) -> None:
        remote = msg.peer
        key = (remote.instance, remote.layout.dcp_rank)
        mismatches, emap, relayout = self._check_peer(remote)
        handle = None
        if not mismatches:
            try:
                handle = self.engine.connect(remote)
            except Exception as e:
                mismatches.append(f"agent: cannot connect ({type(e).__name__}: {e})")
        if mismatches:
            self.counts["refused"] += 1
            log.warning(
                "%s: refused decode %s dcp %d: %s", self._loop.name, key[0], key[1], mismatches
            )
            self._send(
                ident,
                HelloAck(
                    nonce=msg.nonce, accepted=False, rank=self.rank, mismatches=tuple(mismatches)
                ),
            )
            return
        old = self._by_key.get(key)
        if old is not None and old != ident:
            self._drop_peer(self._peers[old], "decode peer reconnected")
        prev = self._peers.get(ident)
        if prev is not None and prev.handle is not None and prev.handle is not handle:
            self.engine.disconnect(prev.handle)
        assert emap is not None
        self._peers[ident] = Peer(
            ident=ident,
            info=remote,
            key=key,
            handle=handle,
            emap=emap,
            dst_base=np.asarray(remote.entry_base, dtype=np.int64),
            relayout=relayout,
            last_seen=now,
        )
        self._by_key[key] = ident
        self.counts["peers"] += 1
        self._send(
            ident, HelloAck(nonce=msg.nonce, accepted=True, rank=self.rank, peer=self.peer_info())
        )

    def _drop_peer(self, peer: Peer, reason: str) -> None:
        peer.alive = False
        self._peers.pop(peer.ident, None)
        if self._by_key.get(peer.key) == peer.ident:
            del self._by_key[peer.key]
        for lease in list(self._leases.values()):
            if any(p is peer for p in lease.peers.values()):
                self._fail(lease, f"decode {peer.key[0]} dcp {peer.key[1]}: {reason}")
        try:
            self.engine.disconnect(peer.handle)
        except Exception:
            pass

    def _on_dest(self, peer: Peer, d: DestInfo, now: float) -> None:
        if (d.decode_instance, d.dcp_rank) != peer.key:
            self._codec.drop("unknown_rank")
            return
        if len(d.dst_pages) % 8 or d.decode_prefix_len < 0 or d.num_tokens < 0:
            self._codec.drop("malformed")
            return
        lease = self._leases.get(d.room)
        if lease is None or lease.failed:
            if d.room not in self._inbox and len(self._inbox) >= _MAX_INBOX:
                self._codec.drop("other")  # a flood of DestInfos nobody starts
                return
            box = self._inbox.setdefault(d.room, {})
            box[peer.key] = (d, now)
            self.counts["dest_early"] += 1
            return
        self._add_dest(lease, peer, d, now)

    def _add_dest(self, lease: Lease, peer: Peer, d: DestInfo, now: float) -> None:
        if lease.instance and lease.instance != d.decode_instance:
            self._codec.drop("other")
            return
        cur = lease.dests.get(d.dcp_rank)
        if cur is not None:
            if cur.generation == d.generation:
                self._codec.drop("other")  # duplicate
            else:  # a recycled room on decode: keep it for this room's next lease
                self._inbox.setdefault(d.room, {})[peer.key] = (d, now)
                self.counts["dest_next_lease"] += 1
            return
        lease.instance = d.decode_instance
        lease.expected = peer.info.layout.dcp_size
        lease.dests[d.dcp_rank] = d
        lease.peers[d.dcp_rank] = peer
        if len(lease.dests) < lease.expected:
            return
        ds = list(lease.dests.values())
        if len({(x.decode_prefix_len, x.num_tokens) for x in ds}) != 1:
            self._fail(
                lease,
                "DestInfo differs across decode DCP ranks: "
                + ", ".join(
                    f"dcp {x.dcp_rank}: decode_prefix_len={x.decode_prefix_len} "
                    f"num_tokens={x.num_tokens}"
                    for x in ds
                ),
            )
            return
        self.rooms.advance(lease.room, KVPoll.WaitingForInput, lease.generation)

    def _on_abort(self, peer: Peer, a: Abort) -> None:
        lease = self._leases.get(a.room)
        mine = None if lease is None else lease.dests.get(peer.key[1])
        if (
            lease is not None
            and mine is not None
            and lease.peers.get(peer.key[1]) is peer
            and mine.generation == a.generation
        ):
            if not lease.failed:
                self.counts["aborted_by_decode"] += 1
                self._fail(lease, f"aborted by decode {peer.key[0]} dcp {peer.key[1]}: {a.reason}")
            return
        box = self._inbox.get(a.room)
        if box is not None and peer.key in box and box[peer.key][0].generation == a.generation:
            del box[peer.key]
            if not box:
                del self._inbox[a.room]
            return
        self._codec.drop("stale")

    # ------------------------------------------------------------------ rooms
    def _start(self, room: int, gen: int) -> None:
        if self.rooms.generation(room) != gen:
            return  # cleared before we got here
        lease = Lease(room=room, generation=gen)
        self._leases[room] = lease
        now = time.monotonic()
        for key, (d, _t) in sorted(self._inbox.pop(room, {}).items()):
            ident = self._by_key.get(key)
            peer = self._peers.get(ident) if ident is not None else None
            if peer is not None:
                self._add_dest(lease, peer, d, now)

    def _dest(self, room: int) -> list[DestInfo]:
        lease = self._leases.get(room)
        return [] if lease is None else [lease.dests[r] for r in sorted(lease.dests)]

    def _capacity(self, room: int) -> int | None:
        lease = self._leases.get(room)
        if lease is None or not lease.expected or len(lease.dests) < lease.expected:
            raise ValueError(f"KVSender.capacity_tokens: room {room} has no destination yet")
        cap: int | None = None
        for peer in lease.peers.values():
            if not peer.relayout:
                continue
            region = self._regions[0]
            per_rank = min(
                region.capacity_tokens,
                self.planner.capacity_tokens(self.layout, peer.info.layout, region.nbytes),
            )
            c = send_capacity_tokens(per_rank, peer.info.layout.dcp_size)
            cap = c if cap is None else min(cap, c)
        return cap

    def _enqueue(self, room: int, gen: int, seg: Segment, pages: np.ndarray) -> None:
        lease = self._leases.get(room)
        if lease is None or lease.generation != gen or lease.failed:
            return
        lay = self.layout
        jobs = []
        try:
            for r in sorted(lease.dests):
                d = lease.dests[r]
                chunk = segment_to_chunk(
                    room,
                    seg,
                    pages,
                    pages_from_bytes(d.dst_pages),
                    d.decode_prefix_len,
                    lay.page_size,
                )
                jobs.append(Job(lease=lease, dst_rank=r, chunk=chunk))
        except ValueError as e:
            self._fail(lease, f"segment {seg.chunk_id}: {e}")
            return
        if seg.chunk_id in lease.segments:
            self._fail(lease, f"segment chunk_id {seg.chunk_id} sent twice")
            return
        lease.segments[seg.chunk_id] = len(jobs)
        self.counts["segments"] += 1
        self._pipe.submit(jobs)

    def _abort(self, room: int, gen: int) -> None:
        lease = self._leases.get(room)
        if lease is not None and lease.generation == gen:
            self._fail(lease, self.rooms.reason(room) or "aborted")

    def _clear(self, room: int, gen: int, done: bool) -> None:
        lease = self._leases.get(room)
        if lease is None or lease.generation != gen:
            return
        if not done:
            self._fail(lease, f"cleared on prefill rank {self.rank} before completion")
        del self._leases[room]
        lease.cleared = True
        self._pipe.purge(lease)
        if lease.inflight:
            self._draining.append(lease)

    def _drained(self, room: int) -> bool:
        lease = self._leases.get(room)
        return lease is None or lease.inflight == 0

    def _fail(self, lease: Lease, reason: str) -> None:
        if lease.failed:
            return
        lease.failed = True
        lease.reason = reason
        self.rooms.fail(lease.room, reason, lease.generation)
        self.counts["rooms_failed"] += 1
        self._event("transfer_failed", lease, reason=reason)
        self._pipe.purge(lease)
        self._notify_failure(lease)

    def _notify_failure(self, lease: Lease) -> None:
        """Tell every destination the room failed: at once, and again (``drained``) once no
        write of the room is in flight here any more."""
        drained = lease.inflight == 0
        if lease.notified >= 1 + drained:
            return
        first = lease.notified == 0
        lease.notified = 1 + drained
        reason = (lease.reason or self.rooms.reason(lease.room) or "failed")[:512]
        for r, d in lease.dests.items():
            peer = lease.peers[r]
            if not peer.alive:
                continue
            tag = ChunkTag(
                generation=d.generation,
                room=lease.room,
                chunk_id=-1,
                is_last=True,
                src_rank=self.rank,
                ok=False,
                reason=reason,
            )
            self._send(peer.ident, Done(chunk=tag, drained=drained))
            if first and self.engine.notifications:
                try:
                    self.engine.notify(peer.handle, self._tags.encode(tag))
                except Exception:
                    self.counts["notify_failed"] += 1

    # ------------------------------------------------------------------ data path
    def _step(self, now: float) -> None:
        self.engine.progress()
        if self._pipe.has_work():
            self._pipe.step(now)
            if self._draining:
                self._draining = [ls for ls in self._draining if ls.inflight]
        if now >= self._next_periodic:
            self._next_periodic = now + 0.01
            self._periodic(now)

    def _written(self, peer: Peer, tag: ChunkTag) -> None:
        self._send(peer.ident, Done(chunk=tag))

    def _job_done(self, job: Job) -> None:
        lease = job.lease
        left = lease.segments.get(job.chunk.chunk_id, 0) - 1
        lease.segments[job.chunk.chunk_id] = left
        if left == 0 and not lease.failed and not lease.cleared:
            self.rooms.touch(lease.room, lease.generation)
            st = self.rooms.done_pending(lease.room, 1, lease.generation)
            if st == KVPoll.Success:
                self.counts["rooms_ok"] += 1
                self._event("transfer_done", lease)

    def _event(self, kind: str, lease: Lease, **fields: Any) -> None:
        if self._emit is None:
            return
        fields.update(rank=self.rank, generation=lease.generation, dests=len(lease.dests))
        self._queue_event(kind, lease.room, fields)

    def _periodic(self, now: float) -> None:
        if self._events:
            self._flush_events()
        for room, gen, reason in self.rooms.expire(now):
            lease = self._leases.get(room)
            if lease is not None and lease.generation == gen:
                self._fail(lease, reason)
        if now >= self._next_hb:
            self._next_hb = now + self._hb_s
            self._hb_seq += 1
            for peer in list(self._peers.values()):
                if now - peer.last_seen > self._peer_timeout_s:
                    self.counts["peers_dead"] += 1
                    self._drop_peer(
                        peer,
                        f"silent for {now - peer.last_seen:.1f} s (KVConfig.transfer_timeout_s)",
                    )
                else:
                    self._send(peer.ident, Heartbeat(seq=self._hb_seq))
            ttl = self.config.bootstrap_timeout_s
            for room in [
                r for r, box in self._inbox.items() if all(now - t > ttl for _d, t in box.values())
            ]:
                del self._inbox[room]
                self.counts["dest_expired"] += 1
