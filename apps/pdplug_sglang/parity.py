"""Token parity of disaggregated SGLang serving against a single SGLang engine.

:func:`reference` runs the prompts on a single engine; :func:`deployment` starts a prefill
engine (PP 1 or more), a decode engine and SGLang's router for one transfer backend
(``pdplug`` over a pdplug KV sender, or SGLang's own ``mooncake_tcp`` / ``nixl``);
:func:`run_parity` sends the same greedy requests through it and compares token ids request
by request; :func:`kill_decode_mid_run` SIGKILLs the decode engine while requests run. The
backend is a parameter, so ``pdplug bench sglang`` compares pdplug with SGLang's own backends
through the same harness, on the same engines and prompts.

Engines here run on this CPU-only machine (:mod:`pdplug_sglang.engines`); every start is
bounded, every engine's process group is stopped on exit, logs go to the run's folder.
"""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Iterator, Sequence
from pathlib import Path

import msgspec

from pdplug.ports import free_ports
from pdplug.transfer.faults import FAULT_ENV, HOLD
from pdplug_engines.holds import hold_ranks
from pdplug_engines.metrics import scrape
from pdplug_engines.procs import Engine, EngineError, launch, running
from pdplug_engines.tiny_model import TinyLlama, build_tiny_llama
from pdplug_engines.tokens import Completion, RequestFailed, compare_tokens, percentile
from pdplug_sglang.client import generate_all
from pdplug_sglang.engines import EngineSpec, RouterSpec
from pdplug_sglang.overlay import write_overlay

__all__ = [
    "BACKENDS",
    "Deployment",
    "KillResult",
    "ParityResult",
    "TINY",
    "deployment",
    "kill_decode_mid_run",
    "reference",
    "run_parity",
]

#: the tiny model every run loads (bf16, 4 layers: a PP 2 prefill holds 2 each)
TINY = TinyLlama(num_hidden_layers=4, dtype="bfloat16")

#: run label -> (``--disaggregation-transfer-backend``, ``PDPLUG_KV_SENDER``)
BACKENDS = {
    "pdplug-nixl": ("pdplug", "nixl"),
    "pdplug-mooncake": ("pdplug", "mooncake"),
    "sglang-nixl": ("nixl", ""),
    "sglang-mooncake": ("mooncake_tcp", ""),
}

_KV_MB = "sglang:kv_transfer_total_mb_sum"


class ParityResult(msgspec.Struct, frozen=True, kw_only=True):
    """What one disaggregated run measured (times in seconds).

    :ivar backend: a :data:`BACKENDS` label.
    :ivar prefill_pp: prefill PP size.
    :ivar requests/prompt_tokens/max_tokens: the workload (``prompt_tokens``: the longest).
    :ivar identical: requests whose tokens equal the single engine's.
    :ivar failed: requests that failed (index, reason).
    :ivar differ: requests answered on both paths with different tokens (index, first
        differing position, prompt tokens).
    :ivar start_s: launch to prefill, decode and router ready.
    :ivar disagg_run_s: wall time of the request phase.
    :ivar ttft_p50_s/ttft_p99_s: TTFT through the router.
    :ivar single_ttft_p50_s: TTFT p50 of the single engine (0 when the reference was given).
    :ivar throughput_rps: requests per second through the router.
    :ivar kv_bytes: bytes the prefill reported moving (SGLang's
        ``sglang:kv_transfer_total_mb`` over every prefill scheduler: KV and state, no
        metadata), warm-up excluded.
    :ivar kv_bytes_min/kv_bytes_max: what the prompts need (every decode prefix hit .. none).
    :ivar kill: the decode-killed phase, when run.
    """

    backend: str
    prefill_pp: int
    requests: int
    prompt_tokens: int
    max_tokens: int
    identical: int
    failed: list[tuple[int, str]]
    differ: list[tuple[int, int, int]]
    start_s: float
    disagg_run_s: float
    ttft_p50_s: float
    ttft_p99_s: float
    single_ttft_p50_s: float
    throughput_rps: float
    kv_bytes: int
    kv_bytes_min: int
    kv_bytes_max: int
    kill: KillResult | None = None

    @property
    def bytes_ok(self) -> bool:
        """``kv_bytes`` within 1% of what the prompts need (SGLang reports MB as a float)."""
        return self.kv_bytes_min * 0.99 <= self.kv_bytes <= self.kv_bytes_max * 1.01

    @property
    def ok(self) -> bool:
        """Every request answered and token-identical, and the bytes check holds."""
        return not self.failed and self.identical == self.requests and self.bytes_ok


