"""The reference host's driver: spawns PP prefill and DCP decode workers, replays a trace
(routing each request to decode, then to prefill once its pages and a prefill slot are there),
checks every request's tokens against a single-process reference run, and reports TTFT (see
:mod:`pdplug_host.report`).
"""

from __future__ import annotations

import logging
import multiprocessing as mp
import os
import secrets
import shutil
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future
from typing import Any

import msgspec
import zmq

from pdplug.bootstrap import RendezvousServer
from pdplug.config import WireConfig
from pdplug.ports import free_ports
from pdplug.types import pages_to_bytes
from pdplug_host.config import ModelConfig
from pdplug_host.messages import (
    Fatal,
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
    to_driver_codec,
    to_worker_codec,
)
from pdplug_host.options import (
    DemoError,
    DemoOptions,
    check_options,
    check_schedule,
    load_requests,
    need_torch,
    refuse,
    selected_names,
)
from pdplug_host.report import RunRecord, build_report
from pdplug_host.trace import TraceRequest, block_hash_chain, prompt_tokens
from pdplug_host.worker import WorkerSpec

__all__ = ["DemoOptions", "DemoError", "Progress", "run_demo", "check_options"]

log = logging.getLogger(__name__)

#: ``progress(phase, done, total, note)``: phases ``"load"`` (once; ``note`` names the trace),
#: ``"reference"`` (requests computed by the single-process reference), ``"start"`` (workers
#: ready), ``"replay"`` (requests finished or failed); ``note`` says what the phase waits for
#: (e.g. the next arrival)
Progress = Callable[[str, int, int, str], None]


