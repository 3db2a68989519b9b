"""Socket settings of an engine adapter: the shared key, the interface it binds, the address
peers are told, from an engine's own configuration.

Every pdplug socket an adapter opens (a prefill instance's rendezvous, each rank's KV control
channel, a decode rank's lookups) follows one :class:`~pdplug.config.WireConfig`. An engine
passes the settings its own way (vLLM: ``kv_connector_extra_config``; SGLang: its server
arguments or the environment); :func:`adapter_wire` turns them into the ``WireConfig`` and the
advertised host, with the rules of ``docs/architecture.md`` section 4 checked at start-up:
a socket off loopback needs the key (:func:`pdplug.wire.require_key` would refuse it later,
at the first socket, in a worker process), and an engine that binds every interface
(``0.0.0.0``) must say which address its peers reach.

The key is the same bytes on every process of the deployment. Prefer a key file (mode 0600,
the same file on every host): an inline key shows in the engine's logged configuration.
"""

from __future__ import annotations

from pathlib import Path

import msgspec

from pdplug.config import WireConfig
from pdplug.wire import is_loopback

__all__ = ["AdapterWire", "WILDCARD_HOSTS", "adapter_wire", "read_key_file"]

#: bind hosts that mean every interface (peers cannot reach them as an address)
WILDCARD_HOSTS = frozenset({"0.0.0.0", "::", "*", "[::]"})


class AdapterWire(msgspec.Struct, frozen=True, kw_only=True):
    """The socket rules of one engine's adapter and the host it advertises.

    :ivar wire: the ``WireConfig`` of every pdplug socket the adapter opens (key, bind host).
    :ivar advertise_host: the host peers reach this engine's sockets at (e.g. the host of the
        rendezvous endpoint ``tcp://advertise_host:port`` the prefill ranks publish at).
    """

    wire: WireConfig
    advertise_host: str


def read_key_file(path: str, field: str) -> bytes:
    """The shared secret in the file at ``path`` (trailing whitespace and newline removed, so
    ``echo -n`` and ``echo`` files agree).

    :param field: the setting's name in errors (``kv_connector_extra_config.hmac_key_file``).
    :raises ValueError: the file cannot be read or holds no key (names ``field`` and ``path``).
    """
    try:
        key = Path(path).expanduser().read_bytes().rstrip()
    except OSError as e:
        raise ValueError(f"{field}={path!r} cannot be read: {e.strerror or e}") from None
    if not key:
        raise ValueError(f"{field}={path!r} holds no key (the file is empty)")
    return key


def adapter_wire(
    *,
    hmac_key: str | bytes | None = None,
    hmac_key_file: str | None = None,
    bind_host: str = "",
    advertise_host: str = "",
    where: str = "",
) -> AdapterWire:
    """Build an adapter's :class:`AdapterWire` from an engine's settings.

    :param hmac_key: the shared secret itself (``str``: its UTF-8 bytes); None: no key.
    :param hmac_key_file: a file holding the shared secret (:func:`read_key_file`).
    :param bind_host: interface the adapter's sockets bind ("" = ``127.0.0.1``).
    :param advertise_host: host peers reach them at ("" = ``bind_host``; required when
        ``bind_host`` is a wildcard such as ``0.0.0.0``).
    :param where: prefix of the setting names in errors (``"kv_connector_extra_config."``).
    :returns: the ``WireConfig`` (other fields at their defaults) and the advertised host.
    :raises ValueError: both a key and a key file, an unreadable or empty key file, an empty
        key, a wildcard ``bind_host`` without ``advertise_host``, or a non-loopback
        ``bind_host`` / ``advertise_host`` without a key (names the key settings).
    """
    if hmac_key is not None and hmac_key_file is not None:
        raise ValueError(f"{where}hmac_key and {where}hmac_key_file are both set; give one")
    key: bytes | None = None
    if hmac_key_file is not None:
        key = read_key_file(hmac_key_file, f"{where}hmac_key_file")
    elif hmac_key is not None:
        key = hmac_key.encode() if isinstance(hmac_key, str) else bytes(hmac_key)
        if not key:
            raise ValueError(f"{where}hmac_key is empty; give a shared secret or leave it unset")
    bind = bind_host or "127.0.0.1"
    if bind in WILDCARD_HOSTS and not advertise_host:
        raise ValueError(
            f"{where}bind_host={bind!r} binds every interface: set {where}advertise_host to "
            "the address peers reach this engine at"
        )
    advertise = advertise_host or bind
    if key is None:
        for name, host in (("bind_host", bind), ("advertise_host", advertise)):
            if not is_loopback(host):
                raise ValueError(
                    f"{where}{name}={host!r} is off loopback and no key is set: set "
                    f"{where}hmac_key_file (a file holding a shared secret, the same on every "
                    "host) to authenticate pdplug's sockets"
                )
    return AdapterWire(wire=WireConfig(hmac_key=key, bind_host=bind), advertise_host=advertise)
