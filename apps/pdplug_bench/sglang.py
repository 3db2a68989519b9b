"""``pdplug bench sglang``: the ``pdplug`` transfer backend against SGLang's own backends, on
the same SGLang engines, in one run.

Like with like: pdplug over transport X against SGLang's own X backend (X = mooncake at PP 1
and PP 2, X = nixl at PP 1; SGLang's own nixl hangs at PP 2 on this machine), the two
alternated ``--rounds`` times per pair so the machine's drift hits both, every round on freshly
started engines (:func:`pdplug_sglang.parity.deployment`) with the same prompts (the bundled
trace), token parity checked against one single engine. Per row: TTFT p50/p99 through SGLang's
router, requests per second, KV bytes the prefill reported moving; at PP 2 also the bootstrap
admission latency (a room ready on its last PP rank -> admitted on every PP rank, from the
ranks' traces): pdplug's consensus against SGLang's ``PPConsensusStore``. The summary gives
each pair's median over rounds and the spread (min..max). Exits 1 when a request failed or
differs.
"""

from __future__ import annotations

import json
import statistics
import tempfile
from collections import defaultdict
from pathlib import Path
from typing import Any

import click

from pdplug_bench.machine import json_option, writable_dir
from pdplug_bench.options import StrictIntRange

__all__ = ["cli", "admission_latencies"]

#: (pdplug label, SGLang label, prefill PP) compared like with like
PAIRS = (
    ("pdplug-mooncake", "sglang-mooncake", 1),
    ("pdplug-mooncake", "sglang-mooncake", 2),
    ("pdplug-nixl", "sglang-nixl", 1),
)


def admission_latencies(trace_dir: str | Path, pp_size: int) -> list[float]:
    """Per room seen on every PP rank: ``max(applied) - max(ready)`` (seconds).

    :param trace_dir: the ``PDPLUG_SGLANG_TRACE_DIR`` of one deployment.
    :param pp_size: PP ranks of its prefill.
    """
    ready: dict[int, dict[int, float]] = defaultdict(dict)
    applied: dict[int, dict[int, float]] = defaultdict(dict)
    for f in Path(trace_dir).glob("bootstrap-*.jsonl"):
        for line in f.read_text().splitlines():
            ev = json.loads(line)
            book = ready if ev["event"] == "ready" else applied
            book[int(ev["room"])].setdefault(int(ev["rank"]), float(ev["t"]))
    out = []
    for room, r in ready.items():
        a = applied.get(room, {})
        if len(r) == pp_size and len(a) == pp_size:
            out.append(max(a.values()) - max(r.values()))
    return out


def _print_reqtrace(console: Any, directory: Path, label: str, pp: int) -> None:
    from pdplug_sglang.reqtrace import summarise

    res = summarise(directory)
    console.print(f"{label} PP {pp}: {res['rooms']} rooms, ms from the decode's intake "
                  "(p50, max; SGLang-thread call ms p50)")  # fmt: skip
    for ph in res["phases"]:
        console.print(f"  {ph['phase']:<44} {ph['at_ms_p50']:9.1f} {ph['at_ms_max']:9.1f}  "
                      f"call {ph['call_ms_p50']:7.2f}  (n={ph['n']})", markup=False)  # fmt: skip


def _row(res: Any, rnd: int, admission: list[float]) -> dict[str, Any]:
    return {
        "backend": res.backend,
        "prefill_pp": res.prefill_pp,
        "round": rnd,
        "requests": res.requests,
        "identical": res.identical,
        "failed": len(res.failed),
        "ttft_p50_s": res.ttft_p50_s,
        "ttft_p99_s": res.ttft_p99_s,
        "req_per_s": res.throughput_rps,
        "kv_bytes": res.kv_bytes,
        "admission_p50_ms": statistics.median(admission) * 1e3 if admission else None,
        "admitted_rooms": len(admission),
        "engines_up_s": res.start_s,
    }


