"""Bounded concurrent streaming requests to an engine: the runner both engines' clients share.

Each request is one coroutine ``one(client, url, index, prompt, max_tokens)``; at most
``concurrency`` run at once, each bounded by ``timeout_s``, and a transport error, a timeout or
an unreadable event becomes that request's :class:`~pdplug_engines.tokens.RequestFailed`.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Awaitable, Callable, Sequence
from typing import Any

from pdplug_engines.tokens import Completion, RequestFailed

__all__ = ["OneRequest", "run_all"]

Answer = Completion | RequestFailed
OneRequest = Callable[[Any, str, int, Sequence[int], int], Awaitable[Answer]]


async def _all(
    one: OneRequest,
    url: str,
    prompts: Sequence[Sequence[int]],
    max_tokens: int,
    concurrency: int,
    timeout_s: float,
) -> list[Answer]:
    import httpx

    sem = asyncio.Semaphore(concurrency)
    # one connection per request (no keep-alive): a pooled connection the server's
    # keep-alive timer closes fails the next request (ReadError) on a loaded host
    limits = httpx.Limits(max_connections=concurrency + 4, max_keepalive_connections=0)
    async with httpx.AsyncClient(timeout=httpx.Timeout(timeout_s), limits=limits) as client:

        async def bounded(i: int, p: Sequence[int]) -> Answer:
            async with sem:
                try:
                    return await asyncio.wait_for(one(client, url, i, p, max_tokens), timeout_s)
                except (httpx.HTTPError, TimeoutError, json.JSONDecodeError) as e:
                    return RequestFailed(i, f"{type(e).__name__}: {e}")

        return list(await asyncio.gather(*(bounded(i, p) for i, p in enumerate(prompts))))


def run_all(
    one: OneRequest,
    url: str,
    prompts: Sequence[Sequence[int]],
    max_tokens: int,
    *,
    concurrency: int = 4,
    timeout_s: float = 120.0,
) -> list[Answer]:
    """Run ``one`` for every prompt and return the answers in prompt order.

    :param one: the engine's request coroutine (an httpx ``AsyncClient``, the base URL, the
        prompt's index, its token ids, tokens to generate).
    :param concurrency: requests in flight at once.
    :param timeout_s: bound of one request (seconds).
    """
    return asyncio.run(_all(one, url, prompts, max_tokens, concurrency, timeout_s))
