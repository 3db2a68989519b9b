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

__all__ = ["ExtraConfig", "parse_extra"]


class ExtraConfig(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """The connector's settings (every key optional).

    :ivar instance: this engine's pdplug instance id ("" = vLLM's ``engine_id``).
    :ivar bootstrap_port: prefill: the TCP port its scheduler process serves the rendezvous on
        (1-65535; required on a ``kv_producer``).
    :ivar bootstrap_host: interface the rendezvous binds / decode ranks reach ("" = 127.0.0.1).
    :ivar kv_sender/pack_planner/scheduler: pdplug plugin selections (None = the default).
    :ivar bootstrap_timeout_s/transfer_timeout_s/waiting_timeout_s: room deadlines (seconds,
        > 0; None = :class:`pdplug.KVConfig`'s).
    :ivar chunk_tokens: split grid (tokens, > 0; None = the engine's max_num_batched_tokens).
    :ivar pack_region_tokens: tokens per pack region (> 0; None = the sender's default).
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

    def timeouts(self) -> dict[str, float]:
        """The room deadlines given (seconds), by :class:`pdplug.KVConfig` field name."""
        names = ("bootstrap_timeout_s", "transfer_timeout_s", "waiting_timeout_s")
        return {k: float(v) for k in names if (v := getattr(self, k)) is not None}


def parse_extra(extra: Mapping[str, Any] | None) -> ExtraConfig:
    """Check ``kv_connector_extra_config``.

    :raises ValueError: an unknown key, a value of the wrong type, a deadline that is not a
        positive finite number of seconds, or a token count that is not a positive integer
        (each names the key and the value, and lists the keys there are).
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
    return cfg
