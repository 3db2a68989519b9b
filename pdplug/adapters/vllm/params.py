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

from typing import Any

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
]

#: key of pdplug's sub-document inside ``kv_transfer_params``
PARAMS_KEY = "pdplug"


class PrefillParams(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """pdplug's part of a prefill request's ``kv_transfer_params``.

    :ivar room: bootstrap room shared with the decode request.
    :ivar decode_instance: decode instance that will send the room's DestInfo ("" = any).
    """

    room: int
    decode_instance: str = ""

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
    prefill_instance: str
    bootstrap: str

    def __post_init__(self) -> None:
        check_room(self.room, f"kv_transfer_params.{PARAMS_KEY}.room")
        if not self.prefill_instance:
            raise ValueError("kv_transfer_params.pdplug.prefill_instance is empty")
        if not self.bootstrap.startswith("tcp://"):
            raise ValueError(
                f"kv_transfer_params.pdplug.bootstrap={self.bootstrap!r} is not tcp://host:port"
            )


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


def _parse(params: dict[str, Any] | None, flag: str, kind: type[Any]) -> Any:
    if not params or not params.get(flag) or PARAMS_KEY not in params:
        return None
    try:
        return msgspec.convert(params[PARAMS_KEY], kind)
    except (msgspec.ValidationError, ValueError) as e:
        raise ValueError(f"kv_transfer_params.{PARAMS_KEY}: {e}") from None


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
        raise ValueError(
            f"kv_transfer_params has do_remote_prefill but no {PARAMS_KEY!r} document (room, "
            "prefill_instance, bootstrap): send decode requests through `pdplug proxy`, which "
            "adds it from the prefill's answer"
        )
    return _parse(params, "do_remote_prefill", DecodeParams)  # type: ignore[no-any-return]
