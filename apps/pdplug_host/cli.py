"""``pdplug demo``: the main job — replay a trace through PP prefill → DCP decode."""

from __future__ import annotations

import json
import sys
from typing import Any

import click

from pdplug.manager import EXTENSION_POINTS

__all__ = ["demo", "demo_options", "options_from_kwargs", "print_report"]


def demo_options(f: Any) -> Any:
    """Options shared by ``pdplug demo`` and ``pdplug bench e2e``."""
    opts = [
        click.option("--prefill-pp", default=2, show_default=True, type=click.IntRange(min=1),
                     help="Prefill PP ranks."),
        click.option("--decode-dcp", default=2, show_default=True, type=click.IntRange(min=1),
                     help="Decode DCP ranks."),
        click.option("--trace", type=click.Path(exists=True, dir_okay=False), default=None,
                     help="Trace JSONL (Mooncake FAST'25 format); default: bundled sample."),
        click.option("--scale", default=32, show_default=True, type=click.IntRange(1, 512),
                     help="Divide trace lengths by this (512-token blocks -> 512/scale tokens)."),
        click.option("--max-output", default=16, show_default=True, type=click.IntRange(min=1),
                     help="Cap output tokens."),
        click.option("--time-scale", default=1.0, show_default=True, type=click.FloatRange(min=0),
                     help="Honour trace arrival times multiplied by this factor."),
        click.option("--no-arrivals", is_flag=True, help="Send requests as fast as admitted."),
        *(click.option(p.option, default=None, help=f"Select a {p.label} (default {p.default}).")
          for p in EXTENSION_POINTS.values()),
        click.option("--chunk-size", default=128, show_default=True, type=click.IntRange(min=1),
                     help="Base chunked-prefill size in tokens (dynamic sizing starts here)."),
        click.option("--pack-region-tokens", default=64, show_default=True,
                     type=click.IntRange(min=1),
                     help="Pack region capacity per destination rank in tokens."),
        click.option("--timeout", "timeout_s", default=30.0, show_default=True,
                     type=click.FloatRange(min=1.0),
                     help="Bound on every wait (transfer, consensus, gloo), seconds."),
        click.option("--log-dir", default=None,
                     help="Directory for worker logs (default: a new temp dir; '' = terminal)."),
    ]  # fmt: skip
    for o in reversed(opts):
        f = o(f)
    return f


def options_from_kwargs(kw: dict[str, Any], requests: int) -> Any:
    """The ``DemoOptions`` of a run from the keyword arguments of :func:`demo_options`."""
    from pdplug_host.driver import DemoOptions

    time_scale = 0.0 if kw.pop("no_arrivals", False) else kw.pop("time_scale", 0.0)
    kw.pop("time_scale", None)
    return DemoOptions(requests=requests, time_scale=time_scale, **kw)


def print_report(rep: dict[str, Any]) -> None:
    """Print the summary table of one run."""
    from rich.table import Table

    from pdplug_host.console import console

    c = console()
    t = Table(title="pdplug demo", show_header=False)
    t.add_column("", style="bold")
    t.add_column("")
    t.add_row("requests", str(rep["requests"]))
    t.add_row("parity OK", f"{rep['parity_ok']} / {rep['requests']}")
    t.add_row("prefix-hit tokens (prefill)", str(rep["prefix_hit_tokens"]))
    t.add_row("tokens transferred", str(rep["tokens_transferred"]))
    t.add_row("bytes transferred", f"{rep['bytes_transferred'] / 2**20:.1f} MiB")
    t.add_row("segments sent (sends split)", f"{rep['segments']} ({rep['split_sends']})")
    ch = rep["chunks"]
    t.add_row("prefill chunks (tokens)", f"{ch['s']} ({ch['_min']}-{ch['_max']})")
    t.add_row("TTFT p50 / p99", f"{rep['ttft_ms']['p50']:.1f} / {rep['ttft_ms']['p99']:.1f} ms")
    for k, v in rep["breakdown_ms"].items():
        t.add_row(f"  {k} p50 / p99", f"{v['p50']:.1f} / {v['p99']:.1f} ms")
    tp = rep["throughput"]
    t.add_row(
        "throughput", f"{tp['requests_per_s']:.2f} req/s, {tp['output_tokens_per_s']:.1f} tok/s"
    )
    t.add_row("serve time / wall", f"{rep['serve_s']:.1f} s / {rep['wall_s']:.1f} s")
    for point, d in rep["plugins"].items():
        t.add_row(f"{point}", f"{d.get('name')} ({d.get('distribution')} {d.get('version', '')})")
    c.print(t)
    if rep.get("worker_logs"):
        c.print(f"worker logs: {rep['worker_logs']}")


@click.command()
@demo_options
@click.option(
    "--requests",
    default=32,
    show_default=True,
    type=click.IntRange(min=1),
    help="Requests from the trace.",
)
@click.option("--json", "json_path", type=click.Path(dir_okay=False), default=None,
              help="Write the report as JSON here.")  # fmt: skip
def demo(requests: int, json_path: str | None, **kw: Any) -> None:
    """Replay a trace through PP prefill -> DCP decode; check tokens against a reference."""
    from rich.progress import Progress

    from pdplug import PdplugError
    from pdplug_host.driver import DemoError, run_demo

    opts = options_from_kwargs(kw, requests)
    with Progress(transient=True) as prog:
        tasks: dict[str, Any] = {}

        def progress(phase: str, done: int, total: int) -> None:
            if phase not in tasks:
                label = "starting workers" if phase == "start" else "serving requests"
                tasks[phase] = prog.add_task(label, total=total)
            prog.update(tasks[phase], completed=done)

        try:
            rep = run_demo(opts, progress)
        except DemoError as e:
            click.echo(f"pdplug demo failed: {e}", err=True)
            sys.exit(1)
        except (PdplugError, ValueError) as e:  # a clear message, never a traceback
            click.echo(f"pdplug demo: {type(e).__name__}: {e}", err=True)
            sys.exit(1)
    print_report(rep)
    if json_path:
        with open(json_path, "w") as f:
            json.dump(rep, f, indent=2)
    bad = rep["mismatches"]
    if bad:
        first = bad[0]
        if "error" in first:
            click.echo(f"request {first['rid']} did not finish: {first['error']}", err=True)
        else:
            click.echo(
                f"MISMATCH: request {first['rid']} position {first['position']}: got "
                f"{first['got']}, reference {first['want']} ({len(bad)} requests differ)",
                err=True,
            )
        sys.exit(1)
    click.echo(f"all {rep['parity_ok']} requests token-identical to the reference")
