"""PP prefill bootstrap agreement through pdplug's consensus, in place of SGLang's
``PPConsensusStore``.

SGLang 0.5.23 admits a PP prefill request when PP0's ``sender.poll_pp_consensus()`` says
WaitingForInput; PP0's answer then travels down SGLang's own PP chain to the other stages
(``disaggregation/utils.py``, ``poll_and_all_reduce_prefill_pp``). SGLang's own backends make
that answer from ``PPConsensusStore``: every rank pushes its room statuses to PP0 over an
unauthenticated PULL socket. Here every PP rank votes instead, on the ``bootstrap`` stream of
the consensus the ``pdplug`` plugin manager selects (``pp0`` by default, ``ring`` with
``PDPLUG_CONSENSUS=ring``): ``good`` once the room is WaitingForInput on every plane of the
rank, ``bad`` once it failed; PP0 answers from the decisions (bad: Failed, good:
WaitingForInput, none yet: Bootstrapping). The consensus sockets follow the engine's pdplug
wire rules (HMAC key, bind host).

One :class:`BootstrapVotes` per prefill rank (one consensus group per attention-TP column:
the PP ranks that share a TP rank, SGLang's ``pp_group``). Its thread is the only caller of
the consensus object (votes, ``poll``, heartbeats). The ranks learn each other's consensus
endpoints with one ``all_gather`` of fixed-size byte tensors on the PP group's CPU (gloo)
group: no pickle.

With ``PDPLUG_SGLANG_TRACE_DIR`` set, each rank appends a JSON line per room to
``<dir>/bootstrap-<pp_rank>-<tp_rank>.jsonl``: when the room became ready here and when the
rank applied SGLang's admission (``init``): ``pdplug bench sglang`` reads admission latency
from these.
"""

from __future__ import annotations

import json
import logging
import os
import threading
import time
from pathlib import Path
from typing import Any

from pdplug.config import ConsensusConfig
from pdplug.ports import free_ports
from pdplug.types import KVPoll

__all__ = ["BootstrapVotes", "exchange_endpoints", "TraceLog"]

log = logging.getLogger(__name__)

_ENDPOINT_BYTES = 128
STREAM = "bootstrap"


def exchange_endpoints(mine: str, group: Any, size: int) -> tuple[str, ...]:
    """Every PP rank's endpoint, in PP rank order, via ``all_gather`` on ``group``.

    :param mine: this rank's ``tcp://host:port`` (ASCII, at most 128 bytes).
    :param group: the PP group's CPU (gloo) process group.
    :param size: PP ranks in the group.
    :raises ValueError: an endpoint too long.
    """
    import torch
    import torch.distributed as dist

    raw = mine.encode("ascii")
    if len(raw) > _ENDPOINT_BYTES:
        raise ValueError(f"consensus endpoint {mine!r} is longer than {_ENDPOINT_BYTES} bytes")
    t = torch.zeros(_ENDPOINT_BYTES, dtype=torch.uint8)
    t[: len(raw)] = torch.tensor(list(raw), dtype=torch.uint8)
    out = [torch.zeros_like(t) for _ in range(size)]
    dist.all_gather(out, t, group=group)
    return tuple(bytes(o.tolist()).rstrip(b"\0").decode("ascii") for o in out)


class TraceLog:
    """Per-room admission timestamps of one rank (``time.time()`` seconds), as JSON lines."""

    def __init__(self, directory: str, pp_rank: int, tp_rank: int, backend: str) -> None:
        path = Path(directory)
        path.mkdir(parents=True, exist_ok=True)
        self.path = path / f"bootstrap-{pp_rank}-{tp_rank}.jsonl"
        self.pp_rank = pp_rank
        self.backend = backend
        self._lock = threading.Lock()

    def write(self, room: int, event: str, t: float) -> None:
        """Append ``{"room", "rank", "event", "t", "backend"}``."""
        line = json.dumps(
            {"room": room, "rank": self.pp_rank, "event": event, "t": t, "backend": self.backend}
        )
        with self._lock, open(self.path, "a") as f:
            f.write(line + "\n")


def trace_from_env(pp_rank: int, tp_rank: int, backend: str) -> TraceLog | None:
    """The :class:`TraceLog` of ``PDPLUG_SGLANG_TRACE_DIR``, or None when unset."""
    d = os.environ.get("PDPLUG_SGLANG_TRACE_DIR", "")
    return TraceLog(d, pp_rank, tp_rank, backend) if d else None


