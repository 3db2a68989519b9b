"""``pdplug bench e2e``: the reference host over a trace, variants side by side in one run.

Runs the same requests with ``pp0`` vs ``ring`` consensus and ``nixl`` vs ``mooncake`` KV
senders (the other choices at their defaults) and prints throughput and TTFT per variant, with
ratios against the default configuration.
"""

from __future__ import annotations

from typing import Any

import click

from pdplug_bench.machine import json_option
from pdplug_bench.options import StrictIntRange
from pdplug_host.cli import demo_options


@click.command()
@demo_options
@click.option(
    "--requests",
    default=64,
    show_default=True,
    type=StrictIntRange(min=1),
    help="Requests from the trace.",
)
@click.option("--variants", default="pp0+nixl,ring+nixl,pp0+mooncake", show_default=True,
              help="Comma list of CONSENSUS+KV_SENDER pairs, each run once (--consensus and "
                   "--kv-sender are refused here: the variants name both).")  # fmt: skip
@json_option
def cli(requests: int, variants: str, json_path: str | None, **kw: Any) -> None:
    """Throughput and TTFT of the reference host per consensus / KV sender variant."""
    from rich.table import Table

    from pdplug_bench.machine import console, machine_line, write_json
    from pdplug_bench.options import variant_pairs
    from pdplug_host.cli import REFUSALS, options_from_kwargs, refusal_line
    from pdplug_host.driver import run_demo
    from pdplug_host.options import check_options

    for name in ("consensus", "kv_sender"):
        if kw.get(name) is not None:
            flag = "--" + name.replace("_", "-")
            raise click.UsageError(
                f"{flag} {kw[name]}: bench e2e takes the consensus and the KV sender of each "
                "run from --variants (CONSENSUS+KV_SENDER pairs)"
            )
    runs = []
    for cons, kv in variant_pairs(variants, "--variants"):
        try:
            opts = options_from_kwargs(dict(kw, consensus=cons, kv_sender=kv), requests)
            check_options(opts)  # every variant before the first runs: one line, no traceback
        except REFUSALS as e:
            raise click.ClickException(f"{cons}+{kv}: {refusal_line(e)}") from None
        runs.append((f"{cons}+{kv}", opts))
    rows = []
    for v, opts in runs:
        click.echo(f"running {v} ...", err=True)
        try:
            rep = run_demo(opts)
        except REFUSALS as e:  # a clear line, as pdplug demo
            raise click.ClickException(f"{v}: {refusal_line(e)}") from None
        rows.append(
            {
                "variant": v,
                "consensus": rep["plugins"].get("consensus", {}).get("name"),
                "kv_sender": rep["plugins"].get("kv_sender", {}).get("name"),
                "requests": rep["requests"],
                "parity_ok": rep["parity_ok"],
                "requests_per_s": rep["throughput"]["requests_per_s"],
                "output_tokens_per_s": rep["throughput"]["output_tokens_per_s"],
                "ttft_p50_ms": rep["ttft_ms"]["p50"],
                "ttft_p99_ms": rep["ttft_ms"]["p99"],
                "consensus_p50_ms": rep["breakdown_ms"]["consensus"]["p50"],
                "transfer_p50_ms": rep["breakdown_ms"]["transfer"]["p50"],
                "serve_s": rep["serve_s"],
            }
        )
    base = rows[0]
    t = Table(title=f"pdplug bench e2e ({requests} requests, PP {kw['prefill_pp']}, "
                    f"DCP {kw['decode_dcp']})")  # fmt: skip
    for col in ("variant", "parity", "req/s", "tok/s", "TTFT p50", "TTFT p99", "consensus p50",
                "transfer p50", "TTFT p50 vs first"):  # fmt: skip
        t.add_column(col)
    for r in rows:
        t.add_row(
            r["variant"],
            f"{r['parity_ok']}/{r['requests']}",
            f"{r['requests_per_s']:.2f}",
            f"{r['output_tokens_per_s']:.1f}",
            f"{r['ttft_p50_ms']:.1f} ms",
            f"{r['ttft_p99_ms']:.1f} ms",
            f"{r['consensus_p50_ms']:.1f} ms",
            f"{r['transfer_p50_ms']:.1f} ms",
            f"{r['ttft_p50_ms'] / base['ttft_p50_ms']:.2f}x",
        )
    console().print(t)
    click.echo(machine_line())
    if json_path:
        write_json(json_path, {"rows": rows, "requests": requests, **kw})
    wrong = [f"{r['variant']} {r['parity_ok']}/{r['requests']}" for r in rows
             if r["parity_ok"] != r["requests"]]  # fmt: skip
    if wrong:
        raise click.ClickException(
            f"parity: {', '.join(wrong)} requests token-identical to the reference run"
        )


# the variants name the consensus and the KV sender of every run: the shared options that would
# set them are refused here (above), and not offered in --help
for _param in cli.params:
    if isinstance(_param, click.Option) and _param.name in ("consensus", "kv_sender"):
        _param.hidden = True
