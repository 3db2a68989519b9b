"""``pdplug bench cluster``: the scenarios of issue 23 on a cluster of network namespaces.

Each scenario (:mod:`pdplug_bench.cluster_scenarios`) runs on a fresh cluster
(:mod:`pdplug.testing.netns`: hosts ``rdv``, ``p0``, ``p1``, ``d0``, ``d1``, and ``x`` for
the intruder) with real pdplug processes on every host (:mod:`pdplug_bench.cluster_worker`)
and the reference host's traffic: clean, 1 % loss + 200 Mbit/s, a 5 s partition, a decode
host's death, a PP prefill host's death (with a rendezvous restart and a rolling restart of
the instance), a starved prefill host, and a non-member sending frames. One row per scenario
and backend: rooms, ok, failed by reason, lost, wrong bytes, time to fail, time to recover.
Exits 1 when a room was lost, a byte was wrong, or a scenario's promise did not hold.

Needs root (namespaces) and ``pdplug.testing`` (``pip install "pdplug[testing]"``: the
harness imports pytest).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import click

from pdplug_bench.machine import json_option
from pdplug_bench.options import StrictIntRange

__all__ = ["cli", "JSON_KEYS", "json_row"]

#: the keys of every ``--json`` row (issue 23); the rest of what a row measured (TTFT, bytes,
#: checks that failed, notes) is under ``"details"``, one entry per row, with the run's options
JSON_KEYS = ("scenario", "backend", "rooms", "ok", "failed", "lost", "wrong_bytes", "fail_s",
             "recover_s")  # fmt: skip


def _scenarios(ctx: click.Context, param: click.Parameter, value: str) -> list[str]:
    from pdplug_bench.cluster_scenarios import SCENARIOS

    keys = [k.strip() for k in value.split(",")]
    bad = [k for k in keys if k not in SCENARIOS]
    if not value.strip() or bad:
        raise click.BadParameter(
            f"{value!r}: expected comma-separated scenario numbers among {', '.join(SCENARIOS)}"
        )
    _no_repeats(value, keys)
    return keys


def _no_repeats(value: str, items: list[str]) -> None:
    twice = sorted({x for x in items if items.count(x) > 1})
    if twice:
        raise click.BadParameter(f"{value!r} names {', '.join(twice)} more than once")


def _rate(ctx: click.Context, param: click.Parameter, value: float) -> float:
    if not 1.0 <= value <= 1000.0:  # also NaN, which click's FloatRange lets through
        raise click.BadParameter(f"{value!r}: expected rooms per second in 1..1000")
    return value


def _backends(ctx: click.Context, param: click.Parameter, value: str) -> list[str]:
    from pdplug_bench.options import component_names

    names = component_names(value, "kv_sender", "--backend")
    _no_repeats(value, names)
    return names


def _harness() -> Any:
    """:mod:`pdplug.testing.netns`, or a one-line error naming what is missing."""
    try:
        from pdplug.testing import netns
    except ImportError as e:
        # the ImportError already names the extra: say it once
        raise click.ClickException(
            f"pdplug bench cluster runs on the test harness pdplug.testing.netns: {e}"
        ) from None
    ok, why = netns.netns_available()
    if not ok:
        raise click.ClickException(f"pdplug bench cluster needs network namespaces: {why}")
    return netns


def json_row(row: Any) -> dict[str, Any]:
    """One ``--json`` row: exactly :data:`JSON_KEYS`; ``failed`` is the failures by reason
    (``{reason: rooms}``, summing to the failed rooms), seconds are ``None`` where the
    scenario has no fault or nothing failed."""
    out = {k: getattr(row, k) for k in JSON_KEYS}
    out["failed"] = dict(row.failed_by)
    return out


def _fmt(v: float | None, scale: float = 1.0, nd: int = 2) -> str:
    return "-" if v is None else f"{v * scale:.{nd}f}"


@click.command()
@click.option(
    "--backend",
    default="nixl,mooncake",
    show_default=True,
    callback=_backends,
    help="Comma-separated KV sender names.",
)
@click.option(
    "--scenarios",
    default="1,2,3,4,5,6,7",
    show_default=True,
    callback=_scenarios,
    help="Comma-separated scenario numbers (1 clean, 2 loss + bucket, 3 partition, "
    "4 decode host killed, 5 PP prefill host killed, 6 prefill host starved, 7 non-member).",
)
@click.option(
    "--short",
    is_flag=True,
    help="The CI version: traffic phases halved (the faults keep their lengths).",
)
@click.option(
    "--rate",
    default=20.0,
    show_default=True,
    type=float,
    callback=_rate,
    help="Rooms issued per second (1 to 1000).",
)
@click.option(
    "--concurrency",
    default=4,
    show_default=True,
    type=StrictIntRange(1, 64),
    help="Rooms in flight per decode host at most.",
)
@click.option(
    "--max-dst-dcp",
    default=8,
    show_default=True,
    type=StrictIntRange(2, 64),
    help="Decode DCP size each prefill rank's pack buffer is sized for (2 pack regions per "
    "rank plus 2 kept for another decode instance; KVConfig's default). 2 (the decode DCP "
    "size) is the tightest: scenario 3 there checks a stuck instance cannot starve the other.",
)
@click.option(
    "--logs",
    type=click.Path(file_okay=False),
    default=None,
    help="Keep every worker's log in this folder, created if missing (default: a temporary "
    "one, removed).",
)
@json_option
def cli(
    backend: list[str],
    scenarios: list[str],
    short: bool,
    rate: float,
    concurrency: int,
    max_dst_dcp: int,
    logs: str | None,
    json_path: str | None,
) -> None:
    """Issue 23's network faults on a cluster of namespaces (root), with real pdplug
    processes and the reference host's traffic: one row per scenario and backend; exit 1 when
    a room was lost, a byte wrong, or a scenario's promise broken."""
    from rich.console import Console
    from rich.table import Table

    from pdplug_bench.cluster_driver import WorkerError
    from pdplug_bench.cluster_kv import demo_geometry
    from pdplug_bench.cluster_scenarios import TITLES, Options, Row, run_scenario
    from pdplug_bench.machine import machine_line, write_json

    netns = _harness()
    console = Console(width=160)
    console.print(machine_line())
    opts = Options(
        short=short,
        rate=rate,
        concurrency=concurrency,
        log_dir=Path(logs) if logs else None,
        geometry=demo_geometry(max_dst_dcp=max_dst_dcp),
    )
    t = opts.timeouts
    console.print(
        f"cluster: hosts rdv, p0, p1 (PP 2, pp0), d0, d1 (DCP 2); transfer_timeout_s "
        f"{t.transfer_s:g}, peer_timeout_s {t.peer_s:g}; {rate:g} rooms/s, {concurrency} in "
        f"flight per decode host; {'short' if short else 'full'} version"
    )
    rows: list[Row] = []
    for key in scenarios:
        for b in backend:
            console.print(f"[bold]{key}[/] {TITLES[key]} on {b} ...")
            try:
                row = run_scenario(key, b, opts)
            except WorkerError as e:
                sig = netns.interrupted()
                if sig is not None:  # the clean-up killed the workers: stop, as interrupted
                    console.print(f"[red]interrupted (signal {sig}): the cluster is removed[/]")
                    raise SystemExit(128 + sig) from None
                row = Row(scenario=key, backend=b, problems=[f"worker failed: {e}"[:2000]])
            rows.append(row)
            # a row as soon as it is measured (a run cut short still shows what it did)
            console.print(
                f"  rooms {row.rooms} ok {row.ok} failed {row.failed} {row.failed_by or ''} "
                f"lost {row.lost} wrong {row.wrong_bytes} fail_s {_fmt(row.fail_s)} "
                f"recover_s {_fmt(row.recover_s)} {row.seconds:g} s"
                + (
                    f" [red]{len(row.problems)} problems: {row.problems[:3]}[/]"
                    if row.problems
                    else ""
                )
            )
    table = Table(
        title="pdplug bench cluster (failed: by reason; lost: never ended on a live side, "
        "wrong bytes, or a byte landed after release; fail: fault to the last in-flight room "
        "failed; recover: heal/kill to the first later room that succeeded; TTFT: issue to "
        "decode Success; link: bytes the decode hosts' veths received)"
    )
    for col in ("scenario", "backend", "rooms", "ok", "failed", "lost", "wrong B", "fail s",
                "recover s", "TTFT p50/p99 ms", "KV / link MB", "s", "checks"):  # fmt: skip
        table.add_column(col, justify="left" if col in ("scenario", "failed") else "right")
    bad = False
    for r in rows:
        bad |= bool(r.lost or r.wrong_bytes or r.problems)
        by = ", ".join(f"{k} {v}" for k, v in sorted(r.failed_by.items()))
        table.add_row(
            r.scenario,
            r.backend,
            str(r.rooms),
            str(r.ok),
            f"{r.failed}" + (f" ({by})" if by else ""),
            str(r.lost),
            str(r.wrong_bytes),
            _fmt(r.fail_s),
            _fmt(r.recover_s),
            f"{_fmt(r.ttft_p50_ms, nd=1)} / {_fmt(r.ttft_p99_ms, nd=1)}",
            f"{r.kv_bytes / 1e6:.1f} / {r.rx_bytes / 1e6:.1f}",
            f"{r.seconds:g}",
            "ok" if not r.problems else f"FAIL {len(r.problems)}",
        )
    console.print(table)
    for r in rows:
        if r.notes:
            console.print(f"{r.scenario} on {r.backend}: {json.dumps(r.notes, default=str)}")
        for p in r.problems:
            console.print(f"[red]{r.scenario} on {r.backend}: {p}[/]")
    if json_path:
        details = [
            {"scenario": r.scenario, "backend": r.backend, "ttft_p50_ms": r.ttft_p50_ms,
             "ttft_p99_ms": r.ttft_p99_ms, "kv_bytes": r.kv_bytes, "rx_bytes": r.rx_bytes,
             "seconds": r.seconds, "problems": r.problems, "notes": r.notes}
            for r in rows
        ]  # fmt: skip
        options = {
            "short": short,
            "rate": rate,
            "concurrency": concurrency,
            "max_dst_dcp": max_dst_dcp,
            "backends": backend,
            "scenarios": scenarios,
        }
        write_json(json_path, {"rows": [json_row(r) for r in rows], "details": details,
                               "options": options})  # fmt: skip
    if bad:
        raise SystemExit(1)
