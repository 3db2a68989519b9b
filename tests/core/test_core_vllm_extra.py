"""``kv_connector_extra_config`` checks: every wrong key, type or value is refused at
start-up with the key and the value named (no vLLM needed)."""

from __future__ import annotations

import math

import pytest

from pdplug.adapters.vllm.extra import ExtraConfig, parse_extra
from pdplug.config import WireConfig


def test_a_full_config_parses() -> None:
    cfg = parse_extra({"instance": "p0", "bootstrap_port": 5555, "bootstrap_host": "0.0.0.0",
                       "kv_sender": "mooncake", "transfer_timeout_s": 30, "chunk_tokens": 512,
                       "pack_region_tokens": 2048, "waiting_timeout_s": 2.5,
                       "hmac_key": "s3cret", "bind_host": "0.0.0.0",
                       "advertise_host": "10.0.0.5"})  # fmt: skip
    assert cfg.instance == "p0" and cfg.bootstrap_port == 5555 and cfg.kv_sender == "mooncake"
    assert cfg.timeouts() == {"transfer_timeout_s": 30.0, "waiting_timeout_s": 2.5}
    aw = cfg.adapter_wire()
    assert (aw.wire.hmac_key, aw.wire.bind_host, aw.advertise_host) == (
        b"s3cret",
        "0.0.0.0",
        "10.0.0.5",
    )
    assert parse_extra(None) == ExtraConfig() and parse_extra({}).timeouts() == {}
    # JSON null means "the default"
    assert parse_extra({"waiting_timeout_s": None}).timeouts() == {}


@pytest.mark.parametrize(
    ("extra", "named"),
    [
        ({"bogus_key": 1}, "bogus_key"),
        ({"transfer_timeout": 5}, "transfer_timeout"),  # a typo is not silently ignored
        ({"transfer_timeout_s": "abc"}, "$.transfer_timeout_s"),
        ({"pack_region_tokens": "x"}, "$.pack_region_tokens"),
        ({"pack_region_tokens": 2.7}, "$.pack_region_tokens"),
        ({"chunk_tokens": "abc"}, "$.chunk_tokens"),
        ({"kv_sender": 5}, "$.kv_sender"),
        ({"scheduler": ["x"]}, "$.scheduler"),
        ({"bootstrap_port": True}, "$.bootstrap_port"),
        ({"bootstrap_port": "5555"}, "$.bootstrap_port"),
        ({"transfer_timeout_s": -1}, "transfer_timeout_s=-1"),
        ({"transfer_timeout_s": 0}, "transfer_timeout_s=0"),
        ({"bootstrap_timeout_s": math.nan}, "bootstrap_timeout_s=nan"),
        ({"waiting_timeout_s": math.inf}, "waiting_timeout_s=inf"),
        ({"chunk_tokens": -5}, "chunk_tokens=-5"),
        ({"chunk_tokens": 0}, "chunk_tokens=0"),
        ({"pack_region_tokens": 0}, "pack_region_tokens=0"),
        ({"hmac_key_file": 3}, "$.hmac_key_file"),
        ({"bind_host": None}, "$.bind_host"),
        ({"hmac_key": ""}, "hmac_key is empty"),
        ({"hmac_key": "k", "hmac_key_file": "/k"}, "hmac_key and"),
        ({"hmac_key_file": "/no/such/key"}, "hmac_key_file='/no/such/key' cannot be read"),
        # off loopback without a key: refused naming the key option
        ({"bind_host": "10.0.0.5"}, "bind_host='10.0.0.5' is off loopback and no key is set"),
        ({"advertise_host": "10.0.0.5"}, "advertise_host='10.0.0.5' is off loopback"),
        ({"bootstrap_host": "0.0.0.0"}, "bootstrap_host='0.0.0.0' is off loopback"),
        (
            {"bind_host": "0.0.0.0", "hmac_key": "k"},
            "set PdplugConnector: kv_connector_extra_config.advertise_host",
        ),
    ],
)
def test_bad_values_are_refused_naming_key_and_value(extra: dict, named: str) -> None:
    with pytest.raises(ValueError, match="kv_connector_extra_config") as e:
        parse_extra(extra)
    assert named in str(e.value), str(e.value)


def test_socket_settings_off_loopback_need_the_key_file(tmp_path) -> None:
    with pytest.raises(ValueError, match=r"kv_connector_extra_config\.hmac_key_file \(a file"):
        parse_extra({"bind_host": "10.0.0.5"})
    key = tmp_path / "pdplug.key"
    key.write_text("a shared secret\n")
    aw = parse_extra({"bind_host": "10.0.0.5", "hmac_key_file": str(key)}).adapter_wire()
    assert aw.wire.hmac_key == b"a shared secret" and aw.advertise_host == "10.0.0.5"
    # the defaults are the connector's old sockets: loopback, no key
    assert ExtraConfig().adapter_wire().wire == WireConfig()
    assert ExtraConfig().adapter_wire().advertise_host == "127.0.0.1"
