"""``pdplug bench plan``: DCP planner time per send and packer throughput vs a plain copy.

Planner: the field's cached-prefix send (83,264 cached + 6,720 new tokens, decode cold, so
all 89,984 tokens go out), DCP 4, page 64, MLA-like rows (61 layers x 576 B), regions sized
from an 8,192-token chunk bound (2,048 tokens per rank region, double-buffered). One timed
"send" = ``Scheduler.split_send`` + for every segment and each of the 4 destination ranks
``segment_to_chunk`` + ``plan`` into the rank's ``(rank, chunk_id % 2)`` region — what the KV
sender does (each decode rank's own SendChunk): 11 segments x 4 ranks = 44 plans.
``planner_ms_p50`` keeps a segment's plans alive until the segment after next is planned (a
double-buffered sender drops a segment's descriptors once its write completed);
``planner_ms_p50_keep_all`` keeps all 44 plans alive; ``planner_ms_p50_plan_all`` plans each
segment's ranks in one batched ``plan_all`` (for hosts that share one chunk across ranks).

Packer: one full segment (8,192 tokens; 4 ranks x 2,048 rows per entry) gathered by the
packer into the pack buffer, against ``dst.copy_(src)`` of the same number of bytes, side by
side in one run; the ratio is the median over repeats of each pack paired with the copy right
after it. The CPU packer uses ``PlannerConfig().pack_threads`` threads (all of torch's), like
the copy. CPU: torch packer. ``--device cuda``: the Triton packer (bit-exactness vs the
torch packer is checked first) against a device-to-device copy, GPU time from CUDA events
recorded behind a spin kernel (so the host's launch overhead is not counted), plus the
host-inclusive figure a sender sees.

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

    from pdplug import KVLayout, PlannerConfig, SchedulerConfig, get_plugin_manager
    from pdplug.packing import (
        pack_regions,
        plan_all_ranks,
        region_index,
        segment_to_chunk,
        send_capacity_tokens,
    )

    p, d, layers, row = args["page"], args["dcp"], args["layers"], args["row_bytes"]
    pm = get_plugin_manager()
    planner = pm.make_pack_planner(PlannerConfig(), name=args["planner"])
    sched = pm.make_scheduler(SchedulerConfig(page_size=p, chunk_size=args["chunk_bound"]))
    bpt = (row,) * layers
    src = KVLayout(page_size=p, entry_bytes_per_token=bpt, num_layers=layers)
    dst = KVLayout(page_size=p, entry_bytes_per_token=bpt, num_layers=layers, dcp_size=d)
    regions = pack_regions(src, dst_dcp_size=d, depth=2, region_tokens=-(-args["chunk_bound"] // d))
    cap = send_capacity_tokens(regions[0], d)
    total = args["cached"] + args["unique"]
    rng = np.random.default_rng(0)
    src_pages = rng.permutation(4 * -(-total // p))[: -(-total // p)].astype(np.int64)
    dst_pages = rng.permutation(4 * -(-total // (p * d)))[: -(-total // (p * d))].astype(np.int64)
    # regions of every rank for chunk_id % 2 == 0 and == 1 (double buffering)
    region_sets = [[regions[region_index(r, c, 2)] for r in range(d)] for c in range(2)]

    def send(keep_all: bool, batched: bool = False) -> tuple[int, int, int]:
        segs = sched.split_send(
            token_start=0,
            token_end=total,
            decode_prefix_len=0,
            is_last_send=True,
            capacity_tokens=cap,
        )
        alive: list[Any] = []
        runs = plans = 0
        for s in segs:
            rset = region_sets[s.chunk_id % 2]
            if batched:
                chunk = segment_to_chunk(1, s, src_pages[s.page_start :], dst_pages, 0, p)
                out = plan_all_ranks(planner, chunk, src, dst, rset)
            else:  # the sender's path: each decode rank's own SendChunk, one plan() each
                out = [
                    planner.plan(
                        segment_to_chunk(1, s, src_pages[s.page_start :], dst_pages, 0, p),
                        src,
                        dst,
                        r,
                        rset[r],
                    )
                    for r in range(d)
                ]
            alive.append(out)
            if not keep_all and len(alive) > 2:
                alive.pop(0)
            plans += len(out)
            runs += sum(pl.num_runs for pl in out)
        return len(segs), plans, runs

    segments, plans, runs = send(True)
    res: dict[str, Any] = {"segments": segments, "plans": plans, "runs_per_send": runs}
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
    res["send_capacity_tokens"] = cap
    res["send_tokens"] = total
    return res


def _packer_bench(args: dict[str, Any], device: str, repeats: int) -> dict[str, Any]:
    import numpy as np
    import torch

    from pdplug import KVLayout, PlannerConfig, SendChunk, get_plugin_manager
    from pdplug.packing import pack_regions, plan_all_ranks

    p, d, row = args["page"], args["dcp"], args["row_bytes"]
    layers = args["pack_layers"] or (args["layers"] if device.startswith("cuda") else 16)
    seg_tokens = args["chunk_bound"]
    planner = get_plugin_manager().make_pack_planner(PlannerConfig(), name=args["planner"])
    bpt = (row,) * layers
    src = KVLayout(page_size=p, entry_bytes_per_token=bpt, num_layers=layers)
    dst = KVLayout(page_size=p, entry_bytes_per_token=bpt, num_layers=layers, dcp_size=d)
    regions = pack_regions(src, dst_dcp_size=d, depth=2, region_tokens=-(-seg_tokens // d))
    pool_pages = 4 * seg_tokens // p  # source KV 4x the segment: rows come from everywhere
    rng = np.random.default_rng(1)
    chunk = SendChunk(
        room=1,
        src_pages=rng.permutation(pool_pages)[: seg_tokens // p].astype(np.int64),
        dst_pages=np.arange(seg_tokens // (p * d), dtype=np.int64),
        num_tokens=seg_tokens,
        is_last=False,
    )
    plans = plan_all_ranks(planner, chunk, src, dst, regions[0::2])
    dev = torch.device(device)
    gen = torch.Generator(device=dev).manual_seed(0)
    entries = [
        torch.randint(0, 256, (pool_pages * p, row), dtype=torch.uint8, device=dev, generator=gen)
        for _ in range(layers)
    ]
    buf = torch.empty(regions[-1].offset + regions[-1].nbytes, dtype=torch.uint8, device=dev)
    nbytes = sum(pl.num_tokens for pl in plans) * row * layers
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
    if cuda:  # bit-exact against the torch packer before timing
        # the core never imports a plugin: the reference packer comes through the Protocol
        torch_packer = planner.packer(device, "torch")
        ref = torch.zeros_like(buf)
        for pl in plans:
            torch_packer.pack(pl, entries, ref)
        buf.fill_(0xA5)
        pack()
        torch.cuda.synchronize()
        res["bit_exact_vs_torch"] = bool(torch.equal(ref, buf))

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
        pack_rows_per_entry=sum(pl.num_tokens for pl in plans),
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
@click.option("--repeats", default=200, show_default=True, type=click.IntRange(1, 100_000),
              help="Timed planner sends.")  # fmt: skip
@click.option("--pack-repeats", default=31, show_default=True, type=click.IntRange(1, 10_000),
              help="Timed packs/copies.")  # fmt: skip
@click.option("--cached", default=83_264, show_default=True, type=click.IntRange(0, 1 << 22),
              help="Cached-prefix tokens.")  # fmt: skip
@click.option("--unique", default=6_720, show_default=True, type=click.IntRange(1, 1 << 22),
              help="New tokens.")  # fmt: skip
@click.option("--dcp", default=4, show_default=True, type=click.IntRange(1, 64),
              help="Decode DCP size.")  # fmt: skip
@click.option("--page", default=64, show_default=True, type=click.IntRange(1, 4096),
              help="Page size (tokens).")  # fmt: skip
@click.option("--layers", default=61, show_default=True, type=click.IntRange(1, 1024),
              help="KV entries (MLA: one per layer).")  # fmt: skip
@click.option("--row-bytes", default=576, show_default=True, type=click.IntRange(1, 1 << 20),
              help="Bytes per token per entry.")  # fmt: skip
@click.option(
    "--chunk-bound",
    default=8192,
    show_default=True,
    type=click.IntRange(1, 1 << 22),
    help="Chunk bound (tokens) sizing the regions: chunk_bound/dcp per rank.",
)
@click.option(
    "--pack-layers",
    default=None,
    type=click.IntRange(1, 1024),
    help="Entries in the packer benchmark [default: 16 on cpu, --layers on cuda].",
)
@click.option("--planner", default="dcp", show_default=True, help="Pack planner name.")
def cli(json_path: str | None, device: str, repeats: int, pack_repeats: int, **args: Any) -> None:
    """Planner time per send (p50) and packer GB/s vs a plain copy of the same bytes."""
    from pdplug_bench.machine import machine_line, write_json
    from pdplug_bench.options import component_names

    (args["planner"],) = component_names(args["planner"], "pack_planner", "--planner")
    if device == "cuda":
        import torch

        if not torch.cuda.is_available():
            raise click.UsageError("--device cuda: no CUDA device is available here")
    pl = _planner_bench(args, repeats)
    pk = _packer_bench(args, device, pack_repeats)
    total = pl["send_tokens"]
    click.echo(
        f"pdplug bench plan: send of {args['cached']:,} cached + {args['unique']:,} new = "
        f"{total:,} tokens, DCP {args['dcp']}, page {args['page']}, {args['layers']} entries x "
        f"{args['row_bytes']} B, regions {pl['capacity_tokens_per_region']:,} tokens/rank "
        f"(send capacity {pl['send_capacity_tokens']:,})"
    )
    click.echo(
        f"  planner ({args['planner']}): {pl['segments']} segments x {args['dcp']} ranks = "
        f"{pl['plans']} plans, {pl['runs_per_send']:,} runs; per send p50 "
        f"{pl['planner_ms_p50']:.3f} ms (the sender's path: plan() per rank, 2 segments of "
        f"plans alive; goal < 1 ms), {pl['planner_ms_p50_keep_all']:.3f} ms with all plans "
        f"alive, {pl['planner_ms_p50_plan_all']:.3f} ms batched (plan_all)"
    )
    click.echo(
        f"  packer ({pk['packer']}, {device}): {pk['packed_bytes'] / 2**20:.1f} MiB "
        f"({pk['pack_layers']} entries x {pk['pack_rows_per_entry']:,} rows of "
        f"{args['row_bytes']} B from {pk['source_slots_per_entry']:,} slots) "
        f"{pk['packer_gbps']:.2f} GB/s vs copy {pk['memcpy_gbps']:.2f} GB/s: p50 of "
        f"{pack_repeats} paired repeats {pk['packer_vs_memcpy']:.0%} (range "
        f"{pk['packer_vs_memcpy_range'][0]:.0%}-{pk['packer_vs_memcpy_range'][1]:.0%}; goal >= "
        f"{'80' if device == 'cuda' else '50'}%), {pk['pack_threads'] or '-'} pack threads"
    )
    if "bit_exact_vs_torch" in pk:
        click.echo(
            f"  triton bit-exact vs torch packer: {pk['bit_exact_vs_torch']}; GPU time only "
            f"({pk['gpu_time_method']}); with host launch overhead "
            f"{pk['packer_gbps_host_included']:.1f} GB/s; torch packer on {device}: "
            f"{pk['torch_packer_gbps']:.1f} GB/s"
        )
    click.echo(machine_line())
    if json_path:
        write_json(json_path, {**pl, **pk, "sizes": args})
