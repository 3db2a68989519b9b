"""``pdplug bench plan``: planner time and merged runs per send, packer throughput vs a copy.

Planner: the field's cached-prefix send (83,264 cached + 6,720 new tokens, decode cold, so
all 89,984 tokens go out), DCP 4, page 64, MLA-like rows (61 layers x 576 B), regions sized
from an 8,192-token chunk bound (2,048 tokens per rank region, double-buffered). ``--layout
hnd|nhd`` uses fused K|V head sub-rows instead (``--kv-heads``, ``--head-bytes``), ``--tp P:D``
prefill and decode TP (prefill TP rank 0 sends to every decode TP rank it holds heads for),
``--page-ratio`` the prefill page over the decode page. One timed "send" =
``Scheduler.split_send`` + for every segment, every routed decode TP rank and each DCP rank
a plan into the rank's ``(rank, chunk_id % 2)`` region (direct plans when the pair needs no
relayout) through :func:`pdplug.packing.plan_segment`, each decode rank with its own layout
(``dcp_rank`` set) and its own ``SendChunk`` — what the KV sender's pack thread does (the
chunks are built before the timer: the engine thread builds them; their time is printed
apart). ``planner_ms_p50`` keeps a segment's plans alive until the segment after next is
planned; ``planner_ms_p50_keep_all`` keeps all; ``planner_ms_p50_per_rank`` calls ``plan``
once per destination.
Next to the runs per send: the runs of the same send in NHD at equal TP (1:1) and the ideal
(one run per head range per destination page). Every plan is checked (runs inside a page, no
byte written twice, bytes = tokens x bytes per token); a failure exits non-zero.

Packer (:mod:`pdplug_bench.plan_pack`): one full segment (8,192 tokens; per rank ``8,192 /
dcp`` rows per entry, every routed decode TP rank) planned for every DCP rank and packed in
one ``pack_all`` call (on CUDA: one launch table, one upload, one Triton launch) and rank by
rank, against ``dst.copy_(src)`` of the same bytes, side by side in one run; both paths'
bytes are compared with a reference filled alike (numpy on CPU, the torch packer on CUDA) and
any difference exits non-zero. On CUDA, GPU time excludes host gaps (a spin kernel sized from
the measured host enqueue time), with the host-included time beside it. The Triton packer's
host preparation per segment (checks + launch table) is timed at the full ``--layers`` count
on every device (goal <= 100 us at 61 entries x 8,192 rows).

``--row-bytes`` and ``--dcp`` take comma-separated lists: every combination is measured and
a summary table printed (``--json`` then holds ``{"shapes": [...]}``).

Heavy imports (torch, the planner plugin) happen inside the command.
"""

from __future__ import annotations

import statistics
import time
from typing import Any

import click

from pdplug_bench.machine import json_option
from pdplug_bench.options import WHOLE_NUMBER, StrictIntRange


def _p50(xs: list[float]) -> float:
    return statistics.median(xs)