class _Run:
    """One demo run: sockets, processes, bookkeeping."""

    def __init__(self, opts: DemoOptions, requests: list[TraceRequest]) -> None:
        self.opts = opts
        self.requests = requests
        # a fresh key per run: every socket of the demo's processes authenticates its frames
        self.wire = WireConfig(hmac_key=secrets.token_bytes(32))
        self.ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context.instance()
        self.inbox = self.ctx.socket(zmq.PULL)
        port = self.inbox.bind_to_random_port("tcp://127.0.0.1")
        self.to_driver = f"tcp://127.0.0.1:{port}"
        self.rx = to_driver_codec(self.wire)
        self.tx = to_worker_codec(self.wire)
        self.server = RendezvousServer(wire=self.wire).start()
        self.log_dir = opts.log_dir
        self.temp_logs = self.log_dir is None  # ours to remove after a clean run
        if self.log_dir is None:
            self.log_dir = tempfile.mkdtemp(prefix="pdplug-demo-")
        self.procs: dict[tuple[str, int], mp.process.BaseProcess] = {}
        self.outs: dict[tuple[str, int], zmq.Socket] = {}
        self.ready: dict[tuple[str, int], Ready] = {}
        self.finished: dict[int, list[int]] = {}
        self.failed: dict[int, str] = {}
        self.timings: dict[int, list[Timing]] = {}
        self.stats: dict[tuple[str, int], dict[str, Any]] = {}
        self.sent_at: dict[int, float] = {}
        # A request goes to the decode ranks at arrival and waits there for pages (Leased);
        # then here for a prefill slot (at most prefill_pp + 1 at the prefill, a router's
        # admission control); then to the prefill ranks (and Route to decode).
        self.waiting_pages: dict[int, NewRequest] = {}
        self.waiting_slot: dict[int, NewRequest] = {}  # insertion order = arrival order
        self.routed: set[int] = set()
        self.prefilled: set[int] = set()  # first token seen: the prefill is done with it
        self.prefill_slots = opts.prefill_pp + 1

    def spawn(self) -> None:
        o = self.opts
        names = selected_names(o)
        model = ModelConfig()
        block_tokens = self.requests[0].block_tokens if self.requests else 16
        ports = free_ports(o.prefill_pp + o.decode_dcp + 2)
        p_eps = tuple(f"tcp://127.0.0.1:{p}" for p in ports[: o.prefill_pp])
        d_eps = tuple(f"tcp://127.0.0.1:{p}" for p in ports[o.prefill_pp : -2])
        ctx = mp.get_context("spawn")
        from pdplug_host.decode import decode_main
        from pdplug_host.prefill import prefill_main

        for role, size, eps, gport, target in (
            ("prefill", o.prefill_pp, p_eps, ports[-2], prefill_main),
            ("decode", o.decode_dcp, d_eps, ports[-1], decode_main),
        ):
            for rank in range(size):
                out = self.ctx.socket(zmq.PUSH)
                out.setsockopt(zmq.LINGER, 0)
                wport = out.bind_to_random_port("tcp://127.0.0.1")
                spec = WorkerSpec(
                    role=role,
                    rank=rank,
                    size=size,
                    model=model,
                    page_size=o.page_size,
                    num_pages=o.num_pages,
                    block_tokens=block_tokens,
                    names=names,
                    consensus_endpoints=eps,
                    gloo_port=gport,
                    to_worker=f"tcp://127.0.0.1:{wport}",
                    to_driver=self.to_driver,
                    bootstrap=self.server.endpoint,
                    chunk_size=o.chunk_size,
                    pack_region_tokens=o.pack_region_tokens,
                    timeout_s=o.timeout_s,
                    max_dst_dcp=max(8, o.decode_dcp),
                    profile=o.profile,
                    log_path=os.path.join(self.log_dir, f"{role}{rank}.log")
                    if self.log_dir
                    else "",
                    wire=self.wire,
                    device=o.device,
                )
                p = ctx.Process(
                    target=target,
                    args=(msgspec.msgpack.encode(spec),),
                    name=f"pdplug-{role}-{rank}",
                    daemon=True,
                )
                p.start()
                self.procs[(role, rank)] = p
                self.outs[(role, rank)] = out

    def send(self, key: tuple[str, int], msg: Any) -> None:
        # Never block the driver on a worker that is gone (its exit is reported by
        # check_alive); a late message to an exiting worker is simply dropped.
        try:
            self.outs[key].send(self.tx.encode(msg), zmq.NOBLOCK)
        except zmq.Again:
            log.debug("driver: %s %d is not receiving; dropped %s", *key, type(msg).__name__)

    def broadcast(self, msg: Any, role: str | None = None) -> None:
        for key in self.outs:
            if role is None or key[0] == role:
                self.send(key, msg)

    def at_prefill(self) -> set[int]:
        """Requests routed to the prefill whose prompt is not computed yet."""
        return self.routed - self.prefilled - set(self.failed) - set(self.finished)

    def route(self) -> None:
        """Send waiting requests (arrival order) to the prefill while it has a free slot."""
        while self.waiting_slot and len(self.at_prefill()) < self.prefill_slots:
            rid = next(iter(self.waiting_slot))
            req = self.waiting_slot.pop(rid)
            self.routed.add(rid)
            self.broadcast(Route(rid=rid), role="decode")
            self.broadcast(req, role="prefill")

    def logs_hint(self) -> str:
        return f" (worker logs: {self.log_dir})" if self.log_dir else ""

    def in_flight(self) -> list[int]:
        return sorted(set(self.sent_at) - set(self.finished) - set(self.failed))

    def check_alive(self) -> None:
        for (role, rank), p in self.procs.items():
            if p.exitcode is not None and not (self.stopping and p.exitcode == 0):
                raise DemoError(
                    f"{role} rank {rank} (pid {p.pid}) exited with code {p.exitcode}; "
                    f"rooms failed (in flight): {self.in_flight()}{self.logs_hint()}"
                )

    stopping = False

    def pump(self, timeout_ms: int = 5) -> None:
        """Receive and dispatch worker messages for up to ``timeout_ms``."""
        if not self.inbox.poll(timeout_ms):
            return
        while True:
            try:
                frame = self.inbox.recv(zmq.NOBLOCK)
            except zmq.Again:
                return
            msg = self.rx.decode(frame)
            if isinstance(msg, Ready):
                self.ready[(msg.role, msg.rank)] = msg
            elif isinstance(msg, Leased):
                req = self.waiting_pages.pop(msg.rid, None)
                if req is not None:
                    self.waiting_slot[msg.rid] = req
            elif isinstance(msg, FirstToken):
                self.prefilled.add(msg.rid)
                self.broadcast(msg, role="decode")
            elif isinstance(msg, Finished):
                self.finished[msg.rid] = list(msg.tokens)
            elif isinstance(msg, Timing):
                self.timings.setdefault(msg.rid, []).append(msg)
            elif isinstance(msg, RequestFailed):
                self.failed.setdefault(msg.rid, f"{msg.role} rank {msg.rank}: {msg.reason}")
                self.waiting_pages.pop(msg.rid, None)
                self.waiting_slot.pop(msg.rid, None)
            elif isinstance(msg, WorkerStats):
                self.stats[(msg.role, msg.rank)] = msg.stats
            elif isinstance(msg, Fatal):
                # A peer's death often surfaces first as a collective error on a survivor:
                # name the dead rank (the cause) when one exits within a short grace period.
                consequence = f"; then {msg.role} rank {msg.rank} failed: {msg.message}"
                deadline = time.monotonic() + 2.0
                while time.monotonic() < deadline:
                    dead = [
                        (k, p)
                        for k, p in self.procs.items()
                        if p.exitcode not in (None, 0) and k != (msg.role, msg.rank)
                    ]
                    if dead:
                        (role, rank), p = dead[0]
                        raise DemoError(
                            f"{role} rank {rank} (pid {p.pid}) exited with code {p.exitcode}"
                            f"{consequence}; rooms failed (in flight): {self.in_flight()}"
                            f"{self.logs_hint()}"
                        )
                    time.sleep(0.05)
                raise DemoError(
                    f"{msg.role} rank {msg.rank} failed: {msg.message}; rooms failed "
                    f"(in flight): {self.in_flight()}{self.logs_hint()}"
                )

    def close(self) -> None:
        for p in self.procs.values():
            if p.is_alive():
                p.terminate()
        for p in self.procs.values():
            p.join(timeout=5)
            if p.is_alive():
                p.kill()
        for s in self.outs.values():
            s.close(linger=0)
        self.inbox.close(linger=0)
        self.server.stop()


