"""One request's life on both engines, for every transfer backend: timestamps per room.

With ``PDPLUG_SGLANG_REQTRACE_DIR`` set, the harness's SGLang plugin
(:mod:`pdplug_sglang.cpu_patches`) calls :func:`install` in every engine process: it wraps the
scheduler's request intake and forward (``Scheduler.handle_generate_request``,
``Scheduler.run_batch``) and the per-request calls of the transfer classes of SGLang's
``mooncake`` and ``nixl`` backends and of pdplug's (``__init__``, ``init``, ``send``,
``send_metadata``, ``poll``, ``clear``), and pdplug's room tables (the moment a plane's room
changed status, on whichever thread changed it). Each process appends JSON lines to
``<dir>/reqtrace-<pid>.jsonl``: ``{"room", "side" ("P"/"D"), "pp", "ev", "t" (time.time()
seconds), "dur" (seconds the call took on SGLang's scheduler thread)}``; a ``poll`` is written
only when its answer changes (with the time SGLang's polls of that request took so far, and
how many there were).

:func:`summarise` reads a run's folder and gives, per phase, the median over rooms of the time
from the decode's intake of the request. Bench-only: nothing here is on by default, and
nothing in it is about pdplug's own code paths beyond observing them.
"""

from __future__ import annotations

import functools
import json
import os
import statistics
import threading
import time
from collections import defaultdict
from collections.abc import Callable
from pathlib import Path
from typing import Any

__all__ = ["ENV", "install", "summarise", "PHASES"]

ENV = "PDPLUG_SGLANG_REQTRACE_DIR"

_out: Any = None
_lock = threading.Lock()
_side = "?"
_pp = 0
_installed = False


def _write(room: Any, ev: str, t: float, dur: float = 0.0, **extra: Any) -> None:
    if _out is None or room is None:
        return
    doc = {"room": int(room), "side": _side, "pp": _pp, "ev": ev, "t": t, "dur": dur}
    doc.update(extra)
    line = json.dumps(doc) + "\n"
    with _lock:
        _out.write(line)


def _timed(ev: str, room_of: Callable[..., Any]) -> Callable[[Callable[..., Any]], Any]:
    def deco(fn: Callable[..., Any]) -> Callable[..., Any]:
        @functools.wraps(fn)
        def w(self: Any, *a: Any, **kw: Any) -> Any:
            t0 = time.time()
            p0 = time.perf_counter()
            try:
                return fn(self, *a, **kw)
            finally:
                _write(room_of(self, *a, **kw), ev, t0, time.perf_counter() - p0)

        return w

    return deco


def _late(cls: Any, name: str) -> Callable[..., Any]:
    """``cls.name`` as it is when called: an inherited method is looked up on the base class
    at each call, so a hook SGLang's ``HookRegistry`` applies to the base later (the harness's
    own bootstrap trace on ``CommonKVSender.init``) still runs."""
    own = cls.__dict__.get(name)
    if own is not None:
        return own  # type: ignore[no-any-return]

    def inherited(self: Any, *a: Any, **kw: Any) -> Any:
        return getattr(super(cls, self), name)(*a, **kw)

    inherited.__name__ = name
    return inherited


def _room(self: Any, *a: Any, **kw: Any) -> Any:
    return getattr(self, "bootstrap_room", None)


def _wrap_transfer(cls: Any, side: str) -> None:
    if getattr(cls, "_reqtrace", False):
        return
    cls._reqtrace = True
    init = _late(cls, "__init__")

    @functools.wraps(init)
    def new(self: Any, *a: Any, **kw: Any) -> None:
        global _side
        _side = side
        t0 = time.time()
        p0 = time.perf_counter()
        init(self, *a, **kw)
        self._rt_poll = [None, 0.0, 0]
        _write(_room(self), "new", t0, time.perf_counter() - p0)

    cls.__init__ = new
    names = ["init", "clear", "abort"]
    names += ["send"] if side == "P" else ["send_metadata"]
    for name in names:
        if hasattr(cls, name):
            setattr(cls, name, _timed(name, _room)(_late(cls, name)))
    poll = _late(cls, "poll")

    @functools.wraps(poll)
    def polled(self: Any) -> Any:
        p0 = time.perf_counter()
        r = poll(self)
        st = getattr(self, "_rt_poll", None)
        if st is None:
            st = self._rt_poll = [None, 0.0, 0]
        st[1] += time.perf_counter() - p0
        st[2] += 1
        if r != st[0]:
            st[0] = r
            name = getattr(r, "name", None) or str(int(r))
            _write(_room(self), f"poll:{name}", time.time(), st[1], polls=st[2])
        return r

    cls.poll = polled


