"""Token parity of disaggregated vLLM serving against a single vLLM engine.

One run starts a single reference engine, a prefill engine and a decode engine (all at once:
their start-up dominates on CPU), plus ``pdplug proxy`` in a thread in front of the pair; it
sends the same greedy requests to the single engine and through the proxy, and compares the
token ids request by request. The connector is a parameter, so ``pdplug bench vllm`` runs
PdplugConnector (push) and vLLM's NixlConnector (pull) through the same harness.
"""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import msgspec

from pdplug.ports import free_ports
from pdplug.transfer.faults import FAULT_ENV
from pdplug_engines.metrics import settled
from pdplug_engines.procs import EngineError, running
from pdplug_engines.tiny_model import TinyLlama, build_tiny_llama, token_prompts
from pdplug_engines.tokens import (
    Completion,
    RequestFailed,
    compare_tokens,
    kv_bytes_bounds,
    percentile,
)
from pdplug_vllm.bad_params import BadParamsResult, probe_bad_params
from pdplug_vllm.client import complete_all
from pdplug_vllm.engines import EngineSpec, kv_transfer_config
from pdplug_vllm.phases import (
    FaultResult,
    KillResult,
    RestartResult,
    fault_phase,
    kill_decode_mid_run,
    restart_prefill,
)
from pdplug_vllm.proxy import ProxyConfig, make_app
from pdplug_vllm.shapes import check_shape

__all__ = [
    "CONNECTORS",
    "KillResult",
    "ParityResult",
    "RunSpecs",
    "check_shape",
    "disagg_specs",
    "kill_decode_mid_run",
    "proxy_thread",
    "run_parity",
    "run_specs",
    "warm_up",
]

#: connector label -> (vLLM connector name, proxy mode)
CONNECTORS = {"pdplug": ("PdplugConnector", "push"), "nixl": ("NixlConnector", "pull")}


class ParityResult(msgspec.Struct, frozen=True, kw_only=True):
    """What one parity run measured (times in seconds).

    :ivar connector: ``"pdplug"`` or ``"nixl"``.
    :ivar requests/prompt_tokens/max_tokens: the workload (``prompt_tokens``: the longest).
    :ivar identical: requests whose tokens equal the single engine's.
    :ivar failed: requests that failed (index, reason).
    :ivar differ: requests answered on both paths with different tokens (index, first
        differing position, prompt tokens).
    :ivar start_s: launch to all engines ready; ``wall_s``: launch to done.
    :ivar single_run_s/disagg_run_s: wall time of the request phase on each path.
    :ivar ttft_p50_s/ttft_p99_s: TTFT through the proxy; ``single_ttft_p50_s``: single engine.
    :ivar throughput_rps: disaggregated requests per second.
    :ivar kv_bytes: KV bytes the connector reported moving in the disaggregated phase
        (warm-up included): pdplug's prefill ``vllm:pdplug_bytes_transferred_total``, NIXL's
        decode ``vllm:nixl_bytes_transferred_sum``.
    :ivar kv_bytes_min/kv_bytes_max: what the prompts need (every decode prefix-cache hit
        possible .. none); ``kv_bytes_unit``: the transfer unit (pdplug a token's KV, NIXL
        a block's): ``kv_bytes`` must be a whole number of units inside the range.
    :ivar kill: the decode-killed phase, when run.
    :ivar prefill_pp/prefill_tp/decode_tp: the engines' shape (the single engine is TP 1).
    :ivar bad_params: malformed ``kv_transfer_params`` sent straight to both engines, when run.
    :ivar restart: the prefill engine killed and started again, when run.
    :ivar extra: one result per extra prefill engine of the run (``extra_prefills`` of
        :func:`run_parity`), each pushing other prompts to the same decode engine; its own
        ``kill``/``faults``/``restart``/``bad_params``/``extra`` are empty.
    """

    connector: str
    requests: int
    prompt_tokens: int
    max_tokens: int
    identical: int
    failed: list[tuple[int, str]]
    differ: list[tuple[int, int, int]]
    start_s: float
    wall_s: float
    single_run_s: float
    disagg_run_s: float
    ttft_p50_s: float
    ttft_p99_s: float
    single_ttft_p50_s: float
    throughput_rps: float
    kv_bytes: int = 0
    kv_bytes_min: int = 0
    kv_bytes_max: int = 0
    kv_bytes_unit: int = 1
    kill: KillResult | None = None
    faults: list[FaultResult] = []
    prefill_pp: int = 1
    prefill_tp: int = 1
    decode_tp: int = 1
    bad_params: BadParamsResult | None = None
    restart: RestartResult | None = None
    extra: list[ParityResult] = []

    @property
    def shape(self) -> str:
        """The engines' shape, ``"prefill PP 2 x TP 1 -> decode TP 1"``."""
        return f"prefill PP {self.prefill_pp} x TP {self.prefill_tp} -> decode TP {self.decode_tp}"

    @property
    def bytes_ok(self) -> bool:
        """The moved bytes are whole units inside what the prompts need."""
        return (
            self.kv_bytes_min <= self.kv_bytes <= self.kv_bytes_max
            and self.kv_bytes % self.kv_bytes_unit == 0
        )

    @property
    def ok(self) -> bool:
        """Every request answered and token-identical, and the bytes check holds (for the
        extra prefill engines' pairs too)."""
        return (
            not self.failed
            and self.identical == self.requests
            and self.bytes_ok
            and all(x.ok for x in self.extra)
        )


