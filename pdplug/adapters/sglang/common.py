"""What the SGLang backend's manager, sender and receiver share: names, per-room state records
and small readers of SGLang's settings."""

from __future__ import annotations

import os
from typing import Any

import msgspec

from pdplug.adapters.push import PushCursor
from pdplug.types import KVPoll

__all__ = [
    "CONNECT_WAIT_S",
    "DIRECTORY",
    "TERMINAL",
    "PrefillInfo",
    "SendRoom",
    "drained",
    "env_flag",
    "par",
]

#: the rendezvous instance naming a prefill engine's pdplug instances
DIRECTORY = "sglang-prefill"

#: the statuses a room ends in
TERMINAL = (KVPoll.Success, KVPoll.Failed)

#: how long a decode scheduler waits, once per prefill address, for its first connect (seconds)
CONNECT_WAIT_S = 2.0


def par(name: str, default: Any) -> Any:
    """A value of SGLang's ``get_parallel()`` (``attn_tp_size``, ``pp_size`` ...), or
    ``default`` where it is not set."""
    from sglang.srt.runtime_context import get_parallel

    try:
        return getattr(get_parallel(), name)
    except (AttributeError, RuntimeError, ValueError):
        return default


def env_flag(name: str, default: bool) -> bool:
    """An on/off environment variable (``1/true/yes/on``); ``default`` when unset or empty."""
    raw = os.environ.get(name)
    if raw is None or raw == "":
        return default
    return raw.strip().lower() in ("1", "true", "yes", "on")


def drained(session: Any, room: int) -> bool:
    """Whether no write of ``room`` is in flight in ``session`` (True for a room it forgot)."""
    try:
        return bool(session.drained(room))
    except KeyError:
        return True


class SendRoom(msgspec.Struct, kw_only=True):
    """Prefill-side state of one request (engine thread of SGLang's scheduler only).

    Token counts are tokens, page counts pages, times ``time.monotonic()`` seconds.
    """

    cursor: PushCursor
    planes: tuple[str, ...]
    num_pages: int = -1
    aux_index: int | None = None
    pos: int = -1  # next token to send; -1 until the decode prefix is known
    sent_pages: int = 0
    decode_prefix_len: int = -1  # from the decode's DestInfo, read once
    capacity: int | None = -1  # KVSender.capacity_tokens, read once (-1: not yet)
    sent_bytes: int = 0
    started: float = 0.0
    finished: float = 0.0
    failure: str | None = None
    aborted: bool = False
    orphan: bool = False  # aborted before SGLang saw it end: it may never poll it again


class PrefillInfo(msgspec.Struct, kw_only=True):
    """What SGLang's decode queue reads of ``prefill_info_table[addr]``."""

    instance: str
    planes: dict[str, str]
    attn_tp_size: int = 1
    attn_cp_size: int = 1
    dp_size: int = 1
    pp_size: int = 1
    page_size: int | None = None
    kv_cache_dtype: str | None = None
    follow_bootstrap_room: bool = True
    decode_allocation_policy: str = "early"
