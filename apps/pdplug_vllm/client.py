"""A streaming OpenAI-completions client for token-id prompts, with per-request TTFT.

Requests go out concurrently (bounded), each is bounded in time, and every answer is checked:
an HTTP error, an error event in the stream, or a wrong token count is a
:class:`~pdplug_engines.tokens.RequestFailed` in the result, never a silent short answer.
"""

from __future__ import annotations

import json
import time
from collections.abc import Sequence
from typing import Any

from pdplug_engines.client import run_all
from pdplug_engines.tokens import Completion, RequestFailed

__all__ = ["complete_all"]


async def _one(
    client: Any, url: str, index: int, prompt: Sequence[int], max_tokens: int
) -> Completion | RequestFailed:
    body = {
        "model": "tiny",
        "prompt": list(prompt),
        "max_tokens": max_tokens,
        "temperature": 0.0,
        "ignore_eos": True,
        "stream": True,
        "return_token_ids": True,
    }
    t0 = time.perf_counter()
    ttft = 0.0
    tokens: list[int] = []
    async with client.stream("POST", url + "/v1/completions", json=body) as r:
        if r.status_code != 200:
            text = (await r.aread()).decode(errors="replace")
            return RequestFailed(index, f"HTTP {r.status_code}: {text[:300]}")
        async for line in r.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            doc = json.loads(line[6:])
            if "error" in doc:
                return RequestFailed(index, f"stream error: {doc['error']}")
            for choice in doc.get("choices", ()):
                new = choice.get("token_ids") or ()
                if new and not tokens:
                    ttft = time.perf_counter() - t0
                tokens.extend(new)
    if len(tokens) != max_tokens:
        return RequestFailed(index, f"got {len(tokens)} tokens, expected {max_tokens}")
    return Completion(
        index=index, tokens=tuple(tokens), ttft_s=ttft, latency_s=time.perf_counter() - t0
    )


def complete_all(
    url: str,
    prompts: Sequence[Sequence[int]],
    max_tokens: int,
    *,
    concurrency: int = 4,
    timeout_s: float = 120.0,
) -> list[Completion | RequestFailed]:
    """Send every prompt (streaming, greedy, ``ignore_eos``) and collect the answers in order.

    :param url: base URL of an engine or of ``pdplug proxy``.
    :param prompts: token-id prompts.
    :param max_tokens: tokens to generate per request.
    :param concurrency: requests in flight at once.
    :param timeout_s: bound of one request (seconds).
    """
    return run_all(_one, url, prompts, max_tokens, concurrency=concurrency, timeout_s=timeout_s)