#: vLLM ``--middleware`` of pdplug's engines (:mod:`pdplug.adapters.vllm.guard`)
GUARD = "pdplug.adapters.vllm.guard.KVParamsGuard"

#: the metric each connector's moved bytes are read from, and the engine that serves it
BYTES_METRIC = {
    "pdplug": ("vllm:pdplug_bytes_transferred_total", "prefill"),
    "nixl": ("vllm:nixl_bytes_transferred_sum", "decode"),
}


def disagg_specs(
    connector: str,
    model: str,
    ports: Sequence[int],
    *,
    cores: tuple[str, str] = ("0", "1"),
    prefill_pp: int = 1,
    prefill_tp: int = 1,
    decode_tp: int = 1,
    prefill_cores: str = "",
    prefill_instance: str = "prefill-0",
    bootstrap_timeout_s: float = 30.0,
) -> tuple[EngineSpec, EngineSpec, dict[str, Any]]:
    """Prefill and decode engine specs for ``connector`` plus the proxy's settings.

    :param ports: at least 4 free ports (prefill HTTP, decode HTTP, two side channels).
    :param prefill_pp/prefill_tp: the prefill engine's PP stages and TP ranks (every worker
        on the prefill engine's core).
    :param decode_tp: the decode engine's TP ranks (every worker on the decode engine's core).
    :param prefill_cores: the prefill workers' core lists instead (``"0|1"``: stage 1 on the
        decode engine's core).
    :param prefill_instance: the prefill's instance name and engine id (PdplugConnector).
    :param bootstrap_timeout_s: both engines' ``bootstrap_timeout_s`` (PdplugConnector;
        seconds): how long a decode waits on a prefill's rendezvous.
    :raises ValueError: an unknown connector, or a shape the tiny model cannot take
        (:func:`check_shape`).
    """
    check_shape(prefill_pp=prefill_pp, prefill_tp=prefill_tp, decode_tp=decode_tp)
    if connector not in CONNECTORS:
        raise ValueError(f"connector={connector!r}: expected one of {sorted(CONNECTORS)}")
    name, mode = CONNECTORS[connector]
    p_http, d_http, p_side, d_side = ports[:4]
    proxy: dict[str, Any] = {"mode": mode}
    if connector == "nixl":
        extra: dict[str, Any] = {"backends": ["UCX"]}
        p_kv = kv_transfer_config(name, "kv_producer", engine_id="prefill-0", extra=extra)
        d_kv = kv_transfer_config(name, "kv_consumer", engine_id="decode-0", extra=extra)
        p_kv["kv_buffer_device"] = d_kv["kv_buffer_device"] = "cpu"
        p_env = {
            "VLLM_NIXL_SIDE_CHANNEL_PORT": str(p_side),
            "VLLM_NIXL_SIDE_CHANNEL_HOST": "127.0.0.1",
        }
        d_env = {
            "VLLM_NIXL_SIDE_CHANNEL_PORT": str(d_side),
            "VLLM_NIXL_SIDE_CHANNEL_HOST": "127.0.0.1",
        }
    else:
        bootstrap = f"tcp://127.0.0.1:{p_side}"
        p_kv = kv_transfer_config(
            name, "kv_producer", engine_id=prefill_instance,
            extra={"instance": prefill_instance, "bootstrap_port": p_side,
                   "bootstrap_timeout_s": bootstrap_timeout_s},
        )  # fmt: skip
        d_kv = kv_transfer_config(
            name, "kv_consumer", engine_id="decode-0",
            extra={"instance": "decode-0", "bootstrap_timeout_s": bootstrap_timeout_s},
        )  # fmt: skip
        p_env, d_env = {}, {}
        proxy.update(prefill_instance=prefill_instance, bootstrap=bootstrap,
                     decode_instance="decode-0")  # fmt: skip
    # every prefill worker on the prefill core: a PP stage sharing the decode engine's core was
    # declared silent by the decode (transfer_timeout_s) and every room failed (docs section 7)
    p_cores = prefill_cores or "|".join([cores[0]] * (prefill_pp * prefill_tp))
    # pdplug's engines answer a malformed kv_transfer_params with HTTP 400 (issue 22)
    args = ("--middleware", GUARD) if connector == "pdplug" else ()
    prefill = EngineSpec(name="prefill", model=model, port=p_http, kv_transfer=p_kv,
                         cpu_cores=p_cores, env=p_env, pipeline_parallel_size=prefill_pp,
                         tensor_parallel_size=prefill_tp, args=args)  # fmt: skip
    decode = EngineSpec(name="decode", model=model, port=d_http, kv_transfer=d_kv,
                        cpu_cores="|".join([cores[1]] * decode_tp), env=d_env,
                        tensor_parallel_size=decode_tp, args=args)  # fmt: skip
    return prefill, decode, proxy


