"""Worker side of PdplugConnector: vLLM's KV cache behind a pdplug KV sender or receiver.

One :class:`PushWorker` per vLLM worker (each PP stage, TP rank and DCP rank). It imports no
vLLM module: the connector hands it vLLM's per-layer tensors, each step's
:class:`~pdplug.adapters.vllm.scheduler.StepPlan` and the finished request ids; the transfers
go through the pdplug components the engine selected (``PluginManager.make_kv_sender`` /
``make_kv_receiver``, ``make_pack_planner``, ``make_scheduler``), so a third-party pdplug
plugin serves vLLM unchanged.

Prefill (``kv_producer``): each :class:`~pdplug.adapters.push.SendJob` leases its
room on first sight (``KVSender.start``); once the decode's DestInfo arrived the job's tokens
are split at ``min(grid, pack capacity)`` by the selected scheduler
(:func:`pdplug.adapters.push.segments_for_job`: chunk ids continue across jobs, a non-last
job's partial page waits for the next) and posted, every segment of an engine step in one
``KVSender.send_many`` call (one hand-off per step, issue 24). Jobs that come before the
DestInfo wait here (the room is ``Bootstrapping``, bounded by ``bootstrap_timeout_s``). A room
of a finished request is reported in ``finished_sending`` once it ended (Success or Failed)
and :meth:`~pdplug.protocols.KVSender.drained`, so vLLM frees its blocks only when no write
reads them. Preemption aborts the room and waits (bounded by ``transfer_timeout_s``) for it to
drain before the freed blocks are overwritten.

Decode (``kv_consumer``): the first :class:`~pdplug.adapters.vllm.scheduler.RecvJob` naming a
prefill instance makes it known to the receiver by its bootstrap endpoint
(:func:`pdplug.protocols.find_instance`: the receiver resolves and connects it in the
background, the room waiting meanwhile, so no worker step blocks on a lookup), and each job
``expect``s the room with the request's blocks from ``decode_prefix_len`` on. A room that
succeeded is reported in ``finished_recving``; one that failed is reported in both
``failed_recving`` and ``finished_recving`` once drained (no prefill write can land in its
blocks any more), and vLLM applies ``kv_load_failure_policy``. A
:class:`~pdplug.adapters.vllm.scheduler.Cancel` (request ended before it was scheduled) tells
the prefill instance at once (a lease with no pages, aborted).

vLLM's caches are registered as they are: on CPU (``CPU_ATTN``) a layer is ``(num_blocks,
H, block_size, 2 * head_size)``, per (block, head) a K slab then a V slab
(:func:`pdplug.geometry.slab_views`, two entries per layer); layers sharing one storage are
registered once (:func:`pdplug.registration.resolve_kv`). The prefill rank publishes itself at
the rendezvous its engine's scheduler process serves from a background thread: vLLM registers
the KV caches before it builds the scheduler.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Iterable, Mapping
from typing import Any

import msgspec
import numpy as np

from pdplug import bootstrap
from pdplug.adapters.placement import RankPlacement
from pdplug.adapters.push import PushCursor, SendJob, segments_for_job
from pdplug.adapters.vllm.placement import TransferResults, ordered_layers
from pdplug.adapters.vllm.scheduler import Cancel, RecvJob, StepPlan
from pdplug.config import KVConfig, SchedulerConfig
from pdplug.geometry import make_layout, slab_views
from pdplug.protocols import find_instance
from pdplug.transfer.faults import inject_from_env
from pdplug.types import KVPoll

__all__ = ["PushWorker"]

log = logging.getLogger(__name__)

_TERMINAL = (KVPoll.Success, KVPoll.Failed)


class _SendRoom(msgspec.Struct, kw_only=True):
    req_id: str
    cursor: PushCursor  # tokens posted, next chunk id, whether the last segment went
    pending: list[SendJob] = []
    aborted: bool = False
    ready: Any = None  # the latest step's readiness: covers every earlier step's KV writes


class _RecvRoom(msgspec.Struct, kw_only=True):
    req_id: str
    aborted: bool = False  # the request ended while waiting: report finished only
    cancel: bool = False  # a decline (no pages): nothing to report


class PushWorker:
    """One vLLM worker's pdplug KV sender (prefill) or receiver (decode).

    :param where: this worker's :class:`RankPlacement`.
    :param manager: the pdplug ``PluginManager`` (default :func:`pdplug.get_plugin_manager`).
    :raises ValueError: a bad ``where.side``.
    """

    def __init__(self, where: RankPlacement, manager: Any = None) -> None:
        if where.side not in ("prefill", "decode"):
            raise ValueError(f"PushWorker: side={where.side!r}: expected 'prefill' or 'decode'")
        if manager is None:
            from pdplug import get_plugin_manager

            manager = get_plugin_manager()
        self.where = where
        self.pm = manager
        self.session: Any = None
        self.layers: list[str] = []
        self._sched: Any = None
        self._send: dict[int, _SendRoom] = {}
        self._recv: dict[int, _RecvRoom] = {}
        self._finished: set[str] = set()  # prefill requests vLLM finished (blocks held)
        self._connected: set[str] = set()
        self._publish: threading.Thread | None = None
        self.publish_error: str | None = None
        self._failed_local: dict[int, str] = {}  # rooms failed here, never leased
        self._counts = {"rooms_started": 0, "rooms_ok": 0, "rooms_failed": 0}
        self._reported = {"bytes": 0, "rooms_started": 0, "rooms_ok": 0, "rooms_failed": 0}
        self._local_ids = 0

    # ------------------------------------------------------------------ registration
    def register(self, kv_caches: Mapping[str, Any]) -> None:
        """Register vLLM's per-layer KV tensors with a new sender (prefill) or receiver.

        :param kv_caches: ``{layer_name: tensor}``; each tensor ``(num_blocks, H, block_size,
            2 * head_size)`` (vLLM ``CPU_ATTN`` / ``LBHNC``), any dtype, K slab then V slab per
            (block, head); layers may share one storage.
        :raises ValueError: an unexpected shape or stride (named).
        :raises pdplug.errors.PluginError: a selected pdplug component cannot be built.
        """
        w = self.where
        layers = ordered_layers(kv_caches)
        if not layers:
            raise ValueError("PdplugConnector.register_kv_caches: no KV cache tensors")
        self.layers = [n for n, _ in layers]
        first = layers[0][1]
        elt = first.element_size()
        page_strides = {int(t.stride(0)) * elt for _, t in layers}
        if len(page_strides) != 1:
            raise ValueError(
                f"PdplugConnector: layers have different block strides {sorted(page_strides)} "
                "bytes; one stride per engine is supported"
            )
        first_layer = min(
            ([int(p) for p in n.split(".") if p.isdigit()] or [0])[0] for n in self.layers
        )
        lay = make_layout(
            kind="hnd", page_size=w.block_size, num_layers=len(layers),
            head_bytes=w.head_size * elt, num_kv_heads=w.num_kv_heads, slabs=True,
            first_layer=first_layer, tp_size=w.tp_size, tp_rank=w.tp_rank,
            pp_size=w.pp_size, pp_rank=w.pp_rank, dcp_size=w.dcp_size, dcp_rank=w.dcp_rank,
            page_stride=page_strides.pop(), dtype=str(first.dtype).removeprefix("torch."),
            head_size=w.head_size, model=w.model, engine="vllm",
            engine_version=w.engine_version,
        )  # fmt: skip
        entries: list[Any] = []
        for _, t in layers:
            entries += list(slab_views(t, w.block_size))
        config = KVConfig(
            instance=w.instance, role=w.side, layout=lay, bootstrap_endpoint="",
            bootstrap_timeout_s=w.bootstrap_timeout_s, waiting_timeout_s=w.waiting_timeout_s,
            transfer_timeout_s=w.transfer_timeout_s, pack_region_tokens=w.pack_region_tokens,
            max_dst_dcp=8, device=str(first.device), wire=w.wire,
        )  # fmt: skip
        if w.side == "prefill":
            planner = self.pm.make_pack_planner(name=w.pack_planner)
            self.session = self.pm.make_kv_sender(config, planner, name=w.kv_sender)
            self._sched = self.pm.make_scheduler(
                SchedulerConfig(page_size=w.block_size, chunk_size=w.chunk_tokens),
                name=w.scheduler,
            )
        else:
            self.session = self.pm.make_kv_receiver(config, name=w.kv_sender)
        self.session.register_kv(entries)
        if w.side == "prefill":
            inject_from_env(self.session)  # test-only, off unless PDPLUG_TEST_FAIL_WRITES
        if w.side == "prefill" and w.bootstrap:
            self._publish = threading.Thread(
                target=self._publish_rank, name="pdplug-publish", daemon=True
            )
            self._publish.start()

    def _publish_rank(self) -> None:
        # the rendezvous lives in the scheduler process, built after the KV caches
        try:
            bootstrap.register(
                self.where.bootstrap, self.session.peer_info(), timeout_s=600.0,
                wire=self.where.wire,
            )  # fmt: skip
        except Exception as e:  # reported through every room's failure
            self.publish_error = f"{type(e).__name__}: {e}"
            log.error("pdplug: publishing this prefill rank failed: %s", self.publish_error)

    def handshake(self) -> dict[str, Any]:
        """What this rank tells vLLM's handshake (the scheduler checks the rank grid)."""
        w = self.where
        return {"instance": w.instance, "side": w.side, "pp_rank": w.pp_rank,
                "tp_rank": w.tp_rank, "bootstrap": w.bootstrap}  # fmt: skip

    # ------------------------------------------------------------------ per step
    def on_plan(self, plan: StepPlan) -> None:
        """Apply a step's aborts, cancels and receive jobs; queue its send jobs (called before
        the forward: they are posted by :meth:`post`, once the forward wrote their KV)."""
        for c in plan.cancel:
            self._decline(c)
        for job in plan.recv:
            self._expect(job)
        self.preempt(plan, wait=False)  # after recv: an abort may name a room leased just now
        for s in plan.send:
            self._queue(s)

    def preempt(self, plan: StepPlan, *, wait: bool = True) -> None:
        """Abort ``plan.abort`` rooms; with ``wait``, until each drained (bounded by
        ``transfer_timeout_s``) so blocks vLLM freed are not read or written any more."""
        if self.session is None:
            return
        for req_id, room in plan.abort:
            if self.where.side == "prefill":
                st = self._send.get(room) or self._new_send_room(room, req_id)
                if not st.aborted:
                    st.aborted, st.pending = True, []
                    self._abort(room, "request aborted or preempted on prefill")
            else:
                r = self._recv.get(room)
                if r is not None and not r.aborted:
                    r.aborted = True
                    self._abort(room, "request aborted on decode")
        if wait and plan.abort:
            deadline = time.monotonic() + self.where.transfer_timeout_s
            for _, room in plan.abort:
                while not self._drained(room) and time.monotonic() < deadline:
                    time.sleep(0.001)

    def post(self, ready: Any = None) -> None:
        """Prefill: post every queued job whose room has its destination (after the forward),
        all of this step's segments in one ``KVSender.send_many`` call: one hand-off per engine
        step however many rooms and segments it has (issue 24; a sender without
        ``send_many``, e.g. a third-party plugin's, gets one ``send`` per segment).

        :param ready: ``None`` (the step's KV is in the blocks now, CPU) or the step's
            readiness (:func:`pdplug.adapters.push.step_ready`, a CUDA event recorded
            after the forward's KV writes) passed with every segment of this step.
        """
        items: list[tuple[int, Any, Any, Any]] = []
        rooms: list[int] = []
        for room, st in list(self._send.items()):
            if st.pending and not st.aborted:
                if ready is not None:  # jobs not posted now keep it (posted from results())
                    st.ready = ready
                n = len(items)
                self._plan(room, st, items)
                if len(items) > n:
                    rooms.append(room)
        if items:
            self._send_step(items, rooms)

    def has_pending(self) -> bool:
        """Prefill: some queued job waits to be posted."""
        return any(st.pending and not st.aborted for st in self._send.values())

    def results(self, finished_req_ids: Iterable[str]) -> TransferResults:
        """Rooms that ended and drained since the last call (vLLM ``get_transfer_results``).

        :param finished_req_ids: requests vLLM finished this step (prefill: held blocks).
        """
        out = TransferResults(finished_sending=set(), finished_recving=set(),
                              failed_recving=set())  # fmt: skip
        if self.session is None:
            return out
        if self.where.side == "prefill":
            live = {st.req_id for st in self._send.values()}
            self._finished |= set(finished_req_ids) & live  # requests without a room: none
            self.post()
            for room, st in list(self._send.items()):
                if st.req_id not in self._finished:
                    continue
                status = self._status(room)
                if status in _TERMINAL and self._drained(room):
                    out.finished_sending.add(st.req_id)
                    if status == KVPoll.Failed:
                        log.warning("pdplug: room %d of %s failed: %s", room, st.req_id,
                                    self._reason(room))  # fmt: skip
                    self._counts["rooms_ok" if status == KVPoll.Success else "rooms_failed"] += 1
                    self._finished.discard(st.req_id)
                    self._forget(room)
                    del self._send[room]
            return out
        for room, r in list(self._recv.items()):
            status = self._status(room)
            if status not in _TERMINAL:
                continue
            if status == KVPoll.Failed and not self._drained(room):
                continue
            if not r.cancel:
                out.finished_recving.add(r.req_id)
                if status == KVPoll.Failed and not r.aborted:
                    out.failed_recving.add(r.req_id)
                    log.warning("pdplug: room %d of %s failed: %s", room, r.req_id,
                                self._reason(room))  # fmt: skip
            self._forget(room)
            del self._recv[room]
        return out

    def stats_delta(self) -> dict[str, int]:
        """Bytes posted (prefill), rooms started and rooms reported ended since the last
        call."""
        now = dict(self._counts)
        if self.session is not None and self.where.side == "prefill":
            now["bytes"] = int(self.session.stats().get("bytes", 0))
        else:
            now["bytes"] = self._reported["bytes"]
        delta = {k: now[k] - self._reported[k] for k in self._reported}
        self._reported = now
        return delta

    def busy(self) -> bool:
        """Rooms still tracked here."""
        return bool(self._send or self._recv)

    def close(self) -> None:
        """Abort what is left and close the session; idempotent."""
        s, self.session = self.session, None
        if s is not None:
            for room in list(self._send) + list(self._recv):
                try:
                    s.abort(room, "engine shutting down")
                except (KeyError, ValueError):
                    pass
            s.close()
        self._send.clear()
        self._recv.clear()

    # ------------------------------------------------------------------ prefill helpers
    def _queue(self, job: SendJob) -> None:
        st = self._send.get(job.room)
        if st is None:
            st = self._new_send_room(job.room, job.req_id)
            try:
                self.session.start(job.room)
            except ValueError as e:  # a live lease of that room: never mix two requests
                log.error("pdplug: room %d of %s not started: %s", job.room, job.req_id, e)
                st.aborted = True
                return
        if not st.aborted:  # posted by post(), after this step's forward wrote the KV
            st.pending.append(job)

    def _new_send_room(self, room: int, req_id: str) -> _SendRoom:
        # every room tracked here is reported ended once (rooms_ok or rooms_failed), so
        # rooms_started - rooms_ok - rooms_failed is what this rank still holds
        st = self._send[room] = _SendRoom(req_id=req_id, cursor=PushCursor(room=room))
        self._counts["rooms_started"] += 1
        return st

    def _plan(self, room: int, st: _SendRoom, items: list[tuple[int, Any, Any, Any]]) -> None:
        # the room's queued jobs as (room, segment, src_pages, ready) items of this step
        status = self._status(room)
        if status == KVPoll.Failed:
            st.pending = []
            return
        if status not in (KVPoll.WaitingForInput, KVPoll.Transferring):
            return
        s = self.session
        prefix = s.dest(room)[0].decode_prefix_len
        cap = s.capacity_tokens(room)
        jobs, st.pending = st.pending, []
        n = len(items)
        for job in jobs:
            if st.cursor.done:
                break
            try:
                segs = segments_for_job(
                    st.cursor, job, decode_prefix_len=prefix, capacity_tokens=cap,
                    block_size=self.where.block_size, scheduler=self._sched,
                    whole_pages=self.where.whole_blocks,
                )  # fmt: skip
            except ValueError as e:
                del items[n:]  # none of this room's segments goes out
                self._abort(room, f"send failed: {e}")
                st.aborted = True
                return
            items += [(room, seg, pages, st.ready) for seg, pages in segs]

    def _send_step(self, items: list[tuple[int, Any, Any, Any]], rooms: list[int]) -> None:
        s = self.session
        many = getattr(s, "send_many", None)
        if many is None:
            bad: set[int] = set()
            for room, seg, pages, ready in items:
                if room in bad:
                    continue
                try:
                    s.send(room, seg, pages, ready=ready)
                except (KeyError, TypeError, ValueError) as e:
                    bad.add(room)
                    self._fail_send(room, e)
            return
        try:
            many(items)
        except (KeyError, TypeError, ValueError) as e:
            # the items before the bad one went out, the rest did not; which room it was is
            # not returned, so every room of the step is failed (the decode side recomputes
            # or fails those requests per kv_load_failure_policy): never a room with a gap
            for room in rooms:
                self._fail_send(room, e)

    def _fail_send(self, room: int, e: Exception) -> None:
        log.error("pdplug: room %d: send failed: %s", room, e)
        self._abort(room, f"send failed: {type(e).__name__}: {e}")
        st = self._send.get(room)
        if st is not None:
            st.aborted, st.pending = True, []

    # ------------------------------------------------------------------ decode helpers
    def _connect(self, instance: str, endpoint: str) -> None:
        if instance in self._connected:
            return
        # the session connects it in the background when the room below needs it: a dead,
        # restarting or unknown prefill instance costs its own rooms (they wait, bounded by
        # bootstrap_timeout_s, then fail naming why), never this worker's step (issue 22)
        find_instance(self.session, instance, endpoint, wire=self.where.wire,
                      timeout_s=self.where.bootstrap_timeout_s)  # fmt: skip
        self._connected.add(instance)

    def _expect(self, job: RecvJob) -> None:
        s = self.session
        room = job.room
        if job.fail or room in self._recv:
            # a request in error, or a duplicate room: fail it under a local id (below 0,
            # never leased) without touching the peer
            self._local_ids += 1
            room = -self._local_ids
            self._recv[room] = _RecvRoom(req_id=job.req_id)
            self._failed_local[room] = job.fail or f"room {job.room} is live on this rank"
            return
        self._recv[room] = _RecvRoom(req_id=job.req_id)
        try:
            self._connect(job.prefill_instance, job.bootstrap)
            s.expect(
                room, np.asarray(job.block_ids, dtype=np.int64),
                decode_prefix_len=job.decode_prefix_len,
                num_tokens=self._tokens(job.num_prompt_tokens),
                instance=job.prefill_instance,
            )  # fmt: skip
        except Exception as e:  # a refused peer or bad job fails the request
            self._failed_local[room] = f"{type(e).__name__}: {e}"
            log.error("pdplug: room %d of %s not expected: %s", room, job.req_id, e)

    def _decline(self, c: Cancel) -> None:
        if c.room in self._recv:
            return
        try:
            self._connect(c.prefill_instance, c.bootstrap)
            self.session.expect(c.room, np.zeros(0, dtype=np.int64), instance=c.prefill_instance)
            self.session.abort(c.room, c.reason)
        except Exception as e:  # the prefill room then ends by its timeout
            log.warning("pdplug: could not decline room %d: %s", c.room, e)
            return
        self._recv[c.room] = _RecvRoom(req_id="", cancel=True)

    # ------------------------------------------------------------------ session wrappers
    def _tokens(self, n: int) -> int:
        # tokens a room moves: the prompt, or its last block whole (RankPlacement.whole_blocks)
        bs = self.where.block_size
        return -(-n // bs) * bs if self.where.whole_blocks else n

    def _status(self, room: int) -> KVPoll:
        if room in self._failed_local:
            return KVPoll.Failed
        try:
            return KVPoll(self.session.poll(room))
        except KeyError:
            return KVPoll.Failed

    def _drained(self, room: int) -> bool:
        if room in self._failed_local:
            return True
        try:
            return bool(self.session.drained(room))
        except KeyError:
            return True

    def _reason(self, room: int) -> str | None:
        if room in self._failed_local:
            return self._failed_local[room]
        try:
            return self.session.failure_reason(room)  # type: ignore[no-any-return]
        except KeyError:
            return None

    def _abort(self, room: int, reason: str) -> None:
        try:
            self.session.abort(room, reason)
        except (KeyError, ValueError):
            pass

    def _forget(self, room: int) -> None:
        if self._failed_local.pop(room, None) is not None:
            return
        try:
            self.session.clear(room)
        except (KeyError, ValueError):
            pass
