"""An ASGI middleware for ``vllm serve`` that answers HTTP 400 to a request whose
``kv_transfer_params`` PdplugConnector would refuse.

vLLM 0.32/0.33 give a connector no way to refuse a request at its HTTP server: the connector
runs in the engine-core process, and a request it cannot serve finishes with
``FinishReason.ERROR``, which the server turns into a bare ``500 Internal server error``
(the reason only in the engine log). vLLM's ``--middleware`` option (an import path, added
to the server's ASGI app) is the place a deployment adds a check in front of the server, so
pdplug ships one::

    vllm serve ... --kv-transfer-config '{"kv_connector": "PdplugConnector", ...}' \\
        --middleware pdplug.adapters.vllm.guard.KVParamsGuard

It reads the JSON body of every ``POST`` that carries ``kv_transfer_params`` and runs
:func:`pdplug.adapters.vllm.params.check_request_params`; a refused request gets vLLM's own
error document (``{"error": {"message", "type": "BadRequestError", "param", "code": 400}}``,
``param`` naming the field) and never reaches the engine.

A well-formed decode request (``do_remote_prefill`` with a ``pdplug`` document) is then held
until its prefill instance resolves at the ``bootstrap`` it names
(:class:`pdplug.adapters.vllm.reachable.PrefillCheck`, the engine's own
``bootstrap_timeout_s`` and key): one naming a prefill nobody runs, or a rendezvous that
answers nothing, gets 404/503/504 with the reason (instance, endpoint, seconds waited) within
that timeout instead of vLLM's bare 500. A client that goes away while it waits is dropped
(nothing sent, the request never reaches vLLM; the shared lookup ends on its own within the
timeout). Everything else passes through untouched (the body replayed as it came). Issue 22.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable, MutableMapping
from typing import Any

import msgspec

from pdplug.adapters.vllm.params import (
    DecodeParams,
    ParamsError,
    check_request_params,
    parse_decode,
)
from pdplug.adapters.vllm.reachable import PrefillCheck

__all__ = ["KVParamsGuard", "refusal", "inspect", "error_document"]

Scope = MutableMapping[str, Any]
Message = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]
ASGIApp = Callable[[Scope, Receive, Send], Awaitable[None]]

_KEY = b'"kv_transfer_params"'


def refusal(body: bytes) -> ParamsError | None:
    """The reason a request body is refused, or None (not JSON, no ``kv_transfer_params``, or
    well-formed ones: vLLM answers those itself).

    :param body: the HTTP request body (bytes of a JSON object).
    """
    return inspect(body)[0]


def inspect(body: bytes) -> tuple[ParamsError | None, DecodeParams | None]:
    """:func:`refusal` of ``body``, and the pdplug params of a well-formed decode request
    (None for any other request).

    :param body: the HTTP request body (bytes of a JSON object).
    """
    # most requests: no decode of a long prompt (a key spelled with \u escapes is decoded)
    if _KEY not in body and b"\\u" not in body:
        return None, None
    try:
        doc = msgspec.json.decode(body)
    except msgspec.DecodeError:
        return None, None  # vLLM's own 400 for a body that is not JSON
    if not isinstance(doc, dict) or "kv_transfer_params" not in doc:
        return None, None
    params = doc["kv_transfer_params"]
    try:
        check_request_params(params)
        return None, parse_decode(params)
    except ParamsError as e:
        return e, None


class KVParamsGuard:
    """ASGI middleware: HTTP 400 for malformed ``kv_transfer_params`` (:func:`refusal`), and
    404/503/504 for a decode request whose prefill instance does not resolve
    (:class:`~pdplug.adapters.vllm.reachable.PrefillCheck`).

    :param app: the ASGI app it wraps (vLLM's server adds it with ``app.add_middleware``).
    :param check: the prefill lookups; default: built at the first decode request from the
        engine's configuration (``scope["app"].state.vllm_config``,
        :func:`~pdplug.adapters.vllm.reachable.engine_settings`).
    """

    def __init__(self, app: ASGIApp, check: PrefillCheck | None = None) -> None:
        self.app = app
        self.check = check

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope.get("method") != "POST":
            await self.app(scope, receive, send)
            return
        chunks: list[bytes] = []
        messages: list[Message] = []
        complete = False
        while True:
            msg = await receive()
            messages.append(msg)
            if msg["type"] != "http.request":  # the client went away
                break
            chunks.append(msg.get("body", b""))
            if not msg.get("more_body", False):
                complete = True
                break
        err, dec = inspect(b"".join(chunks))
        if err is None and dec is not None and complete:
            if self.check is None:
                self.check = PrefillCheck.from_app(scope.get("app"))
            try:
                if await _unless_gone(self.check.check(dec.prefill_instance, dec.bootstrap),
                                      receive, messages):  # fmt: skip
                    return  # nobody to answer, nothing to run
            except ParamsError as e:
                err = e
        if err is not None:
            await _send_error(send, err)
            return

        async def replay() -> Message:
            return messages.pop(0) if messages else await receive()

        await self.app(scope, replay, send)


async def _unless_gone(work: Awaitable[None], receive: Receive, messages: list[Message]) -> bool:
    """Await ``work`` while listening for the client's ``http.disconnect`` (a server's
    ``receive`` after the whole body only returns that). True: the client went first (``work``
    cancelled); a message that is not a disconnect is kept in ``messages`` for the app.

    :raises: whatever ``work`` raises.
    """
    job = asyncio.ensure_future(work)
    listen = asyncio.ensure_future(receive())
    try:
        done, _ = await asyncio.wait((job, listen), return_when=asyncio.FIRST_COMPLETED)
        if listen in done:
            msg = listen.result()
            messages.append(msg)
            if msg["type"] == "http.disconnect":
                return True
        await job
        return False
    finally:
        for t in (job, listen):
            if not t.done():
                t.cancel()
            elif not t.cancelled():
                t.exception()  # retrieved: a client gone needs no answer


def error_document(err: ParamsError) -> dict[str, Any]:
    """The error body for a refused request, in vLLM's error format:
    ``{"error": {"message", "type", "param", "code"}}`` (``"BadRequestError"`` and 400 for
    malformed params; ``err.err_type`` and ``err.status`` otherwise), ``param`` the field and
    ``message`` its value (both cut when huge, see :class:`ParamsError`). ``pdplug proxy``
    answers with the same document (issue 22).

    :param err: what :func:`~pdplug.adapters.vllm.params.check_request_params` or
        :meth:`~pdplug.adapters.vllm.reachable.PrefillCheck.check` raised.
    """
    return {"error": {"message": str(err), "type": err.err_type, "param": err.field,
                      "code": err.status}}  # fmt: skip


async def _send_error(send: Send, err: ParamsError) -> None:
    body = msgspec.json.encode(error_document(err))
    await send({
        "type": "http.response.start",
        "status": err.status,
        "headers": [(b"content-type", b"application/json"),
                    (b"content-length", str(len(body)).encode())],
    })  # fmt: skip
    await send({"type": "http.response.body", "body": body})
