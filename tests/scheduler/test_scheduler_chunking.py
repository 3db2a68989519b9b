"""Dynamic chunked-prefill sizing: quadratic fit and next-chunk prediction."""

from __future__ import annotations

import logging
import math
from decimal import Decimal, getcontext

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from pdplug import SchedulerConfig
from pdplug_scheduler.chunking import ChunkModel, fit_chunk_model, predict_chunk_size
from pdplug_scheduler.scheduler import make_scheduler

A, B, C = 2e-9, 5e-5, 3e-3  # seconds: attention-quadratic + linear + fixed


def profile(a=A, b=B, c=C, n=64, base=8192, noise=0.0, seed=0):
    """SGLang-style profile: lengths from 1.25*base down, first sample a slow warm-up."""
    rng = np.random.default_rng(seed)
    step = int(1.25 * base) // n
    lengths = [int(1.25 * base) - k * step for k in range(n)]
    samples = [(lengths[0], 10.0)]  # warm-up outlier, must be dropped
    for x in lengths[1:]:
        samples.append((x, (a * x * x + b * x + c) * (1 + noise * rng.standard_normal())))
    return samples


def test_fit_recovers_the_model_and_drops_warmup() -> None:
    m = fit_chunk_model(profile())
    assert m is not None
    assert m.a == pytest.approx(A, rel=1e-6)
    assert m.b == pytest.approx(B, rel=1e-6)
    assert m.c == pytest.approx(C, rel=1e-4)
    # keeping the warm-up sample would have wrecked the fit
    pts = np.asarray(profile(), dtype=float)
    a_bad = np.polyfit(pts[:, 0], pts[:, 1], 2)[0]
    assert abs(a_bad - A) > 10 * A


def test_rejected_fits_fall_back_with_a_log(caplog) -> None:
    sched = make_scheduler(SchedulerConfig(page_size=64, chunk_size=8192))
    with caplog.at_level(logging.WARNING):
        sched.fit_chunk_model(profile()[:8])  # 7 points after the warm-up
    assert sched.model is None and "need >= 8" in caplog.text
    assert sched.next_chunk_size(50_000) == 8192
    caplog.clear()
    with caplog.at_level(logging.WARNING):
        sched.fit_chunk_model(profile(a=-1e-9, b=1e-4))  # concave: a <= 0
    assert sched.model is None and "need a > 0" in caplog.text
    assert sched.next_chunk_size(50_000) == 8192
    caplog.clear()
    with caplog.at_level(logging.WARNING):
        sched.fit_chunk_model([(1, 1.0)] + [(x, math.nan) for x in range(100, 1000, 100)])
    assert sched.model is None and "non-finite" in caplog.text


def test_negative_linear_term_is_clamped() -> None:
    m = fit_chunk_model(profile(b=-1e-6, c=1.0))
    assert m is not None and m.b == 0.0 and m.a == pytest.approx(A, rel=1e-3)


def explicit_next(m: ChunkModel, L, base, page, smooth, max_prefill, ctx):
    """Solve f(L+x) - f(L) = f(base) - f(0) with the textbook quadratic formula, in 50-digit
    decimal arithmetic; like the implementation, values within 1e-6 token below an alignment
    unit count as reaching it (x == base must stay base)."""
    getcontext().prec = 50
    a, b = Decimal(m.a), Decimal(m.b)
    t = a * base * base + b * base
    qb = 2 * a * L + b
    x = (-qb + (qb * qb + 4 * a * t).sqrt()) / (2 * a)
    x = base + Decimal(smooth) * (x - base)
    x = max(x, Decimal(base // 4))
    align = max(page, 64)
    x += Decimal("1e-6")
    size = min(int(x) // align * align, min(ctx - L - 100, max_prefill)) // align * align
    return size if size >= align else min(base, max_prefill)


@settings(max_examples=200, deadline=None)
@given(
    L=st.integers(0, 500_000),
    page=st.sampled_from([1, 16, 64, 128]),
    smooth=st.floats(0, 1),
    base=st.sampled_from([2048, 4096, 8192, 16384]),
)
def test_prediction_matches_the_formula(L, page, smooth, base) -> None:
    m = ChunkModel(A, B, C)
    kw = dict(base=base, page_size=page, smooth_factor=smooth, max_prefill_tokens=16384)
    got = predict_chunk_size(m, L, context_len=1 << 20, **kw)
    assert got == explicit_next(m, L, base, page, smooth, 16384, 1 << 20)
    align = max(page, 64)
    assert got % align == 0 and got <= 16384
    assert got >= (base // 4) // align * align
    # equal marginal cost: the unsmoothed chunk at L costs what base costs from 0
    if smooth == 1.0 and got > (base // 4) + align:
        assert m(L + got) - m(L) <= m(base) - m(0) + 1e-12 * (1 + m(base))


def test_schedule_shrinks_with_history_and_is_base_at_zero() -> None:
    sched = make_scheduler(SchedulerConfig(page_size=64, chunk_size=8192, smooth_factor=1.0))
    sched.fit_chunk_model(profile())
    sizes = [sched.next_chunk_size(L) for L in (0, 8192, 32_768, 131_072, 1_000_000)]
    assert sizes[0] == 8192
    assert sizes == sorted(sizes, reverse=True) and sizes[-1] < sizes[1]
    assert sizes[-1] == 2048  # floored at base // 4
    # smoothing 0 keeps the base chunk; the context cap wins near the end
    flat = make_scheduler(SchedulerConfig(page_size=64, chunk_size=8192, smooth_factor=0.0))
    flat.fit_chunk_model(profile())
    assert flat.next_chunk_size(131_072) == 8192
    near = make_scheduler(SchedulerConfig(page_size=64, chunk_size=8192, context_len=10_000))
    near.fit_chunk_model(profile())
    assert near.next_chunk_size(9_000) == 896  # 10,000 - 9,000 - 100 aligned down to 64
    with pytest.raises(ValueError, match="history_len=-1"):
        sched.next_chunk_size(-1)
