"""``pdplug bench consensus``: admission latency of consensus implementations vs pp_size.

For each implementation (default ``pp0`` and ``ring``, resolved by name through the plugin
manager) and each pp_size, one real process per PP rank runs a simulated host loop: at the top
of every iteration it offers the request ids that became ready on this rank and calls
``poll()``; the rest of the iteration (``--iter-ms``) is the forward pass (a sleep). Request
``i`` arrives at ``0.2 s + i * 2 * iter`` and is ready on each rank after an extra
``U(0, 3 * iter)`` (same schedule for every implementation).

Phases (``--phases``): ``pipeline`` (default) runs the ranks as the PP pipeline they are: rank
``k`` starts each iteration ``k * iter / pp_size`` after PP0 (the activation hand-off), and an
implementation with a ``wait(timeout_s)`` method (``ring``) first waits up to half an iteration
for its inbound frame, as SGLang's stages receive the ring with a blocking recv at the top of
the matching iteration. A message forwarded at the end of rank ``k-1``'s iteration (its next
``poll()``) is then received at the top of rank ``k``'s very next iteration: one iteration per
ring hop. The ``ring_trip`` column checks it: a candidate comes back to PP0 after ``pp_size``
of its iterations when no hop missed. What this model cannot copy: SGLang's blocking stages
stretch every iteration by the hand-off, while these loops keep a fixed period, so the
hand-offs of one round add up to one more iteration (the wrap to PP0): a ring admission costs
its 2P-1 hops of one iteration plus ``(2P-1) / pp_size`` iterations of hand-off, i.e. 2P-1
pipeline iterations of ``iter * (1 + 1 / pp_size)`` (the ``pipe_iters`` column counts those).
``random`` (the model before) starts ranks at random phases and never waits, so each hop also
waits U(0, 1) iteration for the receiver's next poll: about 1.5 iterations per hop, a slower
ring than SGLang's.

Admission latency of a request = (time the last rank applied its decision) - (time the last
rank offered it, i.e. became locally ready), all on CLOCK_MONOTONIC shared by the processes.
The table gives p50/p99 in ms and the p50 in loop iterations; the ratio ring/pp0 uses p50s
measured side by side in one run. Goals: ``pp0`` flat in pp_size (p50 at the
largest pp_size within 1.25x of the smallest) and ring/pp0 ≥ 5 at pp_size 8.
"""

from __future__ import annotations

import hashlib
import random
import time
from typing import Any

import click

from pdplug.ports import free_endpoints
from pdplug_bench.machine import json_option
from pdplug_bench.options import StrictIntRange

__all__ = ["cli", "run_one"]

STREAM = "bootstrap"


