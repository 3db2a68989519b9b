"""The ``default`` scheduler: capacity/grid send splitting and dynamic chunked-prefill sizing.

See :mod:`pdplug_scheduler.split` (SGLang PRs #30545/#40376) and
:mod:`pdplug_scheduler.chunking` (SGLang ``ChunkSizePredictor``).
"""

from __future__ import annotations

from collections.abc import Sequence

from pdplug import SchedulerConfig
from pdplug.types import Segment
from pdplug_scheduler.chunking import ChunkModel, fit_chunk_model, predict_chunk_size
from pdplug_scheduler.split import grid_tokens, split_send

__all__ = ["DefaultScheduler", "make_scheduler"]


class DefaultScheduler:
    """Satisfies :class:`pdplug.protocols.Scheduler`.

    :ivar config: the :class:`pdplug.SchedulerConfig` (page size, base chunk size …).
    :ivar grid: split grid in tokens (``config.chunk_size`` floored to whole pages, >= 1 page).
    :ivar model: the fitted latency model, or None (base chunk size is used).
    """

    def __init__(self, config: SchedulerConfig) -> None:
        if config.page_size <= 0:
            raise ValueError(f"SchedulerConfig.page_size must be > 0, got {config.page_size}")
        if config.chunk_size <= 0:
            raise ValueError(f"SchedulerConfig.chunk_size must be > 0, got {config.chunk_size}")
        if not 0.0 <= config.smooth_factor <= 1.0:
            raise ValueError(
                f"SchedulerConfig.smooth_factor must be in [0, 1], got {config.smooth_factor}"
            )
        if config.max_prefill_tokens <= 0:
            raise ValueError(
                f"SchedulerConfig.max_prefill_tokens must be > 0, got {config.max_prefill_tokens}"
            )
        self.config = config
        self.grid = grid_tokens(config.chunk_size, config.page_size)
        self.model: ChunkModel | None = None

    def split_send(
        self,
        *,
        token_start: int,
        token_end: int,
        decode_prefix_len: int,
        is_last_send: bool,
        capacity_tokens: int | None,
        first_chunk_id: int = 0,
    ) -> list[Segment]:
        """Split tokens ``[token_start, token_end)`` at ``decode_prefix_len + k*min(grid,
        capacity_tokens)`` (tokens); see :func:`pdplug_scheduler.split.split_send`.

        :raises ValueError: naming the bad value.
        """
        return split_send(
            token_start=token_start,
            token_end=token_end,
            decode_prefix_len=decode_prefix_len,
            is_last_send=is_last_send,
            capacity_tokens=capacity_tokens,
            page_size=self.config.page_size,
            grid=self.grid,
            first_chunk_id=first_chunk_id,
        )

    def fit_chunk_model(self, samples: Sequence[tuple[int, float]]) -> None:
        """Fit ``f(l)=a*l^2+b*l+c`` to ``(tokens, seconds)`` samples; a rejected fit (logged)
        leaves dynamic chunking off (:meth:`next_chunk_size` returns the base size)."""
        self.model = fit_chunk_model(samples)

    def next_chunk_size(self, history_len: int) -> int:
        """Tokens of the next prefill chunk with ``history_len`` tokens already computed.

        :raises ValueError: ``history_len < 0``.
        """
        c = self.config
        return predict_chunk_size(
            self.model,
            history_len,
            base=c.chunk_size,
            page_size=c.page_size,
            smooth_factor=c.smooth_factor,
            max_prefill_tokens=c.max_prefill_tokens,
            context_len=c.context_len,
        )


def make_scheduler(config: SchedulerConfig) -> DefaultScheduler:
    """Factory of the ``default`` scheduler (entry point
    ``pdplug_scheduler.scheduler:make_scheduler``).

    :raises ValueError: a non-positive page size, chunk size or max prefill tokens, or a
        smoothing factor outside [0, 1].
    """
    return DefaultScheduler(config)
