"""Single-process reference run: the whole model, plain paged attention, no PP/DCP/transfer.

``pdplug demo`` compares every request's disaggregated output with this.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch

from pdplug_host.model import (
    ModelConfig,
    PagedKVCache,
    TinyLlama,
    build_model,
    decode_step,
    greedy,
    pages_needed,
    prefill_chunk,
)
from pdplug_host.trace import TraceRequest, prompt_tokens

__all__ = ["reference_run"]


def reference_run(
    requests: Sequence[TraceRequest],
    config: ModelConfig | None = None,
    *,
    model: TinyLlama | None = None,
    page_size: int = 16,
    chunk_size: int | None = None,
    token_seed: int = 0,
    batch_size: int = 16,
    progress: Callable[[int], None] | None = None,
) -> dict[int, list[int]]:
    """Greedy outputs of ``requests`` from one process running all layers.

    Requests run in groups of ``batch_size``: each prompt is prefilled on its own (in chunks of
    ``chunk_size`` tokens, or at once when None), then the group decodes together, one token per
    live request per step, until each has ``req.output_len`` tokens (the first comes from the
    prefill logits). Pages are freed after every group, so memory scales with the group.

    :param config: model config (ignored when ``model`` is given); default ``ModelConfig()``.
    :param token_seed: seed of ``prompt_tokens`` (must match the disaggregated run).
    :param progress: called with the rid of each request as it finishes.

    :returns: ``{req.rid: [output_len token ids]}``.

    :raises ValueError: ``chunk_size`` or ``batch_size`` < 1, or duplicate rids.
    """
    if chunk_size is not None and chunk_size < 1:
        raise ValueError(f"chunk_size must be >= 1, got {chunk_size}")
    if batch_size < 1:
        raise ValueError(f"batch_size must be >= 1, got {batch_size}")
    if len({r.rid for r in requests}) != len(requests):
        raise ValueError("duplicate request ids")
    mdl = model if model is not None else build_model(config)
    results: dict[int, list[int]] = {}
    for g0 in range(0, len(requests), batch_size):
        group = list(requests[g0 : g0 + batch_size])
        # The last generated token is never fed back, hence output_len - 1 decode positions.
        need = [pages_needed(r.input_len + r.output_len - 1, page_size) for r in group]
        cache = PagedKVCache(mdl.config, max(1, sum(need)), page_size)
        pages = [cache.alloc(n) for n in need]
        last: list[int] = []
        for req, pg in zip(group, pages):
            ids = torch.from_numpy(prompt_tokens(req, mdl.config.vocab, token_seed))
            step = chunk_size or req.input_len
            for start in range(0, req.input_len, step):
                logits = prefill_chunk(mdl, cache, ids[start : start + step], pg, start)
            tok = int(greedy(logits))
            results[req.rid] = [tok]
            last.append(tok)
        live = [i for i, r in enumerate(group) if r.output_len > 1]
        for r in group:
            if r.output_len == 1 and progress is not None:
                progress(r.rid)
        while live:
            logits = decode_step(
                mdl,
                cache,
                torch.tensor([last[i] for i in live], dtype=torch.int64),
                [pages[i] for i in live],
                [group[i].input_len + len(results[group[i].rid]) - 1 for i in live],
            )
            toks = greedy(logits).tolist()
            still = []
            for i, tok in zip(live, toks):
                req = group[i]
                results[req.rid].append(tok)
                last[i] = tok
                if len(results[req.rid]) < req.output_len:
                    still.append(i)
                elif progress is not None:
                    progress(req.rid)
            live = still
    return results