class RunSpecs(msgspec.Struct, frozen=True, kw_only=True):
    """The engines one :func:`run_parity` starts, in launch order (:attr:`engines`).

    :ivar single: the reference engine; ``prefill``/``decode``: the pair.
    :ivar decode_fail: the second decode engine (``kv_load_failure_policy="fail"``) of the
        fault phases, or None.
    :ivar switch: the prefill's ``PDPLUG_TEST_FAIL_WRITES`` switch file (absolute), or None
        when no phase fails or holds the prefill's writes.
    :ivar proxy: the proxy's settings (:func:`disagg_specs`).
    :ivar extra: the extra prefill engines pushing to ``decode``, each with its proxy's
        settings (``prefill-1``, ``prefill-2`` ...).
    """

    single: EngineSpec
    prefill: EngineSpec
    decode: EngineSpec
    decode_fail: EngineSpec | None = None
    switch: Path | None = None
    proxy: dict[str, Any] = {}
    extra: list[tuple[EngineSpec, dict[str, Any]]] = []

    @property
    def engines(self) -> list[EngineSpec]:
        """What is launched: built from the same fields the phases read, so the prefill that
        runs is the one carrying the switch (it once was not: see :func:`run_specs`)."""
        return (
            [self.single, self.prefill, self.decode]
            + ([self.decode_fail] if self.decode_fail is not None else [])
            + [p for p, _ in self.extra]
        )


