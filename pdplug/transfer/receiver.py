"""Decode side: :class:`KVReceiverSession`, the engine-neutral KV receiver of both backends.

One session per decode rank (one per DCP rank). It registers the rank's KV entries with the
engine, connects to every prefill rank's control endpoint (handshake and liveness:
:class:`~pdplug.transfer.sources.PrefillSources`), sends one :class:`~pdplug.types.DestInfo`
per request to every prefill rank, and completes rooms from strictly validated
:class:`~pdplug.types.ChunkTag` s — engine notifications (NIXL) or
:class:`~pdplug.transfer.messages.Done` frames on the control channel (Mooncake, and failures
for every engine). A tag is accepted only if it names the current lease generation of its room,
comes from the source rank it claims (connection or engine agent name), and is not a duplicate;
anything else is dropped and counted (``stale``, ``unknown_rank``, ``malformed``, ``other``).
A room is ``Success`` once every source rank delivered chunks ``0..last`` (its ``is_last``
chunk included) — counting positives with a negative twin: a ``ChunkTag(ok=False)`` fails the
room at once, a silent source fails it after ``transfer_timeout_s``, and so do the room
deadlines (SGLang ``TransferStatus.is_done`` + generations; vLLM PR #50754).
"""

from __future__ import annotations

import time
from collections import Counter
from collections.abc import Sequence
from concurrent.futures import TimeoutError as FutureTimeout
from typing import Any, NoReturn

import numpy as np

from pdplug.config import KVConfig
from pdplug.errors import CompatError, TransferError
from pdplug.registration import RegisteredKV, resolve_kv
from pdplug.rooms import Rooms, check_room_id
from pdplug.transfer.arrivals import RecvLease, RecvLeases
from pdplug.transfer.channel import DealerChannel, Liveness, merge_stats
from pdplug.transfer.engine import TransferEngine
from pdplug.transfer.handshake import (
    Compat,
    Emit,
    check_prefill_instance,
    layout_compat,
    merge_refusals,
    rank_info,
)
from pdplug.transfer.loop import EngineLoop
from pdplug.transfer.messages import Done, Heartbeat, HelloAck, control_codec, tag_codec
from pdplug.transfer.pageids import check_span, page_ids
from pdplug.transfer.refind import Finder
from pdplug.transfer.session import RoomSession
from pdplug.transfer.sources import PrefillSources
from pdplug.types import DestInfo, KVPoll, PeerInfo, pages_to_bytes
from pdplug.wire import rank_identity

__all__ = ["KVReceiverSession"]


