"""SGLang's ``BaseKVSender`` for the pdplug backend (one per request on a prefill rank), and
:func:`post_chunk`, which turns one of SGLang's ``send`` calls into pdplug segments.

SGLang calls ``send(kv_indices)`` once per prefill chunk of a request, with that chunk's pages.
:func:`post_chunk` cuts the chunk with the selected pdplug scheduler at
``decode_prefix_len + k * min(grid, pack capacity)`` (:func:`pdplug.adapters.push.segments_for_job`)
and posts every segment of it through :func:`pdplug.protocols.send_step`: one hand-off to the KV
sender for the chunk (``send`` per segment for a sender without ``send_many``). The last chunk
also moves the metadata row (aux plane) and the state items.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import Any

import numpy as np
from sglang.srt.disaggregation.base.conn import BaseKVSender, KVTransferMetric
from sglang.srt.disaggregation.common.conn import KVTransferError

from pdplug.adapters.push import SendJob, segments_for_job, step_ready
from pdplug.adapters.room_ids import check_room
from pdplug.adapters.sglang.common import TERMINAL, SendRoom
from pdplug.adapters.sglang.manager import PdplugKVManager
from pdplug.adapters.sglang.planes import PLANE_AUX, PLANE_KV
from pdplug.protocols import send_step
from pdplug.types import KVPoll, Segment

__all__ = ["PdplugKVSender", "post_chunk"]

#: the one-item segment of the metadata row
_ONE = Segment(token_start=0, token_end=1, page_start=0, num_tokens=1, chunk_id=0, is_last=True)


def post_chunk(
    mgr: PdplugKVManager,
    room: int,
    page_indices: Any,
    state_indices: Sequence[Any] | None,
    num_kv_tokens: int | None,
) -> None:
    """One ``send`` of SGLang on ``mgr``'s rank: split by pdplug's scheduler, posted on every
    plane; a bad chunk fails the room (both engines are told) instead of raising.

    :param page_indices: int page ids ``[n]`` of this chunk (from where the previous ended).
    :param state_indices: per state type, its item ids (last chunk only).
    :param num_kv_tokens: tokens in the chunk (None: ``n * page_size``).
    """
    rs = mgr.room(room)
    if rs is None or rs.failure is not None:
        return
    pages = np.asarray(page_indices, dtype=np.int64).reshape(-1)
    p = mgr.page_size
    if rs.pos < 0:
        rs.pos = rs.decode_prefix_len = mgr.decode_prefix_len(room)
    kv = mgr.sessions[PLANE_KV]
    n_tokens = int(num_kv_tokens) if num_kv_tokens is not None else len(pages) * p
    rs.sent_pages += len(pages)
    is_last = rs.num_pages < 0 or rs.sent_pages >= rs.num_pages
    start, end = rs.pos, rs.pos + n_tokens
    rs.pos = end
    try:
        if rs.capacity == -1:
            rs.capacity = kv.capacity_tokens(room)
        job = SendJob(
            room=room, page_ids=tuple(pages.tolist()), first_page=start // p,
            token_start=start, token_end=end,
            num_prompt_tokens=end if is_last else rs.decode_prefix_len + rs.num_pages * p,
            is_last=is_last,
        )  # fmt: skip
        segs = segments_for_job(
            rs.cursor, job, decode_prefix_len=rs.decode_prefix_len,
            capacity_tokens=rs.capacity, block_size=p, scheduler=mgr.scheduler,
        )  # fmt: skip
        ready = step_ready(mgr.kv_device)
        send_step(kv, [(room, seg, src, ready) for seg, src in segs])
        rs.sent_bytes += (
            sum(seg.num_tokens for seg, _ in segs) * mgr.planes[0].layout.bytes_per_token
        )
        if is_last:
            _post_side_planes(mgr, room, rs, state_indices)
    except (ValueError, TypeError) as e:
        rs.failure = f"send: {e}"
        mgr.abort_room(room, rs.failure)


def _post_side_planes(
    mgr: PdplugKVManager, room: int, rs: SendRoom, state_indices: Sequence[Any] | None
) -> None:
    if mgr.serves_aux:
        if rs.aux_index is None:
            raise ValueError("the last send came before init() gave the metadata slot")
        # not counted in sent_bytes: SGLang's own backends report KV and state bytes only
        send_step(mgr.sessions[PLANE_AUX], [(room, _ONE, np.array([rs.aux_index], dtype=np.int64))])
    for i, t in enumerate(mgr.state_types):
        name = f"state:{t}"
        if name not in mgr.sessions:
            continue
        idx = None if state_indices is None or i >= len(state_indices) else state_indices[i]
        items = np.asarray(idx if idx is not None else [], dtype=np.int64).reshape(-1)
        n = len(items)
        seg = Segment(
            token_start=0, token_end=n, page_start=0, num_tokens=n, chunk_id=0, is_last=True
        )
        send_step(mgr.sessions[name], [(room, seg, items)])
        rs.sent_bytes += n * mgr.plane_by_name[name].layout.bytes_per_token


class PdplugKVSender(BaseKVSender):
    """One request on a prefill rank (SGLang's ``BaseKVSender``).

    :param mgr: this rank's :class:`PdplugKVManager`.
    :param bootstrap_addr: ``host:bootstrap_port`` (unused: the decode comes to this rank).
    :param bootstrap_room: the request's room (``[0, 2**63)``).
    """

    def __init__(
        self,
        mgr: PdplugKVManager,
        bootstrap_addr: str,
        bootstrap_room: int,
        req_has_disagg_prefill_dp_rank: bool = False,
    ) -> None:
        self.kv_mgr = mgr
        self.bootstrap_room = bootstrap_room
        self.bootstrap_server_url = bootstrap_addr
        self.conclude_state: KVPoll | None = None
        self._metric = KVTransferMetric()
        self._failure: str | None = None
        mgr.reap()
        try:
            check_room(int(bootstrap_room), "bootstrap_room")  # type: ignore[arg-type]
        except (TypeError, ValueError) as e:  # a request the router did not route: it fails
            self._failure = f"pdplug transfer backend: {e}"
            self.conclude_state = KVPoll.Failed
            return
        mgr.start_room(int(bootstrap_room))

    def init(self, num_kv_indices: int, aux_index: int | None = None) -> None:
        """The pages to send (from the decode prefix on) and the metadata slot."""
        rs = self.kv_mgr.room(self.bootstrap_room)
        if rs is not None:
            rs.num_pages = int(num_kv_indices)
            rs.aux_index = None if aux_index is None else int(aux_index)
        if self.kv_mgr.votes is not None:  # SGLang admitted the request on this PP rank
            self.kv_mgr.votes.applied(self.bootstrap_room)

    def pop_decode_prefix_len(self) -> int:
        """Tokens the decode already holds (its DestInfo's ``decode_prefix_len``)."""
        return self.kv_mgr.decode_prefix_len(self.bootstrap_room)

    def get_max_transfer_tokens(self) -> int | None:
        """None: pdplug's scheduler splits each send at ``min(grid, pack capacity)``."""
        return None

    def should_send_kv_chunk(self, num_pages: int, last_chunk: bool) -> bool:
        """A last chunk goes out even without pages (it carries the metadata)."""
        return num_pages > 0 or last_chunk

    def send(
        self,
        kv_indices: Any,
        state_indices: list[Any] | None = None,
        num_kv_tokens: int | None = None,
        indices_event: Any = None,
    ) -> None:
        """Post one chunk: int page ids ``[n]`` of ``num_kv_tokens`` tokens, from where the
        previous chunk ended (the decode prefix for the first); the last chunk also moves the
        metadata row and the state items."""
        if self.conclude_state in TERMINAL:
            return
        post_chunk(self.kv_mgr, self.bootstrap_room, kv_indices, state_indices, num_kv_tokens)

    def poll(self) -> KVPoll:
        """The room's merged status on this rank (a failed room only once drained)."""
        if self.conclude_state is not None:
            return self.conclude_state
        status = self.kv_mgr.room_status(self.bootstrap_room)
        if status in TERMINAL:
            self.conclude_state = status
            rs = self.kv_mgr.room(self.bootstrap_room)
            if rs is not None:
                rs.finished = time.monotonic()
                self._metric.transfer_latency_s = rs.finished - rs.started
                self._metric.transfer_total_bytes = rs.sent_bytes
        return status

    def poll_pp_consensus(self) -> KVPoll:
        """PP0 only (SGLang's PP bootstrap): the decision of pdplug's consensus over every PP
        rank (Bootstrapping until decided)."""
        votes = self.kv_mgr.votes
        if votes is None:
            return self.poll()
        return votes.status(self.bootstrap_room)

    def get_transfer_metric(self) -> KVTransferMetric:
        """Seconds from the room's start to its end here, bytes posted."""
        return self._metric

    def failure_exception(self) -> None:
        """Raise SGLang's ``KVTransferError`` with the room's reason (and forget the room).

        :raises KVTransferError: always.
        """
        self.conclude_state = KVPoll.Failed
        if self._failure is not None:
            raise KVTransferError(self.bootstrap_room or 0, self._failure)
        reason = self.kv_mgr.failure(self.bootstrap_room)
        self.kv_mgr.clear_room(self.bootstrap_room)
        raise KVTransferError(self.bootstrap_room, reason)

    def abort(self) -> None:
        """Fail the room here and tell the decode; a room that already succeeded stays a
        success (SGLang's router closes the prefill request once decode answered, which can
        be before this rank polled the room's end)."""
        if self.conclude_state == KVPoll.Success or (
            self.conclude_state is None
            and self.kv_mgr.room_status(self.bootstrap_room) == KVPoll.Success
        ):
            self.conclude_state = KVPoll.Success
            return
        self.kv_mgr.abort_room(self.bootstrap_room, "aborted by SGLang")
        rs = self.kv_mgr.room(self.bootstrap_room)
        if rs is not None and self.conclude_state is None:
            rs.orphan = True
        self.conclude_state = KVPoll.Failed

    def clear(self) -> None:
        """Forget the room (SGLang released the request)."""
        self.kv_mgr.clear_room(self.bootstrap_room)
