"""The failure phases of a parity run: injected write failures, a killed decode, leak checks.

Each phase runs on engines :func:`pdplug_vllm.parity.run_parity` already started (engine
start-up dominates on CPU):

* :func:`fault_phase`: prefill writes fail (test-only switch file, see
  :func:`pdplug.transfer.faults.inject_from_env`) while requests run through a decode engine
  with a given ``kv_load_failure_policy``: ``recompute`` must still answer every request with
  the single engine's tokens, ``fail`` must end exactly the requests whose room failed;
* :func:`kill_decode_mid_run`: the decode engine is SIGKILLed while requests run;
* :func:`restart_prefill`: the prefill engine is SIGKILLed and started again, and the next
  requests must find it with the decode engine untouched;
* :func:`wait_idle`: afterwards an engine holds no KV block (``delay_free`` blocks included),
  runs and queues no request and, on the prefill engine, every pdplug room a rank started has
  been reported ended (``vllm:pdplug_rooms_started_total`` equals succeeded plus failed).
"""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Callable, Sequence
from pathlib import Path

import msgspec

from pdplug.transfer.faults import HOLD
from pdplug_engines.holds import hold_ranks
from pdplug_engines.metrics import scrape
from pdplug_engines.procs import Engine
from pdplug_engines.tokens import Completion, RequestFailed
from pdplug_vllm.client import complete_all

__all__ = [
    "FaultResult",
    "IdleResult",
    "KillResult",
    "ROOM_METRICS",
    "RestartResult",
    "fault_phase",
    "hold_ranks",
    "kill_decode_mid_run",
    "restart_prefill",
    "wait_idle",
]

#: engine gauges that are all 0 on an engine that holds nothing
IDLE_METRICS = (
    "vllm:kv_cache_usage_perc",
    "vllm:num_requests_running",
    "vllm:num_requests_waiting",
)
#: prefill counters: started == succeeded + failed when no room is left on any rank
ROOM_METRICS = (
    "vllm:pdplug_rooms_started_total",
    "vllm:pdplug_rooms_succeeded_total",
    "vllm:pdplug_rooms_failed_total",
)


class IdleResult(msgspec.Struct, frozen=True, kw_only=True):
    """Whether an engine ended with nothing held.

    :ivar idle: every :data:`IDLE_METRICS` gauge read 0 (and, with rooms, no room left).
    :ivar waited_s: seconds until it did (or the bound, when it did not).
    :ivar metrics: the last values read (gauges; room counters when checked).
    """

    idle: bool
    waited_s: float
    metrics: dict[str, float]


def wait_idle(url: str, *, rooms: bool = False, timeout_s: float = 90.0) -> IdleResult:
    """Poll ``url/metrics`` every 0.5 s until the engine holds no KV block and no request
    (and, with ``rooms``, every pdplug room started was reported ended), at most
    ``timeout_s`` seconds.

    Blocks held for a push (``delay_free``) count in ``vllm:kv_cache_usage_perc`` until the
    workers report the room drained, so a room whose blocks are never released keeps it
    above 0: this is the leak check. vLLM updates the gauges with every engine step (and
    steps while a connector has pending push work).
    """
    names = IDLE_METRICS + (ROOM_METRICS if rooms else ())
    t0 = time.monotonic()
    while True:
        m = scrape(url, names)
        left = m[ROOM_METRICS[0]] - m[ROOM_METRICS[1]] - m[ROOM_METRICS[2]] if rooms else 0.0
        idle = not any(m[n] for n in IDLE_METRICS) and left == 0
        waited = time.monotonic() - t0
        if idle or waited > timeout_s:
            return IdleResult(idle=idle, waited_s=waited, metrics=m)
        time.sleep(0.5)


class FaultResult(msgspec.Struct, frozen=True, kw_only=True):
    """Requests run while prefill writes failed (every ``every``-th write).

    :ivar policy: the decode engine's ``kv_load_failure_policy``.
    :ivar requests/completed/identical: sent, answered, answered with the single engine's
        tokens; ``failed``: ended with an error (index, reason; first 3 reasons).
    :ivar rooms_failed: prefill rooms that failed during the phase (counter delta).
    :ivar writes_every: every this many writes failed.
    :ivar ended_s: seconds the phase's requests took (each is bounded).
    :ivar prefill_idle/decode_idle: :func:`wait_idle` of both engines afterwards.
    """

    policy: str
    requests: int
    completed: int
    identical: int
    failed: int
    reasons: list[str]
    rooms_failed: int
    writes_every: int
    ended_s: float
    prefill_idle: IdleResult
    decode_idle: IdleResult


