"""A streaming client of SGLang's native ``/generate`` for token-id prompts, with TTFT.

Requests go out concurrently (bounded) with ``input_ids``, greedy, ``ignore_eos``; each is
bounded in time and every answer is checked: an HTTP error, an ``error`` event in the
stream, a request SGLang finished as ``abort`` (how a failed KV transfer ends on decode) or
a wrong token count is a :class:`~pdplug_engines.tokens.RequestFailed`, never a silent
short answer. SGLang streams the whole ``output_ids`` so far in every event (without
``--incremental-streaming-output``): the last event's ids are the answer.
"""

from __future__ import annotations

import json
import time
from collections.abc import Sequence
from typing import Any

from pdplug_engines.client import run_all
from pdplug_engines.tokens import Completion, RequestFailed

__all__ = ["generate_all"]


def _abort_reason(doc: dict[str, Any]) -> str | None:
    reason = (doc.get("meta_info") or {}).get("finish_reason") or {}
    if isinstance(reason, dict) and reason.get("type") == "abort":
        return str(reason.get("message") or reason)
    return None


async def _one(
    client: Any, url: str, index: int, prompt: Sequence[int], max_tokens: int
) -> Completion | RequestFailed:
    body = {
        "input_ids": list(prompt),
        "sampling_params": {"max_new_tokens": max_tokens, "temperature": 0.0, "ignore_eos": True},
        "stream": True,
    }
    t0 = time.perf_counter()
    ttft = 0.0
    tokens: list[int] = []
    async with client.stream("POST", url + "/generate", json=body) as r:
        if r.status_code != 200:
            text = (await r.aread()).decode(errors="replace")
            return RequestFailed(index, f"HTTP {r.status_code}: {text[:300]}")
        async for line in r.aiter_lines():
            if not line.startswith("data:") or line.strip() == "data: [DONE]":
                continue
            doc = json.loads(line[5:])
            if "error" in doc:
                return RequestFailed(index, f"stream error: {doc['error']}")
            aborted = _abort_reason(doc)
            if aborted is not None:
                return RequestFailed(index, f"aborted: {aborted}")
            ids = doc.get("output_ids") or []
            if ids and not tokens:
                ttft = time.perf_counter() - t0
            if len(ids) >= len(tokens):
                tokens = list(ids)
    if len(tokens) != max_tokens:
        return RequestFailed(index, f"got {len(tokens)} tokens, expected {max_tokens}")
    return Completion(
        index=index, tokens=tuple(tokens), ttft_s=ttft, latency_s=time.perf_counter() - t0
    )


def generate_all(
    url: str,
    prompts: Sequence[Sequence[int]],
    max_tokens: int,
    *,
    concurrency: int = 4,
    timeout_s: float = 120.0,
) -> list[Completion | RequestFailed]:
    """Send every prompt to ``url``'s ``/generate`` and collect the answers in order.

    :param url: base URL of an SGLang engine or of SGLang's router.
    :param prompts: token-id prompts.
    :param max_tokens: tokens to generate per request (``max_new_tokens``).
    :param concurrency: requests in flight at once.
    :param timeout_s: bound of one request (seconds).
    """
    return run_all(_one, url, prompts, max_tokens, concurrency=concurrency, timeout_s=timeout_s)
