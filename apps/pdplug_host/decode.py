"""A decode DCP rank of the reference host (one process per rank).

Every rank holds the full weights and its share of each request's tokens (token i on rank
``i % dcp`` at local offset ``i // dcp``). Loop:

1. new requests from the driver wait in arrival order (the same on every rank) until the local
   share's pages (prompt + output) can be allocated, then vote ``good`` on the ``prealloc``
   stream; once every rank allocated (decision ``good``) rank 0 tells the driver (``Leased``).
   When the driver routes the request to prefill (``Route``), every rank leases the room with
   the KV receiver, which sends the destination pages to every prefill rank: the receiver's
   timeouts start once the prefill is about to work on it, never while it queues. A request
   that waited ``timeout_s`` with no page freed on this rank votes ``bad`` (a ``bad`` prealloc
   frees the pages and fails the request alone);
2. a room whose KV arrived (``Success``) and whose first token is known is voted ``good`` on the
   ``transfer`` stream (``Failed`` → ``bad``); decisions are applied in order, exactly once;
3. the ranks agree (all-reduce MIN) on how many transfer decisions all of them applied; every
   rank runs the same batch — the requests admitted by those decisions — through one decode
   step (partial attention over the local share, all-gathered and merged by log-sum-exp).
"""

from __future__ import annotations

import time
from collections import deque
from typing import Any

import torch

from pdplug import ConsensusConfig, KVConfig, KVLayout, KVPoll, PluginManager
from pdplug.bootstrap import resolve
from pdplug.types import pages_from_bytes
from pdplug_host.messages import (
    Finished,
    FirstToken,
    Leased,
    NewRequest,
    Ready,
    RequestFailed,
    Route,
    Shutdown,
    Timing,
    WorkerStats,
)
from pdplug_host.model import (
    OutOfPagesError,
    PagedKVCache,
    build_model,
    decode_step_dcp,
    greedy,
    pages_needed,
)
from pdplug_host.worker import (
    POINTS,
    DriverLink,
    WorkerSpec,
    close_quietly,
    init_gloo,
    run_worker,
)

__all__ = ["decode_main"]


class _Req:
    __slots__ = (
        "allocated", "first", "leased", "out", "output_len", "pages", "prompt_len", "reason",
        "rid", "routed", "t", "voted",
    )  # fmt: skip

    def __init__(self, msg: NewRequest, pages: torch.Tensor | None, reason: str = "") -> None:
        self.rid = msg.rid
        self.reason = reason
        self.prompt_len = len(pages_from_bytes(msg.tokens))
        self.output_len = msg.output_len
        self.pages = pages
        self.first: int | None = None
        self.out: list[int] = []
        self.t: dict[str, float] = {}
        self.voted = False
        self.allocated = False  # every rank holds pages (prealloc decision good)
        self.routed = False  # the driver sent it to prefill
        self.leased = False  # leased with the KV receiver (expect() called)