def _start_reference(
    opts: DemoOptions, requests: list[TraceRequest], progress: Progress | None
) -> Future[dict[int, list[int]]] | None:
    """The single-process reference run, on a thread while the workers start up."""
    if not opts.reference:
        return None
    from pdplug_host.reference import reference_run

    fut: Future[dict[int, list[int]]] = Future()
    cancel = threading.Event()
    total = len(requests)
    done = [0]

    def tick(_rid: int) -> None:
        if cancel.is_set():
            raise _ReferenceCancelled
        done[0] += 1
        if progress:
            progress("reference", done[0], total, "")

    def body() -> None:
        try:
            fut.set_result(reference_run(requests, page_size=opts.page_size, progress=tick))
        except BaseException as e:  # surfaced by fut.result() in run_demo
            fut.set_exception(e)

    if progress:
        progress("reference", 0, total, "")
    # not a daemon: interpreter exit while torch runs on a daemon thread aborts the process
    # (SIGABRT); a failed demo cancels it at the next finished request and joins it
    thread = threading.Thread(target=body, name="pdplug-reference")
    thread.start()
    _REFERENCES[id(fut)] = (thread, cancel)
    return fut


class _ReferenceCancelled(Exception):
    """The demo ended before its reference run: stop it at the next finished request."""


#: the reference thread and its cancel flag of each running demo, by id of its future
_REFERENCES: dict[int, tuple[threading.Thread, threading.Event]] = {}


def _stop_reference(fut: Future[dict[int, list[int]]] | None) -> None:
    thread, cancel = _REFERENCES.pop(id(fut), (None, None))
    if thread is not None and cancel is not None:
        cancel.set()
        thread.join()


def _open_requests(
    run: _Run, order: list[TraceRequest], i: int, t0: float, opts: DemoOptions
) -> str:
    """Where the unfinished requests are, for the run-timeout message."""
    done = set(run.finished) | set(run.failed)
    parts = []
    for what, rids in (
        ("waiting for decode pages", run.waiting_pages),
        ("waiting for a prefill slot", run.waiting_slot),
        ("in prefill", run.at_prefill()),
        ("in transfer or decode", run.prefilled - done),
    ):
        if rids:
            parts.append(f"{what}: {sorted(rids)}")
    if i < len(order):
        due = (order[i].arrival_ms - order[0].arrival_ms) * opts.time_scale / 1000.0
        parts.append(
            f"{len(order) - i} not yet arrived (next due at {due:.0f} s, {time.time() - t0:.0f} s "
            f"into the replay; --time-scale {opts.time_scale:g})"
        )
    return "; ".join(parts) or "none open"


