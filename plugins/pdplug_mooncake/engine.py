"""Mooncake adapter of :class:`pdplug.transfer.TransferEngine` (TransferEngine, P2P handshake).

Mooncake's Python API (prior-art vllm-nixl-mooncake.md §4, sglang.md §4):
``TransferEngine.initialize(host, "P2PHANDSHAKE", protocol, device)`` binds a random RPC port
and names the engine ``host:port``, which is what a peer writes to (the session id). Memory is
registered in one ``batch_register_memory`` call over de-duplicated regions (overlapping
re-registration is rejected, Mooncake#3153). Writes are ``batch_transfer_sync_write`` on a
single worker thread per engine, so the session's engine thread can pack the next segment while
a write runs; a batch is cut into calls of at most ``max_batch`` descriptors because a TCP lane
whose queue overflows rejects the batch and stays unusable (measured on mooncake 0.3.13). The
engine has no completion notifications: the session reports completion and failure over the
ZMQ control channel.
"""

from __future__ import annotations

import re
from collections import Counter
from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

import numpy as np

from pdplug import KVConfig, TransferError
from pdplug.types import PeerInfo

__all__ = ["MooncakeEngine"]

_SESSION = re.compile(r"^[A-Za-z0-9_.:\-\[\]]+:\d{1,5}$")


class MooncakeEngine:
    """One Mooncake TransferEngine for one pdplug rank.

    :param config: the rank's KVConfig. ``extra`` keys: ``protocol`` (``"tcp"`` default,
        ``"rdma"`` in production), ``device_name`` (NIC filter, default ``""`` = auto),
        ``host`` (advertised host, default ``config.wire.bind_host``), ``max_batch``
        (descriptors per write call, default 1024).
    :raises ImportError: mooncake is not installed.
    :raises TransferError: ``initialize`` failed (names host and protocol).
    """

    name = "mooncake"
    notifications = False

    def __init__(self, config: KVConfig) -> None:
        from mooncake.engine import TransferEngine

        extra = config.extra
        self._host = extra.get("host", config.wire.bind_host)
        self._protocol = extra.get("protocol", "tcp")
        self._engine = TransferEngine()
        rc = self._engine.initialize(
            self._host, "P2PHANDSHAKE", self._protocol, extra.get("device_name", "")
        )
        if rc != 0:
            raise TransferError(
                f"mooncake: initialize(host={self._host!r}, P2PHANDSHAKE, "
                f"protocol={self._protocol!r}) returned {rc}"
            )
        self._session = f"{self._host}:{self._engine.get_rpc_port()}"
        self._max_batch = int(extra.get("max_batch", "1024"))
        if self._max_batch <= 0:
            raise ValueError(f"KVConfig.extra['max_batch'] must be > 0, got {self._max_batch}")
        self._pool = ThreadPoolExecutor(1, thread_name_prefix="pdplug-mooncake-write")
        self._regions: list[tuple[int, int]] = []
        self._waker: Callable[[], None] | None = None
        self.counts: Counter[str] = Counter()

    # ------------------------------------------------------------------ TransferEngine
    def register(self, regions: Sequence[tuple[int, int]]) -> None:
        """``batch_register_memory`` over the (already de-duplicated) regions."""
        if not regions:
            return
        addrs = [int(a) for a, _ in regions]
        lens = [int(n) for _, n in regions]
        rc = self._engine.batch_register_memory(addrs, lens)
        if rc != 0:
            raise TransferError(f"mooncake: batch_register_memory of {len(addrs)} regions -> {rc}")
        self._regions.extend(regions)

    def agent(self) -> bytes:
        """This engine's session id ``host:rpc_port``."""
        return self._session.encode()

    def agent_name(self) -> str:
        """The session id (Mooncake has no notifications; kept for diagnostics)."""
        return self._session

    def connect(self, peer: PeerInfo) -> str:
        """The peer's session id.

        :raises TransferError: ``peer.agent`` is not a ``host:port`` session id.
        """
        try:
            session = peer.agent.decode()
        except UnicodeDecodeError as e:
            raise TransferError("mooncake: peer agent is not a session id") from e
        if not _SESSION.match(session):
            raise TransferError(f"mooncake: peer agent {session[:64]!r} is not 'host:port'")
        return session

    def disconnect(self, peer: Any) -> None:
        """Nothing to release (P2P sessions are managed by the engine)."""

    def set_waker(self, waker: Callable[[], None]) -> None:
        """Call ``waker`` (from the worker thread) whenever a write finishes."""
        self._waker = waker

    def post(
        self, peer: Any, src: np.ndarray, dst: np.ndarray, length: np.ndarray, tag: bytes
    ) -> Future[int]:
        """Queue the write on the worker thread; :meth:`check` reports it (and the waker, if
        set, fires when it finishes)."""
        fut = self._pool.submit(self._write, str(peer), src.tolist(), dst.tolist(), length.tolist())
        if self._waker is not None:
            waker = self._waker
            fut.add_done_callback(lambda _f: waker())
        return fut

    def _write(self, session: str, src: list[int], dst: list[int], ln: list[int]) -> int:
        step = self._max_batch
        for i in range(0, len(ln), step):
            rc = self._engine.batch_transfer_sync_write(
                session, src[i : i + step], dst[i : i + step], ln[i : i + step]
            )
            self.counts["batch_calls"] += 1
            if rc != 0:
                return int(rc)
        return 0

    def check(self, xfer: Any) -> str:
        """``"PROC"`` while the write runs, then ``"DONE"`` (rc 0) or ``"ERR"``."""
        if not xfer.done():
            return "PROC"
        if xfer.cancelled() or xfer.exception() is not None or xfer.result() != 0:
            return "ERR"
        return "DONE"

    def cancel(self, xfer: Any) -> bool:
        """Withdraw a write still queued behind the running one (``Future.cancel``)."""
        return bool(xfer.cancel())

    def release(self, xfer: Any) -> None:
        """Nothing to release (a future)."""

    def notify(self, peer: Any, tag: bytes) -> None:
        """Unsupported: completion goes over the control channel.

        :raises NotImplementedError: always.
        """
        raise NotImplementedError("mooncake has no notifications; use the control channel")

    def progress(self) -> None:
        """Nothing to drive: the engine runs its own threads."""

    def poll_notifications(self) -> list[tuple[str, bytes]]:
        """Always ``[]`` (no notifications)."""
        return []

    def close(self) -> None:
        """Stop the worker (queued writes are cancelled) and unregister memory; idempotent."""
        self._pool.shutdown(wait=True, cancel_futures=True)
        if self._regions:
            try:
                self._engine.batch_unregister_memory([a for a, _ in self._regions])
            except Exception:
                pass
            self._regions.clear()
