"""Prefill side: :class:`KVSenderSession`, the engine-neutral KV sender both default backends use.

One session per prefill rank: a control ROUTER (:class:`~pdplug.transfer.channel.RouterChannel`;
peers known by the identity that sealed their frames), a :class:`~pdplug.rooms.Rooms` table,
the registered KV and one pack buffer, and an engine loop
(:class:`~pdplug.transfer.loop.EngineLoop`) whose lock is held by whoever calls the
:class:`~pdplug.transfer.engine.TransferEngine`. Decode peers are kept by
:class:`~pdplug.transfer.peers.DecodePeers`, rooms by :class:`~pdplug.transfer.leases.SendLeases`,
writes by :class:`~pdplug.transfer.pipeline.SendPipeline`; sends are handed over and reaped by
:class:`~pdplug.transfer.handoff.Handoff` (on the host's thread when the engine is free).

Per request (room): :meth:`KVSenderSession.start`; ``Bootstrapping`` until every decode DCP rank
of the destination sent its :class:`~pdplug.types.DestInfo`, then ``WaitingForInput``. Each
:meth:`KVSenderSession.send` of a :class:`~pdplug.types.Segment` becomes one job per
destination DCP rank, started once the segment's ``ready`` marker completed: plan, pack the
relayout jobs of the segment together into pack regions (``pack_all``), post the byte runs with
the chunk's :class:`~pdplug.types.ChunkTag` after the pack finished
(:mod:`pdplug.transfer.gather`; double buffered over ``pack_depth`` regions). A rank owning no
token of a chunk sends a notification-only chunk (SGLang #32837). The room turns ``Success``
when the last segment's jobs completed everywhere (never while one is pending), ``Failed`` on a
plan error, a failed or timed-out post, an abort from either side, a silent decode peer or a
room deadline.
"""

from __future__ import annotations

import time
from collections import Counter
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import numpy as np

from pdplug import bootstrap
from pdplug.config import KVConfig
from pdplug.errors import TransferError
from pdplug.protocols import Packer, PackPlanner
from pdplug.registration import RegisteredKV, resolve_kv
from pdplug.rooms import Rooms, check_room_id
from pdplug.transfer.channel import Liveness, RouterChannel
from pdplug.transfer.engine import TransferEngine, dedup_regions
from pdplug.transfer.handoff import WATCH_S, Handoff
from pdplug.transfer.handshake import Compat, Emit, check_decode_peer, layout_compat, rank_info
from pdplug.transfer.leases import SendLeases
from pdplug.transfer.loop import EngineLoop
from pdplug.transfer.messages import Abort, Heartbeat, control_codec, tag_codec
from pdplug.transfer.peers import DecodePeers
from pdplug.transfer.pipeline import Lease, SendPipeline
from pdplug.transfer.regions import make_pack_buffer
from pdplug.transfer.session import RoomSession
from pdplug.types import DestInfo, KVPoll, PackRegion, PeerInfo, Segment
from pdplug.wire import Inbound, rank_identity, require_key

if TYPE_CHECKING:
    import torch

__all__ = ["KVSenderSession"]