def _rank_main(
    impl: str,
    rank: int,
    endpoints: tuple[str, ...],
    iter_s: float,
    phase_s: float,
    ready_at: list[float],
    up_q: Any,
    out_q: Any,
    start_t: Any,
    start: Any,
    stop: Any,
    max_s: float,
    recv_wait_s: float,
) -> None:
    """One PP rank's simulated host loop (spawned process), iteration ``k`` at
    ``start + phase_s + k * iter_s``, first waiting up to ``recv_wait_s`` for an inbound
    frame when the implementation can (``wait``)."""
    import msgspec

    from pdplug import ConsensusConfig, get_plugin_manager

    cfg = ConsensusConfig(
        pp_rank=rank,
        pp_size=len(endpoints),
        endpoints=endpoints,
        streams=(STREAM,),
        vote_deadline_s=60.0,
        peer_timeout_s=20.0,
        heartbeat_s=0.5,
    )
    try:
        c = get_plugin_manager().make_consensus(cfg, name=impl)
    except Exception as e:
        up_q.put(("error", rank, repr(e)))
        return
    up_q.put(("up", rank, ""))
    if not start.wait(120):
        c.close()
        return
    t0 = start_t.value
    n = len(ready_at)
    order = sorted(range(n), key=ready_at.__getitem__)
    offered = [0.0] * n
    applied = [0.0] * n
    h = hashlib.sha256()
    nxt = n_applied = iters = 0
    done = False
    error = ""
    k = 0
    t_first = t_last = 0.0
    wait = getattr(c, "wait", None) if recv_wait_s > 0 else None
    while True:
        target = t0 + phase_s + k * iter_s
        k += 1
        now = time.monotonic()
        if target > now:  # the rest of the iteration: the forward pass
            time.sleep(target - now)
        if wait is not None:  # the stage's blocking recv at the top of the iteration
            wait(recv_wait_s)
        now = time.monotonic()
        if stop.is_set() or now - t0 > max_s:
            break
        t_first = t_first or now
        t_last = now
        batch = []
        while nxt < n and t0 + ready_at[order[nxt]] <= now:
            batch.append(order[nxt])
            nxt += 1
        if batch:
            c.offer(STREAM, good=batch)
            for rid in batch:
                offered[rid] = now
        try:
            ds = c.poll()
        except Exception as e:
            error = repr(e)
            break
        t = time.monotonic()
        for d in ds:
            h.update(msgspec.msgpack.encode((d.seq, d.good, d.bad)))
            for rid in d.good + d.bad:
                applied[rid] = t
            n_applied += len(d.good) + len(d.bad)
        iters += 1
        if n_applied >= n and not done:
            out_q.put(("done", rank, b""))
            done = True
    stats = c.stats()
    c.close()
    out_q.put(
        (
            "result",
            rank,
            msgspec.msgpack.encode(
                {
                    "offered": offered,
                    "applied": applied,
                    "iterations": iters,
                    "mean_iter_ms": 1000.0 * (t_last - t_first) / max(1, iters - 1),
                    "hash": h.hexdigest(),
                    "error": error,
                    "stats": stats,
                }
            ),
        )
    )


def phase_offsets(pp_size: int, iter_s: float, phases: str, rng: random.Random) -> list[float]:
    """Start offset (seconds) of each rank's loop within one iteration.

    :param phases: ``"pipeline"`` (rank ``k`` at ``k * iter_s / pp_size``) or
        ``"random"`` (uniform in ``[0, iter_s)``).
    :raises ValueError: another ``phases``.
    """
    if phases == "pipeline":
        return [k * iter_s / pp_size for k in range(pp_size)]
    if phases == "random":
        return [rng.uniform(0, iter_s) for _ in range(pp_size)]
    raise ValueError(f"phases={phases!r} is not 'pipeline' or 'random'")


