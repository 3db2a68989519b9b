"""``pdplug proxy``: an OpenAI-compatible front for one prefill and one decode vLLM engine.

Like vLLM's disaggregated-serving example proxies, it turns one client request into a
prefill request (``max_tokens=1``, ``do_remote_decode``) and a decode request that streams
the answer back. Two modes:

* ``push`` (``PdplugConnector``): a room from :class:`pdplug.adapters.room_ids.RoomAllocator`
  goes to both engines, and both requests are sent at once, so the decode engine registers
  its destination blocks while the prefill engine computes and writes them.
* ``pull`` (vLLM's ``NixlConnector``): the prefill request runs first; its response's
  ``kv_transfer_params`` (the prefill blocks) go into the decode request, whose engine reads
  the blocks.

A request whose own ``kv_transfer_params`` are malformed or contradictory (what
:func:`pdplug.adapters.vllm.params.check_request_params` refuses on an engine) gets HTTP 400 in
:class:`pdplug.adapters.vllm.guard.KVParamsGuard`'s format and reaches no engine; well-formed
ones are replaced by the proxy's own, as before (the proxy owns the room and the side flags).
So a client cannot make the proxy name a prefill instance or bootstrap of its choosing, and the
proxy does no prefill lookup of its own: if its configured prefill does not resolve, the decode
engine's guard answers 404/503/504 with the reason and the proxy relays that status and body
(a streamed request: as its SSE error). Issue 22.

A client that disconnects cancels both upstream requests (vLLM aborts a request whose HTTP
connection closed); a prefill request that fails ends the decode request with the same error.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
from collections.abc import AsyncIterator
from typing import Any

import httpx
import msgspec
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, StreamingResponse

from pdplug.adapters.room_ids import RoomAllocator
from pdplug.adapters.vllm.guard import error_document
from pdplug.adapters.vllm.params import (
    ParamsError,
    check_request_params,
    decode_request_params,
    prefill_request_params,
)

__all__ = ["ProxyConfig", "make_app", "serve"]

log = logging.getLogger(__name__)

#: vLLM's kv_transfer_params for a pull-mode prefill request (NixlConnector)
PULL_PREFILL_PARAMS: dict[str, Any] = {
    "do_remote_decode": True,
    "do_remote_prefill": False,
    "remote_engine_id": None,
    "remote_block_ids": None,
    "remote_host": None,
    "remote_port": None,
}


class ProxyConfig(msgspec.Struct, frozen=True, kw_only=True):
    """Where the proxy listens and what it fronts.

    :ivar prefill_url/decode_url: base URLs of the engines (``http://host:port``).
    :ivar mode: ``"push"`` (PdplugConnector) or ``"pull"`` (NixlConnector).
    :ivar prefill_instance: the prefill engine's pdplug instance id (push mode).
    :ivar bootstrap: the prefill instance's rendezvous endpoint ``tcp://host:port`` (push).
    :ivar decode_instance: the decode engine's pdplug instance id (push; "" = any).
    :ivar allocator_id: this proxy's room allocator id (one per proxy replica).
    :ivar timeout_s: upper bound of one upstream request (seconds).
    :ivar connect_timeout_s: bound of one upstream TCP connect (seconds); size it to the load
        (a starved event loop on a loaded host misses short bounds even on loopback).
    :ivar keepalive_s: seconds an idle upstream connection is kept for reuse; 0 (default)
        opens one connection per upstream request. vLLM's server closes idle connections
        after ``VLLM_HTTP_TIMEOUT_KEEP_ALIVE`` (5 s): a pooled connection reused just as the
        engine closes it fails the request (``ReadError``), so keep this well below it.
    """

    prefill_url: str
    decode_url: str
    mode: str = "push"
    prefill_instance: str = ""
    bootstrap: str = ""
    decode_instance: str = ""
    allocator_id: int = 0
    timeout_s: float = 600.0
    connect_timeout_s: float = 30.0
    keepalive_s: float = 0.0

    def __post_init__(self) -> None:
        if self.mode not in ("push", "pull"):
            raise ValueError(f"ProxyConfig.mode={self.mode!r}: expected 'push' or 'pull'")
        if self.mode == "push" and not (self.prefill_instance and self.bootstrap):
            raise ValueError(
                "ProxyConfig: push mode needs prefill_instance and bootstrap "
                f"(got {self.prefill_instance!r}, {self.bootstrap!r})"
            )


def make_app(config: ProxyConfig) -> Any:
    """The FastAPI application (``/v1/completions``, ``/v1/chat/completions``, ``/health``).

    :raises ValueError: a bad ``config`` (see :class:`ProxyConfig`).
    """
    rooms = RoomAllocator(config.allocator_id)
    limits = httpx.Limits(
        max_connections=None,
        max_keepalive_connections=64 if config.keepalive_s > 0 else 0,
        keepalive_expiry=config.keepalive_s,
    )
    timeout = httpx.Timeout(config.timeout_s, connect=config.connect_timeout_s)
    clients: dict[str, httpx.AsyncClient] = {}

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        clients["prefill"] = httpx.AsyncClient(
            base_url=config.prefill_url, limits=limits, timeout=timeout
        )
        clients["decode"] = httpx.AsyncClient(
            base_url=config.decode_url, limits=limits, timeout=timeout
        )
        try:
            yield
        finally:
            for c in clients.values():
                await c.aclose()

    app = FastAPI(lifespan=lifespan)

    async def prefill(path: str, body: dict[str, Any]) -> dict[str, Any]:
        req = dict(body, max_tokens=1, stream=False, kv_transfer_params=body["_prefill_params"])
        req.pop("_prefill_params")
        req.pop("stream_options", None)
        if "max_completion_tokens" in req:
            req["max_completion_tokens"] = 1
        try:
            r = await clients["prefill"].post(path, json=req)
        except httpx.HTTPError as e:
            raise _Upstream("prefill", 502, f"{type(e).__name__}: {e}") from None
        if r.status_code != 200:
            raise _Upstream("prefill", r.status_code, r.text)
        try:
            doc: dict[str, Any] = r.json()
        except ValueError:
            raise _Upstream("prefill", r.status_code, r.text) from None
        return doc

    async def relay(path: str, body: dict[str, Any], request: Request) -> Any:
        try:  # the engines' own checks, before either engine sees the request
            check_request_params(body.get("kv_transfer_params"))
        except ParamsError as e:
            return JSONResponse(error_document(e), status_code=400)
        if config.mode == "push":
            room = rooms()
            p_params = prefill_request_params(room, config.decode_instance)
            d_params = decode_request_params(room, config.prefill_instance, config.bootstrap)
            p_task = asyncio.create_task(prefill(path, dict(body, _prefill_params=p_params)))
        else:
            try:
                p_doc = await prefill(path, dict(body, _prefill_params=PULL_PREFILL_PARAMS))
            except _Upstream as e:
                return e.response()
            d_params = p_doc.get("kv_transfer_params") or {}
            p_task = None
        d_body = dict(body, kv_transfer_params=d_params)
        if not body.get("stream"):
            try:
                r = await clients["decode"].post(path, json=d_body)
                if p_task is not None:
                    await p_task
            except _Upstream as e:
                return e.response()
            except httpx.HTTPError as e:
                return _Upstream("decode", 502, f"{type(e).__name__}: {e}").response()
            finally:
                if p_task is not None and not p_task.done():
                    p_task.cancel()
            try:
                doc = r.json()
            except ValueError:  # an engine's bare error page (e.g. "Internal Server Error")
                return _Upstream("decode", r.status_code, r.text).response()
            return JSONResponse(doc, status_code=r.status_code)

        async def stream() -> AsyncIterator[bytes]:
            try:
                async with clients["decode"].stream("POST", path, json=d_body) as r:
                    if r.status_code != 200:
                        text = (await r.aread()).decode(errors="replace")
                        yield _sse_error("decode", r.status_code, text)
                        return
                    async for chunk in r.aiter_bytes():
                        yield chunk
                if p_task is not None:
                    await p_task
            except _Upstream as e:
                yield _sse_error(e.side, e.status, e.text)
            except httpx.HTTPError as e:
                yield _sse_error("decode", 502, f"{type(e).__name__}: {e}")
            finally:
                if p_task is not None and not p_task.done():
                    p_task.cancel()

        return StreamingResponse(stream(), media_type="text/event-stream")

    @app.post("/v1/completions")
    async def completions(request: Request) -> Any:
        body = await _json_object(request)
        if isinstance(body, JSONResponse):
            return body
        return await relay("/v1/completions", body, request)

    @app.post("/v1/chat/completions")
    async def chat(request: Request) -> Any:
        body = await _json_object(request)
        if isinstance(body, JSONResponse):
            return body
        return await relay("/v1/chat/completions", body, request)

    @app.get("/health")
    async def health() -> Any:
        for side, c in clients.items():
            try:
                r = await c.get("/health", timeout=5.0)
            except httpx.HTTPError as e:
                return JSONResponse({"unhealthy": side, "error": str(e)}, status_code=503)
            if r.status_code != 200:
                return JSONResponse({"unhealthy": side, "status": r.status_code}, status_code=503)
        return {"ok": True, "mode": config.mode}

    return app


async def _json_object(request: Any) -> dict[str, Any] | Any:
    """The request's JSON object body, or a 400 response naming what is wrong with it (a
    client error: never forwarded, never a 500)."""
    raw = await request.body()
    if not raw.strip():
        return _bad_request("request body is empty; send an OpenAI request object (JSON)")
    try:
        body = json.loads(raw)
    except (ValueError, RecursionError) as e:  # RecursionError: absurdly deep nesting
        what = "nested too deeply" if isinstance(e, RecursionError) else f"not JSON ({e})"
        return _bad_request(f"request body is {what}; send an OpenAI request object")
    if not isinstance(body, dict):
        return _bad_request(
            f"request body must be a JSON object, got {type(body).__name__}: {raw[:80]!r}"
        )
    return body


def _bad_request(message: str) -> Any:
    return JSONResponse(
        {"error": {"message": message, "type": "invalid_request_error", "code": 400}},
        status_code=400,
    )


class _Upstream(Exception):
    def __init__(self, side: str, status: int, text: str) -> None:
        super().__init__(f"{side} engine answered {status}: {text[:500]}")
        self.side, self.status, self.text = side, status, text

    def response(self) -> Any:
        return JSONResponse(
            {"error": {"message": str(self), "type": "upstream_error", "code": self.status}},
            status_code=502,
        )


def _sse_error(side: str, status: int, text: str) -> bytes:
    doc = {"error": {"message": f"{side} engine answered {status}: {text[:500]}"}}
    return f"data: {json.dumps(doc)}\n\ndata: [DONE]\n\n".encode()


def serve(config: ProxyConfig, host: str = "127.0.0.1", port: int = 8000) -> None:
    """Run the proxy with uvicorn until interrupted."""
    import uvicorn

    uvicorn.run(make_app(config), host=host, port=port, log_level="warning")
