"""The writes a sender has posted and its engine has not finished: their clocks and stuck state.

Each write keeps a *clock*: the time it was posted, moved forward whenever a write posted
before it to the same peer completes — so time spent waiting behind that peer's earlier writes
(an engine that runs a peer's writes in order) is not counted. A write pending ``timeout_s``
past its clock is *stuck*: reported once, then kept (with its pack region and engine handle)
until the engine says it finished. Nothing here ever drops a write the engine may still run.
"""

from __future__ import annotations

import logging
from typing import Any

import msgspec

from pdplug.transfer.engine import XFER_ERROR, XFER_FAILING, XFER_PENDING, TransferEngine
from pdplug.transfer.records import Job, Lease, Peer, PeerKey, describe
from pdplug.types import ChunkTag

__all__ = ["Write", "InFlight"]

log = logging.getLogger(__name__)


class Write(msgspec.Struct, kw_only=True):
    """One posted write: its job, the peer whose handle it uses, the engine handle, the pack
    region it reads (-1: none), post time and clock (seconds), bytes and completion tag;
    ``silent``: the engine will not wake the loop when it ends (someone must poll it)."""

    job: Job
    peer: Peer
    handle: Any
    region: int
    t_post: float
    clock: float
    seq: int
    nbytes: int
    tag: ChunkTag
    stuck: bool = False
    silent: bool = True
    failing: bool = False  # stuck because the engine said FAILING, not for its time

    def held_reason(self, timeout_s: float, detail: str) -> str:
        """Why the room of a write held after it failed or got stuck ended."""
        what = f"write of chunk {self.tag.chunk_id} to {describe(self.job.key)}"
        if self.failing:
            return f"{what} failed (engine FAILING): {detail or 'no detail'}; held until it ends"
        return (
            f"{what} not done after {timeout_s:g} s (KVConfig.transfer_timeout_s); held until "
            "the engine reports it"
        )


class InFlight:
    """The posted writes of one sender (engine thread only).

    :param timeout_s: ``KVConfig.transfer_timeout_s``: how long a write may stay pending past
        its clock before it is stuck.
    """

    def __init__(self, timeout_s: float) -> None:
        self.timeout_s = timeout_s
        self.writes: list[Write] = []
        self._seq = 0

    def __len__(self) -> int:
        return len(self.writes)

    def __bool__(self) -> bool:
        return bool(self.writes)

    def add(
        self,
        job: Job,
        peer: Peer,
        handle: Any,
        region: int,
        nbytes: int,
        tag: ChunkTag,
        now: float,
        silent: bool = True,
    ) -> None:
        """Track a write the engine accepted at ``now`` (``silent``: its end wakes no one)."""
        self._seq += 1
        self.writes.append(
            Write(
                job=job,
                peer=peer,
                handle=handle,
                region=region,
                t_post=now,
                clock=now,
                seq=self._seq,
                nbytes=nbytes,
                tag=tag,
                silent=silent,
            )
        )

    def silent(self) -> bool:
        """Whether a write in flight ends without waking the loop (it must be polled)."""
        return any(w.silent for w in self.writes)

    def poll(
        self, engine: TransferEngine, now: float
    ) -> tuple[list[tuple[Write, str]], list[Write]]:
        """Ask the engine about every write; returns the finished ones with their state
        (``"DONE"``/``"ERR"``; no longer tracked) and the ones that just became stuck."""
        keep: list[Write] = []
        done: list[tuple[Write, str]] = []
        stuck: list[Write] = []
        for w in self.writes:
            try:
                st = engine.check(w.handle)
            except Exception as e:
                st = XFER_ERROR
                log.debug("check raised %s", e)
            if st != XFER_PENDING and st != XFER_FAILING:
                done.append((w, st))
                continue
            keep.append(w)
            if not w.stuck and (st == XFER_FAILING or now - w.clock > self.timeout_s):
                w.stuck = True  # reported once: its room fails, the write stays held
                w.failing = st == XFER_FAILING
                stuck.append(w)
        self.writes = keep
        return done, stuck

    def completed(self, w: Write, now: float) -> None:
        """``w`` completed at ``now``: later writes to its peer stop waiting behind it."""
        for y in self.writes:
            if y.peer is w.peer and y.seq > w.seq and y.clock < now:
                y.clock = now

    def withdraw(self, lease: Lease, engine: TransferEngine) -> list[Write]:
        """Cancel the writes of ``lease`` the engine has not started (``engine.cancel``);
        returns them (no longer tracked)."""
        gone = [w for w in self.writes if w.job.lease is lease and engine.cancel(w.handle)]
        if gone:
            self.writes = [w for w in self.writes if not any(w is g for g in gone)]
        return gone

    def stuck_keys(self) -> set[PeerKey]:
        """Destinations with a stuck write."""
        return {w.job.key for w in self.writes if w.stuck}

    def stuck(self) -> int:
        """Writes stuck now."""
        return sum(1 for w in self.writes if w.stuck)

    def moving(self, now: float) -> set[int]:
        """``id`` of the leases with a write whose clock is under ``timeout_s``."""
        return {id(w.job.lease) for w in self.writes if now - w.clock <= self.timeout_s}

    def release_all(self, engine: TransferEngine) -> None:
        """The engine is closing: withdraw what it has not started, release every handle."""
        for w in self.writes:
            try:
                engine.cancel(w.handle)
                engine.release(w.handle)
            except Exception:
                pass
        self.writes.clear()
