"""A PdplugConnector prefill/decode pair on two hosts of a namespace cluster (issue 23).

Three hosts of a :class:`pdplug.testing.netns.Cluster`: ``p`` runs the prefill engine and ``d``
the decode engine, each binding its own address with a shared key file (``hmac_key_file``,
``bind_host``: off loopback pdplug refuses to run without a key), and ``c`` runs the single
reference engine and the driver (``pdplug proxy`` in a thread, the requests, the parity check):
addresses exist only inside the namespaces, so the driver runs there too
(``python -m pdplug_vllm.netns_pair DOC``). UCX is held to TCP over each host's veth
(:meth:`pdplug.testing.netns.Host.env`), so the KV bytes cross the links, and the decode host's
link counter must have received at least the bytes the prefill reports moving.
"""

from __future__ import annotations

import os
import secrets
import sys
import time
from pathlib import Path
from typing import Any

import msgspec

from pdplug_engines.procs import Engine, EngineError, stop_all
from pdplug_engines.tiny_model import TinyLlama, build_tiny_llama, token_prompts
from pdplug_engines.tokens import Completion, compare_tokens, kv_bytes_bounds, percentile
from pdplug_vllm.engines import EngineSpec, kv_transfer_config

__all__ = ["NetnsPairResult", "run_netns_pair"]

HTTP_PORT, BOOTSTRAP_PORT = 8100, 8200
METRIC = "vllm:pdplug_bytes_transferred_total"
GUARD = "pdplug.adapters.vllm.guard.KVParamsGuard"


class NetnsPairResult(msgspec.Struct, frozen=True, kw_only=True):
    """What one cross-host run measured.

    :ivar requests/identical/failed: parity with the single engine (as
        :class:`pdplug_vllm.parity.ParityResult`).
    :ivar kv_bytes: KV bytes the prefill engine reports pushing; ``kv_bytes_min/max``: what
        the prompts need (every decode prefix-cache hit possible .. none).
    :ivar decode_rx_bytes: bytes the decode host's veth received during the run (frames,
        headers included): at least ``kv_bytes`` when the KV crossed the link.
    :ivar addresses: host name -> address; ``ttft_p50_s``: TTFT through the proxy.
    :ivar start_s: the driver's start to its first answer through the proxy (engine start-up);
        ``wall_s``: the whole run, cluster set-up included.
    """

    requests: int
    identical: int
    failed: list[tuple[int, str]]
    kv_bytes: int
    kv_bytes_min: int
    kv_bytes_max: int
    decode_rx_bytes: int
    addresses: dict[str, str]
    ttft_p50_s: float
    start_s: float
    wall_s: float

    @property
    def bytes_ok(self) -> bool:
        """The KV bytes are what the prompts need, and the decode's link received them."""
        return self.kv_bytes_min <= self.kv_bytes <= self.kv_bytes_max and (
            0 < self.kv_bytes <= self.decode_rx_bytes
        )


def _specs(model: str, addrs: dict[str, str], key: str) -> dict[str, EngineSpec]:
    net = {"hmac_key_file": key, "bootstrap_timeout_s": 30}
    p_kv = kv_transfer_config(
        "PdplugConnector", "kv_producer", engine_id="prefill-0",
        extra={"instance": "prefill-0", "bootstrap_port": BOOTSTRAP_PORT,
               "bind_host": addrs["p"], **net},
    )  # fmt: skip
    d_kv = kv_transfer_config(
        "PdplugConnector", "kv_consumer", engine_id="decode-0",
        extra={"instance": "decode-0", "bind_host": addrs["d"], **net},
    )  # fmt: skip
    args = ("--middleware", GUARD)
    return {
        "p": EngineSpec(name="prefill", model=model, host=addrs["p"], port=HTTP_PORT,
                        kv_transfer=p_kv, cpu_cores="0", args=args),
        "d": EngineSpec(name="decode", model=model, host=addrs["d"], port=HTTP_PORT,
                        kv_transfer=d_kv, cpu_cores="1", args=args),
        "c": EngineSpec(name="single", model=model, port=HTTP_PORT, cpu_cores="0"),
    }  # fmt: skip