def fault_phase(
    url: str,
    prompts: Sequence[Sequence[int]],
    refs: Sequence[Completion | RequestFailed],
    max_tokens: int,
    *,
    policy: str,
    prefill_url: str,
    decode_url: str,
    switch: str | Path,
    every: int = 2,
    timeout_s: float = 120.0,
    idle_timeout_s: float = 60.0,
) -> FaultResult:
    """Run ``prompts`` through the proxy at ``url`` while every ``every``-th prefill write
    fails (the prefill engine was started with ``PDPLUG_TEST_FAIL_WRITES=switch``).

    :param refs: the single engine's answers to ``prompts``.
    :param policy: the decode engine's ``kv_load_failure_policy`` (reported, not set here).
    :param timeout_s: bound of one request (seconds).
    :param idle_timeout_s: bound of each :func:`wait_idle` (seconds; a failed room ends at
        once, a leaked one never).
    """
    before = wait_idle(prefill_url, rooms=True, timeout_s=idle_timeout_s).metrics
    Path(switch).write_text(str(every))
    try:
        t0 = time.monotonic()
        got = complete_all(url, prompts, max_tokens, concurrency=len(prompts), timeout_s=timeout_s)
        ended_s = time.monotonic() - t0
    finally:
        os.unlink(switch)
    p_idle = wait_idle(prefill_url, rooms=True, timeout_s=idle_timeout_s)
    d_idle = wait_idle(decode_url, timeout_s=idle_timeout_s)
    ok = [r for r in got if isinstance(r, Completion)]
    want = {r.index: r.tokens for r in refs if isinstance(r, Completion)}
    identical = sum(want.get(r.index) == r.tokens for r in ok)
    reasons = sorted({r.reason[:120] for r in got if isinstance(r, RequestFailed)})
    failed_key = ROOM_METRICS[2]
    return FaultResult(
        policy=policy,
        requests=len(prompts),
        completed=len(ok),
        identical=identical,
        failed=len(got) - len(ok),
        reasons=reasons[:3],
        rooms_failed=int(p_idle.metrics[failed_key] - before[failed_key]),
        writes_every=every,
        ended_s=ended_s,
        prefill_idle=p_idle,
        decode_idle=d_idle,
    )


class KillResult(msgspec.Struct, frozen=True, kw_only=True):
    """The decode engine killed while requests run through the proxy.

    :ivar requests: requests sent; ``completed``/``failed``: how each ended.
    :ivar ended_s: seconds from the kill until the last request ended (bounded: no hang).
    :ivar prefill_healthy: the prefill engine still answered ``/health`` afterwards.
    :ivar reasons: distinct failure reasons seen (first 3).
    :ivar held_at_kill: pdplug rooms the prefill ranks held when the decode was killed (-1: the
        prefill engine has no pdplug room counters, another connector).
    :ivar prefill_idle: :func:`wait_idle` of the prefill engine afterwards (rooms checked):
        every block it held for the dead decode was released.
    :ivar hold_ranks: prefill workers whose KV sender installed the write hold
        (:func:`hold_ranks`; -1: no hold asked); ``prefill_workers``: the prefill engine's
        workers (PP x TP). Under a hold that every worker installed no request can be answered
        before the kill.
    """

    requests: int
    completed: int
    failed: int
    ended_s: float
    prefill_healthy: bool
    reasons: list[str]
    held_at_kill: int = -1
    prefill_idle: IdleResult | None = None
    hold_ranks: int = -1
    prefill_workers: int = 1


def _workers(engine: Engine) -> int:
    # an EngineSpec's PP x TP (any other launch spec: one worker)
    return int(getattr(engine.spec, "world_size", 1))


