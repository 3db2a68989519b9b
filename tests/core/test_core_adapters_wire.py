"""The socket settings every adapter builds from its engine's config: the key (inline or from
a file), the interface it binds and the host it advertises; off loopback without a key, or a
wildcard bind without an address peers can reach, is refused at start-up, naming the setting."""

from __future__ import annotations

import os

import pytest

from pdplug.adapters.wire import adapter_wire, read_key_file
from pdplug.config import WireConfig


def test_defaults_are_loopback_without_a_key() -> None:
    aw = adapter_wire()
    assert aw.wire == WireConfig() and aw.advertise_host == "127.0.0.1"


def test_a_key_file_and_an_inline_key_give_the_same_bytes(tmp_path) -> None:
    f = tmp_path / "key"
    f.write_bytes(b"s3cret\r\n")
    assert read_key_file(str(f), "k") == b"s3cret"
    a = adapter_wire(hmac_key_file=str(f), bind_host="10.1.2.3")
    b = adapter_wire(hmac_key="s3cret", bind_host="10.1.2.3")
    assert a == b and a.wire.hmac_key == b"s3cret" and a.advertise_host == "10.1.2.3"
    assert adapter_wire(hmac_key=b"\x00\x01", advertise_host="h").wire.hmac_key == b"\x00\x01"


def test_a_wildcard_bind_advertises_the_address_given() -> None:
    aw = adapter_wire(hmac_key="k", bind_host="0.0.0.0", advertise_host="10.0.0.7")
    assert (aw.wire.bind_host, aw.advertise_host) == ("0.0.0.0", "10.0.0.7")
    with pytest.raises(ValueError, match=r"^cfg\.bind_host='::' binds every interface: set "
                                         r"cfg\.advertise_host"):  # fmt: skip
        adapter_wire(hmac_key="k", bind_host="::", where="cfg.")


@pytest.mark.parametrize(
    ("kw", "match"),
    [
        ({"bind_host": "10.0.0.5"}, r"cfg\.bind_host='10\.0\.0\.5' is off loopback"),
        ({"advertise_host": "node-3"}, r"cfg\.advertise_host='node-3' is off loopback"),
        ({"hmac_key": ""}, r"cfg\.hmac_key is empty"),
        ({"hmac_key": "a", "hmac_key_file": "/x"}, r"cfg\.hmac_key and cfg\.hmac_key_file"),
        ({"hmac_key_file": "/no/such/file"}, r"cfg\.hmac_key_file='/no/such/file' cannot be"),
    ],
)
def test_refusals_name_the_setting(kw: dict, match: str) -> None:
    with pytest.raises(ValueError, match=match) as e:
        adapter_wire(where="cfg.", **kw)
    if "loopback" in match:
        assert "set cfg.hmac_key_file" in str(e.value)


def test_an_empty_or_unreadable_key_file_is_named(tmp_path) -> None:
    empty = tmp_path / "empty"
    empty.write_text("\n")
    with pytest.raises(ValueError, match=r"k='.*empty' holds no key"):
        read_key_file(str(empty), "k")
    if os.geteuid() != 0:  # root reads any file
        locked = tmp_path / "locked"
        locked.write_text("x")
        locked.chmod(0)
        with pytest.raises(ValueError, match=r"cannot be read: Permission denied"):
            read_key_file(str(locked), "k")