class KillResult(msgspec.Struct, frozen=True, kw_only=True):
    """The decode engine SIGKILLed while requests ran.

    :ivar requests: requests sent.
    :ivar answered/failed: how they ended (answered before the kill, or failed with a reason).
    :ivar hung: requests that had not ended within the bound (must be 0).
    :ivar ended_s: seconds from the kill until every request ended.
    :ivar prefill_healthy: the prefill engine answered ``/health`` afterwards.
    :ivar prefill_answers: the prefill engine answered ``/health_generate`` afterwards (a
        request through its scheduler: it still serves).
    :ivar reasons: a few failure reasons.
    :ivar hold_senders: the prefill's KV senders (one per plane of each scheduler process)
        that installed the write hold (:func:`~pdplug_engines.holds.hold_ranks`); -1: no hold
        asked.
    """

    requests: int
    answered: int
    failed: int
    hung: int
    ended_s: float
    prefill_healthy: bool
    prefill_answers: bool
    reasons: list[str]
    hold_senders: int = -1


class Deployment(msgspec.Struct, frozen=True, kw_only=True):
    """A running prefill + decode + router (the engines stop when the context exits)."""

    backend: str
    prefill_pp: int
    url: str
    start_s: float
    prefill: Engine
    decode: Engine
    router: Engine


def _model_dir(log_dir: Path, spec: TinyLlama = TINY) -> str:
    return str(build_tiny_llama(log_dir / "model", spec))


def reference(
    log_dir: str | Path,
    prompts: Sequence[Sequence[int]],
    max_tokens: int,
    *,
    concurrency: int = 4,
    timeout_s: float = 240.0,
) -> list[Completion | RequestFailed]:
    """The prompts' answers from one single SGLang engine (started and stopped here).

    :raises EngineError: the engine did not start.
    """
    log_dir = Path(log_dir)
    overlay = str(write_overlay(log_dir / "overlay"))
    (port,) = free_ports(1)
    spec = EngineSpec(name="single", model=_model_dir(log_dir), port=port, overlay=overlay)
    with running([spec], log_dir, timeout_s=timeout_s) as (single,):
        return generate_all(single.spec.url, prompts, max_tokens, concurrency=concurrency)


@contextlib.contextmanager
def deployment(
    backend: str,
    log_dir: str | Path,
    *,
    prefill_pp: int = 1,
    env: dict[str, str] | None = None,
    prefill_args: tuple[str, ...] = (),
    paths: tuple[str, ...] = (),
    model: TinyLlama = TINY,
    timeout_s: float = 300.0,
    hold_switch: str | Path | None = None,
) -> Iterator[Deployment]:
    """Start a prefill (``prefill_pp`` stages), a decode and the router for ``backend``.

    :param backend: a :data:`BACKENDS` label.
    :param env: extra environment of both engines (``PDPLUG_*`` selections, trace folder).
    :param prefill_args: extra ``launch_server`` arguments of the prefill engine.
    :param paths: extra ``PYTHONPATH`` folders of both engines.
    :param model: the tiny model's geometry (SGLang's dynamic-chunking profile draws token ids
        below 10,000: it needs a larger vocabulary than :data:`TINY`'s).
    :param hold_switch: a switch file for the prefill engine's test-only write hold
        (``PDPLUG_TEST_FAIL_WRITES``; :func:`kill_decode_mid_run` writes and removes it);
        writes go out as usual while it does not exist.
    :raises ValueError: an unknown backend.
    :raises EngineError: an engine did not start within ``timeout_s``.
    """
    if backend not in BACKENDS:
        raise ValueError(f"deployment: backend={backend!r} is not one of {sorted(BACKENDS)}")
    flag, sender = BACKENDS[backend]
    log_dir = Path(log_dir)
    overlay = str(write_overlay(log_dir / "overlay"))
    model_dir = _model_dir(log_dir, model)
    p_port, d_port, b_port = free_ports(3)
    extra = dict(env or {})
    if sender:
        extra["PDPLUG_KV_SENDER"] = sender
    metrics = ("--enable-metrics", "--enable-metrics-for-all-schedulers")
    cores = "|".join(str(i % 2) for i in range(prefill_pp)) if prefill_pp > 1 else ""
    # without a switch, none: not even one exported in the caller's shell (engines inherit it)
    p_env = {**extra, FAULT_ENV: "" if hold_switch is None else str(Path(hold_switch).resolve())}
    prefill = EngineSpec(
        name="prefill", model=model_dir, port=p_port, overlay=overlay, role="prefill",
        backend=flag, bootstrap_port=b_port, pp_size=prefill_pp, cpu_cores=cores, env=p_env,
        args=(*metrics, *prefill_args), paths=paths,
    )  # fmt: skip
    decode = EngineSpec(
        name="decode", model=model_dir, port=d_port, overlay=overlay, role="decode", backend=flag,
        env=extra, paths=paths,
    )  # fmt: skip
    t0 = time.monotonic()
    with running([prefill, decode], log_dir, timeout_s=timeout_s) as (p, d):
        router = _start_router(p.spec.url, b_port, d.spec.url, log_dir)
        try:
            yield Deployment(
                backend=backend, prefill_pp=prefill_pp, url=router.spec.url,
                start_s=time.monotonic() - t0, prefill=p, decode=d, router=router,
            )  # fmt: skip
        finally:
            router.stop()


