"""The ``kv_transfer_params`` pdplug adds to a vLLM request.

A proxy (``pdplug proxy`` or any router) sends one request to the prefill engine and, at the
same time, one to the decode engine; both carry the same bootstrap room under the
``"pdplug"`` key of ``kv_transfer_params`` (vLLM passes the dict through
``SamplingParams.extra_args``). vLLM's own keys (``do_remote_decode``, ``do_remote_prefill``)
still say which side a request is on, so vLLM's scheduler treats the request as it treats its
NIXL ones.

Rooms come from :class:`pdplug.adapters.room_ids.RoomAllocator` (shared by every adapter). A
prefill engine that still holds a live room refuses a second request with it (the request ends
with an error in its ``kv_transfer_params``) instead of mixing two requests' pages.
"""

from __future__ import annotations

import re
from typing import Annotated, Any
from urllib.parse import urlsplit

import msgspec

from pdplug.adapters.room_ids import check_room

__all__ = [
    "PARAMS_KEY",
    "PrefillParams",
    "DecodeParams",
    "prefill_request_params",
    "decode_request_params",
    "parse_prefill",
    "parse_decode",
    "check_request_params",
    "ParamsError",
]

#: key of pdplug's sub-document inside ``kv_transfer_params``
PARAMS_KEY = "pdplug"

#: longest instance id or bootstrap address a request may carry (characters): ids are labels
#: from ``kv_connector_extra_config``, not payloads
MAX_NAME_CHARS = 256

#: longest :class:`ParamsError` message (characters): it goes back to the client in an HTTP
#: 400, so a megabyte value is cut, not echoed
MAX_MESSAGE_CHARS = 400

_Name = Annotated[str, msgspec.Meta(max_length=MAX_NAME_CHARS)]


class ParamsError(ValueError):
    """Malformed or contradictory ``kv_transfer_params``.

    The message starts with the field and its value; one longer than
    :data:`MAX_MESSAGE_CHARS` is cut there and says how long it was.

    :ivar field: where (``"kv_transfer_params.pdplug.room"``), for an HTTP 400's ``param``
        (cut to :data:`MAX_NAME_CHARS`: an unknown key a client made up can be any length).
    :cvar status/err_type: the HTTP status and vLLM error ``type`` a client gets for it (400,
        ``"BadRequestError"``; a subclass answers others, see
        :class:`pdplug.adapters.vllm.reachable.PrefillUnreachable`).
    """

    status: int = 400
    err_type: str = "BadRequestError"

    def __init__(self, field: str, message: str) -> None:
        if len(message) > MAX_MESSAGE_CHARS:
            message = f"{message[: MAX_MESSAGE_CHARS - 40]}... ({len(message)} characters)"
        super().__init__(message)
        self.field = field[:MAX_NAME_CHARS]