def _wrap_rooms() -> None:
    from pdplug.rooms import Rooms

    if getattr(Rooms, "_reqtrace", False):
        return
    setattr(Rooms, "_reqtrace", True)  # noqa: B010  (a marker on a class we do not own)

    def after(name: str) -> None:
        fn = getattr(Rooms, name)

        @functools.wraps(fn)
        def w(self: Any, room: int, *a: Any, **kw: Any) -> Any:
            before = self._rooms.get(room)
            s0 = None if before is None else before.status
            r = fn(self, room, *a, **kw)
            now = self._rooms.get(room)
            s1 = None if now is None else now.status
            if s1 is not None and s1 != s0:
                plane = getattr(self, "_rt_plane", "?")
                _write(room, f"room:{plane}:{s1.name}", time.time(),
                       thread=threading.current_thread().name)  # fmt: skip
            return r

        setattr(Rooms, name, w)

    for name in ("lease", "advance", "fail", "begin_send", "done_pending"):
        after(name)


def _wrap_scheduler() -> None:
    from sglang.srt.managers.scheduler import Scheduler

    if getattr(Scheduler, "_reqtrace", False):
        return
    Scheduler._reqtrace = True
    handle = Scheduler.handle_generate_request

    @functools.wraps(handle)
    def arrive(self: Any, recv_req: Any, *a: Any, **kw: Any) -> Any:
        _where(self)
        t0 = time.time()
        p0 = time.perf_counter()
        try:
            return handle(self, recv_req, *a, **kw)
        finally:
            _write(getattr(recv_req, "bootstrap_room", None), "arrive", t0,
                   time.perf_counter() - p0)  # fmt: skip

    Scheduler.handle_generate_request = arrive
    run = Scheduler.run_batch
    seen: set[tuple[int, str]] = set()

    @functools.wraps(run)
    def batch(self: Any, b: Any, *a: Any, **kw: Any) -> Any:
        _where(self)
        t0 = time.time()
        p0 = time.perf_counter()
        try:
            return run(self, b, *a, **kw)
        finally:
            dur = time.perf_counter() - p0
            mode = getattr(getattr(b, "forward_mode", None), "name", "?")
            reqs = getattr(b, "reqs", None) or []
            for req in reqs:
                room = getattr(req, "bootstrap_room", None)
                if room is None:
                    continue
                key = (int(room), mode)
                if mode == "DECODE" and key in seen:
                    continue
                seen.add(key)
                _write(room, f"fwd:{mode}", t0, dur, batch=len(reqs))

    Scheduler.run_batch = batch


def _where(sched: Any) -> None:
    global _side, _pp
    mode = getattr(getattr(sched, "disaggregation_mode", None), "name", "")
    _side = {"PREFILL": "P", "DECODE": "D"}.get(mode, _side)
    _pp = int(getattr(sched, "pp_rank", 0) or 0)


def install() -> None:
    """Wrap what this process has of the above (once); a no-op unless :data:`ENV` is set."""
    global _out, _installed
    d = os.environ.get(ENV, "")
    if not d or _installed:
        return
    _installed = True
    Path(d).mkdir(parents=True, exist_ok=True)
    _out = open(Path(d) / f"reqtrace-{os.getpid()}.jsonl", "a", buffering=1)  # noqa: SIM115
    _wrap_scheduler()
    try:
        _wrap_rooms()
        from pdplug.adapters.sglang import conn as pd

        _wrap_transfer(pd.PdplugKVSender, "P")
        _wrap_transfer(pd.PdplugKVReceiver, "D")
        mgr_init = pd.PdplugKVManager.__init__

        @functools.wraps(mgr_init)
        def named(self: Any, *a: Any, **kw: Any) -> None:
            mgr_init(self, *a, **kw)
            for name, s in self.sessions.items():
                s.rooms._rt_plane = name

        setattr(pd.PdplugKVManager, "__init__", named)  # noqa: B010
    except Exception:  # pdplug's backend not importable here: SGLang's own are still traced
        pass
    for mod, snd, rcv in (
        ("sglang.srt.disaggregation.mooncake.conn", "MooncakeKVSender", "MooncakeKVReceiver"),
        ("sglang.srt.disaggregation.nixl.conn", "NixlKVSender", "NixlKVReceiver"),
    ):
        try:
            import importlib

            m = importlib.import_module(mod)
            _wrap_transfer(getattr(m, snd), "P")
            _wrap_transfer(getattr(m, rcv), "D")
        except Exception:
            continue


