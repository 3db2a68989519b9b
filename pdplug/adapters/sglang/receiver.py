"""SGLang's ``BaseKVReceiver`` for the pdplug backend: one per request on a decode rank.

``init`` checks the prefill is connected (:meth:`PdplugKVManager.try_ensure_parallel_info
<pdplug.adapters.sglang.manager.PdplugKVManager.try_ensure_parallel_info>`), ``send_metadata``
expects the room on every plane (KV pages from the decode prefix on, the metadata slot, the
state items), ``poll`` merges the planes' statuses
(:func:`pdplug.adapters.sglang.rooms.merge_polls`).
"""

from __future__ import annotations

from typing import Any

import numpy as np
from sglang.srt.disaggregation.base.conn import BaseKVReceiver, KVTransferDestination
from sglang.srt.disaggregation.common.conn import KVTransferError

from pdplug.adapters.room_ids import check_room
from pdplug.adapters.sglang.common import TERMINAL
from pdplug.adapters.sglang.manager import PdplugKVManager
from pdplug.adapters.sglang.planes import PLANE_AUX, PLANE_KV
from pdplug.adapters.sglang.rooms import first_failure, merge_polls
from pdplug.protocols import decline_room
from pdplug.types import KVPoll

__all__ = ["PdplugKVReceiver"]


class PdplugKVReceiver(BaseKVReceiver):
    """One request on a decode rank (SGLang's ``BaseKVReceiver``).

    :param mgr: this rank's :class:`PdplugKVManager`.
    :param bootstrap_addr: the prefill's ``host:bootstrap_port``.
    :param bootstrap_room: the request's room.
    """

    def __init__(
        self, mgr: PdplugKVManager, bootstrap_addr: str, bootstrap_room: int | None = None
    ) -> None:
        self.kv_mgr = mgr
        self.bootstrap_addr = bootstrap_addr
        self.bootstrap_room = bootstrap_room
        self.conclude_state: KVPoll | None = None
        self.abort_notified = False
        self.require_staging = False
        self.bootstrap_infos: list[str] = []
        self._local = KVPoll.Bootstrapping
        self._failure: str | None = None
        self._expected = False
        if bootstrap_room is None:
            self._fail("a request without bootstrap_room")
        else:
            try:
                check_room(int(bootstrap_room), "bootstrap_room")
            except ValueError as e:
                self._fail(str(e))

    def _fail(self, reason: str) -> None:
        self._failure = self._failure or reason
        self._local = KVPoll.Failed
        self.conclude_state = KVPoll.Failed

    def init(self, prefill_dp_rank: int) -> None:
        """Ready for :meth:`send_metadata` once the prefill is connected."""
        if self._local == KVPoll.Failed:
            return
        info = self.kv_mgr.prefill_info_table.get(self.bootstrap_addr)
        if info is None:
            why = self.kv_mgr.connect_error(self.bootstrap_addr) or "not connected"
            self._fail(f"prefill {self.bootstrap_addr}: {why}")
            return
        self.bootstrap_infos = list(info.planes.values())
        self._local = KVPoll.WaitingForInput

    def send_metadata(
        self,
        kv_indices: Any,
        aux_index: int | None = None,
        state_indices: list[Any] | None = None,
        decode_prefix_len: int | None = None,
        destination: Any = KVTransferDestination.DEVICE,
        **_: Any,
    ) -> None:
        """Send the destination pages (from ``decode_prefix_len`` on), the metadata slot and
        the state items to the prefill, on every plane."""
        if self._local != KVPoll.WaitingForInput:
            return
        if destination != KVTransferDestination.DEVICE:
            self._fail("decode host destinations are not supported by the pdplug backend")
            return
        mgr, room = self.kv_mgr, int(self.bootstrap_room)  # type: ignore[arg-type]
        info = mgr.prefill_info_table[self.bootstrap_addr]
        prefix = int(decode_prefix_len or 0)
        try:
            for name, session in mgr.sessions.items():
                inst = info.planes[name]
                if name == PLANE_KV:
                    pages = np.asarray(kv_indices, dtype=np.int64).reshape(-1)
                    session.expect(room, pages, decode_prefix_len=prefix, instance=inst)
                elif name == PLANE_AUX:
                    if aux_index is None:
                        raise ValueError("send_metadata without a metadata slot (aux_index)")
                    one = np.array([int(aux_index)], dtype=np.int64)
                    session.expect(room, one, num_tokens=1, instance=inst)
                else:
                    i = mgr.state_types.index(name.split(":", 1)[1])
                    idx = (
                        None
                        if state_indices is None or i >= len(state_indices)
                        else state_indices[i]
                    )
                    items = np.asarray(idx if idx is not None else [], dtype=np.int64).reshape(-1)
                    session.expect(room, items, num_tokens=len(items), instance=inst)
            self._expected = True
        except (ValueError, KeyError) as e:
            self._fail(f"send_metadata: {e}")
            self.abort()

    def poll(self) -> KVPoll:
        """Bootstrapping / WaitingForInput until the metadata went, then the planes' merged
        status (Success once KV, metadata and state all landed)."""
        if self.conclude_state is not None:
            return self.conclude_state
        if not self._expected:
            return self._local
        polls = []
        for s in self.kv_mgr.sessions.values():
            try:
                polls.append(s.poll(self.bootstrap_room))
            except KeyError:
                polls.append(KVPoll.Failed)
        status = merge_polls(polls)
        if status in TERMINAL:
            self.conclude_state = status
        return status

    def failure_exception(self) -> None:
        """Raise SGLang's ``KVTransferError`` with the room's reason.

        :raises KVTransferError: always.
        """
        self.conclude_state = KVPoll.Failed
        reasons: list[tuple[str, str | None]] = [("adapter", self._failure)]
        for name, s in self.kv_mgr.sessions.items():
            try:
                reasons.append((name, s.failure_reason(self.bootstrap_room)))
            except KeyError:
                continue
        raise KVTransferError(
            int(self.bootstrap_room or 0), first_failure(reasons) or "failed (no reason recorded)"
        )

    def abort(self) -> None:
        """Fail the room and tell the prefill (also before :meth:`send_metadata`: then the
        room is declined, :func:`pdplug.protocols.decline_room`, so the prefill neither waits
        for its bootstrap deadline nor sees the room ``WaitingForInput`` first)."""
        self.abort_notified = True
        self.conclude_state = KVPoll.Failed
        self._failure = self._failure or "aborted by SGLang"
        mgr, room = self.kv_mgr, self.bootstrap_room
        if room is None:
            return
        info = mgr.prefill_info_table.get(self.bootstrap_addr)
        for name, s in mgr.sessions.items():
            try:
                if not self._expected and info is not None:
                    decline_room(s, room, self._failure, instance=info.planes[name])
                else:
                    s.abort(room, self._failure)
            except (KeyError, ValueError):
                continue
        self._expected = True

    def ensure_abort_notified(self, *, force_arm: bool = False) -> None:
        """SGLang's deferred release: make sure the prefill was told."""
        if not self.abort_notified:
            self.abort()

    def is_abort_release_safe(self) -> bool:
        """Nothing can still land in this request's pages."""
        return self.bootstrap_room is None or self.kv_mgr.is_abort_release_safe(self.bootstrap_room)

    def clear(self) -> None:
        """Forget the room on every plane."""
        if self.bootstrap_room is None:
            return
        for s in self.kv_mgr.sessions.values():
            try:
                s.clear(self.bootstrap_room)
            except KeyError:
                continue
