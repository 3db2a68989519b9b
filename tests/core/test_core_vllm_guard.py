"""KVParamsGuard's prefill lookup (issue 22): a well-formed decode request naming a prefill
instance nobody runs, or a bootstrap that answers nothing, ends within the decode's bootstrap
timeout with the reason in vLLM's error document. Real rendezvous servers and sockets on
127.0.0.1; the guard in front of a real Starlette app (the framework vLLM's server is built
on), driven through httpx's ASGI transport. No vLLM needed."""

from __future__ import annotations

import asyncio
import threading
import time
import types
from typing import Any

import pytest
import zmq

# the web stack of pdplug[vllm] (tox env ``vllm`` runs this file): skipped without it
httpx = pytest.importorskip("httpx")
pytest.importorskip("starlette")

from starlette.applications import Starlette  # noqa: E402
from starlette.middleware import Middleware  # noqa: E402
from starlette.requests import Request  # noqa: E402
from starlette.responses import PlainTextResponse  # noqa: E402
from starlette.routing import Route  # noqa: E402

from pdplug import KVLayout, WireConfig  # noqa: E402
from pdplug.adapters.vllm.guard import KVParamsGuard  # noqa: E402
from pdplug.adapters.vllm.params import decode_request_params  # noqa: E402
from pdplug.adapters.vllm.reachable import PrefillCheck, engine_settings  # noqa: E402
from pdplug.bootstrap import RendezvousServer, register  # noqa: E402
from pdplug.ports import free_ports  # noqa: E402
from pdplug.types import PeerInfo  # noqa: E402

pytestmark = pytest.mark.timeout(60)

T = 0.6  # the decode's bootstrap timeout in these tests (seconds)
INST = "kv_transfer_params.pdplug.prefill_instance"
BOOT = "kv_transfer_params.pdplug.bootstrap"


def _register(endpoint: str, instance: str, pp_rank: int = 0, pp_size: int = 1) -> None:
    lay = KVLayout(page_size=16, entry_bytes_per_token=(64,), pp_rank=pp_rank, pp_size=pp_size)
    ctl = f"tcp://127.0.0.1:{5000 + pp_rank}"
    peer = PeerInfo(instance=instance, role="prefill", layout=lay, control_endpoint=ctl)
    register(endpoint, peer, timeout_s=10)


def _app(check: PrefillCheck | None = None, state: Any = None) -> tuple[Starlette, list[bytes]]:
    seen: list[bytes] = []

    async def completions(request: Request) -> PlainTextResponse:
        seen.append(await request.body())
        return PlainTextResponse("ok")

    app = Starlette(routes=[Route("/v1/completions", completions, methods=["POST"])],
                    middleware=[Middleware(KVParamsGuard, check=check)])  # fmt: skip
    if state is not None:
        app.state.vllm_config = state
    return app, seen


async def _post(client: httpx.AsyncClient, instance: str, bootstrap: str) -> tuple[int, Any, float]:
    body = {"prompt": [1, 2], "kv_transfer_params": decode_request_params(7, instance, bootstrap)}
    t0 = time.monotonic()
    r = await client.post("/v1/completions", json=body)
    dt = time.monotonic() - t0
    return r.status_code, (r.json()["error"] if r.status_code != 200 else r.text), dt


def _client(app: Starlette) -> httpx.AsyncClient:
    return httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://engine")


def test_unknown_partial_and_silent_prefills_get_the_reason_within_the_timeout() -> None:
    """404 for an instance the rendezvous does not know, 503 for one part-way registered, 504
    for a rendezvous that answers nothing (a bound socket that never reads, a closed port);
    each within the bootstrap timeout (+ slack), naming the field, the instance or endpoint
    and the seconds; none reaches the app. A registered instance passes."""
    ctx: Any = zmq.Context.instance()
    silent = ctx.socket(zmq.ROUTER)  # accepts connections, never answers
    silent_ep = f"tcp://127.0.0.1:{silent.bind_to_random_port('tcp://127.0.0.1')}"
    (closed,) = free_ports(1)
    app, seen = _app(PrefillCheck(T))

    async def run() -> dict[str, tuple[int, Any, float]]:
        with RendezvousServer() as srv:
            _register(srv.endpoint, "prefill-0")
            _register(srv.endpoint, "half", pp_rank=0, pp_size=2)
            cases = {"known": ("prefill-0", srv.endpoint), "unknown": ("nobody", srv.endpoint),
                     "partial": ("half", srv.endpoint), "silent": ("p", silent_ep),
                     "closed": ("p", f"tcp://127.0.0.1:{closed}")}  # fmt: skip
            async with _client(app) as c:
                got = await asyncio.gather(*(_post(c, i, e) for i, e in cases.values()))
            return dict(zip(cases, got, strict=True))

    try:
        res = asyncio.run(run())
    finally:
        silent.close(linger=0)
    assert res["known"][:2] == (200, "ok") and len(seen) == 1, res
    for name, (status, kind, field, needle) in {
        "unknown": (404, "NotFoundError", INST, "'nobody' is not registered"),
        "partial": (503, "ServiceUnavailableError", INST, "only 1 of 2 ranks"),
        "silent": (504, "GatewayTimeoutError", BOOT, silent_ep),
        "closed": (504, "GatewayTimeoutError", BOOT, f"127.0.0.1:{closed}"),
    }.items():
        st, err, dt = res[name]
        assert (st, err["code"], err["type"], err["param"]) == (status, status, kind, field), res
        assert needle in err["message"] and f"{T:g} s" in err["message"], err
        assert T * 0.8 < dt < T + 1.5, (name, dt)
    assert len(seen) == 1  # no refused request reached the app