class PrefillParams(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """pdplug's part of a prefill request's ``kv_transfer_params``.

    :ivar room: bootstrap room shared with the decode request.
    :ivar decode_instance: decode instance that will send the room's DestInfo ("" = any).
    """

    room: int
    decode_instance: _Name = ""

    def __post_init__(self) -> None:
        check_room(self.room, f"kv_transfer_params.{PARAMS_KEY}.room")


class DecodeParams(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """pdplug's part of a decode request's ``kv_transfer_params``.

    :ivar room: bootstrap room shared with the prefill request.
    :ivar prefill_instance: the prefill instance id (``kv_connector_extra_config.instance`` of
        the prefill engine).
    :ivar bootstrap: rendezvous endpoint of the prefill instance (``tcp://host:port``).
    """

    room: int
    prefill_instance: _Name
    bootstrap: _Name

    def __post_init__(self) -> None:
        check_room(self.room, f"kv_transfer_params.{PARAMS_KEY}.room")
        if not self.prefill_instance:
            raise ValueError("kv_transfer_params.pdplug.prefill_instance is empty")
        bad = f"kv_transfer_params.pdplug.bootstrap={self.bootstrap!r} is not tcp://host:port"
        if not self.bootstrap.startswith("tcp://"):
            raise ValueError(bad)
        try:
            url = urlsplit(self.bootstrap)
            port = url.port  # raises on a port outside 0..65535
        except ValueError:
            raise ValueError(bad) from None
        if not url.hostname or not port or url.path or url.query:
            raise ValueError(bad)


def prefill_request_params(room: int, decode_instance: str = "") -> dict[str, Any]:
    """``kv_transfer_params`` of the request a proxy sends to the prefill engine."""
    return {
        "do_remote_decode": True,
        "do_remote_prefill": False,
        PARAMS_KEY: msgspec.to_builtins(PrefillParams(room=room, decode_instance=decode_instance)),
    }


def decode_request_params(room: int, prefill_instance: str, bootstrap: str) -> dict[str, Any]:
    """``kv_transfer_params`` of the request a proxy sends to the decode engine."""
    p = DecodeParams(room=room, prefill_instance=prefill_instance, bootstrap=bootstrap)
    return {
        "do_remote_prefill": True,
        "do_remote_decode": False,
        PARAMS_KEY: msgspec.to_builtins(p),
    }


_AT = re.compile(r" - at `\$\.?(\w*)")


def _parse(params: dict[str, Any] | None, flag: str, kind: type[Any]) -> Any:
    if not params or not params.get(flag) or PARAMS_KEY not in params:
        return None
    doc = params[PARAMS_KEY]
    where = f"kv_transfer_params.{PARAMS_KEY}"
    try:
        return msgspec.convert(doc, kind)
    except msgspec.ValidationError as e:
        # msgspec names the path (`$.room`), not the value: add it
        msg, m = str(e), _AT.search(str(e))
        if m and m.group(1):
            field = f"{where}.{m.group(1)}"
            value = doc.get(m.group(1)) if isinstance(doc, dict) else None
            text = f"{field}={value!r}: {msg[: m.start()]}"
            if len(text) > 300:
                text = f"{field}=<{type(value).__name__}>: {msg[: m.start()]}"
            raise ParamsError(field, text) from None
        if msg.startswith(where):  # __post_init__'s own message starts with the field
            field = msg.split("=", 1)[0].split(" ", 1)[0]
            raise ParamsError(field, msg) from None
        raise ParamsError(where, f"{where}: {msg}") from None


def parse_prefill(params: dict[str, Any] | None) -> PrefillParams | None:
    """pdplug's params of a prefill-side request, None when the request is not pdplug's.

    :raises ValueError: the ``pdplug`` document is malformed (names the field and value).
    """
    return _parse(params, "do_remote_decode", PrefillParams)  # type: ignore[no-any-return]


def parse_decode(params: dict[str, Any] | None) -> DecodeParams | None:
    """pdplug's params of a decode-side request, None when the request is not pdplug's.

    :raises ValueError: the ``pdplug`` document is malformed (names the field and value), or
        missing from a request with ``do_remote_prefill`` (its KV would come from nowhere:
        failed loudly instead of prefilled locally in silence).
    """
    if params and params.get("do_remote_prefill") and PARAMS_KEY not in params:
        raise ParamsError(
            f"kv_transfer_params.{PARAMS_KEY}",
            f"kv_transfer_params has do_remote_prefill but no {PARAMS_KEY!r} document (room, "
            "prefill_instance, bootstrap): send decode requests through `pdplug proxy`, which "
            "adds it from the prefill's answer",
        )
    return _parse(params, "do_remote_prefill", DecodeParams)  # type: ignore[no-any-return]


def check_request_params(params: Any) -> None:
    """Everything a client can get wrong in a request's ``kv_transfer_params`` on an engine
    running PdplugConnector, checked before the engine sees the request (the
    :mod:`pdplug.adapters.vllm.guard` middleware answers HTTP 400 with the message).

    Refused: a non-object; ``do_remote_prefill``/``do_remote_decode`` not booleans, or both
    true; a ``pdplug`` document without either flag (it would be ignored in silence); a
    ``do_remote_prefill`` request without one; a ``pdplug`` document that
    :func:`parse_prefill`/:func:`parse_decode` refuse (wrong types, missing or unknown fields,
    a room outside ``[0, 2**63)``, names over :data:`MAX_NAME_CHARS`, a bootstrap that is not
    ``tcp://host:port``). ``None`` and documents without pdplug's keys pass (not pdplug's).

    :raises ParamsError: the first problem, naming the field and the value.
    """
    if params is None:
        return
    if not isinstance(params, dict):
        got = type(params).__name__
        raise ParamsError("kv_transfer_params", f"kv_transfer_params must be an object, got {got}")
    for flag in ("do_remote_prefill", "do_remote_decode"):
        v = params.get(flag)
        if v is not None and not isinstance(v, bool):
            raise ParamsError(f"kv_transfer_params.{flag}",
                              f"kv_transfer_params.{flag}={v!r} is not a boolean")  # fmt: skip
    pre, dec = bool(params.get("do_remote_prefill")), bool(params.get("do_remote_decode"))
    if pre and dec:
        raise ParamsError(
            "kv_transfer_params",
            "kv_transfer_params has both do_remote_prefill and do_remote_decode: a request is "
            "either a decode request (KV from a prefill) or a prefill request (KV to a decode)",
        )
    if PARAMS_KEY in params and not (pre or dec):
        raise ParamsError(
            f"kv_transfer_params.{PARAMS_KEY}",
            f"kv_transfer_params.{PARAMS_KEY} needs do_remote_prefill (decode side) or "
            "do_remote_decode (prefill side) set true",
        )
    if dec:
        parse_prefill(params)
    else:
        parse_decode(params)