def run_specs(
    connector: str,
    model: str,
    ports: Sequence[int],
    workdir: str | Path,
    *,
    kill_decode: bool = False,
    fault_prompts: int = 0,
    restart: bool = False,
    prefill_pp: int = 1,
    prefill_tp: int = 1,
    decode_tp: int = 1,
    prefill_cores: str = "",
    extra_prefills: Sequence[tuple[int, int]] = (),
    bootstrap_timeout_s: float = 30.0,
) -> RunSpecs:
    """The engine specs of a :func:`run_parity` run (see there for the parameters).

    The prefill engine gets the test-only write switch (``PDPLUG_TEST_FAIL_WRITES`` naming
    ``workdir/fail-writes``) when a phase fails its writes (``fault_prompts``) or holds them
    while an engine is killed (``kill_decode`` or ``restart``, PdplugConnector). The launch
    list is derived from the returned specs: ``run_parity`` once built it before adding the
    switch and rebuilt it only for the fault phases, so a decode-kill run without them started
    a prefill that never read the switch, and its kill caught rooms in flight only when a
    50 ms poll happened to (a fast machine ended every room between two polls).

    The second decode of the fault phases is TP 1 whatever ``decode_tp`` is (its phase is
    about the failure policy, and each TP rank is one more process to start). Each extra
    prefill engine (``extra_prefills``: ``(pp, tp)`` pairs, PdplugConnector only) is
    ``prefill-<i>`` with its own HTTP and rendezvous ports, every worker on the prefill core.

    :param ports: at least ``8 + 3 * len(extra_prefills)`` free ports (the pair's 4, the
        single engine, the proxy, the fail decode and its proxy, then each extra prefill's
        HTTP, rendezvous and proxy ports).
    :raises ValueError: as :func:`disagg_specs`; ``extra_prefills`` with another connector.
    """
    if extra_prefills and connector != "pdplug":
        raise ValueError(f"run_specs: extra_prefills={list(extra_prefills)} needs connector "
                         "'pdplug'")  # fmt: skip
    if len(ports) < 8 + 3 * len(extra_prefills):
        raise ValueError(f"run_specs: {len(ports)} ports, need {8 + 3 * len(extra_prefills)}")
    prefill, decode, proxy_opts = disagg_specs(
        connector, model, ports[:4], prefill_pp=prefill_pp, prefill_tp=prefill_tp,
        decode_tp=decode_tp, prefill_cores=prefill_cores,
        bootstrap_timeout_s=bootstrap_timeout_s,
    )  # fmt: skip
    extras = []
    for i, (pp, tp) in enumerate(extra_prefills, 1):
        http, side = ports[8 + 3 * (i - 1)], ports[9 + 3 * (i - 1)]
        xp, _, xopts = disagg_specs(
            connector, model, [http, ports[1], side, ports[3]], prefill_pp=pp, prefill_tp=tp,
            decode_tp=decode_tp, prefill_instance=f"prefill-{i}",
            bootstrap_timeout_s=bootstrap_timeout_s,
        )  # fmt: skip
        extras.append((msgspec.structs.replace(xp, name=f"prefill-{i}"), xopts))
    single = EngineSpec(name="single", model=model, port=ports[4], cpu_cores="0")
    switch = None
    # the switch also holds the prefill's writes while a kill phase kills an engine
    if fault_prompts or ((kill_decode or restart) and connector == "pdplug"):
        switch = (Path(workdir) / "fail-writes").resolve()
        prefill = msgspec.structs.replace(prefill, env={**prefill.env, FAULT_ENV: str(switch)})
    decode_fail = None
    if fault_prompts:
        kv = dict(decode.kv_transfer or {})
        decode = msgspec.structs.replace(
            decode, kv_transfer={**kv, "kv_load_failure_policy": "recompute"}
        )
        extra = {**kv["kv_connector_extra_config"], "instance": "decode-fail"}
        decode_fail = msgspec.structs.replace(
            decode, name="decode-fail", port=ports[6], tensor_parallel_size=1,
            cpu_cores=decode.cpu_cores.split("|")[0],
            kv_transfer={**kv, "engine_id": "decode-fail", "kv_load_failure_policy": "fail",
                         "kv_connector_extra_config": extra},
        )  # fmt: skip
    return RunSpecs(
        single=single, prefill=prefill, decode=decode, decode_fail=decode_fail, switch=switch,
        proxy=proxy_opts, extra=extras,
    )  # fmt: skip


@contextlib.contextmanager
def proxy_thread(config: ProxyConfig, port: int, timeout_s: float = 30.0) -> Iterator[str]:
    """Run ``pdplug proxy`` in a thread of this process; yields its base URL.

    :raises RuntimeError: the proxy did not start within ``timeout_s``.
    """
    import uvicorn

    server = uvicorn.Server(
        uvicorn.Config(make_app(config), host="127.0.0.1", port=port, log_level="warning")
    )
    t = threading.Thread(target=server.run, name="pdplug-proxy", daemon=True)
    t.start()
    deadline = time.monotonic() + timeout_s
    while not server.started:
        if time.monotonic() > deadline or not t.is_alive():
            server.should_exit = True
            raise RuntimeError(f"pdplug proxy did not start on port {port} in {timeout_s} s")
        time.sleep(0.05)
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        server.should_exit = True
        t.join(timeout=10.0)