def run_netns_pair(
    workdir: str | Path,
    *,
    requests: int = 16,
    prompt_tokens: int = 256,
    max_tokens: int = 8,
    start_timeout_s: float = 600.0,
    request_timeout_s: float = 120.0,
) -> NetnsPairResult:
    """Build the cluster, start the three engines on their hosts, run the driver on ``c``,
    and remove everything (also on error).

    :param workdir: the model checkpoint, the key file and the engine logs go here.
    :raises pdplug.testing.netns.NetnsError: namespaces cannot be made (needs root).
    :raises pdplug_engines.procs.EngineError: an engine died, or the driver failed (its output
        and the engine logs' tails are in the message).
    """
    from pdplug.testing.netns import Cluster

    t0 = time.monotonic()
    workdir = Path(workdir).resolve()
    workdir.mkdir(parents=True, exist_ok=True)
    model = str(build_tiny_llama(workdir / "tiny-llama", TinyLlama()))
    key = workdir / "pdplug.key"
    key.write_text(secrets.token_hex(32))
    key.chmod(0o600)
    logs = workdir / "logs-netns"
    logs.mkdir(exist_ok=True)
    out = workdir / "driver.json"
    out.unlink(missing_ok=True)
    with Cluster(["p", "d", "c"], prefix="pdpvllm") as c:
        addrs = {h: c[h].addr for h in ("p", "d", "c")}
        specs = _specs(model, addrs, str(key))
        engines: list[Engine] = []
        try:
            for h, spec in specs.items():
                log = open(logs / f"{spec.name}.log", "wb")  # noqa: SIM115 (the engine's lifetime)
                proc = c[h].popen(spec.command(), env=spec.environment({}), stdout=log,
                                  stderr=log, stdin=None, start_new_session=True)  # fmt: skip
                log.close()
                engines.append(Engine(spec, proc, logs / f"{spec.name}.log"))
            doc = {
                "urls": {h: s.url for h, s in specs.items()},
                "bootstrap": f"tcp://{addrs['p']}:{BOOTSTRAP_PORT}",
                "requests": requests, "prompt_tokens": prompt_tokens, "max_tokens": max_tokens,
                "start_timeout_s": start_timeout_s, "request_timeout_s": request_timeout_s,
                "out": str(out),
            }  # fmt: skip
            rx0 = c["d"].counters().rx_bytes
            drv = c["c"].run(
                [sys.executable, "-m", "pdplug_vllm.netns_pair", msgspec.json.encode(doc).decode()],
                timeout=start_timeout_s + 4 * request_timeout_s + 60, capture_output=True,
                text=True,
            )  # fmt: skip
            rx = c["d"].counters().rx_bytes - rx0
            if drv.returncode != 0 or not out.exists():
                tails = "\n".join(f"--- {e.spec.name}:\n{e.log_tail(15)}" for e in engines)
                raise EngineError(
                    f"netns driver exited {drv.returncode}:\n{drv.stdout[-2000:]}\n"
                    f"{drv.stderr[-3000:]}\n{tails}"
                )
        finally:
            stop_all(engines)
    got = msgspec.json.decode(out.read_bytes())
    return NetnsPairResult(
        requests=got["requests"], identical=got["identical"],
        failed=[tuple(f) for f in got["failed"]], kv_bytes=got["kv_bytes"],
        kv_bytes_min=got["kv_bytes_min"], kv_bytes_max=got["kv_bytes_max"],
        decode_rx_bytes=rx, addresses=addrs, ttft_p50_s=got["ttft_p50_s"],
        start_s=got["start_s"],
        wall_s=time.monotonic() - t0,
    )  # fmt: skip


def _wait_health(urls: list[str], timeout_s: float) -> None:
    import httpx

    deadline = time.monotonic() + timeout_s
    for u in urls:
        while True:
            try:
                if httpx.get(u + "/health", timeout=2.0).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            if time.monotonic() > deadline:
                raise EngineError(f"{u} not healthy after {timeout_s:g} s")
            time.sleep(0.5)


def _drive(doc: dict[str, Any]) -> None:
    """On host ``c``: wait for the engines, answer the prompts on the single engine and
    through ``pdplug proxy`` in front of the pair, write the outcome to ``doc["out"]``."""
    from pdplug.ports import free_ports
    from pdplug_engines.metrics import settled
    from pdplug_vllm.client import complete_all
    from pdplug_vllm.parity import proxy_thread, warm_up
    from pdplug_vllm.proxy import ProxyConfig

    t0 = time.monotonic()
    urls, spec = doc["urls"], TinyLlama()
    _wait_health(list(urls.values()), doc["start_timeout_s"])
    prompts = token_prompts(doc["requests"], doc["prompt_tokens"], spec.vocab_size, seed=1)
    warm = token_prompts(1, doc["prompt_tokens"], spec.vocab_size, seed=7919)[0]
    mt, rt = doc["max_tokens"], doc["request_timeout_s"]
    warm_up(urls["c"], warm, mt, timeout_s=doc["start_timeout_s"])
    ref = complete_all(urls["c"], prompts, mt, concurrency=4, timeout_s=rt)
    config = ProxyConfig(prefill_url=urls["p"], decode_url=urls["d"], mode="push",
                         prefill_instance="prefill-0", bootstrap=doc["bootstrap"],
                         decode_instance="decode-0")  # fmt: skip
    with proxy_thread(config, free_ports(1)[0]) as url:
        warm_up(url, warm, mt, timeout_s=doc["start_timeout_s"])
        start_s = time.monotonic() - t0
        got = complete_all(url, prompts, mt, concurrency=4, timeout_s=rt)
        kv = settled(urls["p"], METRIC)
    parity = compare_tokens(ref, got, prompts)
    lo, hi, _unit = kv_bytes_bounds([warm, *prompts], spec, 32, 32)
    ttft = [r.ttft_s for r in got if isinstance(r, Completion)]
    Path(doc["out"]).write_bytes(
        msgspec.json.encode(
            {"requests": len(prompts), "identical": parity.identical, "failed": parity.failed,
             "kv_bytes": kv, "kv_bytes_min": lo, "kv_bytes_max": hi,
             "ttft_p50_s": percentile(ttft, 50), "start_s": start_s}
        )
    )  # fmt: skip


if __name__ == "__main__":
    os.environ.setdefault("PYTHONUNBUFFERED", "1")
    _drive(msgspec.json.decode(sys.argv[1]))
