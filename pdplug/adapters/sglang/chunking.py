"""SGLang's dynamic chunk sizes served by the selected pdplug scheduler.

With ``--enable-dynamic-chunking`` at PP > 1, SGLang profiles prefill latencies, fits
``ChunkSizePredictor.fit(seq_lens, latencies_ms)`` and asks ``DynamicChunkSizer.predict
(history_len)`` for each chunked request's next chunk
(``managers/scheduler_components/dynamic_chunk_sizer.py``). Three AROUND hooks
(:func:`pdplug.adapters.sglang.register`) hand both to the ``pdplug`` plugin manager's
scheduler (``PDPLUG_SCHEDULER``, ``default`` unless a plugin overrides it) when the engine
runs the ``pdplug`` transfer backend: the samples (seconds) go to ``fit_chunk_model``, the
sizer stays on when SGLang's own fit rejects them, the sizes come from
``next_chunk_size``. Engines on other backends keep SGLang's own predictor.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Sequence
from typing import Any

__all__ = ["fit_hook", "predict_hook", "profile_hook", "pdplug_selected"]

_SAMPLES = "_pdplug_samples"
_SCHED = "_pdplug_scheduler"


def pdplug_selected() -> bool:
    """Whether this engine runs the ``pdplug`` transfer backend."""
    try:
        from sglang.srt.runtime_context import get_disagg

        return str(get_disagg().disaggregation_transfer_backend) == "pdplug"
    except Exception:
        return False


def fit_hook(
    original: Callable[..., Any],
    predictor: Any,
    seq_lens: Sequence[int],
    latencies: Sequence[float],
    *a: Any,
    **kw: Any,
) -> Any:
    """``ChunkSizePredictor.fit``: the samples are kept, in seconds, for the pdplug scheduler
    (before SGLang's own fit, which may reject them); then SGLang's fit runs as before."""
    if pdplug_selected():
        samples = [(int(n), float(ms) / 1000.0) for n, ms in zip(seq_lens, latencies)]
        setattr(predictor, _SAMPLES, samples)
    return original(predictor, seq_lens, latencies, *a, **kw)


def profile_hook(original: Callable[..., Any], sizer: Any, *a: Any, **kw: Any) -> Any:
    """``DynamicChunkSizer.profile_and_fit``: on a ``pdplug`` engine the sizer is on whenever
    SGLang's profile produced samples, whether or not SGLang's own quadratic fit accepted
    them (on CPU it rejects a noisy, near-linear profile): the pdplug scheduler decides the
    sizes (the default one keeps the static size when its own fit is unusable)."""
    ok = original(sizer, *a, **kw)
    if pdplug_selected() and getattr(sizer.predictor, _SAMPLES, None):
        return True
    return ok


def _scheduler(sizer: Any) -> Any:
    sched = getattr(sizer, _SCHED, None)
    if sched is None:
        from pdplug import get_plugin_manager
        from pdplug.config import SchedulerConfig

        smooth = float(os.environ.get("SGLANG_DYNAMIC_CHUNKING_SMOOTH_FACTOR", "") or 0.75)
        config = SchedulerConfig(
            page_size=int(sizer.page_size),
            chunk_size=int(sizer.chunked_prefill_size),
            smooth_factor=smooth,
            max_prefill_tokens=int(sizer.max_prefill_tokens),
            context_len=int(sizer.model_config.context_len),
        )
        sched = get_plugin_manager().make_scheduler(config)
        sched.fit_chunk_model(getattr(sizer.predictor, _SAMPLES, []))
        setattr(sizer, _SCHED, sched)
    return sched


def predict_hook(
    original: Callable[..., Any], sizer: Any, history_len: int, *a: Any, **kw: Any
) -> Any:
    """``DynamicChunkSizer.predict``: the pdplug scheduler's ``next_chunk_size`` (tokens) once
    SGLang's profile succeeded; SGLang's own answer otherwise."""
    if not pdplug_selected() or not getattr(sizer.predictor, _SAMPLES, None):
        return original(sizer, history_len, *a, **kw)
    return int(_scheduler(sizer).next_chunk_size(int(history_len)))