def warm_up(url: str, prompt: Sequence[int], max_tokens: int, *, timeout_s: float = 300.0) -> float:
    """Send ``prompt`` to ``url`` until one answer comes back whole (bounded by ``timeout_s``).

    An engine answering ``/health`` has not yet run a forward: the first requests pay for
    kernel set-up and, through a disaggregated pair, the connector's first handshake (tens of
    seconds on a loaded 2-core host). Measured request sets start after this.

    :returns: seconds until the first whole answer.
    :raises pdplug_engines.procs.EngineError: no whole answer within ``timeout_s`` (the last
        failure is named).
    """
    t0 = time.monotonic()
    last = "no attempt"
    while (left := timeout_s - (time.monotonic() - t0)) > 0:
        (res,) = complete_all(url, [prompt], max_tokens, concurrency=1, timeout_s=left)
        if isinstance(res, Completion):
            return time.monotonic() - t0
        last = res.reason
        time.sleep(1.0)
    raise EngineError(f"warm-up through {url} got no answer in {timeout_s:.0f} s: {last}")


def run_parity(
    connector: str,
    workdir: str | Path,
    *,
    requests: int = 16,
    prompt_tokens: int = 256,
    max_tokens: int = 16,
    concurrency: int = 4,
    start_timeout_s: float = 600.0,
    request_timeout_s: float = 300.0,
    prompts: Sequence[Sequence[int]] | None = None,
    kill_decode: bool = False,
    kill_timeout_s: float = 60.0,
    fault_prompts: int = 0,
    prefill_pp: int = 1,
    prefill_tp: int = 1,
    decode_tp: int = 1,
    bad_params: bool = False,
    prefill_cores: str = "",
    warm_timeout_s: float | None = None,
    restart: bool = False,
    extra_prefills: Sequence[tuple[int, int]] = (),
    bootstrap_timeout_s: float = 30.0,
) -> ParityResult:
    """Start the three engines, run the workload on both paths, stop everything.

    :param connector: ``"pdplug"`` or ``"nixl"``.
    :param workdir: model checkpoint and engine logs go here.
    :param prompts: token-id prompts (e.g. a trace's); default ``requests`` random prompts of
        ``prompt_tokens`` tokens. Ids must be below the tiny model's vocabulary (1024).
    :param request_timeout_s: bound of one request of the parity set (seconds): a hang
        detector sized to a loaded host, not a latency target.
    :param kill_decode: after the parity phase, run :func:`kill_decode_mid_run` on the
        prompts with every id shifted by one (not in any prefix cache), each request bounded by
        ``kill_timeout_s``; with ``pdplug``, the prefill's writes held from before the requests
        until the kill (:func:`run_specs`).
    :param fault_prompts: ``pdplug`` only: after the parity phase (before the kill), run
        :func:`pdplug_vllm.phases.fault_phase` on the first ``fault_prompts`` prompts (ids
        shifted by two) with failing prefill writes, through the decode engine (started with
        ``kv_load_failure_policy="recompute"``) and through a second decode engine started with
        ``"fail"`` (its own proxy); 0: no fault phase, one decode engine with vLLM's default.
    :param prefill_pp: PP stages of the prefill engine (each stage pushes its layers).
    :param prefill_tp/decode_tp: TP ranks of the prefill and decode engines (vLLM's ``mp``
        executor; each prefill rank pushes its KV heads, each decode rank receives its own).
    :param prefill_cores: the prefill workers' OpenMP core lists (:func:`disagg_specs`).
    :param warm_timeout_s: bound of the first whole answer through the proxy (seconds;
        default ``start_timeout_s``): a pair that cannot serve the shape at all (vLLM's
        NixlConnector with a PP prefill) raises :class:`EngineError` after this long.
    :param bad_params: ``pdplug`` only: after the parity phase, send malformed
        ``kv_transfer_params`` straight to both engines
        (:func:`pdplug_vllm.bad_params.probe_bad_params`).
    :param restart: ``pdplug`` only: after the fault phases (before the decode kill), SIGKILL
        the prefill engine while the prompts (ids shifted by four) run, start it again and send
        the prompts (ids shifted by three) through the same proxy and decode engine
        (:func:`pdplug_vllm.phases.restart_prefill`; the prefill's writes held until its kill).
    :param extra_prefills: ``pdplug`` only: more prefill engines, as ``(pp, tp)`` shapes,
        started with the others and pushing to the same decode engine, each through its own
        proxy right after the parity phase, on the prompts with every id shifted by 5, 6 ...
        (the decode's prefix cache holds the parity set); one :attr:`ParityResult.extra`
        each. A decode serving several prefill instances is the cluster's usual case, and one
        decode start (a minute on 2 cores) serves every prefill shape.
    :param bootstrap_timeout_s: the engines' ``bootstrap_timeout_s`` (PdplugConnector): how
        long the ``bad_params`` probes naming a prefill nobody runs wait.
    :raises pdplug_engines.procs.EngineError: an engine did not start.
    :raises ValueError: bad prompts, a shape :func:`check_shape` refuses, or
        ``fault_prompts`` with another connector.
    """
    t0 = time.monotonic()
    workdir = Path(workdir)
    spec = TinyLlama()
    model = str(build_tiny_llama(workdir / "tiny-llama", spec))
    if fault_prompts and connector != "pdplug":
        raise ValueError(f"run_parity: fault_prompts={fault_prompts} needs connector 'pdplug'")
    if bad_params and connector != "pdplug":
        raise ValueError("run_parity: bad_params needs connector 'pdplug'")
    if restart and connector != "pdplug":
        raise ValueError("run_parity: restart needs connector 'pdplug'")
    ports = free_ports(8 + 3 * len(extra_prefills))
    specs = run_specs(
        connector, model, ports, workdir, kill_decode=kill_decode, fault_prompts=fault_prompts,
        restart=restart, prefill_pp=prefill_pp, prefill_tp=prefill_tp, decode_tp=decode_tp,
        prefill_cores=prefill_cores, extra_prefills=extra_prefills,
        bootstrap_timeout_s=bootstrap_timeout_s,
    )  # fmt: skip
    single, prefill, decode, proxy_opts = specs.single, specs.prefill, specs.decode, specs.proxy
    engines, switch = specs.engines, specs.switch
    if prompts is None:
        prompts = token_prompts(requests, prompt_tokens, spec.vocab_size, seed=1)
    if not prompts:
        raise ValueError("run_parity: prompts is empty (a trace with no requests?)")
    bad = [i for i, p in enumerate(prompts) if not p or max(p) >= spec.vocab_size]
    if bad:
        raise ValueError(f"run_parity: prompts {bad[:5]} are empty or hold ids >= "
                         f"vocab_size={spec.vocab_size}")  # fmt: skip
    requests, prompt_tokens = len(prompts), max(len(p) for p in prompts)
    kill: KillResult | None = None
    restarted: RestartResult | None = None
    faults: list[FaultResult] = []
    extra: list[ParityResult] = []
    with (
        contextlib.ExitStack() as stack,
        running(engines, workdir / f"logs-{connector}", start_timeout_s) as (
            _,
            p_engine,
            d_engine,
            *_others,
        ),
    ):
        start_s = time.monotonic() - t0
        warm = token_prompts(1, prompt_tokens, spec.vocab_size, seed=7919)[0]
        warm_up(single.url, warm, max_tokens, timeout_s=start_timeout_s)
        t1 = time.monotonic()
        ref = complete_all(single.url, prompts, max_tokens, concurrency=concurrency,
                           timeout_s=request_timeout_s)  # fmt: skip
        single_run_s = time.monotonic() - t1
        config = ProxyConfig(prefill_url=prefill.url, decode_url=decode.url, **proxy_opts)
        with proxy_thread(config, ports[5]) as url:
            warm_up(url, warm, max_tokens, timeout_s=warm_timeout_s or start_timeout_s)
            t2 = time.monotonic()
            got = complete_all(url, prompts, max_tokens, concurrency=concurrency,
                               timeout_s=request_timeout_s)  # fmt: skip
            disagg_run_s = time.monotonic() - t2
            metric, side = BYTES_METRIC[connector]
            kv_bytes = settled((prefill if side == "prefill" else decode).url, metric)
            for i, (xp, xopts) in enumerate(specs.extra, 1):
                extra.append(_extra_pair(
                    connector, xp, decode, xopts, config, ports[7 + 3 * i], prompts,
                    [(t + 4 + i) % spec.vocab_size for t in warm], single.url, spec,
                    shift=4 + i, max_tokens=max_tokens, concurrency=concurrency,
                    timeout_s=request_timeout_s, warm_timeout_s=warm_timeout_s or start_timeout_s,
                ))  # fmt: skip
            probed = None
            if bad_params:
                probed = probe_bad_params(
                    prefill.url, decode.url, prefill_instance=proxy_opts["prefill_instance"],
                    bootstrap=proxy_opts["bootstrap"], timeout_s=request_timeout_s,
                )  # fmt: skip
            if fault_prompts:
                assert switch is not None and specs.decode_fail is not None
                faults = _fault_phases(
                    url, [[(t + 2) % spec.vocab_size for t in p] for p in prompts[:fault_prompts]],
                    max_tokens, single.url, prefill.url, [decode, specs.decode_fail], config,
                    ports[7], switch, warm, timeout_s=request_timeout_s,
                )  # fmt: skip
            if restart:
                cut = [[(t + 4) % spec.vocab_size for t in p] for p in prompts]
                again = [[(t + 3) % spec.vocab_size for t in p] for p in prompts]
                ref_again = complete_all(single.url, again, max_tokens, concurrency=concurrency,
                                         timeout_s=request_timeout_s)  # fmt: skip
                restarted, p_engine = restart_prefill(
                    url, cut, again, ref_again, max_tokens, p_engine, d_engine,
                    start_timeout_s=start_timeout_s, timeout_s=request_timeout_s,
                    hold_switch=switch,
                )  # fmt: skip
                stack.callback(p_engine.stop)
            if kill_decode:
                # fresh prompts: the parity set is in both engines' prefix caches and would
                # finish before the kill
                fresh = [[(t + 1) % spec.vocab_size for t in p] for p in prompts]
                # long generations keep the requests in decode when the kill lands (with
                # 16 tokens a fast run had answered all of them before it)
                kill = kill_decode_mid_run(
                    url, fresh, max(max_tokens, 512), p_engine, d_engine, timeout_s=kill_timeout_s,
                    rooms=connector == "pdplug", hold_switch=switch,
                )  # fmt: skip
    return _result(
        connector, prompts, ref, got, warm, spec, prefill, decode, t0=t0, start_s=start_s,
        single_run_s=single_run_s, run_s=disagg_run_s, max_tokens=max_tokens,
        kv_bytes=kv_bytes, kill=kill, faults=faults, bad_params=probed, restart=restarted,
        extra=extra,
    )  # fmt: skip


