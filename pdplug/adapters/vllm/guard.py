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
``param`` naming the field) and never reaches the engine. Everything else passes through
untouched (the body replayed as it came). Issue 22.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, MutableMapping
from typing import Any

import msgspec

from pdplug.adapters.vllm.params import ParamsError, check_request_params

__all__ = ["KVParamsGuard", "refusal", "error_document"]

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
    # most requests: no decode of a long prompt (a key spelled with \u escapes is decoded)
    if _KEY not in body and b"\\u" not in body:
        return None
    try:
        doc = msgspec.json.decode(body)
    except msgspec.DecodeError:
        return None  # vLLM's own 400 for a body that is not JSON
    if not isinstance(doc, dict) or "kv_transfer_params" not in doc:
        return None
    try:
        check_request_params(doc["kv_transfer_params"])
    except ParamsError as e:
        return e
    return None


class KVParamsGuard:
    """ASGI middleware: HTTP 400 for malformed ``kv_transfer_params`` (:func:`refusal`).

    :param app: the ASGI app it wraps (vLLM's server adds it with ``app.add_middleware``).
    """

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope.get("method") != "POST":
            await self.app(scope, receive, send)
            return
        chunks: list[bytes] = []
        messages: list[Message] = []
        while True:
            msg = await receive()
            messages.append(msg)
            if msg["type"] != "http.request":  # the client went away
                break
            chunks.append(msg.get("body", b""))
            if not msg.get("more_body", False):
                break
        err = refusal(b"".join(chunks))
        if err is not None:
            await _send_400(send, err)
            return

        async def replay() -> Message:
            return messages.pop(0) if messages else await receive()

        await self.app(scope, replay, send)


def error_document(err: ParamsError) -> dict[str, Any]:
    """The HTTP 400 body for a refused request, in vLLM's error format:
    ``{"error": {"message", "type": "BadRequestError", "param", "code": 400}}``, ``param``
    the field and ``message`` its value (both cut when huge, see :class:`ParamsError`).
    ``pdplug proxy`` answers with the same document (issue 22).

    :param err: what :func:`~pdplug.adapters.vllm.params.check_request_params` raised.
    """
    return {"error": {"message": str(err), "type": "BadRequestError", "param": err.field,
                      "code": 400}}  # fmt: skip


async def _send_400(send: Send, err: ParamsError) -> None:
    body = msgspec.json.encode(error_document(err))
    await send({
        "type": "http.response.start",
        "status": 400,
        "headers": [(b"content-type", b"application/json"),
                    (b"content-length", str(len(body)).encode())],
    })  # fmt: skip
    await send({"type": "http.response.body", "body": body})
