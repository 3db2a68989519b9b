"""``pdplug proxy`` answers a client's bad body with 400 naming the problem (never a 500, never
forwarded), and turns an engine's non-JSON error page into a 502 that names the engine; real
HTTP on 127.0.0.1 (a stub engine whose decode requests get a bare error page: the proxy's own
behaviour is under test, not vLLM's)."""

from __future__ import annotations

import threading
import time

import pytest

pytest.importorskip("fastapi")
httpx = pytest.importorskip("httpx")
uvicorn = pytest.importorskip("uvicorn")

from fastapi import FastAPI, Request  # noqa: E402
from fastapi.responses import JSONResponse, PlainTextResponse  # noqa: E402

from pdplug.ports import free_ports  # noqa: E402
from pdplug_vllm.proxy import ProxyConfig, make_app  # noqa: E402


def _serve(app, port: int) -> uvicorn.Server:
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="error"))
    threading.Thread(target=server.run, daemon=True).start()
    deadline = time.monotonic() + 30
    while not server.started:
        assert time.monotonic() < deadline, "server did not start"
        time.sleep(0.02)
    return server


def _bare_error_engine():
    """Prefill requests (max_tokens 1) get a JSON answer; decode requests a bare error page,
    as vLLM gives for an exception in its request handler."""
    app = FastAPI()

    @app.post("/v1/completions")
    async def completions(request: Request):
        if (await request.json()).get("max_tokens") == 1:
            return JSONResponse({"choices": [{"text": ""}], "kv_transfer_params": {}})
        return PlainTextResponse("Internal Server Error", status_code=500)

    return app


@pytest.mark.timeout(120)
def test_proxy_bad_bodies_are_400_and_bare_engine_errors_are_502() -> None:
    engine_port, proxy_port = free_ports(2)
    engine = _serve(_bare_error_engine(), engine_port)
    url = f"http://127.0.0.1:{engine_port}"
    config = ProxyConfig(prefill_url=url, decode_url=url, mode="pull", timeout_s=20)
    proxy = _serve(make_app(config), proxy_port)
    try:
        base = f"http://127.0.0.1:{proxy_port}"
        for path in ("/v1/completions", "/v1/chat/completions"):
            for body, what in ((b"{not json", "not JSON"), (b"[1, 2]", "JSON object, got list"),
                               (b"", "body is empty"), (b"\xff\xfe", "not JSON"),
                               (b"[" * 100_000 + b"]" * 100_000, "nested too deeply")):  # fmt: skip
                r = httpx.post(base + path, content=body, timeout=20)
                assert r.status_code == 400, (path, body, r.status_code, r.text)
                assert what in r.json()["error"]["message"], r.text
        r = httpx.post(base + "/v1/completions", json={"prompt": [1, 2], "max_tokens": 2},
                       timeout=20)  # fmt: skip
        assert r.status_code == 502, (r.status_code, r.text)
        msg = r.json()["error"]["message"]
        assert "decode engine answered 500: Internal Server Error" in msg, msg
    finally:
        proxy.should_exit = engine.should_exit = True


@pytest.mark.timeout(120)
def test_proxy_bounds_a_silent_engine_by_its_timeout() -> None:
    """An engine that accepts the connection and never answers fails the request with 502
    after ``timeout_s`` (``pdplug proxy --timeout-s``), instead of holding the client."""
    import socket

    silent = socket.socket()
    silent.bind(("127.0.0.1", 0))
    silent.listen(16)  # accepted by the kernel, never read nor answered
    (proxy_port,) = free_ports(1)
    url = f"http://127.0.0.1:{silent.getsockname()[1]}"
    config = ProxyConfig(prefill_url=url, decode_url=url, mode="pull", timeout_s=2.0)
    proxy = _serve(make_app(config), proxy_port)
    try:
        t0 = time.monotonic()
        r = httpx.post(f"http://127.0.0.1:{proxy_port}/v1/completions",
                       json={"prompt": [1, 2], "max_tokens": 2}, timeout=60)  # fmt: skip
        took = time.monotonic() - t0
        assert r.status_code == 502 and "ReadTimeout" in r.json()["error"]["message"], r.text
        assert 1.5 < took < 30, took
    finally:
        proxy.should_exit = True
        silent.close()