def _result(
    connector: str,
    prompts: Sequence[Sequence[int]],
    ref: Sequence[Completion | RequestFailed],
    got: Sequence[Completion | RequestFailed],
    warm: Sequence[int],
    spec: TinyLlama,
    prefill: EngineSpec,
    decode: EngineSpec,
    *,
    t0: float,
    start_s: float,
    single_run_s: float,
    run_s: float,
    max_tokens: int,
    kv_bytes: int,
    **phases: Any,
) -> ParityResult:
    """One pair's :class:`ParityResult`: tokens compared, TTFTs, and the bytes the prompts
    need (both connectors move whole blocks: vLLM CPU attention's K slab is tiled per block)."""
    parity = compare_tokens(ref, got, prompts)
    ttft = [r.ttft_s for r in got if isinstance(r, Completion)]
    ref_ttft = [r.ttft_s for r in ref if isinstance(r, Completion)]
    bs = prefill.block_size
    lo, hi, unit = kv_bytes_bounds([list(warm), *prompts], spec, bs, bs)
    return ParityResult(
        connector=connector,
        requests=len(prompts),
        prompt_tokens=max(len(p) for p in prompts),
        max_tokens=max_tokens,
        identical=parity.identical,
        failed=parity.failed,
        differ=parity.differ,
        start_s=start_s,
        wall_s=time.monotonic() - t0,
        single_run_s=single_run_s,
        disagg_run_s=run_s,
        ttft_p50_s=percentile(ttft, 50),
        ttft_p99_s=percentile(ttft, 99),
        single_ttft_p50_s=percentile(ref_ttft, 50),
        throughput_rps=len(ttft) / run_s if run_s else 0.0,
        kv_bytes=kv_bytes,
        kv_bytes_min=lo,
        kv_bytes_max=hi,
        kv_bytes_unit=unit,
        prefill_pp=prefill.pipeline_parallel_size,
        prefill_tp=prefill.tensor_parallel_size,
        decode_tp=decode.tensor_parallel_size,
        **phases,
    )