def run_demo(
    opts: DemoOptions,
    progress: Progress | None = None,
    on_ready: Callable[[dict[tuple[str, int], int]], None] | None = None,
) -> dict[str, Any]:
    """Run the reference host once; returns the report (see ``pdplug demo --json``).

    Every option is checked first (:func:`check_options`, :func:`pdplug_host.options.
    check_schedule`); requests that can never fit the KV cache are refused alone (reported as
    failed, never sent) with a ``warning`` log line. The reference run computes on a thread
    while the workers start. A request goes to the decode ranks at its arrival and to the
    prefill ranks once every decode rank holds pages for it and the prefill has a free slot (at
    most ``prefill_pp + 1`` requests not yet prefilled there): requests queue before their KV
    sessions start, so transfer timeouts bound silence, not queueing.

    :param progress: called as ``progress(phase, done, total, note)`` (see :data:`Progress`).
    :param on_ready: called once every worker is up, with ``{(role, rank): pid}`` (fault
        injection in tests, external monitoring).
    :raises DemoError: a refused option or trace, a worker that died or reported a fatal
        error, or a run past ``run_timeout_s``; the message names the role, rank and the rooms
        in flight, or where each open request waits.
    """
    check_options(opts)
    requests = load_requests(opts)
    if progress:
        name = os.path.basename(opts.trace) if opts.trace else "the bundled trace sample"
        progress("load", len(requests), len(requests), name)
    check_schedule(opts, requests)
    refused = refuse(opts, requests)
    need_torch()
    run = _Run(opts, requests)
    t_start = time.time()
    report: dict[str, Any] = {}
    clean = False
    ref_future: Future[dict[int, list[int]]] | None = None
    try:
        run.spawn()
        ref_future = _start_reference(opts, [r for r in requests if r.rid not in refused], progress)
        startup_s = max(120.0, opts.timeout_s * 4)
        deadline = time.monotonic() + startup_s
        n_procs = len(run.procs)
        if progress:
            progress("start", 0, n_procs, "")
        while len(run.ready) < n_procs:
            run.pump(20)
            run.check_alive()
            if progress:
                progress("start", len(run.ready), n_procs, "")
            if time.monotonic() > deadline:
                missing = sorted(set(run.procs) - set(run.ready))
                raise DemoError(
                    f"workers not ready {startup_s:.0f} s after start (4 x --timeout, at least "
                    f"120 s): {missing}{run.logs_hint()}"
                )
        reference: dict[int, list[int]] | None = None
        if ref_future is not None:
            try:  # the thread reported every request to progress
                reference = ref_future.result()
            except Exception as e:
                raise DemoError(f"the reference run failed: {type(e).__name__}: {e}") from e
        if on_ready:
            on_ready({k: p.pid for k, p in run.procs.items() if p.pid is not None})
        for rid, why in refused.items():
            run.failed[rid] = f"refused: {why}"
        t0 = time.time()
        order = sorted((r for r in requests if r.rid not in refused), key=lambda r: r.arrival_ms)
        base_ms = order[0].arrival_ms if order else 0.0
        i = 0
        deadline = time.monotonic() + opts.run_timeout_s
        total = len(requests)
        while len(run.finished) + len(run.failed) < total:
            now = time.time()
            while i < len(order) and (
                opts.time_scale <= 0
                or (order[i].arrival_ms - base_ms) * opts.time_scale / 1000.0 <= now - t0
            ):
                r = order[i]
                msg = NewRequest(
                    rid=r.rid,
                    tokens=pages_to_bytes(prompt_tokens(r)),
                    output_len=r.output_len,
                    chain=tuple(block_hash_chain(r)),
                    arrival=time.time(),
                )
                run.sent_at[r.rid] = msg.arrival
                run.waiting_pages[r.rid] = msg
                run.broadcast(msg, role="decode")
                i += 1
            run.pump(5)
            run.route()
            run.check_alive()
            if progress:
                ended = len(run.finished) + len(run.failed)
                note = ""
                if i < len(order) and len(run.sent_at) + len(refused) == ended:
                    due = (order[i].arrival_ms - base_ms) * opts.time_scale / 1000.0
                    note = f"next arrival in {max(0.0, due - (time.time() - t0)):.0f} s"
                elif run.waiting_pages:
                    note = f"{len(run.waiting_pages)} waiting for decode pages"
                elif run.waiting_slot:
                    note = f"{len(run.waiting_slot)} waiting for a prefill slot"
                progress("replay", ended, total, note)
            if time.monotonic() > deadline:
                raise DemoError(
                    f"the replay did not finish within --run-timeout {opts.run_timeout_s:g} s: "
                    f"{len(run.finished)} of {total} requests finished, {len(run.failed)} failed; "
                    f"{_open_requests(run, order, i, t0, opts)}{run.logs_hint()}"
                )
        t_end = time.time()
        run.stopping = True
        run.broadcast(Shutdown())
        deadline = time.monotonic() + opts.timeout_s
        while len(run.stats) < len(run.procs) and time.monotonic() < deadline:
            run.pump(20)
        report = build_report(
            opts,
            requests,
            RunRecord(
                finished=run.finished,
                failed=run.failed,
                timings=run.timings,
                sent_at=run.sent_at,
                stats=run.stats,
                served_by=next(iter(run.ready.values())).served_by if run.ready else {},
                log_dir=run.log_dir,
            ),
            reference,
            t_end - t0,
            t_end - t_start,
        )
        report["refused"] = sorted(refused)
        clean = all(m["rid"] in refused for m in report["mismatches"])
    except KeyboardInterrupt:
        if run.log_dir:  # kept after a failure: say where (the CLI prints only "Aborted!")
            sys.stderr.write(f"pdplug demo: interrupted; worker logs kept in {run.log_dir}\n")
        raise
    finally:
        _stop_reference(ref_future)
        run.close()
        if run.temp_logs and clean and not opts.keep_logs and run.log_dir:
            shutil.rmtree(run.log_dir, ignore_errors=True)
            report["worker_logs"] = None
    return report
