"""Answers of an engine run, the token parity of two runs, and the KV bytes prompts need.

A disaggregated pair is right when every request gets the tokens a single engine gives it
(greedy decoding, the same model): :func:`compare_tokens` compares two runs request by
request; :func:`kv_bytes_bounds` says how many KV bytes the pair may move for a prompt set.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

import msgspec

if TYPE_CHECKING:
    from pdplug_engines.tiny_model import TinyLlama

__all__ = [
    "Completion",
    "RequestFailed",
    "TokenParity",
    "compare_tokens",
    "kv_bytes_bounds",
    "percentile",
]


class RequestFailed(msgspec.Struct, frozen=True):
    """Why one request failed (HTTP status or stream error text)."""

    index: int
    reason: str


class Completion(msgspec.Struct, frozen=True, kw_only=True):
    """One answered request.

    :ivar index: position in the prompt list.
    :ivar tokens: generated token ids.
    :ivar ttft_s: seconds from sending to the first generated token.
    :ivar latency_s: seconds from sending to the last byte.
    """

    index: int
    tokens: tuple[int, ...]
    ttft_s: float
    latency_s: float


class TokenParity(msgspec.Struct, frozen=True, kw_only=True):
    """Two runs of the same prompts compared request by request.

    :ivar identical: requests answered on both runs with the same tokens.
    :ivar failed: requests that failed on either run (index, ``"<label>: <reason>"``).
    :ivar differ: requests answered on both runs with different tokens (index, first
        differing position, prompt tokens).
    """

    identical: int
    failed: list[tuple[int, str]]
    differ: list[tuple[int, int, int]]


def compare_tokens(
    ref: Sequence[Completion | RequestFailed],
    got: Sequence[Completion | RequestFailed],
    prompts: Sequence[Sequence[int]],
    *,
    labels: tuple[str, str] = ("single", "disagg"),
) -> TokenParity:
    """Compare ``got`` with ``ref`` (the same prompts, in order).

    :param ref: the reference run's answers (a single engine).
    :param got: the run under test (the disaggregated pair).
    :param prompts: the prompts (their lengths are reported with a difference).
    :param labels: names of the two runs in ``failed``.
    """
    failed = [(r.index, f"{labels[0]}: {r.reason}") for r in ref if isinstance(r, RequestFailed)]
    failed += [(r.index, f"{labels[1]}: {r.reason}") for r in got if isinstance(r, RequestFailed)]
    pairs = [
        (a, b) for a, b in zip(ref, got) if isinstance(a, Completion) and isinstance(b, Completion)
    ]
    differ = [
        (a.index, next(i for i, (x, y) in enumerate(zip(a.tokens, b.tokens)) if x != y),
         len(prompts[a.index]))
        for a, b in pairs
        if a.tokens != b.tokens
    ]  # fmt: skip
    return TokenParity(
        identical=sum(a.tokens == b.tokens for a, b in pairs), failed=failed, differ=differ
    )


def percentile(values: Sequence[float], q: float) -> float:
    """The ``q``-th percentile (0-100, nearest rank) of ``values``; 0.0 when empty."""
    if not values:
        return 0.0
    s = sorted(values)
    k = max(0, min(len(s) - 1, round(q / 100 * len(s) + 0.5) - 1))
    return s[k]


def kv_bytes_bounds(
    prompts: Sequence[Sequence[int]], spec: TinyLlama, block_size: int, unit_tokens: int
) -> tuple[int, int, int]:
    """``(min, max, unit)`` bytes a decode engine receives for ``prompts`` sent in order.

    ``max``: no decode prefix-cache hit. ``min``: each prompt hits every full block an
    earlier prompt shares (engines cache full blocks and always compute the last prompt
    token). ``unit``: ``unit_tokens`` tokens of KV (1 for a token-exact transfer,
    ``block_size`` when whole blocks move).
    """
    per_token = spec.num_hidden_layers * spec.num_key_value_heads * 2 * spec.head_dim
    per_token *= 4 if spec.dtype == "float32" else 2
    seen: set[tuple[int, ...]] = set()
    lo = hi = 0
    for p in prompts:
        blocks = [tuple(p[: (i + 1) * block_size]) for i in range(len(p) // block_size)]
        hit = 0
        for b in blocks:
            if b not in seen or len(b) >= len(p):
                break
            hit = len(b)
        seen.update(blocks)
        units = lambda n: -(-n // unit_tokens) * unit_tokens  # noqa: E731
        lo += units(len(p) - hit)
        hi += units(len(p))
    return lo * per_token, hi * per_token, per_token * unit_tokens