def run_one(
    impl: str,
    pp_size: int,
    iter_ms: float,
    requests: int,
    seed: int,
    timeout_s: float = 120.0,
    phases: str = "pipeline",
) -> dict[str, Any]:
    """Run one implementation at one pp_size; return latencies (ms) and loop counts.

    :param phases: rank phases (:func:`phase_offsets`).
    :raises RuntimeError: a rank failed to start, raised, disagreed or timed out.
    """
    import multiprocessing as mp
    import queue

    import msgspec
    import numpy as np

    iter_s = iter_ms / 1000.0
    rng = random.Random(seed * 1000 + pp_size)
    arrive = [0.2 + i * 2 * iter_s for i in range(requests)]
    ready = {r: [a + rng.uniform(0, 3 * iter_s) for a in arrive] for r in range(pp_size)}
    offsets = phase_offsets(pp_size, iter_s, phases, rng)
    ctx = mp.get_context("spawn")
    up_q, out_q = ctx.Queue(), ctx.Queue()
    start, stop = ctx.Event(), ctx.Event()
    start_t = ctx.Value("d", 0.0)
    eps = free_endpoints(pp_size)
    span = arrive[-1] + 3 * iter_s
    max_s = span + 40 * pp_size * iter_s + 20.0
    procs = [
        ctx.Process(
            target=_rank_main,
            args=(
                impl,
                r,
                eps,
                iter_s,
                offsets[r],
                ready[r],
                up_q,
                out_q,
                start_t,
                start,
                stop,
                max_s,
                iter_s / 2 if phases == "pipeline" else 0.0,
            ),
            daemon=True,
        )
        for r in range(pp_size)
    ]
    for p in procs:
        p.start()
    deadline = time.monotonic() + timeout_s
    results: dict[int, dict[str, Any]] = {}
    try:
        ups = 0
        while ups < pp_size:
            try:
                kind, rank, info = up_q.get(timeout=0.5)
            except queue.Empty:
                if time.monotonic() > deadline or any(not p.is_alive() for p in procs):
                    raise RuntimeError(f"{impl} pp{pp_size}: a rank did not start") from None
                continue
            if kind != "up":
                raise RuntimeError(f"{impl} pp{pp_size}: rank {rank} failed to start: {info}")
            ups += 1
        start_t.value = time.monotonic() + 0.1
        start.set()
        done: set[int] = set()
        while len(results) < pp_size and time.monotonic() < deadline:
            if len(done) == pp_size:
                stop.set()
            try:
                kind, rank, blob = out_q.get(timeout=0.2)
            except queue.Empty:
                continue
            if kind == "done":
                done.add(rank)
            elif kind == "result":
                results[rank] = msgspec.msgpack.decode(blob)
                stop.set()  # a rank only stops early on an error or max_s
    finally:
        stop.set()
        start.set()
        for p in procs:
            p.join(10)
            if p.is_alive():
                p.kill()
    if len(results) < pp_size:
        raise RuntimeError(f"{impl} pp{pp_size}: only {len(results)} ranks reported in time")
    errors = {r: x["error"] for r, x in results.items() if x["error"]}
    if errors:
        raise RuntimeError(f"{impl} pp{pp_size}: ranks raised {errors}")
    if len({x["hash"] for x in results.values()}) != 1:
        raise RuntimeError(f"{impl} pp{pp_size}: ranks applied different decision sequences")
    offered = np.array([results[r]["offered"] for r in range(pp_size)])
    applied = np.array([results[r]["applied"] for r in range(pp_size)])
    if (applied == 0).any():
        raise RuntimeError(f"{impl} pp{pp_size}: some requests were never decided")
    lat_ms = (applied.max(axis=0) - offered.max(axis=0)) * 1000.0
    iters = [results[r]["iterations"] for r in range(pp_size)]
    mean_iter_ms = float(np.mean([results[r]["mean_iter_ms"] for r in range(pp_size)]))
    lead = results[0]["stats"]
    rounds = lead.get("rounds_frozen", 0)
    return {
        "impl": impl,
        "pp_size": pp_size,
        "p50_ms": float(np.percentile(lat_ms, 50)),
        "p99_ms": float(np.percentile(lat_ms, 99)),
        "p50_iterations": float(np.percentile(lat_ms, 50)) / iter_ms,
        "mean_iter_ms": mean_iter_ms,
        "loop_iterations": int(max(iters)),
        "requests": requests,
        # ring: PP0 iterations a candidate took around the ring (SGLang: pp_size)
        "round_trip_iterations": lead.get("round_polls", 0) / rounds if rounds else None,
    }


def _parse_pp(value: str) -> list[int]:
    try:
        sizes = [int(x) for x in value.split(",") if x.strip()]
    except ValueError:
        raise click.BadParameter(f"--pp={value!r}: expected comma-separated integers") from None
    if not sizes or any(s < 1 or s > 64 for s in sizes):
        raise click.BadParameter(f"--pp={value!r}: every pp_size must be in 1..64")
    return sizes


@click.command()
@click.option("--pp", "pp", default="2,4,8", show_default=True, help="pp_size values, comma list")
@click.option("--iter-ms", default=5.0, show_default=True, help="loop iteration (ms)",
              type=click.FloatRange(min=0, min_open=True, max=1000))  # fmt: skip
@click.option("--requests", default=200, show_default=True, type=StrictIntRange(1, 100_000),
              help="requests per run")  # fmt: skip
@click.option("--impl", "impls", default="pp0,ring", show_default=True, help="consensus names")
@click.option("--seed", default=0, show_default=True, type=int,
              help="seed of the readiness schedule (same for every implementation)")  # fmt: skip