@click.command("sglang")
@click.option("--requests", type=StrictIntRange(1, 64), default=16, show_default=True,
              help="Prompts from the bundled trace.")  # fmt: skip
@click.option("--scale", type=StrictIntRange(1, 512), default=32, show_default=True,
              help="Trace scale (a 512-token trace block becomes 512/scale tokens).")  # fmt: skip
@click.option("--max-tokens", type=StrictIntRange(1, 256), default=16, show_default=True)
@click.option("--concurrency", type=StrictIntRange(1, 64), default=4, show_default=True)
@click.option("--rounds", type=StrictIntRange(1, 10), default=3, show_default=True,
              help="Alternations of each pdplug / SGLang pair.")  # fmt: skip
@click.option("--pairs", default="mooncake-pp1,mooncake-pp2,nixl-pp1", show_default=True,
              help="Comma-separated transport-ppN pairs to run.")  # fmt: skip
@click.option("--workdir", type=click.Path(file_okay=False), default=None, callback=writable_dir,
              help="Model, engine logs and traces (default: a temporary directory).")  # fmt: skip
@json_option
@click.option("--reqtrace", is_flag=True,
              help="Trace every request's life on both engines (pdplug_sglang.reqtrace) and "
                   "print each run's phases.")  # fmt: skip
def cli(
    requests: int,
    scale: int,
    max_tokens: int,
    concurrency: int,
    rounds: int,
    pairs: str,
    workdir: str | None,
    json_path: str | None,
    reqtrace: bool,
) -> None:
    """pdplug vs SGLang's own mooncake / nixl backends on real SGLang engines: TTFT, req/s,
    KV bytes, PP 2 admission latency, token parity; alternated rounds with their spread."""
    import importlib.util

    from rich.console import Console
    from rich.table import Table

    missing = [m for m in ("sglang", "sglang_router", "httpx") if not importlib.util.find_spec(m)]
    if missing:
        raise click.ClickException(
            f"pdplug bench sglang needs {', '.join(missing)}: see docs/sglang-backend.md (install)"
        )
    from pdplug_bench.machine import machine_line, write_json
    from pdplug_engines.tokens import Completion, RequestFailed, percentile
    from pdplug_host.trace import trace_prompts
    from pdplug_sglang.parity import deployment, measure, reference

    names = [p.strip() for p in pairs.split(",") if p.strip()]
    if len(set(names)) != len(names):
        raise click.BadParameter(f"{pairs!r}: a pair is named twice", param_hint="--pairs")
    wanted = set(names)
    chosen = [p for p in PAIRS if f"{p[0].split('-')[1]}-pp{p[2]}" in wanted]
    known = {f"{p[0].split('-')[1]}-pp{p[2]}" for p in PAIRS}
    if not chosen or wanted - known:
        why = " (no nixl-pp2: SGLang's nixl hangs at PP 2 on CPU)" if "nixl-pp2" in wanted else ""
        raise click.BadParameter(
            f"{sorted(wanted - known) or pairs}: expected some of {sorted(known)}{why}",
            param_hint="--pairs",
        )
    console = Console(width=160)
    console.print(machine_line())
    prompts = trace_prompts(requests, scale)
    console.print(
        f"bench sglang: {len(prompts)} trace prompts ({min(map(len, prompts))}-"
        f"{max(map(len, prompts))} tokens), {max_tokens} generated each, concurrency "
        f"{concurrency}; tiny Llama (4 layers, 2 KV heads x 32, bf16), SGLang 0.5.23 CPU engines"
    )
    rows: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory(prefix="pdplug-bench-sglang-") as tmp:
        root = Path(workdir or tmp)
        console.print("single engine (reference) ...")
        ref = reference(root / "single", prompts, max_tokens, concurrency=concurrency)
        bad = [r for r in ref if isinstance(r, RequestFailed)]
        if bad:
            raise click.ClickException(f"the single engine failed a request: {bad[0].reason}")
        single = percentile([r.ttft_s for r in ref if isinstance(r, Completion)], 50)
        for mine, theirs, pp in chosen:
            for rnd in range(rounds):
                for label in (mine, theirs) if rnd % 2 == 0 else (theirs, mine):
                    run_dir = root / f"{label}-pp{pp}-r{rnd}"
                    trace = run_dir / "trace"
                    console.print(f"round {rnd + 1}/{rounds}: {label} PP {pp} ...")
                    env = {"PDPLUG_SGLANG_TRACE_DIR": str(trace)}
                    if reqtrace:
                        env["PDPLUG_SGLANG_REQTRACE_DIR"] = str(run_dir / "reqtrace")
                    with deployment(label, run_dir, prefill_pp=pp, env=env) as dep:
                        res = measure(dep, prompts, max_tokens, ref, concurrency=concurrency,
                                      single_ttft_p50_s=single)  # fmt: skip
                    adm = admission_latencies(trace, pp) if pp > 1 else []
                    rows.append(_row(res, rnd, adm))
                    if reqtrace:
                        _print_reqtrace(console, run_dir / "reqtrace", label, pp)
                    for i, why in res.failed[:3]:
                        console.print(f"{label} PP {pp}: request {i} failed: {why}", markup=False)
    t = Table(
        title="pdplug bench sglang: one row per run (TTFT and req/s through SGLang's router; "
        "KV bytes from sglang:kv_transfer_total_mb; admission: PP 2 only)"
    )
    for col in ("backend", "PP", "round", "identical", "TTFT p50 s", "TTFT p99 s", "req/s",
                "KV bytes", "admission p50 ms", "engines up s"):  # fmt: skip
        t.add_column(col, justify="right")
    for r in rows:
        adm_ms = "-" if r["admission_p50_ms"] is None else f"{r['admission_p50_ms']:.1f}"
        t.add_row(r["backend"], str(r["prefill_pp"]), str(r["round"] + 1),
                  f"{r['identical']}/{r['requests']}", f"{r['ttft_p50_s']:.3f}",
                  f"{r['ttft_p99_s']:.3f}", f"{r['req_per_s']:.2f}", f"{r['kv_bytes']:,}", adm_ms,
                  f"{r['engines_up_s']:.0f}")  # fmt: skip
    console.print(t)
    s = Table(title="per pair: median over rounds (min..max)")
    for col in ("pair", "PP", "pdplug TTFT p50 s", "SGLang TTFT p50 s", "ratio",
                "pdplug admission ms", "SGLang admission ms"):  # fmt: skip
        s.add_column(col, justify="right")

    def spread(vals: list[float], fmt: str) -> str:
        return (
            f"{statistics.median(vals):{fmt}} ({min(vals):{fmt}}..{max(vals):{fmt}})"
            if vals
            else "-"
        )

    for mine, theirs, pp in chosen:
        a = [r for r in rows if r["backend"] == mine and r["prefill_pp"] == pp]
        b = [r for r in rows if r["backend"] == theirs and r["prefill_pp"] == pp]
        ta, tb = [r["ttft_p50_s"] for r in a], [r["ttft_p50_s"] for r in b]
        ratio = (
            statistics.median(ta) / statistics.median(tb)
            if tb and statistics.median(tb) > 0
            else 0.0
        )
        aa = [r["admission_p50_ms"] for r in a if r["admission_p50_ms"] is not None]
        ab = [r["admission_p50_ms"] for r in b if r["admission_p50_ms"] is not None]
        s.add_row(f"{mine} / {theirs}", str(pp), spread(ta, ".3f"), spread(tb, ".3f"),
                  f"{ratio:.2f}", spread(aa, ".1f"), spread(ab, ".1f"))  # fmt: skip
    console.print(s)
    if json_path:
        write_json(json_path, {"rows": rows})
    if any(r["identical"] != r["requests"] for r in rows):
        raise click.ClickException(
            "a request failed or differs from the single engine (see the table)"
        )
