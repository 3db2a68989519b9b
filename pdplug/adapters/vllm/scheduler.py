"""Scheduler-side bookkeeping of PdplugConnector: rooms, push jobs, held blocks, aborts.

This is the part of the connector that runs in vLLM's engine-core process. It turns vLLM's
scheduler calls into one :class:`StepPlan` per engine step (the connector metadata the
workers receive) and decides which blocks stay held after a request finishes. It imports no
vLLM module: the connector passes plain values (request ids, block ids, token counts), so the
rules can be read and tested on their own; ``tests/vllm_connector`` drives them through vLLM's real
``Scheduler``.

Prefill engine (``kv_producer``), per request carrying a room:

* every step that computes a chunk adds a :class:`~pdplug.adapters.push.SendJob`: the
  tokens ``[token_start, token_end)`` that are in the KV cache once the step's forward ends
  (``token_start`` is 0 on the first job, so blocks the prefill engine took from its own
  prefix cache are sent too) and the request's block ids so far (its ``page_ids``); the
  job whose ``token_end`` reaches the prompt is ``is_last``. The workers split each job at
  ``min(grid, pack capacity)`` and post it;
* when the request finishes, its blocks stay held (``delay_free``) if any job was issued,
  until every worker reported the room drained (``finished_sending``); a request that ends
  before its last job (abort, error, preemption) has its room aborted first;
* a preempted request's room is aborted in the same step (its blocks are freed by vLLM and
  will be overwritten): the decode side sees the room fail and recomputes or fails the
  request per ``kv_load_failure_policy``.

Decode engine (``kv_consumer``), per request carrying a room:

* :meth:`PushBook.num_new_matched_tokens` claims the prompt tokens beyond the local prefix
  hit as loaded asynchronously; vLLM parks the request in ``WAITING_FOR_REMOTE_KVS``;
* :meth:`PushBook.after_alloc` adds a :class:`RecvJob` with the blocks vLLM allocated; the
  workers register them as the room's destination at once, so the prefill engine can write
  each chunk as soon as it is computed (push);
* a request aborted while waiting has its room aborted; vLLM itself keeps its blocks until
  the workers report the room finished (``finished_recving``, after it drained);
* a request aborted before allocation, or a full local prefix hit, cancels the room on the
  prefill side (:attr:`StepPlan.cancel`) so the prefill engine frees its blocks at once.

Rooms: one live request per room per engine. A second request with a live room is not
served (prefill: its error is returned in ``kv_transfer_params``; decode: it fails through
``failed_recving``).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from typing import Any

import msgspec

from pdplug.adapters.push import SendJob
from pdplug.adapters.vllm.params import DecodeParams, parse_decode, parse_prefill

__all__ = ["RecvJob", "Cancel", "StepPlan", "PushBook"]


class RecvJob(msgspec.Struct, frozen=True, kw_only=True):
    """Decode workers: register ``block_ids`` as the destination of ``room``.

    :ivar req_id: vLLM request id on the decode engine.
    :ivar room: bootstrap room.
    :ivar block_ids: destination block ids for tokens from ``decode_prefix_len`` on (with DCP,
        virtual blocks of ``block_size * dcp_size`` tokens, the same id on every DCP rank).
    :ivar decode_prefix_len: prompt tokens the decode engine already holds (local prefix hit).
    :ivar num_prompt_tokens: prompt length (tokens).
    :ivar prefill_instance/bootstrap: where the prefill instance's ranks are found.
    :ivar fail: non-empty: do not transfer, report the room failed with this reason.
    """

    req_id: str
    room: int
    block_ids: tuple[int, ...]
    decode_prefix_len: int
    num_prompt_tokens: int
    prefill_instance: str = ""
    bootstrap: str = ""
    fail: str = ""


class Cancel(msgspec.Struct, frozen=True, kw_only=True):
    """Decode workers: tell the prefill instance that ``room`` will not be received."""

    room: int
    prefill_instance: str
    bootstrap: str
    reason: str


class StepPlan(msgspec.Struct, frozen=True, kw_only=True):
    """Everything the workers do for one engine step (the connector metadata's payload).

    :ivar send: prefill: chunks to push once the step's forward completed.
    :ivar recv: decode: rooms to register destinations for.
    :ivar abort: rooms to fail on every worker (request aborted, preempted or in error); each
        is reported finished (sending or receiving) once drained.
    :ivar cancel: decode: rooms never registered here whose prefill side must stop.
    """

    send: tuple[SendJob, ...] = ()
    recv: tuple[RecvJob, ...] = ()
    abort: tuple[tuple[str, int], ...] = ()
    cancel: tuple[Cancel, ...] = ()

    def __bool__(self) -> bool:
        return bool(self.send or self.recv or self.abort or self.cancel)


class _Prefill(msgspec.Struct, kw_only=True):
    room: int
    num_prompt_tokens: int
    block_ids: list[int] = []
    sent_upto: int = 0  # tokens covered by issued SendJobs
    jobs: int = 0
    done: bool = False  # no more jobs: the is_last job was issued, or the room was aborted
    aborted: bool = False


class _Decode(msgspec.Struct, kw_only=True):
    params: DecodeParams | None  # None: a request in error (fails through its RecvJob)
    allocated: bool = False
    waiting: bool = False  # a RecvJob is out; finished_recving ends it
    finished: bool = False  # vLLM finished the request while it was waiting


class PushBook:
    """The scheduler-side state of PdplugConnector on one engine.

    :param role: ``"prefill"`` (vLLM ``kv_producer``) or ``"decode"`` (``kv_consumer``).
    :raises ValueError: another role.
    """

    def __init__(self, role: str) -> None:
        if role not in ("prefill", "decode"):
            raise ValueError(f"PushBook: role={role!r}: expected 'prefill' or 'decode'")
        self.role = role
        self.rooms: dict[int, str] = {}  # live room -> request id
        self.errors: dict[str, str] = {}  # request id -> why it is not served
        self.prefill: dict[str, _Prefill] = {}
        self.decode: dict[str, _Decode] = {}
        self.held: dict[str, int] = {}  # finished request id -> room, blocks held until drained
        self._recv: list[RecvJob] = []
        self._abort: list[tuple[str, int]] = []
        self._cancel: list[Cancel] = []

    # ----------------------------------------------------------------- both roles
    def on_new_request(
        self, req_id: str, params: Mapping[str, Any] | None, num_prompt_tokens: int
    ) -> None:
        """Adopt a request whose ``kv_transfer_params`` carry pdplug's document."""
        try:
            if self.role == "prefill":
                p = parse_prefill(dict(params) if params else None)
                room = None if p is None else p.room
            else:
                d = parse_decode(dict(params) if params else None)
                room = None if d is None else d.room
        except ValueError as e:
            self.errors[req_id] = str(e)
            return
        if room is None:
            return
        owner = self.rooms.get(room)
        if owner is not None and owner != req_id:
            self.errors[req_id] = f"room {room} is live for request {owner} on this engine"
            return
        self.rooms[room] = req_id
        if self.role == "prefill":
            self.prefill[req_id] = _Prefill(room=room, num_prompt_tokens=num_prompt_tokens)
        else:
            assert d is not None
            self.decode[req_id] = _Decode(params=d)

    def has_pending_push_work(self) -> bool:
        """Rooms whose blocks are held, or plans not yet handed to the workers."""
        return bool(self.held or self._recv or self._abort or self._cancel)

    def finished_transfers(self, req_ids: Iterable[str]) -> None:
        """Workers reported these requests' rooms drained (``finished_sending`` on prefill,
        ``finished_recving`` on decode): forget them, and any abort of them not yet sent."""
        req_ids = set(req_ids)
        if self._abort:
            self._abort = [a for a in self._abort if a[0] not in req_ids]
        for rid in req_ids:
            room = self.held.pop(rid, None)
            dec = self.decode.get(rid)
            if dec is not None:
                dec.waiting = False
                room = dec.params.room if dec.params is not None else None
                if dec.finished:
                    del self.decode[rid]
            if room is not None:
                self._release_room(room, rid)

    # ----------------------------------------------------------------- decode
    def num_new_matched_tokens(
        self, req_id: str, num_prompt_tokens: int, num_computed_tokens: int
    ) -> tuple[int, bool]:
        """vLLM ``get_num_new_matched_tokens`` on decode (side-effect free).

        :returns: ``(prompt tokens beyond the local prefix hit, True)`` for a room not yet
            registered, ``(0, False)`` otherwise; a request in error claims its tokens too, so
            it parks and then fails through ``failed_recving`` (never a silent local prefill).
        """
        if self.role != "decode":
            return 0, False
        dec = self.decode.get(req_id)
        if (dec is None and req_id not in self.errors) or (dec is not None and dec.allocated):
            return 0, False
        n = num_prompt_tokens - num_computed_tokens
        return (n, True) if n > 0 else (0, False)

    def after_alloc(
        self,
        req_id: str,
        block_ids: Sequence[int],
        num_external_tokens: int,
        num_prompt_tokens: int,
    ) -> None:
        """vLLM ``update_state_after_alloc`` on decode.

        :param block_ids: the blocks allocated for the external tokens (vLLM's unhashed
            blocks), in token order.
        :param num_external_tokens: tokens to receive (0: nothing, e.g. a full local hit).
        """
        if self.role != "decode":
            return
        if req_id in self.errors and num_external_tokens > 0:
            if req_id not in self.decode:  # fail it through the workers, once
                self.decode[req_id] = _Decode(params=None, allocated=True, waiting=True)
                self._recv.append(
                    RecvJob(req_id=req_id, room=-1, block_ids=(), decode_prefix_len=0,
                            num_prompt_tokens=num_prompt_tokens, fail=self.errors[req_id])
                )  # fmt: skip
            return
        dec = self.decode.get(req_id)
        if dec is None or dec.allocated or dec.params is None:
            return
        dec.allocated = True
        p = dec.params
        if num_external_tokens <= 0:
            self._cancel.append(
                Cancel(room=p.room, prefill_instance=p.prefill_instance, bootstrap=p.bootstrap,
                       reason="decode holds the whole prompt (local prefix hit)")
            )  # fmt: skip
            return
        dec.waiting = True
        self._recv.append(
            RecvJob(
                req_id=req_id,
                room=p.room,
                block_ids=tuple(block_ids),
                decode_prefix_len=num_prompt_tokens - num_external_tokens,
                num_prompt_tokens=num_prompt_tokens,
                prefill_instance=p.prefill_instance,
                bootstrap=p.bootstrap,
            )
        )

    # ----------------------------------------------------------------- prefill
    def scheduled(
        self,
        req_id: str,
        new_block_ids: Sequence[int] | None,
        resumed: bool,
        num_computed_tokens: int,
        num_scheduled_tokens: int,
    ) -> SendJob | None:
        """One scheduled request of this step on prefill: the job to push after the forward.

        :param new_block_ids: blocks added this step (all blocks when ``resumed``).
        :param resumed: the request was preempted before and resumes with new blocks.
        :param num_computed_tokens: tokens computed before this step.
        :param num_scheduled_tokens: tokens computed by this step.
        """
        st = self.prefill.get(req_id)
        if st is None or st.done:
            return None
        if resumed:  # its room was aborted at preemption: nothing more to send
            return None
        if new_block_ids:
            st.block_ids.extend(new_block_ids)
        end = min(num_computed_tokens + num_scheduled_tokens, st.num_prompt_tokens)
        if end <= st.sent_upto:
            return None
        job = SendJob(
            req_id=req_id,
            room=st.room,
            page_ids=tuple(st.block_ids),
            token_start=st.sent_upto,
            token_end=end,
            num_prompt_tokens=st.num_prompt_tokens,
            is_last=end >= st.num_prompt_tokens,
        )
        st.sent_upto, st.jobs, st.done = end, st.jobs + 1, job.is_last
        return job

    def preempted(self, req_ids: Iterable[str]) -> None:
        """Requests vLLM preempted this step: abort their rooms before the blocks are reused.

        A room whose last job was already issued is aborted too: its writes may still read
        the blocks the preemption freed.
        """
        for rid in req_ids:
            st = self.prefill.get(rid)
            if st is not None and not st.aborted:
                st.done = st.aborted = True  # nothing more is sent for this room
                if st.jobs:
                    self._abort.append((rid, st.room))

    def finished(self, req_id: str, completed: bool) -> tuple[bool, dict[str, Any] | None]:
        """vLLM ``request_finished``: whether to hold the blocks, and the params to return.

        :param completed: the request ended normally (length cap or stop), not aborted.
        :returns: ``(delay_free, kv_transfer_params)``.
        """
        error = self.errors.pop(req_id, None)
        if self.role == "decode":
            return self._finished_decode(req_id, error)
        st = self.prefill.pop(req_id, None)
        if st is None:
            return False, ({"pdplug": {"error": error}} if error else None)
        if not st.jobs:  # nothing posted: free now; the decode side's room fails on its own
            self._release_room(st.room, req_id)
            return False, {"pdplug": {"room": st.room, "error": "aborted before any chunk"}}
        if st.aborted or not (completed and st.done):
            if not st.aborted:
                self._abort.append((req_id, st.room))
            self.held[req_id] = st.room
            return True, {"pdplug": {"room": st.room, "error": "aborted"}}
        self.held[req_id] = st.room
        return True, {"pdplug": {"room": st.room, "sent_tokens": st.sent_upto}}

    def _finished_decode(self, req_id: str, error: str | None) -> tuple[bool, None]:
        dec = self.decode.get(req_id)
        if dec is None:
            return False, None
        p = dec.params
        if dec.waiting:  # vLLM holds its blocks until the workers report finished_recving
            dec.finished = True
            if p is not None:
                self._abort.append((req_id, p.room))
            return False, None
        if p is not None and not dec.allocated:  # ended before it was scheduled
            self._cancel.append(
                Cancel(room=p.room, prefill_instance=p.prefill_instance, bootstrap=p.bootstrap,
                       reason="decode request ended before it was scheduled")
            )  # fmt: skip
        del self.decode[req_id]
        if p is not None:
            self._release_room(p.room, req_id)
        return False, None

    def _release_room(self, room: int, req_id: str) -> None:
        if self.rooms.get(room) == req_id:
            del self.rooms[room]

    # ----------------------------------------------------------------- per step
    def take_plan(self, send: Iterable[SendJob] = ()) -> StepPlan:
        """The plan of this step (pending recv/abort/cancel plus ``send``); resets them."""
        plan = StepPlan(
            send=tuple(send),
            recv=tuple(self._recv),
            abort=tuple(self._abort),
            cancel=tuple(self._cancel),
        )
        self._recv, self._abort, self._cancel = [], [], []
        return plan