#: (label, side, event) in the order of a request's life; ``pp`` -1: the last PP rank's
PHASES = (
    ("decode intake", "D", "arrive"),
    ("decode receiver built", "D", "new"),
    ("decode receiver init", "D", "init"),
    ("decode sees WaitingForInput", "D", "poll:WaitingForInput"),
    ("decode send_metadata", "D", "send_metadata"),
    ("prefill intake", "P", "arrive"),
    ("prefill sender built", "P", "new"),
    ("prefill sees WaitingForInput", "P", "poll:WaitingForInput"),
    ("prefill sender init", "P", "init"),
    ("prefill forward start", "P", "fwd:EXTEND"),
    ("prefill first send", "P", "send"),
    ("prefill sees Transferring", "P", "poll:Transferring"),
    ("prefill sees Success", "P", "poll:Success"),
    ("decode sees Transferring", "D", "poll:Transferring"),
    ("decode sees Success", "D", "poll:Success"),
    ("decode receiver clear", "D", "clear"),
    ("decode prebuilt forward", "D", "fwd:PREBUILT"),
    ("decode first decode forward", "D", "fwd:DECODE"),
)


def _load(directory: str | Path) -> dict[int, list[dict[str, Any]]]:
    rooms: dict[int, list[dict[str, Any]]] = defaultdict(list)
    for f in Path(directory).glob("reqtrace-*.jsonl"):
        for line in f.read_text().splitlines():
            try:
                ev = json.loads(line)
            except json.JSONDecodeError:
                continue
            rooms[int(ev["room"])].append(ev)
    return rooms


def summarise(directory: str | Path, since: float = 0.0) -> dict[str, Any]:
    """Per phase of :data:`PHASES` and per pdplug room-table change: the median and max over
    rooms of the time from the decode's intake (ms), and the median duration of the call on
    SGLang's thread (ms); plus the number of rooms. Rooms the warm-up made (no decode intake)
    are left out, and so are rooms whose decode intake came before ``since`` (``time.time()``
    seconds)."""
    rooms = _load(directory)
    t_rel: dict[str, list[float]] = defaultdict(list)
    durs: dict[str, list[float]] = defaultdict(list)
    sums: dict[str, list[float]] = defaultdict(list)
    n = 0
    for evs in rooms.values():
        base = [e["t"] for e in evs if e["side"] == "D" and e["ev"] == "arrive"]
        if not base or min(base) < since:
            continue
        n += 1
        t0 = min(base)
        first: dict[str, dict[str, Any]] = {}
        per_call: dict[str, float] = defaultdict(float)
        for e in sorted(evs, key=lambda e: e["t"]):
            key = f"{e['side']}:{e['ev']}"
            if e["ev"].startswith("room:"):
                key = f"{e['side']}:{e['ev']}"
            if e["ev"] == "send" or e["ev"].startswith("fwd:"):
                per_call[key] += e["dur"]
            first.setdefault(key, e)
            if e["ev"].startswith("poll:"):
                # the last one: its cumulative poll time is the request's total
                sums[key].append(e["dur"] * 1e3)
        for key, e in first.items():
            t_rel[key].append((e["t"] - t0) * 1e3)
            durs[key].append(per_call.get(key, e["dur"]) * 1e3)
    out: dict[str, Any] = {"rooms": n, "phases": []}
    keys = [f"{s}:{ev}" for _l, s, ev in PHASES]
    extra = sorted(k for k in t_rel if k not in keys)
    labels = {f"{s}:{ev}": label for label, s, ev in PHASES}
    for key in [k for k in keys if k in t_rel] + extra:
        v = t_rel[key]
        out["phases"].append(
            {
                "phase": labels.get(key, key),
                "key": key,
                "n": len(v),
                "at_ms_p50": statistics.median(v),
                "at_ms_max": max(v),
                "call_ms_p50": statistics.median(durs[key]),
                "poll_ms_p50": statistics.median(sums[key]) if key in sums else None,
            }
        )
    out["phases"].sort(key=lambda p: p["at_ms_p50"])
    return out


def main() -> None:  # python -m pdplug_sglang.reqtrace DIR
    import sys

    res = summarise(sys.argv[1], float(sys.argv[2]) if len(sys.argv) > 2 else 0.0)
    print(f"{res['rooms']} rooms (ms from the decode's intake; median, max; call ms p50)")
    for p in res["phases"]:
        poll = "" if p["poll_ms_p50"] is None else f"  polls so far {p['poll_ms_p50']:.2f} ms"
        print(
            f"  {p['phase']:<44} {p['at_ms_p50']:9.1f} {p['at_ms_max']:9.1f}  "
            f"call {p['call_ms_p50']:7.2f}{poll}  (n={p['n']})"
        )


if __name__ == "__main__":
    main()