def _extra_pair(
    connector: str,
    prefill: EngineSpec,
    decode: EngineSpec,
    proxy_opts: dict[str, Any],
    config: ProxyConfig,
    port: int,
    prompts: Sequence[Sequence[int]],
    warm: list[int],
    single_url: str,
    spec: TinyLlama,
    *,
    shift: int,
    max_tokens: int,
    concurrency: int,
    timeout_s: float,
    warm_timeout_s: float,
) -> ParityResult:
    # another prefill instance pushing to the same decode, behind its own proxy (its own room
    # allocator: rooms are unique per decode), on prompts the decode has not cached
    shifted = [[(t + shift) % spec.vocab_size for t in p] for p in prompts]
    t0 = time.monotonic()
    ref = complete_all(single_url, shifted, max_tokens, concurrency=concurrency,
                       timeout_s=timeout_s)  # fmt: skip
    single_run_s = time.monotonic() - t0
    cfg = msgspec.structs.replace(
        config, prefill_url=prefill.url, prefill_instance=proxy_opts["prefill_instance"],
        bootstrap=proxy_opts["bootstrap"], allocator_id=config.allocator_id + 16 + shift,
    )  # fmt: skip
    with proxy_thread(cfg, port) as url:
        warm_up(url, warm, max_tokens, timeout_s=warm_timeout_s)
        t1 = time.monotonic()
        got = complete_all(url, shifted, max_tokens, concurrency=concurrency, timeout_s=timeout_s)
        run_s = time.monotonic() - t1
        metric, _side = BYTES_METRIC[connector]
        kv_bytes = settled(prefill.url, metric)
    return _result(
        connector, shifted, ref, got, warm, spec, prefill, decode, t0=t0, start_s=0.0,
        single_run_s=single_run_s, run_s=run_s, max_tokens=max_tokens, kv_bytes=kv_bytes,
    )  # fmt: skip