@click.option(
    "--phases",
    type=click.Choice(["pipeline", "random"]),
    default="pipeline",
    show_default=True,
    help="rank loop phases: a PP pipeline (as in the field) or random (the model before)",
)
@json_option
def cli(
    pp: str,
    iter_ms: float,
    requests: int,
    impls: str,
    seed: int,
    phases: str,
    json_path: str | None,
) -> None:
    """Admission latency of pp0 vs ring at several pp_size (real processes per rank)."""
    from pdplug_bench.machine import machine_line, write_json
    from pdplug_bench.options import component_names

    sizes = _parse_pp(pp)
    names = component_names(impls, "consensus", "--impl")  # before any rank is spawned
    click.echo(machine_line())
    click.echo(
        f"sizes: pp_size {sizes}, iteration {iter_ms} ms, {requests} requests per run, "
        f"implementations {names}, phases {phases}"
    )
    rows = []
    for size in sizes:
        for name in names:
            row = run_one(name, size, iter_ms, requests, seed, phases=phases)
            rows.append(row)
            click.echo(
                f"  {name:>5} pp{size}: p50 {row['p50_ms']:.2f} ms, p99 {row['p99_ms']:.2f} ms"
            )
    click.echo("")
    click.echo(
        f"{'impl':>6} {'pp_size':>7} {'p50_ms':>9} {'p99_ms':>9} {'iterations':>10} "
        f"{'pipe_iters':>10} {'ring_trip':>9} {'2P-1':>5}"
    )
    for r in rows:
        trip = r["round_trip_iterations"]
        pipe = r["p50_ms"] / (iter_ms * (1 + 1 / r["pp_size"]))
        click.echo(
            f"{r['impl']:>6} {r['pp_size']:>7} {r['p50_ms']:>9.2f} {r['p99_ms']:>9.2f} "
            f"{r['p50_iterations']:>10.1f} {pipe if phases == 'pipeline' else float('nan'):>10.1f} "
            f"{'-' if trip is None else f'{trip:.2f}':>9} {2 * r['pp_size'] - 1:>5}"
        )
    click.echo(
        "iterations = p50 / iter-ms (last rank ready -> last rank applied); pipe_iters = p50 in "
        "pipeline iterations of iter-ms * (1 + 1/pp_size) (forward + hand-off, what SGLang's "
        "2P-1 counts); ring_trip = PP0 iterations a ring candidate took to come back (pp_size "
        "when no hop missed its iteration)"
    )
    missed = [
        f"pp{r['pp_size']} {r['round_trip_iterations']:.2f}"
        for r in rows
        if r["round_trip_iterations"] and r["round_trip_iterations"] > 1.1 * r["pp_size"]
    ]
    if phases == "pipeline" and missed:
        click.echo(
            "note: ring_trip above pp_size (" + ", ".join(missed) + "): some hops missed their "
            "iteration (a loaded host delays hand-offs), so that ring measured slower than the "
            "field's"
        )
    by = {(r["impl"], r["pp_size"]): r for r in rows}
    ratio = {}
    if "pp0" in names and "ring" in names:
        ratio = {str(s): by[("ring", s)]["p50_ms"] / by[("pp0", s)]["p50_ms"] for s in sizes}
        click.echo(
            "ratio ring/pp0 (p50): " + ", ".join(f"pp{k}: {v:.1f}x" for k, v in ratio.items())
        )
    if "pp0" in names and len(sizes) > 1:
        lo, hi = min(sizes), max(sizes)
        flat = by[("pp0", hi)]["p50_ms"] / by[("pp0", lo)]["p50_ms"]
        click.echo(
            f"goal pp0 flat: p50 pp{hi} / pp{lo} = {flat:.2f} "
            f"({'met' if flat <= 1.25 else 'NOT met'}, <= 1.25)"
        )
    if "8" in ratio:
        click.echo(
            f"goal ring/pp0 at pp8 = {ratio['8']:.1f}x "
            f"({'met' if ratio['8'] >= 5 else 'NOT met'}, >= 5)"
        )
    if json_path:
        write_json(
            json_path,
            {
                "rows": rows,
                "ratio_ring_over_pp0": ratio,
                "sizes": {
                    "pp": sizes,
                    "iter_ms": iter_ms,
                    "requests": requests,
                    "seed": seed,
                    "phases": phases,
                },
            },
        )