def _planner_bench(args: dict[str, Any], repeats: int) -> dict[str, Any]:
    import msgspec
    import numpy as np

    from pdplug import PlannerConfig, SchedulerConfig, get_plugin_manager
    from pdplug.packing import (
        pack_regions,
        plan_all_ranks,
        plan_segment,
        region_index,
        segment_chunks,
        segment_to_chunk,
        send_capacity_tokens,
    )
    from pdplug.types import pages_to_bytes
    from pdplug_bench.plan_layouts import bench_layouts, check_plans, ideal_runs

    d = args["dcp"]
    pm = get_plugin_manager()
    planner = pm.make_pack_planner(PlannerConfig(), name=args["planner"])
    src, dsts = bench_layouts(args)
    p = src.page_size
    vp = dsts[0].page_size * d
    sched = pm.make_scheduler(SchedulerConfig(page_size=p, chunk_size=args["chunk_bound"]))
    regions = pack_regions(src, dst_dcp_size=d, depth=2, region_tokens=-(-args["chunk_bound"] // d))
    relayout = [planner.needs_relayout(src, dst) for dst in dsts]
    cap = send_capacity_tokens(regions[0], d) if any(relayout) else None
    total = args["cached"] + args["unique"]
    rng = np.random.default_rng(0)
    src_pages = rng.permutation(4 * -(-total // p))[: -(-total // p)].astype(np.int64)
    dst_pages = rng.permutation(4 * -(-total // vp))[: -(-total // vp)].astype(np.int64)
    # regions of every rank for chunk_id % 2 == 0 and == 1 (double buffering)
    region_sets = [[regions[region_index(r, c, 2)] for r in range(d)] for c in range(2)]
    segs = sched.split_send(
        token_start=0, token_end=total, decode_prefix_len=0, is_last_send=True,
        capacity_tokens=cap,
    )  # fmt: skip

    # every decode DCP rank hands out its own layout (dcp_rank set) and its own page list,
    # as peers do in the sender
    rank_layouts = [[msgspec.structs.replace(dst, dcp_rank=r) for r in range(d)] for dst in dsts]

    # each decode rank declares its pages on the wire (its own bytes object, equal content:
    # the ranks of one decode instance hold a request in the same block ids)
    wire = [(pages_to_bytes(dst_pages), 0) for _ in dsts for _ in range(d)]

    def chunks() -> list[list[Any]]:
        """The engine thread's part: the SendChunks of every (segment, destination), built as
        the sender builds them (:func:`pdplug.packing.segment_chunks`)."""
        return [segment_chunks(1, s, src_pages[s.page_start :], wire, p) for s in segs]

    def send(
        cs: list[list[Any]], keep_all: bool, per_rank: bool = False,
        keep: list[Any] | None = None,
    ) -> int:  # fmt: skip
        alive: list[Any] = []
        runs = 0
        for s, seg_chunks in zip(segs, cs):
            rset = region_sets[s.chunk_id % 2]
            items = [
                (seg_chunks[i * d + r], rank_layouts[i][r], r, rset[r] if relayout[i] else None)
                for i in range(len(dsts))
                for r in range(d)
            ]
            if per_rank:  # one plan() per destination
                out = [planner.plan(c, src, dl, r, rg) for c, dl, r, rg in items]
            else:  # the sender's path (pdplug.transfer.gather.prepare_segment)
                out = plan_segment(planner, src, items)
            alive.append(out)
            if keep is not None:  # the untimed send: keep and count (not the planner's work)
                for i in range(len(dsts)):
                    keep[i].extend(out[i * d : (i + 1) * d])
                runs += sum(pl.num_runs for pl in out)
            if not keep_all and len(alive) > 2:
                del alive[0]
        return runs

    kept: list[list[Any]] = [[] for _ in dsts]
    runs = send(chunks(), True, keep=kept)
    failures = [f"decode tp {dst.tp_rank}: {f}" for dst, pl in zip(dsts, kept)
                for f in check_plans(pl, src, dst)]  # fmt: skip
    ideal = sum(ideal_runs(pl, dst) for dst, pl in zip(dsts, kept))
    res: dict[str, Any] = {
        "segments": len(segs),
        "plans": sum(len(pl) for pl in kept),
        "decode_tp_ranks": [dst.tp_rank for dst in dsts],
        "relayout": relayout,
        "runs_per_send": runs,
        "ideal_runs_per_send": ideal,
        "runs_over_ideal": runs / ideal if ideal else 1.0,
        "check_failures": failures,
    }
    if args["layout"] == "hnd" or args["tp"] != "1:1":  # the same send in NHD at equal TP
        n_src, n_dsts = bench_layouts(args, kind="nhd", tp=(1, 1))
        n_regions = pack_regions(n_src, dst_dcp_size=d, depth=2,
                                 region_tokens=-(-args["chunk_bound"] // d))  # fmt: skip
        n_relayout = planner.needs_relayout(n_src, n_dsts[0])
        n_segs = sched.split_send(
            token_start=0, token_end=total, decode_prefix_len=0, is_last_send=True,
            capacity_tokens=send_capacity_tokens(n_regions[0], d) if n_relayout else None,
        )  # fmt: skip
        n_runs = 0
        for s in n_segs:
            chunk = segment_to_chunk(1, s, src_pages[s.page_start :], dst_pages, 0, p)
            rset = [n_regions[region_index(r, s.chunk_id, 2)] for r in range(d)]
            plans = plan_all_ranks(planner, chunk, n_src, n_dsts[0], rset if n_relayout else None)
            n_runs += sum(pl.num_runs for pl in plans)
        res["nhd_equal_tp_runs_per_send"] = n_runs
    variants = (
        ("planner_ms_p50", False, False),
        ("planner_ms_p50_keep_all", True, False),
        ("planner_ms_p50_per_rank", False, True),
    )
    for key, keep, per_rank in variants:
        for _ in range(5):
            send(chunks(), keep, per_rank)
        ts, cpu = [], []
        for _ in range(repeats):
            cs = chunks()
            c0, t0 = time.thread_time(), time.perf_counter()
            send(cs, keep, per_rank)
            ts.append(time.perf_counter() - t0)
            cpu.append(time.thread_time() - c0)
        res[key] = _p50(ts) * 1e3
        res[key.replace("p50", "min")] = min(ts) * 1e3
        # CPU time of this thread: what the planner costs, without the waits a loaded
        # machine adds to wall time
        res[key.replace("ms_p50", "cpu_ms_p50")] = _p50(cpu) * 1e3
    ts = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        chunks()
        ts.append(time.perf_counter() - t0)
    res["chunks_ms_p50"] = _p50(ts) * 1e3
    res["capacity_tokens_per_region"] = regions[0].capacity_tokens
    res["send_capacity_tokens"] = cap or total
    res["send_tokens"] = total
    res["decode_page"] = dsts[0].page_size
    return res


class IntList(click.ParamType):
    """A comma-separated list of integers in ``[lo, hi]`` (``"1,2,4"`` -> ``[1, 2, 4]``)."""

    name = "ints"

    def __init__(self, lo: int, hi: int) -> None:
        self.lo, self.hi = lo, hi

    def convert(self, value: Any, param: Any, ctx: Any) -> list[int]:
        if isinstance(value, list):
            return value
        try:
            parts = [x for x in str(value).split(",") if x.strip()]
            if not all(WHOLE_NUMBER.fullmatch(x) for x in parts):  # int() takes 1_0, other digits
                raise ValueError(value)
            vals = [int(x) for x in parts]
        except ValueError:
            self.fail(f"{value!r} is not integers separated by commas", param, ctx)
        bad = [v for v in vals if not self.lo <= v <= self.hi]
        if not vals or bad:
            self.fail(f"{value!r}: each must be {self.lo}<=x<={self.hi}", param, ctx)
        return vals


def _shape_report(args: dict[str, Any], device: str, pack_repeats: int, pl: dict[str, Any],
                  pk: dict[str, Any]) -> None:  # fmt: skip
    """Print one shape's planner and packer lines."""
    total = pl["send_tokens"]
    row = (
        f"{args['row_bytes']} B"
        if args["layout"] == "mla"
        else (f"{args['kv_heads']} heads x {args['head_bytes']} B")
    )
    click.echo(
        f"pdplug bench plan: send of {args['cached']:,} cached + {args['unique']:,} new = "
        f"{total:,} tokens, {args['layout'].upper()} TP {args['tp']}, DCP {args['dcp']}, page "
        f"{args['page']} -> {pl['decode_page']}, {args['layers']} layers x {row}, regions "
        f"{pl['capacity_tokens_per_region']:,} tokens/rank (send capacity "
        f"{pl['send_capacity_tokens']:,})"
    )
    nhd = pl.get("nhd_equal_tp_runs_per_send")
    click.echo(
        f"  planner ({args['planner']}): {pl['segments']} segments x "
        f"{len(pl['decode_tp_ranks'])} decode TP ranks x {args['dcp']} DCP ranks = "
        f"{pl['plans']} plans, {pl['runs_per_send']:,} runs per send (ideal, one per head range "
        f"per page: {pl['ideal_runs_per_send']:,}; {pl['runs_over_ideal']:.3f}x, goal <= 1.1x"
        + (f"; NHD at TP 1:1: {nhd:,}" if nhd is not None else "")
        + f"); per send p50 {pl['planner_ms_p50']:.3f} ms wall, {pl['planner_cpu_ms_p50']:.3f} ms "
        f"thread CPU (the sender's path: plan_segment per segment, every rank's own layout and "
        f"SendChunk, 2 segments of plans alive; goal < 1 ms), "
        f"{pl['planner_ms_p50_keep_all']:.3f} ms with all plans alive, "
        f"{pl['planner_ms_p50_per_rank']:.3f} ms with one plan() per destination; building the "
        f"SendChunks (engine thread, not timed above) {pl['chunks_ms_p50']:.3f} ms"
    )
    if pk.get("prep_us_p50") is not None and device != "cuda":
        click.echo(
            f"  triton host prep per segment (checks + launch table, no device): "
            f"{pk['prep_entries']} entries x {pk['prep_rows']:,} rows, {pk['prep_plans']} plans "
            f"({pk['prep_gathers']} gathers): p50 {pk['prep_us_p50']:.1f} us for a cached "
            f"shape (goal <= 100 us), {pk['prep_new_shape_us_p50']:.0f} us for a new shape"
        )
    if pk.get("packer") is None:
        click.echo(f"  packer: not run ({pk['why']})")
        return
    same = "identical" if pk["bit_exact"] else f"{pk['mismatched_bytes']:,} DIFFER"
    if pk.get("forced_whole_rows"):
        click.echo("  packer: the planner sends this pair directly; whole rows packed anyway")
    click.echo(
        f"  packer ({pk['packer']}, {device}): {pk['packed_bytes'] / 2**20:.1f} MiB "
        f"({pk['pack_layers']} entries, {pk['pack_plans']} plans, {pk['pack_subrows']:,} "
        f"sub-rows from {pk['source_slots_per_entry']:,} slots per entry); whole segment in "
        f"one pack_all {pk['packer_gbps']:.2f} GB/s, rank by rank {pk['per_rank_gbps']:.2f} "
        f"GB/s, copy {pk['memcpy_gbps']:.2f} GB/s: pack_all/copy p50 of {pack_repeats} paired "
        f"repeats {pk['packer_vs_memcpy']:.0%} (range {pk['packer_vs_memcpy_range'][0]:.0%}-"
        f"{pk['packer_vs_memcpy_range'][1]:.0%}; goal >= "
        f"{'85' if device == 'cuda' else '50'}%), per-rank/copy {pk['per_rank_vs_memcpy']:.0%}"
        f", pack_all {pk['whole_vs_per_rank']:.2f}x per-rank; gather threads "
        f"{pk['pack_threads'] or '-'} (the sender's default); bytes (pack_all and per rank) vs "
        f"{pk['reference']}: {same}"
    )
    if device == "cuda":
        lt = pk.get("launch", {})
        cov, cov_r = pk["spin_covered"], pk["spin_covered_per_rank"]
        click.echo(
            f"  GPU time ({pk['gpu_time_method']}; the spin outlasted the enqueue in "
            f"{cov[0]}/{cov[1]} repeats, rank by rank {cov_r[0]}/{cov_r[1]}); host included "
            f"(prep + upload + launch + GPU, synchronised) {pk['packer_gbps_host_included']:.1f}"
            f" GB/s = {pk['host_included_vs_memcpy']:.0%} of copy (goal >= 50%); host enqueue "
            f"p50 {pk['enqueue_us_whole']:.0f} us whole segment vs "
            f"{pk['enqueue_us_per_rank']:.0f} us rank by rank; prep "
            f"{pk.get('prep_us_p50', float('nan')):.0f} us; tile {lt.get('tile')}; torch packer "
            f"on {device} (host included): {pk['torch_packer_gbps']:.1f} GB/s"
        )


def _summary(device: str, shapes: list[dict[str, Any]]) -> None:
    """One row per shape: the whole-segment pack against the copy, prep, planner."""
    gpu = device == "cuda"
    click.echo(
        "summary: row B | DCP | pack_all/copy | per-rank/copy | "
        + ("host-incl/copy | " if gpu else "")
        + "prep us (cached) | planner ms | bytes"
    )
    for r in shapes:
        a, pk = r["sizes"], r
        if pk.get("packer") is None:
            click.echo(f"  {a['row_bytes']:>5} | {a['dcp']:>3} | not packed")
            continue
        click.echo(
            f"  {a['row_bytes']:>5} | {a['dcp']:>3} | {pk['packer_vs_memcpy']:>12.0%} | "
            f"{pk['per_rank_vs_memcpy']:>12.0%} | "
            + (f"{pk['host_included_vs_memcpy']:>13.0%} | " if gpu else "")
            + f"{pk.get('prep_us_p50', float('nan')):>15.1f} | {r['planner_ms_p50']:>10.3f} | "
            + ("ok" if pk["bit_exact"] else "DIFFER")
        )


@click.command()
@json_option
@click.option(
    "--device",
    type=click.Choice(["cpu", "cuda"]),
    default="cpu",
    show_default=True,
    help="Where KV and the pack buffer live for the packer benchmark.",
)
@click.option("--repeats", default=200, show_default=True, type=StrictIntRange(1, 100_000),
              help="Timed planner sends.")  # fmt: skip
@click.option("--pack-repeats", default=31, show_default=True, type=StrictIntRange(1, 10_000),
              help="Timed packs/copies.")  # fmt: skip
@click.option("--cached", default=83_264, show_default=True, type=StrictIntRange(0, 1 << 22),
              help="Cached-prefix tokens.")  # fmt: skip
@click.option("--unique", default=6_720, show_default=True, type=StrictIntRange(1, 1 << 22),
              help="New tokens.")  # fmt: skip
@click.option("--dcp", default="4", show_default=True, type=IntList(1, 64),
              help="Decode DCP size(s), e.g. 1,2,4,8.")  # fmt: skip
@click.option("--page", default=64, show_default=True, type=StrictIntRange(1, 4096),
              help="Page size (tokens).")  # fmt: skip
@click.option("--layers", default=61, show_default=True, type=StrictIntRange(1, 1024),
              help="KV entries (MLA: one per layer).")  # fmt: skip
@click.option(
    "--row-bytes",
    default="576",
    show_default=True,
    type=IntList(1, 1 << 20),
    help="Bytes per token per entry (MLA), or a list, e.g. 128,256,576,656,1152,4096.",
)
@click.option(
    "--chunk-bound",
    default=8192,
    show_default=True,
    type=StrictIntRange(1, 1 << 22),
    help="Chunk bound (tokens) sizing the regions: chunk_bound/dcp per rank.",
)
@click.option(
    "--pack-layers",
    default=None,
    type=StrictIntRange(1, 1024),
    help="Entries in the packer benchmark [default: 16 on cpu, --layers on cuda].",
)
@click.option("--planner", default="dcp", show_default=True, help="Pack planner name.")
@click.option(
    "--layout",
    type=click.Choice(["mla", "nhd", "hnd"]),
    default="mla",
    show_default=True,
    help="KV layout on both sides: MLA latent rows, or NHD/HND fused K|V head sub-rows.",
)
@click.option("--tp", default="1:1", show_default=True, help="Prefill:decode TP sizes.")
@click.option(
    "--page-ratio",
    default=1.0,
    type=float,
    show_default=True,
    help="Prefill page / decode page (2: decode pages half the size; 0.5: twice).",
)
@click.option("--kv-heads", default=8, show_default=True, type=StrictIntRange(1, 4096),
              help="KV heads (nhd/hnd).")  # fmt: skip
@click.option("--head-bytes", default=512, show_default=True, type=StrictIntRange(1, 1 << 20),
              help="Bytes of one K|V head sub-row.")  # fmt: skip
@click.option(
    "--prep-repeats", default=200, show_default=True, help="Timed host preparations (triton)."
)
@click.option("--pack-runs", default=1, show_default=True, type=StrictIntRange(1, 100),
              help="Consecutive packer runs per shape (each a p50 of --pack-repeats pairs); "
              "the count meeting the goal is printed.")  # fmt: skip
def cli(
    json_path: str | None,
    device: str,
    repeats: int,
    pack_repeats: int,
    prep_repeats: int,
    pack_runs: int,
    **args: Any,
) -> None:
    """Planner time per send (p50) and the whole-segment pack's GB/s vs a plain copy of the
    same bytes (and vs packing rank by rank), for one shape or a sweep of row sizes x DCP."""
    from pdplug_bench.machine import machine_line, write_json
    from pdplug_bench.options import component_name
    from pdplug_bench.plan_pack import packer_bench, prep_bench

    args["planner"] = component_name(args["planner"], "pack_planner", "--planner")
    if device == "cuda":
        import torch

        if not torch.cuda.is_available():
            raise click.UsageError("--device cuda: no CUDA device is available here")
    from pdplug_bench.plan_layouts import bench_layouts

    combos = [{**args, "row_bytes": rb, "dcp": d} for rb in args["row_bytes"] for d in args["dcp"]]
    try:
        for a in combos:
            bench_layouts(a)
    except ValueError as e:
        raise click.UsageError(str(e)) from e
    shapes: list[dict[str, Any]] = []
    failed: list[str] = []
    for a in combos:
        pl = _planner_bench(a, repeats)
        pk = packer_bench(a, device, pack_repeats)
        if pack_runs > 1 and pk.get("packer") is not None:
            runs = [pk] + [packer_bench(a, device, pack_repeats) for _ in range(pack_runs - 1)]
            goal = 0.85 if device == "cuda" else 0.5
            ratios = [r["packer_vs_memcpy"] for r in runs]
            pk["runs_vs_memcpy"] = ratios
            pk["runs_meeting_goal"] = sum(x >= goal for x in ratios)
            pk["bit_exact"] = all(r["bit_exact"] for r in runs)
            click.echo(
                f"  packer over {pack_runs} consecutive runs (pack_all/copy p50 each): "
                + ", ".join(f"{x:.0%}" for x in ratios)
                + f"; {pk['runs_meeting_goal']}/{pack_runs} meet >= {goal:.0%}"
            )
        if device != "cuda":
            pk.update(prep_bench(a, prep_repeats))
        _shape_report(a, device, pack_repeats, pl, pk)
        shapes.append({**pl, **pk, "sizes": a})
        tag = f"{a['row_bytes']} B, DCP {a['dcp']}: " if len(combos) > 1 else ""
        failed += [tag + f for f in pl["check_failures"]]
        if pk.get("packer") is not None and not pk["bit_exact"]:
            failed.append(
                f"{tag}packed bytes differ from the {pk['reference']}: "
                f"{pk['mismatched_bytes_by_path']}"
            )
    if len(combos) > 1:
        _summary(device, shapes)
    click.echo(machine_line())
    if json_path:
        write_json(json_path, shapes[0] if len(shapes) == 1 else {"shapes": shapes})
    if failed:
        raise click.ClickException("check failed: " + "; ".join(failed[:5]))