def _start_router(p_url: str, b_port: int, d_url: str, log_dir: Path, tries: int = 3) -> Engine:
    """SGLang's router in front of a started pair, on a port picked only now: engines bind
    ports of their own choosing while they start (a port picked before them was once taken
    by then), and a port lost to that race is picked again."""
    for attempt in range(tries):
        (port,) = free_ports(1)
        router = launch(RouterSpec(port=port, prefill=((p_url, b_port),), decode=(d_url,)), log_dir)
        try:
            router.wait_ready(60.0)
            return router
        except EngineError as e:
            router.stop()
            if "address already in use" not in str(e) or attempt == tries - 1:
                raise
    raise AssertionError("unreachable")


def _kv_bytes(prefill: Engine) -> float:
    try:
        return scrape(prefill.spec.url, [_KV_MB])[_KV_MB] * (1 << 20)
    except Exception:
        return 0.0


def measure(
    dep: Deployment,
    prompts: Sequence[Sequence[int]],
    max_tokens: int,
    ref: Sequence[Completion | RequestFailed],
    *,
    concurrency: int = 4,
    timeout_s: float = 180.0,
    single_ttft_p50_s: float = 0.0,
) -> ParityResult:
    """Send ``prompts`` through ``dep``'s router and compare with ``ref``."""
    from pdplug_engines.tokens import kv_bytes_bounds

    before = _kv_bytes(dep.prefill)
    t0 = time.monotonic()
    got = generate_all(dep.url, prompts, max_tokens, concurrency=concurrency, timeout_s=timeout_s)
    run_s = time.monotonic() - t0
    time.sleep(1.0)  # the last requests' transfer metrics reach /metrics with their outputs
    moved = round(_kv_bytes(dep.prefill) - before)
    par = compare_tokens(ref, got, prompts)
    ttft = [g.ttft_s for g in got if isinstance(g, Completion)]
    lo, hi, _ = kv_bytes_bounds(prompts, TINY, 1, 1)
    return ParityResult(
        backend=dep.backend, prefill_pp=dep.prefill_pp, requests=len(prompts),
        prompt_tokens=max((len(p) for p in prompts), default=0), max_tokens=max_tokens,
        identical=par.identical, failed=par.failed, differ=par.differ, start_s=dep.start_s,
        disagg_run_s=run_s, ttft_p50_s=percentile(ttft, 50), ttft_p99_s=percentile(ttft, 99),
        single_ttft_p50_s=single_ttft_p50_s,
        throughput_rps=len(prompts) / run_s if run_s > 0 else 0.0,
        kv_bytes=moved, kv_bytes_min=lo, kv_bytes_max=hi,
    )  # fmt: skip


