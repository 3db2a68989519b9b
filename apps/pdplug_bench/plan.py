"""``pdplug bench plan``: planner time and merged runs per send, packer throughput vs a copy.

Planner: the field's cached-prefix send (83,264 cached + 6,720 new tokens, decode cold, so
all 89,984 tokens go out), DCP 4, page 64, MLA-like rows (61 layers x 576 B), regions sized
from an 8,192-token chunk bound (2,048 tokens per rank region, double-buffered). ``--layout
hnd|nhd`` uses fused K|V head sub-rows instead (``--kv-heads``, ``--head-bytes``), ``--tp P:D``
prefill and decode TP (prefill TP rank 0 sends to every decode TP rank it holds heads for),
``--page-ratio`` the prefill page over the decode page. One timed "send" =
``Scheduler.split_send`` + for every segment, every routed decode TP rank and each DCP rank
``segment_to_chunk`` + ``plan`` into the rank's ``(rank, chunk_id % 2)`` region (direct plans
when the pair needs no relayout) — what the KV sender does. ``planner_ms_p50`` keeps a
segment's plans alive until the segment after next is planned; ``planner_ms_p50_keep_all``
keeps all; ``planner_ms_p50_plan_all`` plans each segment's ranks in one batched ``plan_all``.
Next to the runs per send: the runs of the same send in NHD at equal TP (1:1) and the ideal
(one run per head range per destination page). Every plan is checked (runs inside a page, no
byte written twice, bytes = tokens x bytes per token); a failure exits non-zero.

Packer: one full segment (8,192 tokens; per rank ``8,192 / dcp`` rows per entry, every routed
decode TP rank) gathered by the packer into the pack buffer, against ``dst.copy_(src)`` of
the same number of bytes, side by side in one run; the ratio is the median over repeats of
each pack paired with the copy right after it. Before timing, the packed bytes are compared
with a numpy reference gather (CPU) or with the torch packer (``--device cuda``, Triton), both
buffers filled alike; a mismatch exits non-zero. The CPU packer uses
``PlannerConfig().pack_threads`` threads (all of torch's), like the copy. On CUDA, GPU time
comes from CUDA events recorded behind a spin kernel (the host's launch overhead hidden),
plus the host-inclusive figure a sender sees.

Heavy imports (torch, the planner plugin) happen inside the command.
"""

from __future__ import annotations

import statistics
import time
from typing import Any

import click

from pdplug_bench.machine import json_option


def _p50(xs: list[float]) -> float:
    return statistics.median(xs)


def _planner_bench(args: dict[str, Any], repeats: int) -> dict[str, Any]:
    import numpy as np

    from pdplug import PlannerConfig, SchedulerConfig, get_plugin_manager
    from pdplug.packing import (
        pack_regions,
        plan_all_ranks,
        region_index,
        segment_to_chunk,
        send_capacity_tokens,
    )
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

    def send(keep_all: bool, batched: bool = False, keep: list[Any] | None = None) -> int:
        alive: list[Any] = []
        runs = 0
        for s in segs:
            rset = region_sets[s.chunk_id % 2]
            for i, dst in enumerate(dsts):
                rg = rset if relayout[i] else None
                if batched:
                    chunk = segment_to_chunk(1, s, src_pages[s.page_start :], dst_pages, 0, p)
                    out = plan_all_ranks(planner, chunk, src, dst, rg)
                else:  # the sender's path: each decode rank's own SendChunk, one plan() each
                    out = [
                        planner.plan(
                            segment_to_chunk(1, s, src_pages[s.page_start :], dst_pages, 0, p),
                            src,
                            dst,
                            r,
                            rg[r] if rg else None,
                        )
                        for r in range(d)
                    ]
                alive.append(out)
                if keep is not None:
                    keep[i].extend(out)
                runs += sum(pl.num_runs for pl in out)
            if not keep_all and len(alive) > 2 * len(dsts):
                del alive[: len(dsts)]
        return runs

    kept: list[list[Any]] = [[] for _ in dsts]
    runs = send(True, keep=kept)
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
        ("planner_ms_p50_plan_all", False, True),
    )
    for key, keep, batched in variants:
        for _ in range(5):
            send(keep, batched)
        ts = []
        for _ in range(repeats):
            t0 = time.perf_counter()
            send(keep, batched)
            ts.append(time.perf_counter() - t0)
        res[key] = _p50(ts) * 1e3
        res[key.replace("p50", "min")] = min(ts) * 1e3
    res["capacity_tokens_per_region"] = regions[0].capacity_tokens
    res["send_capacity_tokens"] = cap or total
    res["send_tokens"] = total
    res["decode_page"] = dsts[0].page_size
    return res


