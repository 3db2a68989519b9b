"""Dynamic chunked-prefill sizing (after SGLang's ``ChunkSizePredictor``).

Fit the prefill latency of one chunk of ``l`` tokens as ``f(l) = a*l^2 + b*l + c`` (least
squares on profiling samples, the first one dropped as warm-up, at least 8 points, ``a <= 0``
rejected, ``b < 0`` clamped to 0). For a request with ``L`` tokens already computed, attention
makes the next chunk costlier, so pick ``x`` with equal marginal cost to a base chunk from
zero: ``f(L + x) - f(L) = f(base) - f(0)``, i.e. the positive root of
``a*x^2 + (2aL + b)*x - T = 0`` with ``T = a*base^2 + b*base``; then smooth towards ``base``,
floor at ``base // 4``, align down to ``max(page_size, 64)`` and cap at
``min(context_len - L - 100, max_prefill_tokens)``.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Sequence

import msgspec
import numpy as np

__all__ = ["ChunkModel", "MIN_POINTS", "fit_chunk_model", "predict_chunk_size"]

log = logging.getLogger(__name__)

#: Samples required after dropping the warm-up sample.
MIN_POINTS = 8
#: Tokens kept free below the context length (SGLang's margin).
CONTEXT_MARGIN = 100


class ChunkModel(msgspec.Struct, frozen=True):
    """Fitted latency model ``f(l) = a*l^2 + b*l + c`` (seconds; ``l`` in tokens)."""

    a: float
    b: float
    c: float

    def __call__(self, tokens: float) -> float:
        """Predicted seconds for a chunk of ``tokens`` tokens from an empty history."""
        return (self.a * tokens + self.b) * tokens + self.c


def fit_chunk_model(samples: Sequence[tuple[int, float]]) -> ChunkModel | None:
    """Least-squares fit of ``(tokens, seconds)`` profiling samples, or None (logged) when the
    fit is unusable.

    The first sample is dropped (warm-up); fewer than :data:`MIN_POINTS` remaining, a
    non-finite fit, or ``a <= 0`` rejects the fit; ``b < 0`` is clamped to 0.
    """
    pts = np.asarray(samples, dtype=np.float64).reshape(-1, 2)[1:]
    if pts.shape[0] < MIN_POINTS:
        log.warning(
            "dynamic chunking off: %d profiling samples after dropping the warm-up one, need "
            ">= %d; using the base chunk size",
            pts.shape[0],
            MIN_POINTS,
        )
        return None
    x, y = pts[:, 0], pts[:, 1]
    if not (np.isfinite(x).all() and np.isfinite(y).all()):
        log.warning("dynamic chunking off: non-finite profiling samples; using the base size")
        return None
    scale = max(float(np.abs(x).max()), 1.0)  # conditioning: fit in units of scale tokens
    u = x / scale
    coef, *_ = np.linalg.lstsq(np.stack((u * u, u, np.ones_like(u)), axis=1), y, rcond=None)
    a, b, c = coef[0] / scale**2, coef[1] / scale, coef[2]
    if not (math.isfinite(a) and math.isfinite(b) and math.isfinite(c)) or a <= 0:
        log.warning(
            "dynamic chunking off: fitted f(l)=a*l^2+b*l+c has a=%.3g (need a > 0), b=%.3g, "
            "c=%.3g over %d samples; using the base chunk size",
            a,
            b,
            c,
            pts.shape[0],
        )
        return None
    return ChunkModel(float(a), max(float(b), 0.0), float(c))


def predict_chunk_size(
    model: ChunkModel | None,
    history_len: int,
    *,
    base: int,
    page_size: int,
    smooth_factor: float,
    max_prefill_tokens: int,
    context_len: int,
) -> int:
    """Next chunk size (tokens) for a request with ``history_len`` tokens already computed.

    Without a model, or when the capped size falls below one alignment unit
    (``max(page_size, 64)``), returns ``base`` capped at ``max_prefill_tokens`` (the host
    clamps to the tokens it has left).

    :raises ValueError: negative ``history_len``, non-positive ``base``/``page_size``, or
        ``smooth_factor`` outside [0, 1].
    """
    if history_len < 0:
        raise ValueError(f"history_len={history_len} must be >= 0")
    if base <= 0 or page_size <= 0:
        raise ValueError(f"base chunk size {base} and page_size {page_size} must be > 0")
    if not 0.0 <= smooth_factor <= 1.0:
        raise ValueError(f"smooth_factor={smooth_factor} must be in [0, 1]")
    fallback = min(base, max_prefill_tokens)
    if model is None:
        return fallback
    t = model.a * base * base + model.b * base
    bq = 2.0 * model.a * history_len + model.b
    x = 2.0 * t / (bq + math.sqrt(bq * bq + 4.0 * model.a * t))  # stable positive root
    x = base + smooth_factor * (x - base)
    x = max(x, base // 4)
    align = max(page_size, 64)
    cap = min(context_len - history_len - CONTEXT_MARGIN, max_prefill_tokens)
    # +1e-6: x == base at L == 0 must not round down to the previous alignment unit
    size = min(int(x + 1e-6) // align * align, cap) // align * align
    return size if size >= align else fallback