def kill_decode_mid_run(
    dep: Deployment,
    prompts: Sequence[Sequence[int]],
    max_tokens: int,
    *,
    kill_after_s: float = 1.0,
    timeout_s: float = 120.0,
    hold_switch: str | Path | None = None,
) -> KillResult:
    """Send ``prompts`` at once through ``dep``'s router, SIGKILL the decode engine
    ``kill_after_s`` seconds later; every request must end (answered or failed) within
    ``timeout_s``; afterwards the prefill engine must answer ``/health`` and a request of its
    own (it keeps serving).

    :param hold_switch: the switch file ``dep`` was started with (:func:`deployment`): it
        holds every prefill write (:data:`~pdplug.transfer.faults.HOLD`) from before the
        requests until just after the kill, so the kill lands while every room is live however
        fast the host is (a fixed 1 s once came after all 16 requests had ended); then the
        held writes go to a dead peer.
    """
    import httpx

    box: list[list[Completion | RequestFailed]] = []
    t = threading.Thread(
        target=lambda: box.append(
            generate_all(
                dep.url, prompts, max_tokens, concurrency=len(prompts), timeout_s=timeout_s
            )
        ),
        daemon=True,
    )
    try:
        if hold_switch is not None:
            Path(hold_switch).write_text(HOLD)
        t.start()
        time.sleep(kill_after_s)
        dep.decode.kill()
    finally:
        if hold_switch is not None:
            Path(hold_switch).unlink(missing_ok=True)
    killed = time.monotonic()
    t.join(timeout_s + 10.0)
    ended = time.monotonic() - killed
    got = box[0] if box else []
    answered = sum(isinstance(g, Completion) for g in got)
    failed = [g for g in got if isinstance(g, RequestFailed)]
    healthy = False
    with contextlib.suppress(httpx.HTTPError):
        healthy = httpx.get(dep.prefill.spec.url + "/health", timeout=10.0).status_code == 200
    answers = False
    with contextlib.suppress(httpx.HTTPError):
        # SGLang's own end-to-end check: a request through the prefill scheduler
        r = httpx.get(dep.prefill.spec.url + "/health_generate", timeout=60.0)
        answers = r.status_code == 200
    return KillResult(
        requests=len(prompts), answered=answered, failed=len(failed),
        hung=len(prompts) - len(got), ended_s=ended, prefill_healthy=healthy,
        prefill_answers=answers, reasons=sorted({f.reason[:200] for f in failed})[:4],
        hold_senders=-1 if hold_switch is None else hold_ranks(dep.prefill.log_path, hold_switch),
    )  # fmt: skip


def run_parity(
    backend: str,
    log_dir: str | Path,
    *,
    prompts: Sequence[Sequence[int]],
    max_tokens: int = 16,
    prefill_pp: int = 1,
    ref: Sequence[Completion | RequestFailed] | None = None,
    kill: bool = False,
    env: dict[str, str] | None = None,
) -> ParityResult:
    """One parity run: the reference (unless given), then the deployment's answers.

    :param kill: then :func:`kill_decode_mid_run` in a second deployment whose prefill holds
        its writes until the kill (``kill`` of the result).

    :raises EngineError: an engine did not start, or the reference failed a request.
    """
    log_dir = Path(log_dir)
    single_p50 = 0.0
    if ref is None:
        ref = reference(log_dir / "single", prompts, max_tokens)
        bad = [r for r in ref if isinstance(r, RequestFailed)]
        if bad:
            raise EngineError(f"the single engine failed {len(bad)} requests: {bad[0].reason}")
        single_p50 = percentile([r.ttft_s for r in ref if isinstance(r, Completion)], 50)
    where = log_dir / f"{backend}-pp{prefill_pp}"
    with deployment(backend, where, prefill_pp=prefill_pp, env=env) as dep:
        res = measure(dep, prompts, max_tokens, ref, single_ttft_p50_s=single_p50)
    if kill:
        # a deployment of its own: a prefill started with the write switch posts every write
        # through the fault wrapper, not on the prepared page lists the parity run measures
        switch = where / "kill" / "hold-switch"
        with deployment(
            backend, where / "kill", prefill_pp=prefill_pp, env=env, hold_switch=switch
        ) as dep:
            k = kill_decode_mid_run(dep, prompts, max_tokens, hold_switch=switch)
        res = msgspec.structs.replace(res, kill=k)
    return res
