"""``pdplug demo --engine sglang``: a trace through an SGLang prefill engine and an SGLang
decode engine with the ``pdplug`` transfer backend behind SGLang's router, token parity
against a single SGLang engine.

Runs :func:`pdplug_sglang.parity.run_parity` (``pdplug`` over the selected pdplug KV sender,
``PDPLUG_KV_SENDER``, nixl by default) and prints the reference demo's summary table
(:mod:`pdplug_engines.report`; rows only the reference host measures are left out).
"""

from __future__ import annotations

import os
import tempfile
from typing import Any

from pdplug_engines.report import parity_table, print_parity_report
from pdplug_host.trace import load_trace, prompt_tokens
from pdplug_sglang.parity import TINY, ParityResult, run_parity

__all__ = ["run_sglang_demo", "print_sglang_report"]


def run_sglang_demo(
    requests: int | None,
    scale: int,
    max_output: int,
    *,
    trace: str | None = None,
    prefill_pp: int = 1,
    log_dir: str | None = None,
) -> ParityResult:
    """Replay the first ``requests`` (default 16) prompts of ``trace`` (default: the bundled
    one) scaled by ``scale``, ``max_output`` generated tokens each, through the ``pdplug``
    backend with a ``prefill_pp``-stage prefill.

    :raises pdplug_engines.procs.EngineError: an engine did not start.
    """
    reqs = load_trace(trace, limit=requests or 16, scale=scale)
    if not reqs:
        raise ValueError(f"--trace {trace}: the trace has no requests")
    prompts = [prompt_tokens(r, TINY.vocab_size).tolist() for r in reqs]
    sender = os.environ.get("PDPLUG_KV_SENDER", "") or "nixl"
    label = f"pdplug-{sender}" if sender in ("nixl", "mooncake") else "pdplug-nixl"
    env = {"PDPLUG_KV_SENDER": sender}
    if log_dir:
        return run_parity(label, log_dir, prompts=prompts, max_tokens=max_output,
                          prefill_pp=prefill_pp, env=env)  # fmt: skip
    with tempfile.TemporaryDirectory(prefix="pdplug-demo-sglang-") as tmp:
        return run_parity(label, tmp, prompts=prompts, max_tokens=max_output,
                          prefill_pp=prefill_pp, env=env)  # fmt: skip


def print_sglang_report(res: ParityResult, scale: int, console: Any) -> None:
    """The reference demo's summary table for an SGLang run."""
    spec = TINY
    per_token = spec.num_hidden_layers * spec.num_key_value_heads * 2 * spec.head_dim * 2
    table = parity_table(
        res,
        title=(
            f"pdplug demo (SGLang): prefill engine (PP {res.prefill_pp}) -> decode engine, "
            f"--disaggregation-transfer-backend pdplug ({res.backend})"
        ),
        caption=(
            f"A tiny {spec.num_hidden_layers}-layer Llama with random weights (bf16), SGLang "
            "0.5.23 CPU engines; times include this machine's load."
        ),
        scale=scale,
        per_token_bytes=per_token,
        engine="SGLang",
        front="SGLang's router",
        via="SGLang's router",
        engines="prefill, decode and router",
    )
    print_parity_report(res, table, console)
