"""What a KV transfer backend adapts: the :class:`TransferEngine` protocol (+ region helpers).

A backend plugin (``nixl``, ``mooncake``, a third party's) implements only this thin verb set;
:class:`~pdplug.transfer.sender.KVSenderSession` and
:class:`~pdplug.transfer.receiver.KVReceiverSession` do everything else (control channel,
rooms, planning, packing, double buffering, tags, timeouts). The verbs are the ones SGLang's
and vLLM's transfer backends share (register / export / connect / write / poll / notify), with
capability flags.

Threading: a session calls its engine from **one thread only** (its engine thread), so engines
need not be thread-safe (vLLM serialises NIXL on a single-thread executor for the same reason).
An engine whose writes are synchronous runs them on its own worker thread and reports them
through :meth:`TransferEngine.check` like an asynchronous one.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, NoReturn, Protocol, runtime_checkable

import numpy as np

from pdplug.registration import dedup_regions
from pdplug.types import PeerInfo

__all__ = [
    "TransferEngine",
    "dedup_regions",
    "hard_exit",
    "engine_wakes",
    "XFER_DONE",
    "XFER_PENDING",
    "XFER_ERROR",
    "XFER_FAILING",
]

XFER_PENDING = "PROC"
XFER_DONE = "DONE"
XFER_ERROR = "ERR"
#: failed, but some of its bytes may still land: the room fails now, the write stays held
XFER_FAILING = "FAILING"


@runtime_checkable
class TransferEngine(Protocol):
    """One rank's handle on a transfer engine (one agent / engine instance per session).

    :ivar name: backend name (``"nixl"``, ``"mooncake"``); peers with another backend are
        refused at the handshake.
    :ivar notifications: True when a write can carry a completion tag that the target reads
        after the data landed (NIXL). False: the session sends the tag over the control
        channel once :meth:`check` reports ``"DONE"`` (Mooncake).

    Optional (not part of the protocol): ``info_extra() -> dict[str, str]``, fields the rank
    publishes in its ``PeerInfo.extra`` for the peers' engines (read in :meth:`connect`; NIXL:
    its registered regions, for descriptor lists prepared once per peer).

    Optional, together: ``prepare_pages(peer, grid) -> lists | None`` prepares the descriptors
    of every page of a :class:`~pdplug.types.PageGrid` on both sides once (a peer's first send
    on a direct template; ``None``: not for this pair); ``post_pages(peer, lists, src_pages,
    dst_pages, last_bytes, tag) -> xfer | None`` then starts one write by page ids (int64
    ``[P]`` each, entry-major runs, the last page of each entry moving ``last_bytes`` bytes;
    ``None``: those pages are not in the lists, the session posts the addresses instead), with
    :meth:`post`'s errors. An engine whose class sets ``page_id_lists = True`` also takes the two
    as lists of Python ints (up to 64 source pages, as the session carries a short send's ids
    from ``send`` on: no numpy operation on the way; issue 24); without it, it gets int64 arrays
    (read from the class: a wrapper forwarding attributes to such an engine, with a
    ``post_pages`` of its own, gets arrays unless its own class declares it).
    """

    name: str
    notifications: bool

    def register(self, regions: Sequence[tuple[int, int]]) -> None:
        """Register memory once: ``(address, nbytes)`` pairs, already de-duplicated
        (:func:`dedup_regions`); memory kind and device come from the engine's config.

        :raises pdplug.errors.TransferError: the engine refused a region.
        """
        ...

    def agent(self) -> bytes:
        """Connection blob a peer needs to write here (``PeerInfo.agent``), taken after
        :meth:`register` (NIXL agent metadata, Mooncake ``host:rpc_port``)."""
        ...

    def agent_name(self) -> str:
        """Name notifications from this engine carry (``""`` when it has none)."""
        ...

    def connect(self, peer: PeerInfo) -> Any:
        """Prepare writes to ``peer`` (load its agent blob); returns an opaque peer handle.

        :raises pdplug.errors.TransferError: the blob is unusable (the handshake refuses).
        """
        ...

    def disconnect(self, peer: Any) -> None:
        """Forget a peer handle returned by :meth:`connect`."""
        ...

    def post(
        self, peer: Any, src: np.ndarray, dst: np.ndarray, length: np.ndarray, tag: bytes
    ) -> Any:
        """Start writing ``length[i]`` bytes from local ``src[i]`` to remote ``dst[i]``.

        :param src/dst/length: int64 ``[R]`` absolute addresses and sizes (bytes).
        :param tag: completion tag delivered after the data (engines with notifications);
            ``b""`` otherwise.
        :returns: a transfer handle for :meth:`check` / :meth:`release`.
        :raises Exception: an immediate failure (the session fails the room and sends the
            failure tag; nothing is retried silently).
        """
        ...

    def check(self, xfer: Any) -> str:
        """``"PROC"`` (in flight), ``"DONE"`` or ``"ERR"``; never raises for a failed write.
        ``"FAILING"`` (optional): it failed but part of it is still with the engine (its room
        fails at once; the write stays held, as a stuck one, until ``"DONE"``/``"ERR"``).
        An engine may also define ``failure(xfer) -> str | None`` (optional, not part of the
        protocol): why a write that ended ``"ERR"`` failed, appended to the room's reason; and
        ``wakes(xfer) -> bool``: whether this write's end calls the waker (default: whether
        the engine took one, :func:`engine_wakes`); and ``done_at_post(xfer) -> bool``: whether
        the write ended ``"DONE"`` inside :meth:`post` (an engine that copies inside its post
        call, as UCX over TCP or shared memory does), so the session completes it at once
        without polling it."""
        ...

    def cancel(self, xfer: Any) -> bool:
        """Withdraw a posted write that has not started; True if it will never touch memory
        (then it needs no :meth:`release`). Engines that cannot tell return False."""
        ...

    def release(self, xfer: Any) -> None:
        """Free a handle whose write is DONE or ERR (or abandoned after a timeout)."""
        ...

    def notify(self, peer: Any, tag: bytes) -> None:
        """Send ``tag`` alone (a chunk with nothing to write; engines with notifications).

        :raises Exception: the notification could not be sent.
        """
        ...

    def progress(self) -> None:
        """Drive the engine's progress (an engine without its own progress thread flushes
        pending notifications and connection set-up here); called every loop round. A no-op
        for engines that progress by themselves."""
        ...

    def poll_notifications(self) -> list[tuple[str, bytes]]:
        """New notifications as ``(sender agent name, tag)``; ``[]`` without notifications."""
        ...

    def close(self) -> None:
        """Release handles, deregister memory; idempotent."""
        ...


def engine_wakes(engine: object, waker: Callable[[], None]) -> bool:
    """Give ``engine`` a ``waker`` to call (from any thread) when a posted write completes, if
    it supports one (an optional ``set_waker(waker)`` method: engines that complete writes on
    their own threads, like Mooncake's worker). Returns whether it does; then the session's
    engine thread sleeps until woken instead of polling :meth:`TransferEngine.check`."""
    setter = getattr(engine, "set_waker", None)
    if not callable(setter):
        return False
    setter(waker)
    return True


def hard_exit(code: int = 0) -> NoReturn:
    """End the process now with ``code``, after flushing stdout/stderr and logging, without
    running interpreter shutdown (``os._exit``).

    Not needed for clean exits any more: a process whose sessions were closed exits normally
    (the NIXL 1.5.1 crash at interpreter exit is avoided by the ``nixl`` plugin, see
    ``pdplug_nixl.engine``). Kept for scripts that want to end at once.
    """
    import logging
    import os
    import sys

    logging.shutdown()
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except Exception:
            pass
    os._exit(code)
