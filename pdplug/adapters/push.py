"""Turns a prefill engine's per-step :class:`SendJob` s into the segments a KV sender posts.

Each prefill rank keeps one :class:`PushCursor` per room. When a step's forward is done, the
rank feeds the step's job through :func:`segments_for_job` with the room's destination (its
``decode_prefix_len`` from the decode ranks' DestInfo) and the sender's pack capacity; the
selected pdplug :class:`~pdplug.protocols.Scheduler` cuts the new tokens at
``decode_prefix_len + k * min(grid, capacity)``. Tokens the decode engine already holds are
never sent; a partial last page is held back until the job that completes the prompt; the
job with ``is_last`` always yields a final segment (possibly empty) that completes the room.

The job type is the engine's view reduced to what a send needs (room, the tokens now in the
KV cache, their source pages, whether the prompt is complete), so the vLLM adapter (one job
per scheduled request and step, every block id so far) and an SGLang sender (one job per
``send(kv_indices)``, the pages of that chunk only: ``first_page``) share the cutting rules.

:func:`step_ready` says when a step's KV may be read: at once on CPU, after a CUDA event on a
GPU (recorded on the forward's stream, polled by the sender: no stream synchronisation).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import msgspec
import numpy as np

from pdplug.protocols import Scheduler
from pdplug.types import Segment

__all__ = ["SendJob", "PushCursor", "segments_for_job", "step_ready"]


class SendJob(msgspec.Struct, frozen=True, kw_only=True):
    """A prefill rank: push tokens ``[token_start, token_end)`` of ``room``, complete now.

    :ivar req_id: the engine's request id (opaque to pdplug: the adapter's own bookkeeping,
        e.g. vLLM's ``finished_sending``; "" when the engine does not give one).
    :ivar room: bootstrap room.
    :ivar page_ids: the request's page ids in token order from page ``first_page`` on (vLLM
        block id = pdplug page id): ``page_ids[i]`` holds tokens ``[(first_page + i) *
        page_size, (first_page + i + 1) * page_size)``.
    :ivar first_page: index (in the request) of the page ``page_ids[0]`` is; 0 when
        ``page_ids`` starts at the request's first token (vLLM), the chunk's first page when
        the engine hands over one chunk's pages per send (SGLang's ``kv_indices``).
    :ivar token_start/token_end: the tokens whose KV is complete after this step (tokens).
    :ivar num_prompt_tokens: prompt length (tokens).
    :ivar is_last: ``token_end`` reaches the prompt: the room completes with this job.
    """

    req_id: str = ""
    room: int
    page_ids: tuple[int, ...]
    first_page: int = 0
    token_start: int
    token_end: int
    num_prompt_tokens: int
    is_last: bool


class PushCursor(msgspec.Struct, kw_only=True):
    """Per-room progress of one prefill rank.

    :ivar room: bootstrap room.
    :ivar sent_upto: tokens covered by segments already handed to the sender.
    :ivar next_chunk_id: ``chunk_id`` of the next segment (0, 1, ... per rank).
    :ivar done: the last segment was produced.
    """

    room: int
    sent_upto: int = 0
    next_chunk_id: int = 0
    done: bool = False


def segments_for_job(
    cursor: PushCursor,
    job: SendJob,
    *,
    decode_prefix_len: int,
    capacity_tokens: int | None,
    block_size: int,
    scheduler: Scheduler,
    whole_pages: bool = False,
) -> list[tuple[Segment, np.ndarray]]:
    """The segments of ``job`` to post now, each with its source pages; advances ``cursor``.

    :param cursor: the room's cursor on this rank (updated in place).
    :param job: this step's job (tokens ``[job.token_start, job.token_end)`` are computed).
    :param decode_prefix_len: tokens the decode engine already holds (a multiple of
        ``block_size`` times the decode DCP size; the split grid's origin).
    :param capacity_tokens: ``KVSender.capacity_tokens(room)`` (None: no relayout, no cap).
    :param block_size: prefill page (vLLM block) size in tokens.
    :param scheduler: the selected pdplug scheduler (``PluginManager.make_scheduler``).
    :param whole_pages: the last job's end is rounded up to a page boundary, so the prompt's
        last page moves whole (vLLM's CPU attention tiles a block's K slab: a token is not a
        row of it, only whole blocks can be copied).
    :returns: ``(segment, src_pages)`` pairs in order; ``src_pages`` is int64 ``[n]``, the
        pages of the segment's tokens from its first token on.
    :raises ValueError: a job for another room, a job after the last one, a
        ``decode_prefix_len`` not on a page boundary or beyond the prompt, or ``page_ids``
        that do not hold a segment's pages (each names the values).
    """
    if job.room != cursor.room:
        raise ValueError(f"segments_for_job: job room {job.room} != cursor room {cursor.room}")
    if cursor.done:
        raise ValueError(f"segments_for_job: room {cursor.room} already sent its last segment")
    if decode_prefix_len % block_size or not 0 <= decode_prefix_len < job.num_prompt_tokens:
        raise ValueError(
            f"segments_for_job: decode_prefix_len={decode_prefix_len} must be a multiple of "
            f"block_size={block_size} in [0, {job.num_prompt_tokens})"
        )
    start = max(cursor.sent_upto, decode_prefix_len)
    end = job.token_end
    if whole_pages and job.is_last:
        end = -(-end // block_size) * block_size
    end = max(end, start)
    segments = scheduler.split_send(
        token_start=start,
        token_end=end,
        decode_prefix_len=decode_prefix_len,
        is_last_send=job.is_last,
        capacity_tokens=capacity_tokens,
        first_chunk_id=cursor.next_chunk_id,
    )
    if not segments:
        return []
    pages = np.asarray(job.page_ids, dtype=np.int64)
    out = []
    for s in segments:
        lo, hi = s.token_start // block_size, -(-s.token_end // block_size)
        if s.num_tokens and (lo < job.first_page or hi - job.first_page > len(pages)):
            raise ValueError(
                f"segments_for_job: room {job.room}: segment tokens [{s.token_start}, "
                f"{s.token_end}) need pages [{lo}, {hi}), the job holds pages "
                f"[{job.first_page}, {job.first_page + len(pages)})"
            )
        out.append((s, pages[max(lo - job.first_page, 0) : max(hi - job.first_page, 0)]))
    cursor.sent_upto = segments[-1].token_end
    cursor.next_chunk_id = segments[-1].chunk_id + 1
    cursor.done = segments[-1].is_last
    return out


def step_ready(device: str, make_event: Callable[[], Any] | None = None) -> Any:
    """The ``ready`` of this step's ``KVSender.send`` calls, made right after the forward
    enqueued its KV writes (vLLM ``wait_for_save``, SGLang's send after the forward).

    On a CUDA device: a new event (``make_event()``, default ``torch.cuda.Event()``) recorded
    on the current stream, so the sender polls ``event.query()`` instead of the engine
    blocking the step on ``stream.synchronize()``. On any other device (CPU: the forward
    wrote the KV synchronously): ``None``, nothing is created.

    :param device: the KV cache's device (``"cpu"``, ``"cuda:0"`` ...).
    :param make_event: event factory (tests pass a fake with ``record()``/``query()``).
    :returns: the recorded event, or ``None``.
    """
    if not device.startswith("cuda"):
        return None
    if make_event is None:
        import torch

        make_event = torch.cuda.Event
    event = make_event()
    event.record()  # on the current stream, after the forward's KV writes
    return event
