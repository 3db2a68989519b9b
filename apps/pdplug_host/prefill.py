"""A prefill PP rank of the reference host (one process per rank).

Loop (one iteration = one forward chunk at most):

1. take new requests from the driver; poll each room's KV sender: ``WaitingForInput`` (every
   decode rank sent its destination) → vote ``good`` on the ``bootstrap`` stream, ``Failed`` →
   ``bad``;
2. apply consensus decisions in order, exactly once: ``bootstrap`` good → the run queue,
   ``release`` → free the request's pages (prefix-cache references dropped);
3. PP0 picks the next chunk (dynamic chunk size from the scheduler) and hands
   ``(rid, start, end, hit)`` plus hidden states to PP1 over gloo; rank k>0 waits for that
   hand-off while still polling consensus and transfers. A request's pages are taken at its
   first chunk; when they cannot all be had, PP0 waits (head of line) until finished requests
   give pages back;
4. after computing its layers for a chunk, every rank sends the chunk's KV of *its* layers:
   the send ``[sent, end)`` (end floored to a page unless it is the last chunk) is split by the
   scheduler at ``min(grid, pack capacity)`` and each segment goes to the KV sender, which plans,
   packs and writes it to every decode DCP rank;
5. once its sender reports ``Success`` (or ``Failed``) a rank votes on the ``release`` stream.

The prefix cache is matched when PP0 schedules a request's first chunk, and every other rank
matches when it processes that same chunk. Only PP0 chooses blocks to evict; the hand-off names
them and the other ranks evict the same ones (waiting, if needed, until their own sends of those
blocks drained), so all ranks see the same cache contents and agree on every hit.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections import deque
from typing import Any

import numpy as np
import torch

from pdplug import (
    KVLayout,
    KVPoll,
    PlannerConfig,
    PluginManager,
    SchedulerConfig,
)
from pdplug.protocols import send_step
from pdplug.types import pages_from_bytes
from pdplug_host.messages import (
    FirstToken,
    NewRequest,
    Ready,
    RequestFailed,
    Shutdown,
    Timing,
)
from pdplug_host.model import (
    PagedKVCache,
    SeqSpan,
    build_model,
    embed,
    final_logits,
    greedy,
    layer_split,
    pages_needed,
    run_layers,
)
from pdplug_host.prefix_cache import PrefixCache
from pdplug_host.worker import (
    POINTS,
    DriverLink,
    WorkerSpec,
    close_quietly,
    init_gloo,
    kv_config,
    make_consensus,
    run_worker,
    send_stats,
)

__all__ = ["prefill_main"]

log = logging.getLogger("pdplug_host.prefill")

SCHED_LEN = 6  # (rid, start, end, hit_tokens, flags, evicted blocks that follow)
STOP = 1


class _Req:
    """Per-request state on one prefill rank."""

    __slots__ = (
        "arrival",
        "chain",
        "chunk_id",
        "compute_s",
        "computed",
        "hit",
        "last_sent",
        "output_len",
        "pages",
        "rid",
        "send_s",
        "sent",
        "t",
        "tokens",
        "voted_boot",
        "voted_release",
    )  # fmt: skip

    def __init__(self, msg: NewRequest) -> None:
        self.rid = msg.rid
        self.tokens = torch.from_numpy(pages_from_bytes(msg.tokens).copy())
        self.chain = list(msg.chain)
        self.output_len = msg.output_len
        self.arrival = msg.arrival
        self.pages: torch.Tensor | None = None
        self.hit = 0
        self.computed = 0
        self.sent = 0
        self.chunk_id = 0
        self.last_sent = False
        self.t: dict[str, float] = {}
        self.compute_s = 0.0
        self.send_s = 0.0
        self.voted_boot = False
        self.voted_release = False


class PrefillRank:
    """State and steps of one prefill PP rank (see the module docstring)."""

    def __init__(self, spec: WorkerSpec) -> None:
        self.spec = spec
        self.link = DriverLink(spec)
        self.rank, self.size = spec.rank, spec.size
        # The hand-off receive idles between requests: a long gloo timeout; dead ranks are
        # caught by consensus peer timeouts and the driver's watchdog instead.
        self.group = init_gloo(spec.rank, spec.size, spec.gloo_port, 3600.0)
        cfg = spec.model
        self.model = build_model(cfg, spec.device)
        self.lo, self.hi = layer_split(cfg.num_layers, spec.size)[spec.rank]
        self.cache = PagedKVCache(
            cfg, spec.num_pages, spec.page_size, layers=(self.lo, self.hi), device=spec.device
        )
        self.pcache = PrefixCache(self.cache, spec.block_tokens, spec.page_size)
        self.layout = KVLayout(
            page_size=spec.page_size,
            entry_bytes_per_token=tuple(self.cache.entry_bytes_per_token()),
            dtype=cfg.dtype,
            pp_size=spec.size,
            pp_rank=spec.rank,
            first_layer=self.lo,
            num_layers=self.hi - self.lo,
        )
        pm = PluginManager()
        names = spec.names
        self.served_by = {p: pm.describe(p, names.get(p)) for p in POINTS}
        self.planner = pm.make_pack_planner(PlannerConfig(), name=names.get("pack_planner"))
        kv_cfg = kv_config(
            spec, self.layout, pack_region_tokens=spec.pack_region_tokens,
            max_dst_dcp=spec.max_dst_dcp,
        )  # fmt: skip
        self.sender = pm.make_kv_sender(kv_cfg, self.planner, name=names.get("kv_sender"))
        self.sender.register_kv(self.cache.entry_tensors())  # also publishes this rank
        self.consensus = make_consensus(pm, spec)
        self.scheduler = pm.make_scheduler(
            SchedulerConfig(page_size=spec.page_size, chunk_size=spec.chunk_size),
            name=names.get("scheduler"),
        )
        self.reqs: dict[int, _Req] = {}
        self.waiting_boot: list[int] = []  # rooms not yet decided on the bootstrap stream
        self.admitted: set[int] = set()
        self.run_queue: deque[int] = deque()  # PP0: admitted, prompt not fully scheduled
        self.inflight: list[int] = []  # last segment posted, waiting for Success/Failed
        self.stopping = False
        self.segments = 0
        self.split_sends = 0  # sends the scheduler cut into more than one segment
        self.tokens_sent = 0
        self.chunk_sizes: list[int] = []
        self.waited_for_pages: set[int] = set()  # PP0: requests that found no pages at first
        self.pending_work: list[Any] = []
        self.draining: list[tuple[_Req, float]] = []
        self._next_dump = 0.0
        self.handoff: queue.Queue[tuple[Any, Any, Any]] = queue.Queue()
        if spec.rank > 0:
            threading.Thread(target=self._handoff_rx, name="pp-handoff", daemon=True).start()
        if spec.rank == 0 and spec.profile:
            self._profile_chunk_model()

    # ------------------------------------------------------------------ set-up
    def _profile_chunk_model(self) -> None:
        """Fit the scheduler's latency model on this rank's layers (chunked-prefill sizing).

        Lengths span ``base/8 … 4·base`` so the attention term's curvature shows above the
        per-call overhead on a tiny model; each length keeps the best of three runs (less noise).
        """
        base = self.spec.chunk_size
        lengths = np.linspace(max(8, base // 8), base * 4, 12).astype(int)
        samples: list[tuple[int, float]] = []
        gen = torch.Generator().manual_seed(1)
        for n in [int(lengths[0]), *map(int, lengths)]:  # first sample is warm-up (dropped)
            ids = torch.randint(0, self.spec.model.vocab, (n,), generator=gen)
            pages = self.cache.alloc(pages_needed(n, self.spec.page_size))
            best = float("inf")
            for _ in range(3):
                t0 = time.perf_counter()
                run_layers(self.model, self.cache, embed(self.model, ids), [SeqSpan(pages, 0, n)])
                best = min(best, time.perf_counter() - t0)
            samples.append((n, best))
            self.cache.free(pages)
        self.scheduler.fit_chunk_model(samples)
        log.info("chunk model fitted on %d samples", len(samples))

    # ------------------------------------------------------------------ control plane
    def poll_control(self) -> None:
        """Driver messages, bootstrap/release votes and decisions (non-blocking)."""
        if log.isEnabledFor(logging.DEBUG) and time.monotonic() > self._next_dump:
            self._next_dump = time.monotonic() + 2.0
            log.debug(
                "prefill %d: reqs=%s boot=%s admitted=%s queue=%s inflight=%s polls=%s",
                self.rank, sorted(self.reqs), self.waiting_boot, sorted(self.admitted),
                list(self.run_queue), self.inflight,
                {r: int(self.sender.poll(r)) for r in self.reqs},
            )  # fmt: skip
        for msg in self.link.recv_all():
            if isinstance(msg, NewRequest):
                self.reqs[msg.rid] = _Req(msg)
                self.sender.start(msg.rid)
                self.waiting_boot.append(msg.rid)
            elif isinstance(msg, Shutdown):
                self.stopping = True
        still = []
        for rid in self.waiting_boot:
            req = self.reqs[rid]
            st = self.sender.poll(rid)
            if st == KVPoll.Failed:
                self.consensus.offer("bootstrap", bad=[rid])
            elif st >= KVPoll.WaitingForInput and not req.voted_boot:
                req.t.setdefault("t_ready", time.time())
                req.voted_boot = True
                self.consensus.offer("bootstrap", good=[rid])
            still.append(rid)
        self.waiting_boot = still
        for rid in self.inflight:
            req = self.reqs[rid]
            st = self.sender.poll(rid)
            if req.voted_release:
                continue
            if st == KVPoll.Success:
                req.t["t_sent"] = time.time()
                req.voted_release = True
                self.consensus.offer("release", good=[rid])
            elif st == KVPoll.Failed:
                req.voted_release = True
                self.consensus.offer("release", bad=[rid])
        if self.draining:
            self._free_drained()
        for d in self.consensus.poll():
            if d.stream == "bootstrap":
                for rid in d.good:
                    if rid in self.reqs and rid not in self.admitted:
                        self.admitted.add(rid)
                        self.reqs[rid].t["t_admit"] = time.time()
                        if self.rank == 0:
                            self.run_queue.append(rid)
                for rid in d.bad:
                    self._finish(rid, ok=False, reason=self.sender.failure_reason(rid) or "bad")
                done = set(d.good) | set(d.bad)
                self.waiting_boot = [r for r in self.waiting_boot if r not in done]
            elif d.stream == "release":
                for rid in d.good:
                    self._finish(rid, ok=True)
                for rid in d.bad:
                    self._finish(rid, ok=False, reason=self.sender.failure_reason(rid) or "bad")

    def _finish(self, rid: int, ok: bool, reason: str = "") -> None:
        req = self.reqs.pop(rid, None)
        if req is None:
            return
        # Pages are reused only once no write still reads them (an aborted room may drain late).
        self.draining.append((req, time.monotonic() + self.spec.timeout_s))
        self.inflight = [r for r in self.inflight if r != rid]
        self.admitted.discard(rid)
        if rid in self.run_queue:
            self.run_queue.remove(rid)
        if not ok:
            self.link.send(RequestFailed(role="prefill", rank=self.rank, rid=rid, reason=reason))
        fields = dict(req.t)
        fields.update(compute_s=req.compute_s, send_s=req.send_s)
        self.link.send(Timing(role="prefill", rank=self.rank, rid=rid, fields=fields))

    def _free_drained(self) -> None:
        keep = []
        for req, deadline in self.draining:
            if self.sender.drained(req.rid) or time.monotonic() > deadline:
                if req.pages is not None:
                    self.pcache.release(req.chain, req.pages)
                self.sender.clear(req.rid)
            else:
                keep.append((req, deadline))
        self.draining = keep

    # ------------------------------------------------------------------ data plane
    def _admit_pages(self, req: _Req) -> list[int] | None:
        """PP0: match the prefix cache and allocate the rest of the prompt's pages.

        :returns: chain hashes of the blocks evicted for it (the other ranks evict the same),
            or None when its pages cannot all be had yet (nothing taken; try again later).
        """
        n = int(req.tokens.numel())
        got = self.pcache.admit(req.chain, pages_needed(n, self.spec.page_size), max_tokens=n - 1)
        if got is None:
            return None
        req.hit, req.pages, evicted = got
        req.computed = req.hit
        return evicted

    def _follow_pages(self, req: _Req, hit_expected: int, evicted: list[int]) -> None:
        """Rank k>0: take the same prefix hit and evict the same blocks as PP0, then allocate.

        Pages come back here once this rank's own sends drained, possibly later than on PP0:
        wait for them (bounded) while the control plane keeps moving.

        :raises RuntimeError: the hit differs from PP0's (caches diverged), or the pages did
            not come back within twice the timeout.
        """
        n = int(req.tokens.numel())
        deadline = time.monotonic() + self._page_wait_s
        while not self.pcache.evict_blocks(evicted):
            self._wait_pages(deadline, req)
        hit, hit_pages = self.pcache.match(req.chain, max_tokens=n - 1)
        if hit != hit_expected:
            raise RuntimeError(
                f"prefill rank {self.rank}: prefix-cache hit for request {req.rid} is {hit} "
                f"tokens, PP0 found {hit_expected}; caches diverged"
            )
        extra = pages_needed(n, self.spec.page_size) - hit_pages.numel()
        while self.cache.num_free < extra:
            self._wait_pages(deadline, req)
        req.pages = torch.cat([hit_pages, self.cache.alloc(extra)])
        req.hit = hit
        req.computed = hit

    @property
    def _page_wait_s(self) -> float:
        # a release decision plus the drain of its writes, each bounded by the timeout
        return 2 * self.spec.timeout_s + 5.0

    def _wait_pages(self, deadline: float, req: _Req) -> None:
        if time.monotonic() > deadline:
            raise RuntimeError(
                f"prefill rank {self.rank}: pages for request {req.rid} did not come back "
                f"within {self._page_wait_s:.0f} s although PP0 had them"
            )
        self.poll_control()
        time.sleep(0.0005)

    def _compute(
        self, req: _Req, start: int, end: int, hidden: torch.Tensor | None
    ) -> torch.Tensor:
        assert req.pages is not None
        t0 = time.perf_counter()
        if hidden is None:
            hidden = embed(self.model, req.tokens[start:end])
        out = run_layers(self.model, self.cache, hidden, [SeqSpan(req.pages, start, end - start)])
        req.compute_s += time.perf_counter() - t0
        req.computed = end
        self.pcache.insert(req.chain, req.pages)
        return out

    def _send_kv(self, req: _Req, end: int) -> None:
        """Send the KV of ``[req.sent, end)`` (floored to a page unless the prompt is done)."""
        n = int(req.tokens.numel())
        ps = self.spec.page_size
        last = end == n
        stop = end if last else (end // ps) * ps
        if stop <= req.sent and not last:
            return
        cap = self.sender.capacity_tokens(req.rid)
        segs = self.scheduler.split_send(
            token_start=req.sent,
            token_end=stop,
            decode_prefix_len=0,
            is_last_send=last,
            capacity_tokens=cap,
            first_chunk_id=req.chunk_id,
        )
        assert req.pages is not None
        t0 = time.perf_counter()
        ready = None
        if self.spec.device.startswith("cuda"):  # the forward's KV writes may still be queued
            ready = torch.cuda.Event()
            ready.record()
        pages = req.pages.numpy()
        # the step's segments in one hand-off (send_many, or one send each)
        items = [
            (req.rid, seg, pages[seg.token_start // ps : -(-seg.token_end // ps)], ready)
            for seg in segs
        ]
        send_step(self.sender, items)
        req.send_s += time.perf_counter() - t0
        self.segments += len(segs)
        self.split_sends += len(segs) > 1
        self.tokens_sent += sum(seg.num_tokens for seg in segs)
        req.chunk_id += len(segs)
        req.sent = stop
        if last:
            req.t["t_last_send"] = time.time()
            req.last_sent = True
            self.inflight.append(req.rid)

    def _after_chunk(self, req: _Req, end: int, hidden: torch.Tensor) -> None:
        self._send_kv(req, end)
        if self.rank == self.size - 1 and end == int(req.tokens.numel()):
            with torch.no_grad():
                tok = int(greedy(final_logits(self.model, hidden[-1:]))[0])
            self.link.send(FirstToken(rid=req.rid, token=tok))

    # ------------------------------------------------------------------ PP hand-off
    def _isend(self, t: torch.Tensor, dst: int) -> None:
        import torch.distributed as dist

        t = t.cpu()  # gloo moves CPU tensors (a no-op for the CPU model)
        self.pending_work.append((dist.isend(t, dst), t))

    def _drain_sends(self) -> None:
        for w, _ in self.pending_work:
            w.wait()
        self.pending_work.clear()

    def step_leader(self) -> bool:
        """PP0: schedule and run at most one chunk.

        :returns: False once stopped.
        """
        self.poll_control()
        if self.stopping and not self.run_queue and not self.inflight and not self.waiting_boot:
            if self.size > 1:
                self._drain_sends()
                self._isend(torch.tensor([0, 0, 0, 0, STOP, 0], dtype=torch.int64), 1)
                self._drain_sends()
            return False
        if not self.run_queue:
            time.sleep(0.001)
            return True
        req = self.reqs[self.run_queue[0]]
        evicted: list[int] = []
        if req.pages is None:
            got = self._admit_pages(req)
            if got is None:  # waits for pages that finished requests give back
                self.waited_for_pages.add(req.rid)
                time.sleep(0.001)
                return True
            evicted = got
            req.t["t_first_chunk"] = time.time()
        n = int(req.tokens.numel())
        start = req.computed
        size = max(1, min(self.scheduler.next_chunk_size(start), n - start))
        self.chunk_sizes.append(size)
        end = start + size
        if end == n:
            self.run_queue.popleft()
        hidden = self._compute(req, start, end, None)
        if self.size > 1:
            self._drain_sends()
            sched = torch.tensor([req.rid, start, end, req.hit, 0, len(evicted)])
            self._pass_on(sched, torch.tensor(evicted, dtype=torch.int64), hidden, 1)
        self._after_chunk(req, end, hidden)
        return True

    def _pass_on(
        self, sched: torch.Tensor, evicted: torch.Tensor, hidden: torch.Tensor, dst: int
    ) -> None:
        """Hand a chunk to PP rank ``dst``: schedule, evicted block hashes (when any), hidden."""
        self._isend(sched, dst)
        if evicted.numel():
            self._isend(evicted, dst)
        self._isend(hidden.contiguous(), dst)

    def _handoff_rx(self) -> None:
        """Receiver thread (rank k>0): blocking gloo receives from rank k-1 into a queue.

        gloo's point-to-point work objects only complete inside ``wait()``, so the receive
        runs here and the loop polls the queue while it keeps the control plane moving.
        """
        import torch.distributed as dist

        try:
            while True:
                sched = torch.empty(SCHED_LEN, dtype=torch.int64)
                dist.recv(sched, self.rank - 1)
                start, end, flags = int(sched[1]), int(sched[2]), int(sched[4])
                evicted = torch.empty(int(sched[5]), dtype=torch.int64)
                if flags & STOP:
                    self.handoff.put((sched, evicted, None))
                    return
                if evicted.numel():
                    dist.recv(evicted, self.rank - 1)
                hidden = torch.empty(end - start, self.spec.model.hidden, dtype=self.model_dtype)
                dist.recv(hidden, self.rank - 1)
                self.handoff.put((sched, evicted, hidden))
        except Exception as e:  # surfaced by step_follower
            self.handoff.put((None, None, e))

    def step_follower(self) -> bool:
        """PP rank k>0: receive one chunk from rank k-1, run it, pass it on."""
        while True:
            try:
                sched, evicted, hidden = self.handoff.get_nowait()
                break
            except queue.Empty:
                # Idle is legitimate: a dead PP0 surfaces through consensus (peer timeout) and
                # the driver's watchdog, not through this wait.
                self.poll_control()
                time.sleep(0.0005)
        if sched is None:
            raise RuntimeError(f"prefill rank {self.rank}: hand-off from PP rank "
                               f"{self.rank - 1} failed: {hidden}")  # fmt: skip
        rid, start, end, hit, flags, _ = (int(x) for x in sched.tolist())
        if flags & STOP:
            while self.inflight or self.waiting_boot:  # let in-flight transfers conclude
                self.poll_control()
                time.sleep(0.001)
            if self.rank < self.size - 1:
                self._isend(sched, self.rank + 1)
                self._drain_sends()
            return False
        deadline = time.monotonic() + self.spec.timeout_s
        while rid not in self.admitted:  # PP0 decided it; this rank applies it before running
            self.poll_control()
            if time.monotonic() > deadline:
                raise TimeoutError(
                    f"prefill rank {self.rank}: request {rid} was scheduled by PP0 but its "
                    f"bootstrap decision did not arrive within {self.spec.timeout_s} s"
                )
            time.sleep(0.0005)
        req = self.reqs[rid]
        if req.pages is None:
            self._follow_pages(req, hit, evicted.tolist())
        out = self._compute(req, start, end, hidden)
        if self.rank < self.size - 1:
            self._drain_sends()
            self._pass_on(sched, evicted, out, self.rank + 1)
        self._after_chunk(req, end, out)
        return True

    @property
    def model_dtype(self) -> torch.dtype:
        return self.spec.model.torch_compute_dtype

    def run(self) -> None:
        """Serve until the driver says stop and every transfer concluded."""
        self.link.send(Ready(role="prefill", rank=self.rank, served_by=self.served_by))
        step = self.step_leader if self.rank == 0 else self.step_follower
        while step():
            pass
        own: dict[str, Any] = {
            "segments": self.segments,
            "split_sends": self.split_sends,
            "chunks": len(self.chunk_sizes),
            "chunk_min": min(self.chunk_sizes, default=0),
            "chunk_max": max(self.chunk_sizes, default=0),
            "tokens_sent": self.tokens_sent,
            "hit_tokens": self.pcache.hit_tokens,
            "page_waits": len(self.waited_for_pages),
            "evicted_blocks": self.pcache.evicted_blocks,
        }
        send_stats(self.link, own, sender=self.sender, consensus=self.consensus)

    def close(self) -> None:
        """Release sockets and registered memory."""
        close_quietly(self.link, self.consensus, self.sender)


def prefill_main(spec_bytes: bytes) -> None:
    """Process entry point (``multiprocessing`` spawn target)."""
    run_worker(spec_bytes, PrefillRank)
