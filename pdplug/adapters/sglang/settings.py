"""The pdplug backend's settings inside an SGLang engine: SGLang's own server arguments and
deadlines, plus ``PDPLUG_SGLANG_*`` environment variables for what SGLang has no flag for.

SGLang's CLI has no place for a backend's options, so the engine's environment carries them
(set on the ``sglang serve`` / ``launch_server`` command; every scheduler process inherits it):

============================== ===============================================================
``PDPLUG_SGLANG_KEY_FILE``     file holding the shared HMAC key of every pdplug socket (same
                               file on every host; required off loopback)
``PDPLUG_SGLANG_KEY``          the key itself (prefer the file: an inline key shows in ps)
``PDPLUG_SGLANG_BIND_HOST``    interface pdplug's sockets bind (default: SGLang's ``--host``)
``PDPLUG_SGLANG_ADVERTISE_HOST`` host peers reach them at (required with a wildcard bind)
``PDPLUG_SGLANG_TRANSFER_TIMEOUT_S`` silence bound of a room in Transferring (default 30 s)
``PDPLUG_SGLANG_PACK_REGION_TOKENS`` pack region capacity (tokens, default 8192): the split
                               bound of a send to a decode that needs relayout (DCP)
``PDPLUG_SGLANG_CHUNK_TOKENS`` split grid of sends (tokens; default SGLang's
                               ``--chunked-prefill-size``)
============================== ===============================================================

The room deadlines follow SGLang's: ``SGLANG_DISAGGREGATION_BOOTSTRAP_TIMEOUT`` (a prefill
room waiting for its decode, default 300 s) and ``SGLANG_DISAGGREGATION_WAITING_TIMEOUT`` (a
decode room waiting for its KV, 300 s). pdplug's own selections (``PDPLUG_KV_SENDER``,
``PDPLUG_CONSENSUS``, ``PDPLUG_PACK_PLANNER``, ``PDPLUG_SCHEDULER``) apply unchanged.
"""

from __future__ import annotations

from collections.abc import Mapping

import msgspec

from pdplug.adapters.wire import AdapterWire, adapter_wire

__all__ = ["BackendSettings", "settings_from"]

_MARK = "\x00"
_VARS = (
    ("hmac_key_file", "PDPLUG_SGLANG_KEY_FILE"),
    ("hmac_key", "PDPLUG_SGLANG_KEY"),
    ("bind_host", "PDPLUG_SGLANG_BIND_HOST (or SGLang's --host)"),
    ("advertise_host", "PDPLUG_SGLANG_ADVERTISE_HOST"),
)


def _float(env: Mapping[str, str], name: str, default: float) -> float:
    raw = env.get(name, "")
    if not raw:
        return default
    try:
        value = float(raw)
    except ValueError:
        raise ValueError(f"{name}={raw!r} is not a number of seconds") from None
    if not value > 0:
        raise ValueError(f"{name}={raw!r} must be > 0")
    return value


def _int(env: Mapping[str, str], name: str, default: int) -> int:
    raw = env.get(name, "")
    if not raw:
        return default
    try:
        value = int(raw)
    except ValueError:
        raise ValueError(f"{name}={raw!r} is not a whole number of tokens") from None
    if value <= 0:
        raise ValueError(f"{name}={raw!r} must be > 0")
    return value


class BackendSettings(msgspec.Struct, frozen=True, kw_only=True):
    """What every pdplug piece of one SGLang engine is built with.

    :ivar net: socket rules (key, bind host) and the advertised host.
    :ivar bootstrap_timeout_s/waiting_timeout_s/transfer_timeout_s: room deadlines (seconds).
    :ivar pack_region_tokens: pack region capacity (tokens).
    :ivar chunk_tokens: split grid of sends (tokens).
    """

    net: AdapterWire
    bootstrap_timeout_s: float = 300.0
    waiting_timeout_s: float = 300.0
    transfer_timeout_s: float = 30.0
    pack_region_tokens: int = 8192
    chunk_tokens: int = 8192


def settings_from(
    env: Mapping[str, str], *, host: str, chunked_prefill_size: int | None
) -> BackendSettings:
    """Read the settings of one engine.

    :param env: the process environment.
    :param host: SGLang's ``--host`` (the default bind host).
    :param chunked_prefill_size: SGLang's ``--chunked-prefill-size`` (None or <= 0: 8192).
    :raises ValueError: a malformed variable or inconsistent socket settings (each names the
        variable and the value).
    """
    try:
        net = adapter_wire(
            hmac_key=env.get("PDPLUG_SGLANG_KEY") or None,
            hmac_key_file=env.get("PDPLUG_SGLANG_KEY_FILE") or None,
            bind_host=env.get("PDPLUG_SGLANG_BIND_HOST") or host,
            advertise_host=env.get("PDPLUG_SGLANG_ADVERTISE_HOST", ""),
            where=_MARK,
        )
    except ValueError as e:  # name the environment variables, not adapter_wire's fields
        msg = str(e)
        for field, var in _VARS:
            msg = msg.replace(_MARK + field, var)
        raise ValueError(msg) from None
    grid = chunked_prefill_size if chunked_prefill_size and chunked_prefill_size > 0 else 8192
    return BackendSettings(
        net=net,
        bootstrap_timeout_s=_float(env, "SGLANG_DISAGGREGATION_BOOTSTRAP_TIMEOUT", 300.0),
        waiting_timeout_s=_float(env, "SGLANG_DISAGGREGATION_WAITING_TIMEOUT", 300.0),
        transfer_timeout_s=_float(env, "PDPLUG_SGLANG_TRANSFER_TIMEOUT_S", 30.0),
        pack_region_tokens=_int(env, "PDPLUG_SGLANG_PACK_REGION_TOKENS", 8192),
        chunk_tokens=_int(env, "PDPLUG_SGLANG_CHUNK_TOKENS", grid),
    )