class DecodeRank:
    """State and steps of one decode DCP rank (see the module docstring)."""

    def __init__(self, spec: WorkerSpec) -> None:
        self.spec = spec
        self.link = DriverLink(spec)
        self.rank, self.size = spec.rank, spec.size
        self.group = init_gloo(spec.rank, spec.size, spec.gloo_port, spec.timeout_s)
        cfg = spec.model
        self.model = build_model(cfg)
        self.cache = PagedKVCache(cfg, spec.num_pages, spec.page_size)
        self.layout = KVLayout(
            page_size=spec.page_size,
            entry_bytes_per_token=tuple(self.cache.entry_bytes_per_token()),
            dtype=cfg.dtype,
            dcp_size=spec.size,
            dcp_rank=spec.rank,
            first_layer=0,
            num_layers=cfg.num_layers,
        )
        pm = PluginManager()
        names = spec.names
        self.served_by = {p: pm.describe(p, names.get(p)) for p in POINTS}
        kv_cfg = KVConfig(
            instance=spec.decode_instance,
            role="decode",
            layout=self.layout,
            bootstrap_endpoint=spec.bootstrap,
            bootstrap_timeout_s=spec.timeout_s,
            waiting_timeout_s=spec.timeout_s,
            transfer_timeout_s=spec.timeout_s,
            wire=spec.wire,
        )
        self.receiver = pm.make_kv_receiver(kv_cfg, name=names.get("kv_sender"))
        self.receiver.register_kv(self.cache.entry_tensors())
        peers = resolve(
            spec.bootstrap, spec.prefill_instance, timeout_s=spec.timeout_s * 2, wire=spec.wire
        )
        self.receiver.connect(list(peers))
        self.consensus = pm.make_consensus(
            ConsensusConfig(
                pp_rank=spec.rank,
                pp_size=spec.size,
                endpoints=spec.consensus_endpoints,
                peer_timeout_s=spec.timeout_s,
                vote_deadline_s=spec.timeout_s * 2,
                wire=spec.wire,
            ),
            name=names.get("consensus"),
        )
        self.reqs: dict[int, _Req] = {}
        self.admitted: list[int] = []  # transfer-stream good ids, in decision order
        self.done: set[int] = set()
        self.stopping = False
        self.steps = 0
        self.draining: list[tuple[_Req, float]] = []
        self.page_wait: deque[tuple[NewRequest, float]] = deque()  # (request, since)
        self.last_free = time.monotonic()  # a page wait is bounded from the later of the two
        self.waited_for_pages: set[int] = set()  # requests that found no pages at first

    def poll_control(self) -> None:
        """Driver messages, transfer votes and decisions (non-blocking)."""
        for msg in self.link.recv_all():
            if isinstance(msg, NewRequest):
                self.page_wait.append((msg, time.monotonic()))
            elif isinstance(msg, Route):
                routed = self.reqs.get(msg.rid)
                if routed is not None:
                    routed.routed = True
                    self._expect(routed)
            elif isinstance(msg, FirstToken):
                if msg.rid in self.reqs:
                    self.reqs[msg.rid].first = msg.token
            elif isinstance(msg, Shutdown):
                self.stopping = True
        for req in list(self.reqs.values()):
            if req.voted or not req.leased:
                continue
            st = self.receiver.poll(req.rid)
            if st == KVPoll.Failed:
                req.voted = True
                self.consensus.offer("transfer", bad=[req.rid])
            elif st == KVPoll.Success and req.first is not None:
                req.voted = True
                req.t["t_success"] = time.time()
                self.consensus.offer("transfer", good=[req.rid])
        if self.draining:
            self._free_drained()
        if self.page_wait:
            self._lease_waiting()
        for d in self.consensus.poll():
            if d.stream == "prealloc":
                self._apply_prealloc(d.good, d.bad)
                continue
            if d.stream != "transfer":
                continue
            for rid in d.good:
                if rid in self.reqs:
                    self.admitted.append(rid)
                    self.reqs[rid].t["t_decided"] = time.time()
            for rid in d.bad:
                gone = self.reqs.pop(rid, None)
                if gone is not None:
                    reason = self.receiver.failure_reason(rid) or "transfer failed"
                    self._release(gone)
                    self.link.send(
                        RequestFailed(role="decode", rank=self.rank, rid=rid, reason=reason)
                    )

    def _lease_waiting(self) -> None:
        """Allocate pages for waiting requests in arrival order (head of line first, so every
        rank allocates the same requests in the same order) and vote on ``prealloc``.

        Virtual pages of ``page_size * dcp`` tokens (SGLang DCP): every rank allocates the same
        page count, enough for its share of prompt + output. The driver refused up front every
        request that could never fit.
        """
        vpage = self.spec.page_size * self.size
        while self.page_wait:
            msg, since = self.page_wait[0]
            n = len(pages_from_bytes(msg.tokens))
            try:
                pages = self.cache.alloc(pages_needed(n + msg.output_len, vpage))
            except OutOfPagesError:
                self.waited_for_pages.add(msg.rid)
                waited = time.monotonic() - max(since, self.last_free)
                if waited <= self.spec.timeout_s:
                    return
                self.page_wait.popleft()
                reason = (
                    f"decode out of pages: waited {waited:.0f} s with no page freed (--timeout "
                    f"{self.spec.timeout_s:g} s; {self.cache.num_free} of "
                    f"{self.cache.num_pages} pages free)"
                )
                self.reqs[msg.rid] = _Req(msg, None, reason)
                self.consensus.offer("prealloc", bad=[msg.rid])
                continue
            self.page_wait.popleft()
            self.reqs[msg.rid] = _Req(msg, pages)
            self.consensus.offer("prealloc", good=[msg.rid])

    def _apply_prealloc(self, good: tuple[int, ...], bad: tuple[int, ...]) -> None:
        for rid in good:
            req = self.reqs.get(rid)
            if req is not None and req.pages is not None:
                req.allocated = True
                req.t["t_prealloc"] = time.time()
                if self.rank == 0:
                    self.link.send(Leased(rid=rid))
                self._expect(req)
        for rid in bad:
            req = self.reqs.pop(rid, None)
            if req is None:
                continue
            if req.pages is not None:
                self.cache.free(req.pages)
                self.last_free = time.monotonic()
            reason = req.reason or "another decode rank ran out of pages"
            self.link.send(RequestFailed(role="decode", rank=self.rank, rid=rid, reason=reason))

    def _expect(self, req: _Req) -> None:
        """Lease the room with the KV receiver once allocated here and routed to prefill."""
        if req.leased or not (req.allocated and req.routed):
            return
        assert req.pages is not None
        req.leased = True
        n_pages = pages_needed(req.prompt_len, self.spec.page_size * self.size)
        self.receiver.expect(req.rid, req.pages[:n_pages].numpy(), num_tokens=req.prompt_len)

    def _release(self, req: _Req) -> None:
        # A failed room's pages may still be written by a late post: free them once drained.
        self.draining.append((req, time.monotonic() + self.spec.timeout_s))
        self._free_drained()

    def _free_drained(self) -> None:
        keep = []
        for req, deadline in self.draining:
            if self.receiver.drained(req.rid) or time.monotonic() > deadline:
                assert req.pages is not None
                self.cache.free(req.pages)
                self.last_free = time.monotonic()
                self.receiver.clear(req.rid)
            else:
                keep.append((req, deadline))
        self.draining = keep

    def _sync(self) -> tuple[int, bool]:
        """Agree on the step: how many transfer decisions *every* rank applied (MIN), and
        whether every rank is ready to stop.

        Decisions are applied in the same order everywhere, so the first ``n`` admitted ids
        are the same list on every rank; a rank that is behind never blocks the others in a
        collective (a relayed decision, e.g. ``ring``, may reach ranks at different times).
        """
        n = len(self.admitted)
        stop = self.stopping and not self.reqs and not self.page_wait
        if self.size == 1:
            return n, stop
        import torch.distributed as dist

        t = torch.tensor([n, int(stop)], dtype=torch.int64)
        dist.all_reduce(t, op=dist.ReduceOp.MIN)
        return int(t[0]), bool(t[1])

    def _gather(self, t: torch.Tensor) -> list[torch.Tensor]:
        if self.size == 1:
            return [t]
        import torch.distributed as dist

        out = [torch.empty_like(t) for _ in range(self.size)]
        dist.all_gather(out, t)
        return out

    def step(self) -> bool:
        """One loop iteration (at most one decode step). Returns False once stopped."""
        self.poll_control()
        n, stop = self._sync()
        if stop:
            return False
        batch = [self.reqs[r] for r in self.admitted[:n] if r not in self.done]
        for req in batch:
            if not req.out:  # the first token came from prefill
                assert req.first is not None
                req.out.append(req.first)
        live = [r for r in batch if len(r.out) < r.output_len]
        if live:
            ids = torch.tensor([r.out[-1] for r in live], dtype=torch.int64)
            positions = [r.prompt_len + len(r.out) - 1 for r in live]
            pages = [r.pages for r in live if r.pages is not None]  # admitted => allocated
            logits = decode_step_dcp(
                self.model,
                self.cache,
                ids,
                pages,
                positions,
                self.rank,
                self.size,
                self._gather,
            )
            for r, tok in zip(live, greedy(logits).tolist()):
                r.out.append(int(tok))
            self.steps += 1
        else:
            time.sleep(0.001)
        for req in batch:
            if len(req.out) >= req.output_len:
                self.done.add(req.rid)
                del self.reqs[req.rid]
                self._release(req)
                self.link.send(Timing(role="decode", rank=self.rank, rid=req.rid, fields=req.t))
                if self.rank == 0:
                    self.link.send(Finished(rid=req.rid, tokens=tuple(req.out)))
        return True

    def run(self) -> None:
        """Serve until the driver says stop and every request finished."""
        self.link.send(Ready(role="decode", rank=self.rank, served_by=self.served_by))
        while self.step():
            pass
        stats: dict[str, Any] = {
            "decode_steps": self.steps,
            "page_waits": len(self.waited_for_pages),
        }
        stats.update({f"receiver_{k}": v for k, v in self.receiver.stats().items()})
        stats.update({f"consensus_{k}": v for k, v in self.consensus.stats().items()})
        self.link.send(WorkerStats(role="decode", rank=self.rank, stats=stats))

    def close(self) -> None:
        """Release sockets and registered memory."""
        close_quietly(self.link, self.consensus, self.receiver)


def decode_main(spec_bytes: bytes) -> None:
    """Process entry point (``multiprocessing`` spawn target)."""
    run_worker(spec_bytes, DecodeRank)