def test_a_healthy_decode_pays_one_lookup_and_concurrent_ones_share_it() -> None:
    """Requests at once share one lookup; later ones within the cache window pay none (the
    rendezvous answers no more requests, and a stopped one is not asked); after the window a
    dead prefill is found again."""
    check = PrefillCheck(T, cache_s=1.0)
    app, seen = _app(check)

    async def run() -> None:
        with RendezvousServer() as srv:
            _register(srv.endpoint, "prefill-0")
            async with _client(app) as c:
                first = await asyncio.gather(*(_post(c, "prefill-0", srv.endpoint)
                                               for _ in range(4)))  # fmt: skip
                assert all(s == 200 for s, _, _ in first) and check.counts["looked_up"] == 1
                asked = srv.stats()["resolved"]
                srv.stop()
                assert (await _post(c, "prefill-0", srv.endpoint))[0] == 200
                assert check.counts == {"looked_up": 1, "cached": 1, "refused": 0,
                                        "unchecked": 0} and asked == 1  # fmt: skip
                await asyncio.sleep(1.05)
                st, err, _ = await _post(c, "prefill-0", srv.endpoint)
                assert st == 504 and err["param"] == BOOT, err

    asyncio.run(run())
    assert len(seen) == 5


def test_a_client_gone_while_waiting_leaks_nothing() -> None:
    """The client disconnects while its lookup waits on a silent endpoint: the guard returns
    at once, sends nothing, the app never runs; the lookup ends within the timeout, its thread
    exits and nothing stays in flight."""
    (closed,) = free_ports(1)
    check = PrefillCheck(T)
    app, seen = _app(check)
    body = httpx.Request("POST", "http://e/v1/completions", json={
        "prompt": [1], "kv_transfer_params": decode_request_params(
            3, "p", f"tcp://127.0.0.1:{closed}")}).read()  # fmt: skip
    sent: list[Any] = []

    async def run() -> float:
        msgs = [{"type": "http.request", "body": body, "more_body": False}]

        async def receive() -> dict[str, Any]:
            if msgs:
                return msgs.pop(0)
            await asyncio.sleep(0.1)
            return {"type": "http.disconnect"}

        async def send(m: Any) -> None:
            sent.append(m)

        scope = {"type": "http", "method": "POST", "path": "/v1/completions", "headers": [],
                 "query_string": b"", "app": app}  # fmt: skip
        t0 = time.monotonic()
        await KVParamsGuard(app, check=check)(scope, receive, send)
        dt = time.monotonic() - t0
        assert check.in_flight() == 1  # the lookup runs on, bounded by its own timeout
        await asyncio.sleep(T + 1.0)
        return dt

    dt = asyncio.run(run())
    assert dt < T / 2 and sent == [] and seen == [], (dt, sent)
    assert check.in_flight() == 0
    assert not [t for t in threading.enumerate() if t.name == "pdplug-guard-lookup"]


def test_lookups_beyond_the_cap_pass_to_the_engine_unchecked() -> None:
    """Clients naming many dead endpoints cannot make the guard hold more than max_lookups
    threads: a request beyond them goes to vLLM as before (its worker's lookup answers it)."""
    a, b = free_ports(2)
    check = PrefillCheck(T, max_lookups=1)
    app, seen = _app(check)

    async def run() -> list[int]:
        async with _client(app) as c:
            first = asyncio.ensure_future(_post(c, "p", f"tcp://127.0.0.1:{a}"))
            await asyncio.sleep(0.1)
            second = await _post(c, "p", f"tcp://127.0.0.1:{b}")
            return [(await first)[0], second[0]]

    assert asyncio.run(run()) == [504, 200]
    assert check.counts["unchecked"] == 1 and len(seen) == 1


def test_settings_come_from_the_engine_config(tmp_path) -> None:
    """The timeout and key are the engine's (``app.state.vllm_config`` ->
    ``kv_transfer_config.kv_connector_extra_config``, the key file read as the worker reads
    it); without a config, or with one pdplug refuses, the worker's defaults."""
    key = tmp_path / "key"
    key.write_bytes(b"s3cret\n")
    extra = {"instance": "decode-0", "bootstrap_timeout_s": 7, "hmac_key_file": str(key)}
    state = types.SimpleNamespace(
        kv_transfer_config=types.SimpleNamespace(kv_connector_extra_config=extra)
    )
    app, _ = _app(state=state)
    timeout, wire, source = engine_settings(app)
    assert (timeout, wire.hmac_key, source) == (7.0, b"s3cret", "kv_connector_extra_config")
    for other in (None, _app()[0], _app(state=types.SimpleNamespace(kv_transfer_config=None))[0],
                  _app(state=types.SimpleNamespace(kv_transfer_config=types.SimpleNamespace(
                      kv_connector_extra_config={"backends": ["UCX"]})))[0]):  # fmt: skip
        timeout, wire, source = engine_settings(other)
        assert (timeout, wire, source.split()[0]) == (60.0, WireConfig(), "defaults"), source

    # the guard builds its check from the app of the first decode request it sees
    state.kv_transfer_config.kv_connector_extra_config = {"bootstrap_timeout_s": T}
    app, _ = _app(state=state)
    (closed,) = free_ports(1)

    async def run() -> tuple[int, Any, float]:
        async with _client(app) as c:
            return await _post(c, "p", f"tcp://127.0.0.1:{closed}")

    st, err, dt = asyncio.run(run())
    assert st == 504 and f"{T:g} s" in err["message"] and dt < T + 1.5, (err, dt)
