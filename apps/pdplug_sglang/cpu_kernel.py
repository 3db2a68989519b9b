"""CPU stand-in for ``sgl_kernel``, for the SGLang engines the harness launches.

SGLang 0.5.23 with ``SGLANG_USE_CPU_ENGINE=1`` imports ``sgl_kernel`` unconditionally
(``sglang/srt/mem_cache/allocation.py``, ``sglang/kernels/ops/kvcache/cache_move.py``), and
PyPI ships no CPU build of it. The one op the CPU path of a tiny Llama calls is
``assign_req_to_token_pool_cpu``; it is written here in torch. Every other name resolves to a
function that raises ``NotImplementedError`` naming the op, so a path this stand-in does not
cover fails loudly instead of computing something wrong.

:func:`pdplug_sglang.overlay.write_overlay` writes an ``sgl_kernel`` package that re-exports
this module into a folder that the harness puts first on the ``PYTHONPATH`` of the engine
processes it starts; nothing is installed into site-packages.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

__version__ = "0.0.0+pdplug-cpu-standin"


def assign_req_to_token_pool_cpu(
    req_pool_indices: torch.Tensor,
    req_to_token: torch.Tensor,
    start_offset: torch.Tensor,
    end_offset: torch.Tensor,
    out_cache_loc: torch.Tensor,
    pool_len: int,
) -> None:
    """Write each request's new KV slots into its row of the request-to-token table.

    For request ``i``: ``req_to_token[req_pool_indices[i], start_offset[i]:end_offset[i]]``
    takes the next ``end_offset[i] - start_offset[i]`` entries of ``out_cache_loc`` (the slots of
    the requests before ``i`` come first).

    :param req_pool_indices: ``(B,)`` int, rows of ``req_to_token``.
    :param req_to_token: ``(rows, pool_len)`` int32, written in place.
    :param start_offset: ``(B,)`` int, first token position written per request.
    :param end_offset: ``(B,)`` int, one past the last position per request.
    :param out_cache_loc: ``(sum(end - start),)`` int, KV slot per new token.
    :param pool_len: ``req_to_token.shape[1]`` (tokens per row).
    :raises ValueError: ``out_cache_loc`` is shorter than the tokens to write.
    """
    lengths = (end_offset - start_offset).to(torch.int64)
    total = int(lengths.sum())
    if total == 0:
        return
    if out_cache_loc.numel() < total:
        raise ValueError(
            f"assign_req_to_token_pool_cpu: out_cache_loc has {out_cache_loc.numel()} slots, "
            f"the requests need {total}"
        )
    rows = torch.repeat_interleave(req_pool_indices.to(torch.int64), lengths)
    firsts = torch.cumsum(lengths, 0) - lengths
    cols = torch.arange(total, dtype=torch.int64) - torch.repeat_interleave(firsts, lengths)
    cols += torch.repeat_interleave(start_offset.to(torch.int64), lengths)
    flat = rows * pool_len + cols
    req_to_token.view(-1)[flat] = out_cache_loc[:total].to(req_to_token.dtype)


def __getattr__(name: str) -> Callable[..., Any]:
    if name.startswith("__"):
        raise AttributeError(name)

    def refuse(*_args: object, **_kwargs: object) -> None:
        raise NotImplementedError(
            f"sgl_kernel.{name}: not provided by pdplug's CPU stand-in (only "
            "assign_req_to_token_pool_cpu is)"
        )

    refuse.__name__ = name
    return refuse