class KVReceiverSession(RoomSession):
    """Engine-neutral decode-side KV receiver (implements :class:`pdplug.protocols.KVReceiver`).

    :param config: this rank's :class:`~pdplug.config.KVConfig` (``role="decode"``).
    :param engine: the backend adapter (:class:`~pdplug.transfer.engine.TransferEngine`).
    :param compat: handshake check ``(local, remote) -> mismatches`` (a plugin manager passes
        its ``check_compat``); ``None``: the layout checks only
        (:func:`~pdplug.transfer.handshake.layout_compat`).
    :param emit: observer callback for room outcomes (``transfer_done`` /
        ``transfer_failed``, once per room; a plugin manager passes its ``emit``); ``None``:
        no events.
    :raises ValueError: ``config.role`` is not ``"decode"``.
    """

    def __init__(
        self,
        config: KVConfig,
        engine: TransferEngine,
        *,
        compat: Compat | None = None,
        emit: Emit | None = None,
    ) -> None:
        if config.role != "decode":
            raise ValueError(
                f"KVReceiverSession: KVConfig.role must be 'decode', got {config.role!r}"
            )
        self.config = config
        self.layout = config.layout
        self.engine = engine
        self.compat: Compat = compat or layout_compat
        self._emit = emit
        self._events: list[tuple[str, int, dict[str, Any]]] = []
        self.rooms = Rooms.from_config(config)
        self.counts: Counter[str] = Counter()
        self._closed = False
        self._down = False
        w = config.wire
        name = f"{config.instance}/d{config.layout.dcp_rank}"
        me = rank_identity(config.instance, config.layout)
        # semantic drops (stale acks and tags); each connection has its own sealed codec
        self._codec = control_codec(w, identity=me, name=f"{name}/control")
        self._tags = tag_codec(w, name=f"{name}/tags")
        self._num_pages = 0
        self._refused: dict[str, str] = {}  # instance -> why its last connect was refused
        self._info: PeerInfo | None = None
        self._next_periodic = 0.0
        self._live = Liveness(config.transfer_timeout_s)
        self._loop = EngineLoop(
            f"pdplug-{engine.name}-recv-{config.instance}-{config.layout.dcp_rank}",
            self._step,
            lambda: False,
            idle_s=self._idle_s,
            on_death=self._engine_died,
        )
        self._channel = DealerChannel(
            self._loop, w, me, f"{name}/control", self._on_message, self.counts
        )
        self._sources = PrefillSources(
            channel=self._channel,
            codec=self._codec,
            liveness=self._live,
            on_dead=lambda src, why: self._table.source_dead(src, why, time.monotonic()),
            on_replace=lambda old, new: self._table.rebind(old, new),
            counts=self.counts,
            on_answered=lambda inst: self._table.unpark(inst, None, time.monotonic()),
        )
        self._table = RecvLeases(
            rooms=self.rooms,
            sources=self._sources,
            ask_s=max(0.25, min(2.0, config.transfer_timeout_s / 4)),
            event=self._event,
            counts=self.counts,
            refind=lambda inst: self._finder.start(inst),
            searching=lambda inst: self._finder.busy(inst),
        )
        self._finder = Finder(
            name=self._loop.name,
            connect=lambda peers, where, t: self.connect(peers, t, rendezvous=where),
            submit=self._loop.submit,
            on_found=lambda inst, err, since: self._table.unpark(
                inst, err, time.monotonic(), since
            ),
            timeout_s=config.bootstrap_timeout_s,
            retry_s=max(1.0, config.transfer_timeout_s),
            wire=config.wire,
            counts=self.counts,
        )
        # engine-thread tables, named for tools that inspect what a session holds
        self._leases = self._table.leases
        self._draining = self._table.draining
        self._loop.start()

    # ================================================================== host-facing API
    def register_kv(self, entries: Sequence[Any]) -> None:
        """Register the rank's KV entries (``layout`` order) once, without copying them.

        Items are as for :meth:`pdplug.transfer.sender.KVSenderSession.register_kv`
        (:func:`pdplug.registration.resolve_kv`: strided tensors matching the entry geometry,
        layers sharing one storage, raw ``(address, nbytes[, page_stride])`` regions); draft
        entries hold whole virtual pages (``page_size * dcp_size`` tokens). Memory shared by
        several entries is registered once. The memory must outlive the session.

        :raises ValueError: entry count, a tensor whose strides do not match its entry, a
            region with another page stride, an entry below one page (each named).
        :raises TransferError: the engine refused the memory.
        """
        reg = resolve_kv(self.layout, list(entries))
        self._loop.call(lambda: self._register(reg), 60.0)

    def peer_info(self) -> PeerInfo:
        """What this rank sends to prefill ranks at the handshake (after :meth:`register_kv`).

        :raises TransferError: :meth:`register_kv` was not called.
        """
        if self._info is None:
            raise TransferError("KVReceiver.peer_info: call register_kv first")
        return self._info

    def connect(
        self,
        prefill: Sequence[PeerInfo],
        timeout_s: float | None = None,
        *,
        rendezvous: str | None = None,
    ) -> None:
        """Handshake with every rank of one prefill instance (from
        :func:`pdplug.bootstrap.resolve`); bounded by ``timeout_s`` (default
        ``bootstrap_timeout_s``). The instance stays known after its sources die: one dropped
        as silent or replaced (a rolling restart) is looked up again at ``rendezvous`` (default
        ``KVConfig.bootstrap_endpoint``; ``""``: never) by the next :meth:`expect` bound for it,
        in the background, and whenever a failed room waits for such a source to drain.

        :raises CompatError: naming every mismatch, from this side's check and from each
            prefill rank's refusal (:meth:`pdplug.protocols.KVReceiver.connect`).
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
        peers, mine = check_prefill_instance(
            local, peers, backend=self.engine.name, compat=self.compat
        )
        if not peers:
            self._refuse(instance, mine)
        limit = self.config.bootstrap_timeout_s if timeout_s is None else timeout_s
        fut = self._loop.call(lambda: self._sources.connect(instance, peers, local), limit)
        try:
            sources = fut.result(timeout=limit)
        except FutureTimeout as e:
            missing = self._loop.call(lambda: self._sources.abandon(fut), 10.0)
            why = "KVConfig.bootstrap_timeout_s" if timeout_s is None else "timeout_s"
            raise TransferError(
                f"KVReceiver.connect: prefill {instance} ranks {missing} did not answer the "
                f"handshake in {limit:g} s ({why})"
            ) from e
        theirs = [
            f"prefill {instance} rank {s.rank} refused: {m}"
            for s in sources
            if s.state == "refused"
            for m in s.mismatches
        ]
        merged = merge_refusals(mine, theirs)
        if merged:
            self._loop.call(lambda: self._sources.disconnect(instance), 10.0)
            self._refuse(instance, merged)
        self._refused.pop(instance, None)
        self._finder.remember(
            instance, self.config.bootstrap_endpoint if rendezvous is None else rendezvous
        )

    def find(self, instance: str, rendezvous: str) -> None:
        """Know ``instance`` by its rendezvous without connecting now: the first :meth:`expect`
        bound for it waits while a thread resolves and connects it (``bootstrap_timeout_s``),
        then is sent or fails naming why: no host step blocks on a lookup (issue 22).

        :raises ValueError: an empty or non-str ``instance`` or ``rendezvous``.
        :raises TransferError: the session is closed.
        """
        if not all(isinstance(x, str) and x for x in (instance, rendezvous)):
            raise ValueError(f"KVReceiver.find: instance={instance!r}, rendezvous={rendezvous!r}"
                             ": both must be non-empty str")  # fmt: skip
        if self._closed:
            raise TransferError(f"KVReceiver.find: {self.config.instance} is closed")
        self._finder.rendezvous.setdefault(str(instance), str(rendezvous))

    def _refuse(self, instance: str, mismatches: list[str]) -> NoReturn:
        """Remember why ``instance`` refused this rank (its rooms fail naming it); raise."""
        self._refused[instance] = "; ".join(mismatches)[:1024]
        raise CompatError(mismatches)

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

        :param dst_pages: integer ``[n]`` destination (virtual) page ids of this rank from
            ``decode_prefix_len`` on; every id must be a registered page (copied: the caller
            may reuse its array once ``expect`` returns).
        :param decode_prefix_len: tokens decode already holds (a multiple of the virtual page,
            ``page_size * dcp_size`` tokens).
        :param num_tokens: the prompt length in tokens (0: unknown, unchecked).
        :param instance: the prefill instance; optional when this rank knows only one:
            connected, found (even while found again) or refused (the room then fails).
        :raises ValueError: a page id out of range or not an integer, too few pages for
            ``num_tokens``, an unaligned prefix, an unknown or non-str instance, a room not an int
            in ``[0, 2**63)`` (a NumPy integer is taken as its int) or already leased.
        """
        room = check_room_id(room, "KVReceiver.expect")
        inst = self._instance(instance)
        pages = page_ids(dst_pages, "dst_pages", self._num_pages, "KVReceiver.expect", room)
        check_span(self.layout, pages.size, decode_prefix_len, num_tokens)
        gen = self._lease(room, "expect")
        if inst in self._refused and inst not in self._sources.by_instance:
            why = f"prefill {inst} refused this decode rank at connect: {self._refused[inst]}"
            self.rooms.fail(room, why, gen)
            self.counts["rooms_refused"] += 1
            return gen
        dest = self._dest(room, gen, pages_to_bytes(pages), decode_prefix_len, num_tokens)
        self._loop.submit(lambda: self._table.expect(inst, dest, time.monotonic()))
        return gen

    def abort(self, room: int, reason: str = "aborted") -> None:
        """Fail ``room`` here and tell every prefill rank to stop sending it (Success stays)."""
        gen = self.rooms.generation(check_room_id(room, "KVReceiver.abort"))
        if gen is None or self.rooms.status(room) == KVPoll.Success:
            return
        self.rooms.fail(room, f"aborted on decode dcp {self.layout.dcp_rank}: {reason}", gen)
        self._loop.submit(lambda: self._table.abort(room, gen, reason, time.monotonic()))

    def decline(self, room: int, reason: str = "aborted", *, instance: str | None = None) -> int:
        """Lease ``room`` failed and tell every prefill rank of ``instance`` to stop waiting
        for it, without a DestInfo (:func:`pdplug.protocols.decline_room`); drained at once.

        :raises ValueError: an unknown instance, a room outside ``[0, 2**63)`` or already leased.
        :raises TypeError: ``reason`` is not a str.
        """
        if not isinstance(reason, str):
            raise TypeError(f"KVReceiver.decline: reason must be a str, got {reason!r}")
        room = check_room_id(room, "KVReceiver.decline")
        inst = self._instance(instance, "decline")
        gen = self._lease(room, "decline")
        self.rooms.fail(room, f"aborted on decode dcp {self.layout.dcp_rank}: {reason}", gen)
        dest = self._dest(room, gen, b"")
        self._loop.submit(lambda: self._table.decline(inst, dest, reason, time.monotonic()))
        return gen

    def clear(self, room: int) -> None:
        """Forget ``room``; later tags of its generation are dropped as stale. An unfinished
        room is aborted first (the prefill ranks are told)."""
        gen = self.rooms.generation(check_room_id(room, "KVReceiver.clear"))
        if gen is None:
            return
        if self.rooms.status(room) not in (KVPoll.Success, KVPoll.Failed):
            self.abort(room, "cleared before completion")
        self.rooms.clear(room, gen)
        self._loop.submit(lambda: self._table.clear(room, gen))

    def stats(self) -> dict[str, Any]:
        """Counters: chunks, rooms_ok/failed, sources_dead, abort_resent, drops by reason for
        the control channel (``control_dropped_*``) and engine notifications
        (``tags_dropped_*``), ``engine_*`` engine counters; and what the rank holds now:
        leases, draining (cleared, not drained), undrained (failed, not drained), sources."""
        out: dict[str, Any] = {"backend": self.engine.name, "dcp_rank": self.layout.dcp_rank}
        out.update(self._common_stats(self._codec, self._tags))
        frames: dict[str, int] = {}
        try:  # every connection's codec, open or closed (read on the engine thread)
            frames = (
                self._loop.locked(self._channel.stats, 10.0)
                if self._loop.running
                else self._channel.stats()
            )
        except TransferError:
            pass
        merged = merge_stats([self._codec.stats(), frames])
        out.update({f"control_{k}": v for k, v in merged.items()})
        return out

    # ================================================================== helpers
    def _lease(self, room: int, call: str) -> int:
        if room in self.rooms:
            raise ValueError(f"KVReceiver.{call}: room {room} is already leased; clear it first")
        return self.rooms.lease(room, KVPoll.WaitingForInput)

    def _dest(
        self, room: int, gen: int, pages: bytes, prefix: int = 0, tokens: int = 0
    ) -> DestInfo:
        return DestInfo(
            room=room,
            generation=gen,
            decode_instance=self.config.instance,
            dcp_rank=self.layout.dcp_rank,
            dst_pages=pages,
            decode_prefix_len=prefix,
            num_tokens=tokens,
        )

    def _instance(self, instance: str | None, call: str = "expect") -> str:
        if isinstance(instance, str):  # the usual call: three lookups, no set built per request
            src, found = self._sources.by_instance, self._finder.rendezvous
            if instance in src or instance in found or instance in self._refused:
                return instance if type(instance) is str else str(instance)  # np.str_: wire
            raise ValueError(f"KVReceiver.{call}: prefill instance {instance!r} not connected")
        if instance is not None:  # a list raised "unhashable type" from a lookup
            raise ValueError(f"KVReceiver.{call}: instance must be a str, got {instance!r}")
        # the only one this rank knows: connected, found (being found again) or refused
        known = {*self._sources.by_instance, *self._finder.rendezvous, *self._refused}
        if len(known) != 1:
            raise ValueError(
                f"KVReceiver.{call}: instance is required when this rank knows "
                f"{len(known)} prefill instances ({sorted(known)}; connected, found or refused)"
            )
        return next(iter(known))

    def _idle_s(self) -> float:
        return 0.001 if (self.engine.notifications and self._leases) else 0.005

    # ================================================================== engine thread
    def _register(self, reg: RegisteredKV) -> None:
        if self._info is not None:
            raise TransferError("KVReceiver.register_kv: already registered")
        self.engine.register(list(reg.regions))
        self._num_pages = reg.num_pages
        self._info = rank_info(self.config, self.engine, reg.base)

    def _shutdown(self) -> None:
        self._down = True
        self._finder.closed = True
        self._flush_events()
        self._sources.close()
        self._channel.close_all()
        self.engine.close()

    def _on_message(self, cid: bytes, msg: Any, now: float) -> None:
        src = self._sources.by_cid.get(cid)
        if src is None:
            return
        src.last_seen = now
        if isinstance(msg, Done):
            self._table.on_tag(src, msg.chunk, self._codec, now, msg.drained)
        elif isinstance(msg, HelloAck):
            self._sources.on_ack(src, msg)
        elif isinstance(msg, Heartbeat):
            if msg.live:
                self._table.keep_alive(src, msg.live)
        else:
            self._codec.drop("wrong_type")

    def _step(self, now: float) -> None:
        if self._down:
            return  # the engine is closed; the loop is about to stop
        if self.engine.notifications:
            for name, data in self.engine.poll_notifications():
                src = self._sources.by_agent.get(name)
                if src is None:
                    self._tags.drop("unknown_rank")
                    continue
                tag = self._tags.decode(data)
                if tag is not None:
                    src.last_seen = now
                    self._table.on_tag(src, tag, self._tags, now, False)
        if now >= self._next_periodic:
            self._next_periodic = now + 0.01
            self._periodic(now)

    def _event(self, kind: str, lease: RecvLease, **fields: Any) -> None:
        fields.update(
            dcp_rank=self.layout.dcp_rank,
            generation=lease.generation,
            chunks=sum(len(g) for g in lease.got.values()),
        )
        self._queue_event(kind, lease.room, fields)

    def _periodic(self, now: float) -> None:
        if self._events:
            self._flush_events()
        self._table.expire(now)
        self._channel.revive(now)
        if self._live.due(now):
            self._sources.heartbeat(now)
            self._table.sweep(now)
            self._finder.for_drain(self._table.stranded(), now)

    def _drained(self, room: int) -> bool:
        return self._table.drained(room)

    def _gauges(self) -> dict[str, int]:
        out = self._table.gauges()
        srcs = [s for t in self._sources.by_instance.values() for s in t.values()]
        out["sources"] = len(srcs)
        # silent: declared dead for silence; ended: nothing of theirs can land any more
        out["sources_silent"] = sum(1 for s in srcs if s.silent)
        now = time.monotonic()
        out["sources_ended"] = sum(1 for s in srcs if self._sources.ended(s, now))
        return out
