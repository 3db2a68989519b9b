"""``kv_connector_extra_config`` of ``PdplugConnector``: its keys, their types and ranges,
checked once when the connector is built (no vLLM import, so hosts and tests can check a
config before starting an engine).

A wrong key, type or value stops the engine at start-up with an error naming the key and the
value, instead of a worker dying later on ``float('abc')`` or a typo silently ignored.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

import msgspec

from pdplug.adapters.wire import AdapterWire, adapter_wire
from pdplug.wire import is_loopback

__all__ = ["ExtraConfig", "parse_extra"]

_WHERE = "PdplugConnector: kv_connector_extra_config."


class ExtraConfig(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """The connector's settings (every key optional).

    :ivar instance: this engine's pdplug instance id ("" = vLLM's ``engine_id``).
    :ivar bootstrap_port: prefill: the TCP port its scheduler process serves the rendezvous on
        (1-65535; required on a ``kv_producer``).
    :ivar bootstrap_host: interface the rendezvous binds, and the host its ranks register at
        ("" = ``bind_host`` / ``advertise_host``).
    :ivar kv_sender/pack_planner/scheduler: pdplug plugin selections (None = the default).
    :ivar bootstrap_timeout_s/transfer_timeout_s/waiting_timeout_s: room deadlines (seconds,
        > 0; None = :class:`pdplug.KVConfig`'s).
    :ivar chunk_tokens: split grid (tokens, > 0; None = the engine's max_num_batched_tokens).
    :ivar pack_region_tokens: tokens per pack region (> 0; None = the sender's default).
    :ivar hmac_key_file: a file holding the deployment's shared secret (the same bytes on
        every engine); every pdplug socket of the engine then authenticates its frames.
        Required off loopback, on both engines.
    :ivar hmac_key: the shared secret inline (its UTF-8 bytes; vLLM logs its config, so
        prefer ``hmac_key_file``); not with ``hmac_key_file``.
    :ivar bind_host: interface every pdplug socket of this engine binds (each rank's KV
        control channel; the rendezvous unless ``bootstrap_host``) ("" = 127.0.0.1); with a
        wildcard (``0.0.0.0``) the KV channels bind ``advertise_host``, the address they
        publish.
    :ivar advertise_host: host peers reach this engine at (the ranks' rendezvous endpoint)
        ("" = ``bind_host``; required when ``bind_host`` is ``0.0.0.0`` or ``::``).
    """

    instance: str = ""
    bootstrap_port: int = 0
    bootstrap_host: str = ""
    kv_sender: str | None = None
    pack_planner: str | None = None
    scheduler: str | None = None
    bootstrap_timeout_s: float | None = None
    transfer_timeout_s: float | None = None
    waiting_timeout_s: float | None = None
    chunk_tokens: int | None = None
    pack_region_tokens: int | None = None
    hmac_key_file: str | None = None
    hmac_key: str | None = None
    bind_host: str = ""
    advertise_host: str = ""

    def adapter_wire(self) -> AdapterWire:
        """The socket rules and advertised host of this engine's pdplug sockets
        (:func:`pdplug.adapters.wire.adapter_wire`; reads ``hmac_key_file``).

        :raises ValueError: see :func:`parse_extra`.
        """
        return adapter_wire(
            hmac_key=self.hmac_key, hmac_key_file=self.hmac_key_file,
            bind_host=self.bind_host, advertise_host=self.advertise_host, where=_WHERE,
        )  # fmt: skip

    def timeouts(self) -> dict[str, float]:
        """The room deadlines given (seconds), by :class:`pdplug.KVConfig` field name."""
        names = ("bootstrap_timeout_s", "transfer_timeout_s", "waiting_timeout_s")
        return {k: float(v) for k in names if (v := getattr(self, k)) is not None}


def parse_extra(extra: Mapping[str, Any] | None) -> ExtraConfig:
    """Check ``kv_connector_extra_config``.

    :raises ValueError: an unknown key, a value of the wrong type, a deadline that is not a
        positive finite number of seconds, a token count that is not a positive integer, both
        ``hmac_key`` and ``hmac_key_file``, a key file that cannot be read or is empty, or a
        non-loopback ``bind_host`` / ``advertise_host`` / ``bootstrap_host`` without a key
        (each names the key and the value; an unknown key lists the keys there are).
    """
    keys = ", ".join(ExtraConfig.__struct_fields__)
    try:
        cfg = msgspec.convert(dict(extra or {}), ExtraConfig)
    except msgspec.ValidationError as e:
        raise ValueError(
            f"PdplugConnector: kv_connector_extra_config: {e} (keys: {keys})"
        ) from None
    for k in ("bootstrap_timeout_s", "transfer_timeout_s", "waiting_timeout_s"):
        v = getattr(cfg, k)
        if v is not None and not (math.isfinite(v) and v > 0):
            raise ValueError(
                f"PdplugConnector: kv_connector_extra_config.{k}={v!r} must be a positive "
                "number of seconds"
            )
    for k in ("chunk_tokens", "pack_region_tokens"):
        v = getattr(cfg, k)
        if v is not None and v <= 0:
            raise ValueError(
                f"PdplugConnector: kv_connector_extra_config.{k}={v!r} must be a positive "
                "number of tokens"
            )
    aw = cfg.adapter_wire()
    host = cfg.bootstrap_host
    if host and aw.wire.hmac_key is None and not is_loopback(host):
        raise ValueError(
            f"{_WHERE}bootstrap_host={host!r} is off loopback and no key is set: set "
            f"{_WHERE}hmac_key_file (a file holding a shared secret, the same on every host)"
        )
    return cfg