def _kill_while_rooms_live(
    url: str,
    prompts: Sequence[Sequence[int]],
    max_tokens: int,
    p_url: str,
    victim: Engine,
    *,
    timeout_s: float,
    rooms: bool,
    kill_after_s: float = 1.0,
    hold_switch: str | Path | None = None,
    after_kill: Callable[[], None] | None = None,
) -> tuple[list[Completion | RequestFailed], int, float]:
    """Send ``prompts`` through the proxy at ``url`` (all at once) and SIGKILL ``victim``'s
    process group once the prefill engine at ``p_url`` holds rooms of them (``rooms``; polled,
    at most 30 s) or ``kill_after_s`` later; ``hold_switch`` holds the prefill's writes from
    before the requests until just after the kill (:func:`kill_decode_mid_run`);
    ``after_kill`` runs then, while the requests are still ending.

    :returns: the answers (every request ended, or the list is short), the rooms the prefill
        held at the kill (-1 without ``rooms``), seconds from the kill until the last ended.
    """
    started = scrape(p_url, ROOM_METRICS)[ROOM_METRICS[0]] if rooms else 0.0
    if hold_switch is not None:
        Path(hold_switch).write_text(HOLD)
    box: list[list[Completion | RequestFailed]] = []
    t = threading.Thread(
        target=lambda: box.append(
            complete_all(url, prompts, max_tokens, concurrency=len(prompts), timeout_s=timeout_s)
        ),
        daemon=True,
    )
    t.start()
    held = -1
    try:
        if rooms:  # kill while rooms are live on the prefill side, whatever the host's load
            deadline = time.monotonic() + 30.0
            while time.monotonic() < deadline:
                m = scrape(p_url, ROOM_METRICS)
                if m[ROOM_METRICS[0]] > started:
                    held = int(m[ROOM_METRICS[0]] - m[ROOM_METRICS[1]] - m[ROOM_METRICS[2]])
                    if held > 0:  # rooms of this run live on the prefill now: kill
                        break
                time.sleep(0.05)
        else:
            time.sleep(kill_after_s)
        victim.kill()
    finally:
        if hold_switch is not None:
            Path(hold_switch).unlink(missing_ok=True)
    killed = time.monotonic()
    if after_kill is not None:
        after_kill()
    t.join(timeout_s + 10.0)
    return (box[0] if box else []), held, time.monotonic() - killed


def kill_decode_mid_run(
    url: str,
    prompts: Sequence[Sequence[int]],
    max_tokens: int,
    prefill: Engine,
    decode: Engine,
    *,
    timeout_s: float = 120.0,
    kill_after_s: float = 1.0,
    idle_timeout_s: float = 90.0,
    rooms: bool = True,
    hold_switch: str | Path | None = None,
) -> KillResult:
    """Send ``prompts`` through the proxy at ``url`` and SIGKILL the decode engine's process
    group once the prefill engine holds rooms of them (``rooms``: started and not yet ended;
    polled, at most 30 s), or
    ``kill_after_s`` seconds later (without ``rooms``); every request must end (answered or
    failed) within ``timeout_s``, the prefill engine must stay healthy and then (``rooms``)
    release everything it held within ``idle_timeout_s``.

    :param rooms: the prefill engine reports pdplug's room counters (PdplugConnector).
    :param hold_switch: the prefill engine's ``PDPLUG_TEST_FAIL_WRITES`` switch file: it holds
        every write (:data:`~pdplug.transfer.faults.HOLD`) from before the requests until just
        after the kill, so the kill lands while rooms are live however fast the host is (a fast
        CI machine had ended every room between two polls); then the held writes go to a dead
        peer. The result says how many prefill workers installed it (``hold_ranks``).
    """
    import httpx

    p_url = prefill.spec.url
    res, held, ended_s = _kill_while_rooms_live(
        url, prompts, max_tokens, p_url, decode, timeout_s=timeout_s, rooms=rooms,
        kill_after_s=kill_after_s, hold_switch=hold_switch,
    )  # fmt: skip
    reasons = sorted({r.reason[:120] for r in res if isinstance(r, RequestFailed)})
    try:
        healthy = httpx.get(p_url + "/health", timeout=10.0).status_code == 200
    except httpx.HTTPError:
        healthy = False
    return KillResult(
        requests=len(prompts),
        completed=sum(isinstance(r, Completion) for r in res),
        failed=sum(isinstance(r, RequestFailed) for r in res),
        ended_s=ended_s,
        prefill_healthy=healthy,
        reasons=reasons[:3],
        held_at_kill=held,
        prefill_idle=(
            wait_idle(p_url, rooms=True, timeout_s=idle_timeout_s) if healthy and rooms else None
        ),
        hold_ranks=-1 if hold_switch is None else hold_ranks(prefill.log_path, hold_switch),
        prefill_workers=_workers(prefill),
    )