class KVSenderSession(RoomSession):
    """Engine-neutral prefill-side KV sender (implements :class:`pdplug.protocols.KVSender`).

    :param config: this rank's :class:`~pdplug.config.KVConfig` (``role="prefill"``).
    :param planner: the pack planner (``needs_relayout``, ``capacity_tokens``, ``plan``).
    :param packer: the packer; ``None`` takes ``planner.packer(config.device)``.
    :param engine: the backend adapter (:class:`~pdplug.transfer.engine.TransferEngine`).
    :param compat: handshake check ``(local, remote) -> mismatches`` (a plugin manager passes
        its ``check_compat``); ``None``: the layout checks only
        (:func:`~pdplug.transfer.handshake.layout_compat`).
    :param emit: observer callback for room outcomes (``transfer_done``, ``transfer_failed``
        with the reason; once per room and rank; a plugin manager passes its ``emit``);
        ``None``: no events.
    :param max_inflight: unpacked posts in flight at once per decode peer (packed ones are
        bounded by the pack regions).
    :raises ValueError: ``config.role`` is not ``"prefill"``, ``pack_depth``/``max_dst_dcp``
        is not > 0, or ``WireConfig.bind_host`` is off loopback and ``WireConfig.hmac_key`` is
        ``None``.
    """

    def __init__(
        self,
        config: KVConfig,
        planner: PackPlanner,
        packer: Packer | None,
        engine: TransferEngine,
        *,
        compat: Compat | None = None,
        emit: Emit | None = None,
        max_inflight: int = 64,
    ) -> None:
        if config.role != "prefill":
            raise ValueError(
                f"KVSenderSession: KVConfig.role must be 'prefill', got {config.role!r}"
            )
        for name in ("pack_depth", "max_dst_dcp"):
            if getattr(config, name) <= 0:
                raise ValueError(f"KVConfig.{name} must be > 0, got {getattr(config, name)}")
        try:  # refuse before anything is built: an unauthenticated socket off loopback
            require_key(config.wire, config.wire.bind_host, what=f"KVSender {config.instance}")
        except ValueError:
            engine.close()  # the session owns the engine it was given
            raise
        self.config = config
        self.layout = config.layout
        self.planner = planner
        self._packer = packer
        self._engine = engine
        self.compat: Compat = compat or layout_compat
        self._emit = emit
        self._events: list[tuple[str, int, dict[str, Any]]] = []
        self._outcomes: list[tuple[str, int, int, int, str | None]] = []  # see _event
        self.rank = bootstrap.rank_of(config.layout)
        self.rooms = Rooms.from_config(config)
        self.max_inflight = max_inflight
        self.counts: Counter[str] = Counter()
        self._closed = self._down = False
        w = config.wire
        label = f"{config.instance}/p{self.rank}"
        me = rank_identity(config.instance, config.layout)
        self._codec = control_codec(w, identity=me, name=f"{label}/control")
        self._tags = tag_codec(w, name=f"{label}/tags")
        self._regions: list[PackRegion] = []
        self._pack: torch.Tensor | None = None
        self._num_pages = 0
        self._info: PeerInfo | None = None
        self._registrar: bootstrap.Registrar | None = None
        self._next_periodic = 0.0
        self._live = Liveness(config.transfer_timeout_s)
        self._loop = EngineLoop(
            f"pdplug-{engine.name}-send-{config.instance}-{self.rank}",
            self._step,
            # a host that reaps itself (polled within WATCH_S) needs no loop thread polling too
            lambda: self._pipe.busy(self._handoff.watched()),
            idle_s=lambda: WATCH_S if self._pipe.has_work() else 0.005,
            on_death=self._engine_died,
        )
        self._channel = RouterChannel(self._loop, w, self._codec, self._on_message, self.counts)
        self.endpoint = self._channel.endpoint
        self._pipe = SendPipeline(
            engine=engine,
            planner=planner,
            layout=config.layout,
            rank=self.rank,
            tags=self._tags,
            timeout_s=config.transfer_timeout_s,
            max_inflight=max_inflight,
            on_done=lambda job: self._table.job_done(job),
            on_fail=lambda lease, reason: self._table.fail(lease, reason),
            on_written=lambda job, tag: self._table.written(job, tag),
            on_drained=lambda lease: self._table.notify_failure(lease),
            on_idle=lambda peer: self._peers.release(peer),
            waker=self._loop.wake,
        )
        self._peers = DecodePeers(
            name=self._loop.name, rank=self.rank, engine=lambda: self._engine,
            channel=self._channel, check=self._check_peer, local=self.peer_info,
            on_drop=lambda peer, reason: self._table.peer_dropped(peer, reason),
            on_rebind=lambda old, new: self._table.rebind(old, new),
            liveness=self._live, counts=self.counts,
        )  # fmt: skip
        self._table = SendLeases(
            rank=self.rank,
            layout=config.layout,
            planner=planner,
            rooms=self.rooms,
            pipe=self._pipe,
            peers=self._peers,
            engine=lambda: self._engine,
            codec=self._codec,
            tags=self._tags,
            regions=lambda: self._regions,
            # an early DestInfo waits as long as its decode rank waits for the room
            inbox_ttl_s=max(config.bootstrap_timeout_s, config.waiting_timeout_s),
            event=self._event,
            counts=self.counts,
            after=self._loop.after_round,
        )
        self._pipe.poster.outcomes(self._table.job_done, self._table.written)  # not lambdas
        self._handoff = Handoff(rooms=self.rooms, loop=self._loop, table=self._table,
                                pipe=self._pipe, counts=self.counts)  # fmt: skip
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
    def register_kv(self, entries: Sequence[Any]) -> None:
        """Register the rank's KV entries (``layout`` order) and the pack buffer, once, without
        copying them; then publish this rank at the rendezvous when
        ``config.bootstrap_endpoint`` is set.

        Each item is what the engine hands over (:func:`pdplug.registration.resolve_kv`): a
        tensor of any dtype whose shape and strides match the entry's geometry (a vLLM
        per-layer view ``(num_blocks, H, block_size, C)``, several layers sharing one storage,
        or one K or V slab view of vLLM's CPU cache), a contiguous block of whole pages, or a
        raw region ``(address, nbytes[, page_stride])`` / :class:`pdplug.registration.KVRegion`
        (SGLang; the CPU packer reads it by address). Memory shared by several entries is
        registered with the engine once. The memory must outlive the session.

        :raises ValueError: entry count, a tensor whose strides do not match its entry, a
            region with another page stride, an entry below one page (each named).
        :raises TransferError: the engine refused the memory, or the rendezvous did not
            answer within ``rendezvous_timeout_s``.
        """
        items = list(entries)
        reg = resolve_kv(self.layout, items)
        # the packer reads tensors through their storage, raw regions by address
        mem = [t if hasattr(t, "data_ptr") else b for t, b in zip(items, reg.base)]
        self._loop.call(lambda: self._register(mem, reg), 60.0)
        cfg, at = self.config, self.config.bootstrap_endpoint
        if at:
            wait_s = cfg.rendezvous_timeout_s
            bootstrap.register(at, self.peer_info(), timeout_s=wait_s, wire=cfg.wire)
            if cfg.rendezvous_refresh_s > 0:  # a restarted rendezvous learns this rank again
                every = cfg.rendezvous_refresh_s
                self._registrar = bootstrap.Registrar(
                    at, self.peer_info(), every, timeout_s=wait_s, wire=cfg.wire
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
        :raises ValueError: ``room`` is not an int in ``[0, 2**63)`` or already leased here.
        """
        room = check_room_id(room, "KVSender.start")
        if room in self.rooms:
            raise ValueError(f"KVSender.start: room {room} is already leased; clear it first")
        gen = self.rooms.lease(room, KVPoll.Bootstrapping)
        self._loop.submit(lambda: self._table.start(room, gen, time.monotonic()))
        return gen

    def dest(self, room: int) -> list[DestInfo]:
        """The DestInfos received for ``room``, one per destination DCP rank (sorted)."""
        return self._loop.locked(lambda: self._table.dest(room), 10.0)

    def capacity_tokens(self, room: int) -> int | None:
        """Largest segment (tokens) a send of ``room`` may have: the pack-region bound for a
        destination that needs relayout (pass it to ``Scheduler.split_send``), ``None`` when
        no destination needs packing (then sends are not split).

        :raises ValueError: ``room`` has no destination yet (not ``WaitingForInput``).
        """
        return self._loop.locked(lambda: self._table.capacity(room), 10.0)

    def send(self, room: int, segment: Segment, src_pages: np.ndarray, ready: Any = None) -> None:
        """Plan, pack and post the writes of one segment to every destination DCP rank.

        Never waits for the wire: the writes are planned and posted on the calling thread when
        the engine is free (no thread hand-off), else on the engine thread; :meth:`send_many`
        posts a whole step's segments at once. Segments of one room must be sent in
        ``chunk_id`` order, the last with ``is_last``; chunk ids of one rank start at 0 and have
        no gaps (the decode side counts them). A send for a failed room is ignored. Ordering
        (:mod:`pdplug.transfer.gather`): nothing reads the segment's KV before
        ``ready.query()`` is true; the relayout jobs of the segment are packed in one
        ``pack_all`` call and their writes posted only after the pack finished on the device.

        :param segment: a scheduler segment (tokens ``[token_start, token_end)``).
        :param src_pages: integer ``[n]`` source page ids from the segment's first page on
            (copied: the caller may reuse its array once ``send`` returns).
        :param ready: ``None`` (the KV is complete now) or anything with ``query() -> bool``
            that turns true once the forward's KV writes of this segment completed (a
            ``torch.cuda.Event`` recorded after them, or the ``torch.cuda.Stream`` writing
            them). Polled, never waited on; still false after ``transfer_timeout_s``: the room
            fails.
        :raises KeyError: ``room`` is not leased.
        :raises TypeError: ``ready`` has no ``query()``.
        :raises ValueError: ``room`` is not an int (``True`` would be room 1), the room is not
            ``WaitingForInput``/``Transferring``, the segment's fields disagree
            (:func:`~pdplug.transfer.handoff.malformed`), a source page id is outside the KV or
            not an integer (:func:`~pdplug.transfer.pageids.page_ids`).
        """
        job = self._handoff.accept(room, segment, src_pages, ready)
        if job is not None:
            self._handoff.post((job,))

    def send_many(self, sends: Sequence[tuple[Any, ...]]) -> None:
        """:meth:`send` for every ``(room, segment, src_pages[, ready])`` of one engine step,
        with one hand-off for all of them (:mod:`pdplug.transfer.handoff`).

        :raises KeyError, TypeError, ValueError: as :meth:`send`, for the first bad item (named
            ``item i``; the ones before it are sent), or ``sends`` (a set)/an item misshaped.
        """
        self._handoff.accept_all(sends)

    def poll(self, room: int) -> KVPoll:
        """Room status on this rank; while it is ``Transferring`` the calling thread reaps
        finished writes itself when the engine is free (:meth:`Handoff.poll
        <pdplug.transfer.handoff.Handoff.poll>`), so a polling host sees ``Success`` with no
        thread hand-off.

        :raises KeyError: ``room`` is not leased (never started, or cleared).
        """
        return self._handoff.poll(room)

    def wait(
        self,
        room: int,
        until: tuple[KVPoll, ...] = (KVPoll.Success, KVPoll.Failed),
        timeout_s: float | None = None,
    ) -> KVPoll:
        """Block until ``room`` reaches a status in ``until`` (a single non-terminal status
        means "at least"), reaping writes on the waiting thread while any is in flight.

        :param timeout_s: seconds; ``None``: as long as the room's deadlines allow.
        :raises KeyError: ``room`` is not leased.
        """
        return self._handoff.wait(room, until, timeout_s)

    def abort(self, room: int, reason: str = "aborted") -> None:
        """Fail ``room`` here and tell every destination once in-flight writes drained (a room
        that already succeeded stays so)."""
        gen = self.rooms.generation(check_room_id(room, "KVSender.abort"))
        if gen is None or self.rooms.status(room) == KVPoll.Success:
            return
        self.rooms.fail(room, f"aborted on prefill rank {self.rank}: {reason}", gen)
        # here when free: a host's next reap could post a just-ready segment into the room
        self._loop.run_here_or_submit(lambda: self._table.abort(room, gen), in_order=True)

    def clear(self, room: int) -> None:
        """Forget ``room`` (the host released it). An unfinished room is aborted first."""
        gen = self.rooms.generation(check_room_id(room, "KVSender.clear"))
        if gen is None:
            return
        done = self.rooms.status(room) == KVPoll.Success
        if not done:
            self.rooms.fail(room, f"cleared on prefill rank {self.rank} before completion", gen)
        self.rooms.clear(room, gen)
        self._loop.run_here_or_submit(lambda: self._table.clear(room, gen, done), in_order=True)

    def stats(self) -> dict[str, Any]:
        """Counters: posts, runs, bytes, notify_only, segments, direct_plans, direct_lane (segments
        posted straight from ``send``), rooms_ok/failed, refused peers, peers_dead, room_conflicts,
        writes_stuck (ever), pack_launches (per segment), pack_s/plan_s/post_s (seconds),
        pack_busy_s/write_busy_s/overlap_s (seconds the pack thread worked, a write was in flight,
        both: :class:`~pdplug.transfer.gather.BusyClock`), control-channel drops by reason,
        ``engine_*`` counters; and what the rank holds now: leases, draining, inbox, early_aborts,
        queued, waiting_ready (segments behind their ready marker), packing, xfers, stuck_writes
        (past ``transfer_timeout_s``, regions and handles held), busy_regions, peers_connected."""
        out: dict[str, Any] = {"backend": self.engine.name, "rank": self.rank}
        out.update(self._common_stats(self._codec, self._tags))
        out.update(self._pipe.counts)
        out.update({k: round(v, 6) for k, v in self._pipe.timings.items()})
        out.update({k: round(v, 6) for k, v in self._pipe.clock.totals().items()})
        out["rooms_ignored_events"] = self.rooms.ignored
        return out

    # ================================================================== engine thread
    def _register(self, entries: list[Any], reg: RegisteredKV) -> None:
        if self._info is not None:
            raise TransferError("KVSender.register_kv: already registered")
        cfg = self.config
        regions = list(reg.regions)
        self._pack, self._regions = make_pack_buffer(cfg)
        if self._pack is not None:
            regions.append((int(self._pack.data_ptr()), int(self._pack.numel())))
        self.engine.register(dedup_regions(regions))
        self._num_pages = self._handoff.num_pages = reg.num_pages
        self._handoff.page_size = cfg.layout.page_size
        base = np.asarray(reg.base, dtype=np.int64)
        packer = self._packer or self.planner.packer(cfg.device)
        self._pipe.set_memory(entries, base, self._pack, self._regions, cfg.pack_depth, packer)
        pk = (0, 0) if self._pack is None else (self._pack.data_ptr(), self._pack.numel())
        extra = {"rank": str(self.rank)}
        self._info = rank_info(cfg, self.engine, base, endpoint=self.endpoint, pack=pk, extra=extra)

    def close(self) -> None:
        """Stop refreshing the registration, then close the session; idempotent."""
        if self._registrar is not None:
            self._registrar.stop()
        super().close()

    def _shutdown(self) -> None:
        self._down = True
        self._table.close(f"sender closed on prefill rank {self.rank}")  # decodes learn it now
        self._flush_events()
        self._pipe.close()
        self._peers.close()
        self._channel.close(linger_s=1.0)  # the failure notices just queued still go out
        self.engine.close()

    def _check_peer(self, remote: PeerInfo) -> tuple[list[str], np.ndarray | None, bool]:
        return check_decode_peer(
            self.peer_info(),
            remote,
            backend=self.engine.name,
            compat=self.compat,
            planner=self.planner,
            max_dst_dcp=self.config.max_dst_dcp,
            region_nbytes=self._regions[0].nbytes if self._regions else None,
        )

    def _on_message(self, got: Inbound, now: float) -> None:
        peer = self._peers.intake(got, self._codec, now)  # Hellos, strangers, liveness
        msg = got.msg
        if peer is None or isinstance(msg, Heartbeat):
            return
        if isinstance(msg, DestInfo):
            self._table.on_dest(peer, msg, now)
        elif isinstance(msg, Abort):
            self._table.on_abort(peer, msg, now)
        else:
            self._codec.drop("wrong_type")

    def _drained(self, room: int) -> bool:
        return self._table.drained(room)

    def _gauges(self) -> dict[str, int]:
        out = self._table.gauges()
        out.update(self._pipe.gauges())
        out["peers_connected"] = len(self._peers)
        return out

    def _step(self, now: float) -> None:
        if self._down:
            return  # the engine is closed; the loop is about to stop
        periodic, busy = now >= self._next_periodic, self._pipe.has_work()
        if busy:
            self._pipe.step(now)  # before progress: a send just submitted posts without delay
        if busy or periodic:  # idle, it expects nothing: short rounds leave the lock to hosts
            self.engine.progress()
        if periodic:
            self._next_periodic = now + 0.01
            if self._outcomes:  # the sender's _events fill only inside its flush
                self._flush_events()
            self._table.expire(now)
            if self._live.due(now):
                live = self._table.keep_alive(self._pipe.active(now))
                self._peers.heartbeat(now, live)
                self._table.expire_inbox(now)

    def _event(self, kind: str, lease: Lease, reason: str | None = None) -> None:
        if self._emit is not None:  # on the send path: a tuple now, the fields at the flush
            self._outcomes.append((kind, lease.room, lease.generation, len(lease.dests), reason))

    def _flush_events(self) -> None:
        outcomes, self._outcomes = self._outcomes, []
        for kind, room, generation, dests, reason in outcomes:
            fields: dict[str, Any] = {} if reason is None else {"reason": reason}
            fields.update(rank=self.rank, generation=generation, dests=dests)
            self._events.append((kind, room, fields))
        super()._flush_events()