def _fault_phases(
    url: str,
    prompts: list[list[int]],
    max_tokens: int,
    single_url: str,
    prefill_url: str,
    decodes: list[EngineSpec],
    config: ProxyConfig,
    port: int,
    switch: Path,
    warm: Sequence[int],
    *,
    timeout_s: float,
) -> list[FaultResult]:
    # the recompute decode behind the running proxy, then the fail decode behind its own
    ref = complete_all(single_url, prompts, max_tokens, concurrency=len(prompts),
                       timeout_s=timeout_s)  # fmt: skip

    def phase(proxy_url: str, policy: str, decode: EngineSpec) -> FaultResult:
        return fault_phase(
            proxy_url, prompts, ref, max_tokens, policy=policy, prefill_url=prefill_url,
            decode_url=decode.url, switch=switch, timeout_s=timeout_s,
        )  # fmt: skip

    out = [phase(url, "recompute", decodes[0])]
    # a second proxy in front of the same prefill engine: its own room allocator
    fail_cfg = msgspec.structs.replace(config, decode_url=decodes[1].url,
                                       decode_instance=decodes[1].name,
                                       allocator_id=config.allocator_id + 1)  # fmt: skip
    with proxy_thread(fail_cfg, port) as url2:
        warm_up(url2, warm, max_tokens, timeout_s=timeout_s)
        out.append(phase(url2, "fail", decodes[1]))
    return out


if __name__ == "__main__":  # python -m pdplug_vllm.parity nixl /tmp/dir
    import sys

    res = run_parity(sys.argv[1], sys.argv[2])
    print(msgspec.json.encode(res).decode())
    sys.exit(0 if res.ok else 1)