class RestartResult(msgspec.Struct, frozen=True, kw_only=True):
    """The prefill engine killed while requests run, then started again (new processes, same
    ports), the decode engine untouched (issue 22's prefill killed mid-run; issue 23 scenario 5
    in the vLLM adapter).

    :ivar inflight: requests running when the prefill was killed; ``inflight_completed`` /
        ``inflight_failed``: how they ended (the decode's ``kv_load_failure_policy`` decides);
        ``inflight_ended_s``: seconds from the kill until the last ended; ``held_at_kill``:
        rooms the prefill held then.
    :ivar decode_idle: :func:`wait_idle` of the decode engine after they ended: it freed every
        block of the rooms the dead prefill was writing.
    :ivar requests: fresh requests sent one at a time once the new prefill was ready;
        ``identical``: answered with the single engine's tokens; ``failed``: (index, reason).
    :ivar restart_s: seconds from the kill until the new prefill engine answered ``/health``.
    :ivar first_s: the first fresh request's latency (the decode found the new instance); -1
        when it failed.
    :ivar decode_alive: the decode engine's process is the one started before the kill.
    :ivar hold_ranks: workers of the killed prefill that installed the write hold
        (:func:`hold_ranks`; -1: no hold asked); ``prefill_workers``: its workers (PP x TP).
    """

    inflight: int
    inflight_completed: int
    inflight_failed: int
    inflight_ended_s: float
    held_at_kill: int
    decode_idle: IdleResult | None
    requests: int
    identical: int
    failed: list[tuple[int, str]]
    restart_s: float
    first_s: float
    decode_alive: bool
    hold_ranks: int = -1
    prefill_workers: int = 1


def restart_prefill(
    url: str,
    inflight: Sequence[Sequence[int]],
    prompts: Sequence[Sequence[int]],
    ref: Sequence[Completion | RequestFailed],
    max_tokens: int,
    prefill: Engine,
    decode: Engine,
    *,
    start_timeout_s: float = 600.0,
    timeout_s: float = 120.0,
    hold_switch: str | Path | None = None,
) -> tuple[RestartResult, Engine]:
    """Send ``inflight`` through the proxy at ``url`` and SIGKILL the prefill engine's process
    group while it holds rooms of them (``hold_switch``: as :func:`kill_decode_mid_run`); every
    one must end within ``timeout_s`` and the decode engine must free every block. The same
    prefill spec starts again as soon as the killed processes are gone (same ports: the same
    rendezvous address and instance name), as a supervisor restarts it, so it comes up while
    the decode still waits for the dead instance's rooms; ``prompts`` are sent one at a time
    once those ended and it is ready: each must be answered with ``ref``'s tokens
    (the single engine's), with no decode restarted.

    :returns: the result and the new prefill engine (the caller stops it).
    :raises pdplug_engines.procs.EngineError: the new prefill did not start.
    """
    from pdplug_engines.procs import EngineError, launch, stop_all
    from pdplug_engines.tokens import compare_tokens

    spec = msgspec.structs.replace(prefill.spec, name=f"{prefill.spec.name}-restarted")  # type: ignore[type-var]
    started: list[Engine] = []

    def start_again() -> None:
        # as a supervisor does: the new processes start as soon as the old ones are gone,
        # while the decode still waits out the dead instance's rooms (KVConfig.transfer_timeout_s)
        if not prefill.wait_gone(30.0):
            raise EngineError(f"{prefill.spec.name}: processes left 30 s after the kill")
        started.append(launch(spec, prefill.log_path.parent))

    try:
        res, held, ended_s = _kill_while_rooms_live(
            url, inflight, max_tokens, prefill.spec.url, prefill, timeout_s=timeout_s,
            rooms=True, hold_switch=hold_switch, after_kill=start_again,
        )  # fmt: skip
        t_kill = time.monotonic() - ended_s
        done = len(res) == len(inflight)
        idle = wait_idle(decode.spec.url, timeout_s=90.0) if done and decode.alive() else None
        if not started:
            raise EngineError(f"{spec.name}: not started again after the kill")
        new = started[0]
        new.wait_ready(start_timeout_s)
    except BaseException:
        stop_all(started)
        raise
    t_ready = time.monotonic()
    # one at a time: the first request is the first room bound for the new instance
    got = complete_all(url, prompts, max_tokens, concurrency=1, timeout_s=timeout_s)
    parity = compare_tokens(ref, got, prompts)
    first = got[0].latency_s if got and isinstance(got[0], Completion) else -1.0
    return (
        RestartResult(
            inflight=len(inflight),
            inflight_completed=sum(isinstance(r, Completion) for r in res),
            inflight_failed=sum(isinstance(r, RequestFailed) for r in res),
            inflight_ended_s=round(ended_s, 2),
            held_at_kill=held,
            decode_idle=idle,
            requests=len(prompts),
            identical=parity.identical,
            failed=parity.failed,
            restart_s=round(t_ready - t_kill, 2),
            first_s=round(first, 2),
            decode_alive=decode.alive(),
            hold_ranks=-1 if hold_switch is None else hold_ranks(prefill.log_path, hold_switch),
            prefill_workers=_workers(prefill),
        ),
        new,
    )