def _packer_bench(args: dict[str, Any], device: str, repeats: int) -> dict[str, Any]:
    import numpy as np
    import torch

    from pdplug import PlannerConfig, get_plugin_manager
    from pdplug.packing import pack_regions
    from pdplug.types import SendChunk
    from pdplug_bench.plan_layouts import bench_layouts, reference_pack

    d = args["dcp"]
    layers = args["pack_layers"] or (args["layers"] if device.startswith("cuda") else 16)
    seg_tokens = args["chunk_bound"]
    planner = get_plugin_manager().make_pack_planner(PlannerConfig(), name=args["planner"])
    src, dsts = bench_layouts({**args, "layers": layers})
    dsts = [dst for dst in dsts if planner.needs_relayout(src, dst)]
    if not dsts:
        return {"packer": None, "why": "no decode rank of this layout pair needs packing"}
    p = src.page_size
    vp = dsts[0].page_size * d
    regions = pack_regions(src, dst_dcp_size=d * len(dsts), depth=1,
                           region_tokens=-(-seg_tokens // d))  # fmt: skip
    pool_pages = 4 * seg_tokens // p  # source KV 4x the segment: rows come from everywhere
    rng = np.random.default_rng(1)
    chunk = SendChunk(
        room=1,
        src_pages=rng.permutation(pool_pages)[: seg_tokens // p].astype(np.int64),
        dst_pages=np.arange(-(-seg_tokens // vp), dtype=np.int64),
        num_tokens=seg_tokens,
        is_last=False,
    )
    plans = [
        planner.plan(chunk, src, dst, r, regions[i * d + r])
        for i, dst in enumerate(dsts)
        for r in range(d)
    ]
    dev = torch.device(device)
    gen = torch.Generator(device=dev).manual_seed(0)
    entries = [
        torch.randint(0, 256, (pool_pages * src.entry(e).page_stride,), dtype=torch.uint8,
                      device=dev, generator=gen)
        for e in range(src.num_entries)
    ]  # fmt: skip
    buf = torch.empty(regions[-1].offset + regions[-1].nbytes, dtype=torch.uint8, device=dev)
    nbytes = sum(pl.nbytes for pl in plans)
    copy_src = torch.randint(0, 256, (nbytes,), dtype=torch.uint8, device=dev, generator=gen)
    copy_dst = torch.empty_like(copy_src)
    packer = planner.packer(device)
    cuda = dev.type == "cuda"

    spin = getattr(torch.cuda, "_sleep", None)

    def once(fn: Any, gpu_only: bool) -> float:
        if cuda:
            if gpu_only and spin is not None:
                spin(4_000_000)  # ~2 ms busy GPU: the host enqueues everything before it starts
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(True)
            start.record()
            fn()
            end.record()
            end.synchronize()
            return start.elapsed_time(end) / 1e3
        t0 = time.perf_counter()
        fn()
        return time.perf_counter() - t0

    pairs: list[float] = []

    def timed(*fns: Any, gpu_only: bool = True) -> list[float]:
        """p50 seconds of each fn, interleaved per repeat so drift hits all alike (with two
        fns, ``pairs`` gets each repeat's time ratio fns[1]/fns[0]). On CUDA, ``gpu_only`` times
        GPU work only (host launch overhead hidden behind a spin kernel)."""
        for fn in fns:
            fn()  # warm-up (Triton JIT, first touch of the output pages)
        ts: list[list[float]] = [[] for _ in fns]
        for _ in range(repeats):
            for i, fn in enumerate(fns):
                ts[i].append(once(fn, gpu_only))
        if len(fns) == 2:
            pairs[:] = [b / a for a, b in zip(*ts)]
        return [_p50(t) for t in ts]

    def pack() -> None:
        for pl in plans:
            packer.pack(pl, entries, buf)

    res: dict[str, Any] = {"packer": getattr(packer, "kind", type(packer).__name__)}
    # correctness before timing: both buffers filled alike, every byte compared
    ref = torch.full_like(buf, 0xA5)
    buf.fill_(0xA5)
    if cuda:  # Triton vs the torch packer on the device
        torch_packer = planner.packer(device, "torch")
        for pl in plans:
            torch_packer.pack(pl, entries, ref)
        pack()
        torch.cuda.synchronize()
        res["reference"] = "torch packer on the device"
    else:  # the packer vs a numpy gather
        ref_np = ref.numpy()
        src_np = [t.numpy() for t in entries]
        for pl in plans:
            reference_pack(pl, src_np, ref_np)
        pack()
        res["reference"] = "numpy sub-row gather"
    res["mismatched_bytes"] = int((ref != buf).sum().item())
    res["bit_exact"] = res["mismatched_bytes"] == 0
    if cuda:

        def pack_torch() -> None:
            for pl in plans:
                torch_packer.pack(pl, entries, ref)

        (t_torch,) = timed(pack_torch)
        res["torch_packer_gbps"] = nbytes / t_torch / 1e9
    t_pack, t_copy = timed(pack, lambda: copy_dst.copy_(copy_src))
    if cuda:  # what a sender sees: host preparation and launches included
        (t_host,) = timed(pack, gpu_only=False)
        res["packer_gbps_host_included"] = nbytes / t_host / 1e9
        res["gpu_time_method"] = "cuda events after a spin kernel" if spin else "cuda events"
    res.update(
        packer_gbps=nbytes / t_pack / 1e9,
        memcpy_gbps=nbytes / t_copy / 1e9,
        pack_ms_p50=t_pack * 1e3,
        memcpy_ms_p50=t_copy * 1e3,
        packed_bytes=nbytes,
        pack_layers=layers,
        pack_rows_per_entry=sum(pl.num_tokens for pl in plans) // len(dsts),
        pack_subrows=sum(len(g.tokens) * len(g.cols) for pl in plans for g in pl.pack_groups),
        source_slots_per_entry=pool_pages * p,
        device=device,
    )
    # the headline ratio pairs each pack with the copy right after it (the machine's memory
    # bandwidth drifts between repeats); the ratio of the two medians is kept alongside
    res["packer_vs_memcpy"] = _p50(pairs)
    res["packer_vs_memcpy_of_medians"] = res["packer_gbps"] / res["memcpy_gbps"]
    res["packer_vs_memcpy_range"] = [min(pairs), max(pairs)]
    res["pack_threads"] = getattr(packer, "threads", None)
    return res


@click.command()
@json_option
@click.option(
    "--device",
    type=click.Choice(["cpu", "cuda"]),
    default="cpu",
    show_default=True,
    help="Where KV and the pack buffer live for the packer benchmark.",
)
@click.option("--repeats", default=200, show_default=True, help="Timed planner sends.")
@click.option("--pack-repeats", default=31, show_default=True, help="Timed packs/copies.")
@click.option("--cached", default=83_264, show_default=True, help="Cached-prefix tokens.")
@click.option("--unique", default=6_720, show_default=True, help="New tokens.")
@click.option("--dcp", default=4, show_default=True, help="Decode DCP size.")
@click.option("--page", default=64, show_default=True, help="Page size (tokens).")
@click.option("--layers", default=61, show_default=True, help="KV entries (MLA: one per layer).")
@click.option("--row-bytes", default=576, show_default=True, help="Bytes per token per entry.")
@click.option(
    "--chunk-bound",
    default=8192,
    show_default=True,
    help="Chunk bound (tokens) sizing the regions: chunk_bound/dcp per rank.",
)
@click.option(
    "--pack-layers",
    default=None,
    type=int,
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
@click.option("--kv-heads", default=8, show_default=True, help="KV heads (nhd/hnd).")
@click.option("--head-bytes", default=512, show_default=True, help="Bytes of one K|V head sub-row.")
def cli(json_path: str | None, device: str, repeats: int, pack_repeats: int, **args: Any) -> None:
    """Planner time per send (p50) and packer GB/s vs a plain copy of the same bytes."""
    from pdplug_bench.machine import machine_line, write_json

    if device == "cuda":
        import torch

        if not torch.cuda.is_available():
            raise click.UsageError("--device cuda: no CUDA device is available here")
    from pdplug_bench.plan_layouts import bench_layouts

    try:
        bench_layouts(args)
    except ValueError as e:
        raise click.UsageError(str(e)) from e
    pl = _planner_bench(args, repeats)
    pk = _packer_bench(args, device, pack_repeats)
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
        + f"); per send p50 {pl['planner_ms_p50']:.3f} ms (the sender's path: plan() per rank, "
        f"2 segments of plans alive; goal < 1 ms), {pl['planner_ms_p50_keep_all']:.3f} ms with "
        f"all plans alive, {pl['planner_ms_p50_plan_all']:.3f} ms batched (plan_all)"
    )
    if pk.get("packer") is None:
        click.echo(f"  packer: not run ({pk['why']})")
    else:
        click.echo(
            f"  packer ({pk['packer']}, {device}): {pk['packed_bytes'] / 2**20:.1f} MiB "
            f"({pk['pack_layers']} entries, {pk['pack_subrows']:,} sub-rows from "
            f"{pk['source_slots_per_entry']:,} slots per entry) {pk['packer_gbps']:.2f} GB/s vs "
            f"copy {pk['memcpy_gbps']:.2f} GB/s: p50 of {pack_repeats} paired repeats "
            f"{pk['packer_vs_memcpy']:.0%} (range {pk['packer_vs_memcpy_range'][0]:.0%}-"
            f"{pk['packer_vs_memcpy_range'][1]:.0%}; goal >= "
            f"{'80' if device == 'cuda' else '50'}%), {pk['pack_threads'] or '-'} pack threads; "
            f"bytes vs {pk['reference']}: "
            + ("identical" if pk["bit_exact"] else f"{pk['mismatched_bytes']:,} DIFFER")
        )
        if device == "cuda":
            click.echo(
                f"  GPU time only ({pk['gpu_time_method']}); with host launch overhead "
                f"{pk['packer_gbps_host_included']:.1f} GB/s; torch packer on {device}: "
                f"{pk['torch_packer_gbps']:.1f} GB/s"
            )
    click.echo(machine_line())
    if json_path:
        write_json(json_path, {**pl, **pk, "sizes": args})
    failed = list(pl["check_failures"])
    if pk.get("packer") is not None and not pk["bit_exact"]:
        failed.append(f"packed bytes differ from the {pk['reference']}: {pk['mismatched_bytes']}")
    if failed:
        raise click.ClickException("check failed: " + "; ".join(failed[:5]))