class BootstrapVotes:
    """One prefill rank's bootstrap votes and the decisions PP0 answers SGLang from.

    :param mgr: the rank's :class:`~pdplug.adapters.sglang.conn.PdplugKVManager`.
    :param consensus: the selected pdplug consensus of this rank.
    :param interval_s: how often the thread votes and polls (seconds).
    """

    def __init__(self, mgr: Any, consensus: Any, interval_s: float = 0.002) -> None:
        self.mgr = mgr
        self.consensus = consensus
        self.interval_s = interval_s
        self._lock = threading.Lock()
        self._turn = threading.Lock()  # one caller of the consensus at a time
        self._last_step = 0.0
        self.leader = mgr.shape.pp_rank == 0
        self._live: dict[int, float] = {}  # room -> time it was tracked
        self._voted: dict[int, float] = {}  # room -> time this rank voted (ready or failed)
        self._decided: dict[int, KVPoll] = {}
        self.error: str | None = None
        self._stop = threading.Event()
        self.trace = trace_from_env(mgr.shape.pp_rank, mgr.shape.attn_tp_rank, "pdplug")
        self._thread = threading.Thread(target=self._run, name="pdplug-votes", daemon=True)
        self._thread.start()

    @classmethod
    def build(cls, mgr: Any) -> BootstrapVotes:
        """Exchange endpoints over SGLang's PP group and build the selected consensus."""
        from sglang.srt.runtime_context import get_parallel

        pp = get_parallel().pp_group
        wire = mgr.settings.net.wire
        (port,) = free_ports(1, wire.bind_host)
        mine = f"tcp://{mgr.settings.net.advertise_host}:{port}"
        endpoints = exchange_endpoints(mine, pp.cpu_group, mgr.shape.pp_size)
        config = ConsensusConfig(
            pp_rank=mgr.shape.pp_rank,
            pp_size=mgr.shape.pp_size,
            endpoints=endpoints,
            vote_deadline_s=mgr.settings.bootstrap_timeout_s,
            wire=wire,
        )
        return cls(mgr, mgr.pm.make_consensus(config))

    def track(self, room: int) -> None:
        """A new room on this rank: vote on it once it is ready or failed here."""
        with self._lock:
            self._live[room] = time.monotonic()
            self._decided.pop(room, None)
            self._voted.pop(room, None)

    def forget(self, room: int) -> None:
        """The room ended on this rank."""
        with self._lock:
            self._live.pop(room, None)
            self._voted.pop(room, None)
            self._decided.pop(room, None)

    def applied(self, room: int) -> None:
        """SGLang admitted the room on this rank (its ``init``): traced."""
        if self.trace is not None:
            self.trace.write(room, "applied", time.time())

    def status(self, room: int) -> KVPoll:
        """PP0's answer to SGLang: the decision on ``room``, Bootstrapping until there is one.

        On PP0 (the rank SGLang asks) an undecided room first runs one vote-and-poll step in
        the caller's thread (at most every ``interval_s / 2``): a decision that arrived is
        answered in the same loop iteration, not after the voting thread's next wake-up."""
        with self._lock:
            d = self._decided.get(room)
        if d is None and self.leader and self.error is None:
            now = time.monotonic()
            if now - self._last_step >= self.interval_s / 2 and self._turn.acquire(blocking=False):
                try:
                    self._last_step = now
                    self._step()
                except Exception as e:  # the voting thread reports it on its next step
                    log.debug("pdplug: inline consensus step: %s", e)
                finally:
                    self._turn.release()
                with self._lock:
                    d = self._decided.get(room)
        if d is not None:
            return d
        if self.error is not None:
            return KVPoll.Failed
        return KVPoll.Bootstrapping

    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                with self._turn:
                    self._last_step = time.monotonic()
                    self._step()
            except Exception as e:  # a dead PP rank: every undecided room fails
                self.error = f"{type(e).__name__}: {e}"
                log.error("pdplug: PP bootstrap consensus failed: %s", self.error)
                with self._lock:
                    for room in self._live:
                        self._decided.setdefault(room, KVPoll.Failed)
                        self.mgr.abort_room(room, f"PP consensus: {self.error}")
                if self._stop.wait(0.5):
                    return
                continue
            self._stop.wait(self.interval_s)

    def _step(self) -> None:
        with self._lock:
            pending = [r for r in self._live if r not in self._voted]
        good, bad = [], []
        for room in pending:
            s = self.mgr.room_status(room)
            if s == KVPoll.Failed:
                bad.append(room)
            elif s >= KVPoll.WaitingForInput:
                good.append(room)
        now = time.time()
        if good or bad:
            with self._lock:
                for r in (*good, *bad):
                    self._voted[r] = now
            self.consensus.offer(STREAM, good=good, bad=bad)
            if self.trace is not None:
                for r in good:
                    self.trace.write(r, "ready", now)
        for d in self.consensus.poll():
            if d.stream != STREAM:
                continue
            with self._lock:
                for r in d.good:
                    if r in self._live:
                        self._decided[r] = KVPoll.WaitingForInput
                for r in d.bad:
                    if r in self._live:
                        self._decided[r] = KVPoll.Failed

    def close(self) -> None:
        """Stop the thread and close the consensus (idempotent)."""
        self._stop.set()
        self._thread.join(timeout=2)
        self.consensus.close()
