"""``pdplug bench pack``: the field's cached-prefix table on this machine.

A long cached prefix on prefill with a cold decode ships the whole prompt; with plain TP on
prefill and DCP on decode every decode rank's tokens are strided in the prefill cache (SGLang
#35186 / #35762 / #40336). Three modes, side by side in one run,
all through pdplug's KV sender over the selected backend (``--backend``, NIXL by default) to
real receivers in another process:

* ``per_token`` — the fallback the field hit: one descriptor per token and entry, no packing
  (pdplug never does this by itself: a planner wrapper asks the ``dcp`` planner for its
  explicit per-token baseline plan, ``plan(..., region=None)``);
* ``packed`` — pdplug's path: the send split at the pack-region capacity (regions of 2,048
  tokens per rank, the field's 8,192-token chunk bound / DCP 4), packed and double-buffered;
* ``tp`` — the same bytes to a DCP-1 decode: merged page runs, no packing.

Shapes (cached prefix + unique tokens, decode cold, so all tokens go out): 83,264 + 6,720,
163,840 + 6,720 and 0 + 32,768; DCP 4, page 64, 576 B per token per layer (an FP8 MLA latent),
``--layers`` layers (default 4, so each mode runs in seconds here; the field used 61). Seconds
are the median of ``--repeats`` runs after one warm-up, from the first ``send`` to the sender's
``Success``. Ratios use total bytes over total seconds across the shapes. Bytes: the warm-up
round and one extra untimed round at the end of every mode and shape are checked: the decode
side poisons the pages it expects, and after ``Success`` a digest of every decode rank's rows
must equal the digest of the source rows that rank owns (:mod:`pdplug_bench.bytecheck`); a
mismatch exits non-zero. The *overlap bound* line reads the senders' busy clocks: how much
slower the packed mode's writes ran than the tp mode's (the gather's memory traffic competing
with the engine's copy), how much of the pack overlapped a write, and the packed / tp that
perfect double buffering would reach in this run (``packed_over_tp_bound``). JSON:
``{"rows": [{"prefix", "unique", "dcp", "mode", "seconds", "gbps"}], "ratios":
{"packed_over_per_token", "packed_over_tp", "packed_over_tp_bound"}}``.
"""

from __future__ import annotations

import statistics
import time
from typing import Any

import click

from pdplug_bench.machine import json_option
from pdplug_bench.options import StrictIntRange

SHAPES = ((83_264, 6_720), (163_840, 6_720), (0, 32_768))
PAGE = 64
ROW = 576
DCP = 4
REGION_TOKENS = 2048  # per destination rank: the 8,192-token chunk bound / DCP 4
MODES = ("per_token", "packed", "tp")


class PerTokenPlanner:
    """Wraps a pack planner into the per-token fallback (benchmark only): never asks for
    relayout, so the sender plans with ``region=None`` and the planner returns one run per
    token and entry."""

    def __init__(self, inner: Any) -> None:
        self.inner = inner

    def needs_relayout(self, src: Any, dst: Any) -> bool:
        """Always False: no pack regions, no split."""
        return False

    def capacity_tokens(self, src: Any, dst: Any, region_nbytes: int) -> int:
        """The wrapped planner's answer (unused: no relayout)."""
        return int(self.inner.capacity_tokens(src, dst, region_nbytes))

    def plan(self, chunk: Any, src: Any, dst: Any, dst_dcp_rank: int, region: Any = None) -> Any:
        """The wrapped planner's per-token baseline plan."""
        return self.inner.plan(chunk, src, dst, dst_dcp_rank, None)

    def packer(self, device: str = "cpu", kind: str = "auto") -> Any:
        """The wrapped planner's packer (unused)."""
        return self.inner.packer(device, kind)


def _run(
    backend: str, layers: int, repeats: int, corrupt: bool = False, pack_threads: int = 0
) -> tuple[list[dict[str, Any]], dict[str, dict[str, Any]], list[str]]:
    """Rows per shape and mode, the senders' time split, and the byte-check failures."""
    import numpy as np
    import torch

    from pdplug import KVConfig, KVLayout, KVPoll, PlannerConfig, PluginManager, SchedulerConfig
    from pdplug.bootstrap import RendezvousServer
    from pdplug_bench._kvpeer import DecodeInstance, DecodePeer
    from pdplug_bench.bytecheck import POISON, dcp_tokens, rows_digest, src_rows

    max_total = max(a + b for a, b in SHAPES)
    src_pages = -(-max_total // PAGE) + 8
    bpt = (ROW,) * layers
    src_l = KVLayout(
        page_size=PAGE, entry_bytes_per_token=bpt, dtype="float8_e4m3fn", num_layers=layers
    )
    d4 = KVLayout(
        page_size=PAGE,
        entry_bytes_per_token=bpt,
        dtype="float8_e4m3fn",
        num_layers=layers,
        dcp_size=DCP,
    )
    d1 = KVLayout(
        page_size=PAGE, entry_bytes_per_token=bpt, dtype="float8_e4m3fn", num_layers=layers
    )
    d4_pages = -(-max_total // (PAGE * DCP)) + 8
    d1_pages = src_pages
    server = RendezvousServer().start()
    pm = PluginManager()
    planner = pm.make_pack_planner(PlannerConfig(pack_threads=pack_threads))
    sched = pm.make_scheduler(SchedulerConfig(page_size=PAGE, chunk_size=REGION_TOKENS * DCP))
    g = torch.Generator().manual_seed(0)
    kv = [
        torch.randint(1, 256, (src_pages * PAGE, ROW), dtype=torch.uint8, generator=g)
        for _ in range(layers)
    ]
    senders: dict[str, Any] = {}
    for mode in MODES:
        cfg = KVConfig(
            instance=f"pf-{mode}",
            role="prefill",
            layout=src_l,
            bootstrap_endpoint=server.endpoint,
            bootstrap_timeout_s=120,
            waiting_timeout_s=300,
            transfer_timeout_s=120,
            pack_region_tokens=REGION_TOKENS,
            pack_depth=2,
            max_dst_dcp=DCP,
        )
        pl = PerTokenPlanner(planner) if mode == "per_token" else planner
        senders[mode] = pm.make_kv_sender(cfg, pl, name=backend)  # type: ignore[arg-type]
        senders[mode].register_kv(kv)
    peer = DecodePeer(
        backend,
        server.endpoint,
        "pf-packed",
        [
            DecodeInstance(
                name="d-per_token", layout=d4, rows=d4_pages * PAGE, prefill="pf-per_token"
            ),
            DecodeInstance(name="d-packed", layout=d4, rows=d4_pages * PAGE, prefill="pf-packed"),
            DecodeInstance(name="d-tp", layout=d1, rows=d1_pages * PAGE, prefill="pf-tp"),
        ],
    )
    rows: list[dict[str, Any]] = []
    failures: list[str] = []
    rng = np.random.default_rng(0)
    room = 1
    try:
        peer.wait_ready(300)
        for prefix, unique in SHAPES:
            total = prefix + unique
            sp = rng.permutation(src_pages)[: -(-total // PAGE)].astype(np.int64)
            times: dict[str, list[float]] = {m: [] for m in MODES}
            segs_n: dict[str, int] = {}
            runs_n: dict[str, int] = {}
            want = {  # digests of the source rows each decode rank owns
                dcp: [rows_digest(kv, src_rows(sp, PAGE, total, r, dcp)) for r in range(dcp)]
                for dcp in (1, DCP)
            }
            for rep in range(repeats + 2):
                # the first round warms up, the last is an extra check: both checked, untimed
                checked = rep in (0, repeats + 1)
                for mode in MODES:
                    sender = senders[mode]
                    dcp = 1 if mode == "tp" else DCP
                    n_dst = -(-total // (PAGE * dcp))
                    dp = [
                        rng.permutation(d1_pages if dcp == 1 else d4_pages)[:n_dst].tolist()
                        for _ in range(dcp)
                    ]
                    peer.expect(f"d-{mode}", room, dp, total, poison=POISON if checked else None)
                    sender.start(room)
                    if sender.wait(room, (KVPoll.WaitingForInput,), 120) != KVPoll.WaitingForInput:
                        raise click.ClickException(f"{mode}: {sender.failure_reason(room)}")
                    cap = sender.capacity_tokens(room)
                    segs = sched.split_send(
                        token_start=0,
                        token_end=total,
                        decode_prefix_len=0,
                        is_last_send=True,
                        capacity_tokens=cap,
                    )
                    segs_n[mode] = len(segs)
                    runs0 = sender.stats().get("runs", 0)
                    t0 = time.perf_counter()
                    for seg in segs:
                        sender.send(room, seg, sp[seg.token_start // PAGE :])
                    st = sender.wait(room, timeout_s=300)
                    dt = time.perf_counter() - t0
                    if st != KVPoll.Success:
                        raise click.ClickException(f"{mode}: {sender.failure_reason(room)}")
                    verdict = peer.done(room, 300)
                    if not verdict["ok"]:
                        raise click.ClickException(f"{mode} decode: {verdict['reasons']}")
                    runs_n[mode] = sender.stats().get("runs", 0) - runs0
                    if checked:
                        got = peer.digest(
                            f"d-{mode}",
                            dp,
                            [dcp_tokens(total, r, dcp) for r in range(dcp)],
                            corrupt=corrupt and rep == 0 and mode == "packed",
                            timeout=300,
                        )
                        bad = [r for r in range(dcp) if got[r] != want[dcp][r]]
                        if bad:
                            failures.append(
                                f"{mode} {prefix:,} + {unique:,} round {rep}: bytes on decode "
                                f"DCP ranks {bad} differ from the source rows they own"
                            )
                    sender.clear(room)
                    peer.clear(f"d-{mode}", room)
                    room += 1
                    if not checked:
                        times[mode].append(dt)
            nbytes = total * ROW * layers
            for mode in MODES:
                sec = statistics.median(times[mode])
                rows.append(
                    {
                        "prefix": prefix,
                        "unique": unique,
                        "dcp": 1 if mode == "tp" else DCP,
                        "mode": mode,
                        "seconds": sec,
                        "gbps": nbytes / sec / 1e9,
                        "segments": segs_n[mode],
                        "descriptors": runs_n[mode],
                        "bytes": nbytes,
                    }
                )
        # where each sender's time went, over all runs (plan_s/pack_s: pack thread; post_s:
        # engine thread inside post calls; write_s: post to completion seen)
        stats = {
            mode: {k: v for k, v in s.stats().items() if k.endswith("_s") or k == "posts"}
            for mode, s in senders.items()
        }
    finally:
        peer.close()
        for s in senders.values():
            s.close()
        server.stop()
    return rows, stats, failures


@click.command()
@click.option("--backend", default="nixl", show_default=True, help="KV sender name.")
@click.option(
    "--layers",
    default=4,
    show_default=True,
    type=StrictIntRange(1, 128),
    help="Layers of 576 B/token (the field used 61; fewer keep each mode to seconds).",
)
@click.option("--repeats", default=3, show_default=True, type=StrictIntRange(1, 100),
              help="Timed runs per mode and shape.")  # fmt: skip
@click.option(
    "--pack-threads",
    default=0,
    show_default=True,
    type=StrictIntRange(0, 64),
    help="CPU gather threads of the sender's packer (0: the default, torch's thread count "
    "less one, left to the engine's copy).",
)
@click.option("--inject-fault", is_flag=True, hidden=True,
              help="Tests only: flip one landed byte before the first check.")  # fmt: skip
@json_option
def cli(
    backend: str,
    layers: int,
    repeats: int,
    pack_threads: int,
    inject_fault: bool,
    json_path: str | None,
) -> None:
    """Cached-prefix sends over the KV backend: per-token vs packed vs plain TP->TP; bytes
    checked."""
    from rich.console import Console
    from rich.table import Table

    from pdplug_bench.machine import machine_line, write_json
    from pdplug_bench.options import component_name

    backend = component_name(backend, "kv_sender", "--backend")
    console = Console(width=120)  # tables stay whole when piped
    console.print(machine_line())
    console.print(
        f"backend {backend}; DCP {DCP}, page {PAGE}, {ROW} B/token x {layers} layers; pack "
        f"regions {REGION_TOKENS} tokens per rank x 2 (double-buffered); shapes "
        + ", ".join(f"{a:,} + {b:,}" for a, b in SHAPES)
    )
    rows, stats, failures = _run(backend, layers, repeats, inject_fault, pack_threads)
    t = Table(title=f"pdplug bench pack ({backend}; seconds = median of {repeats})")
    for col in (
        "prefix + unique",
        "MB",
        "mode",
        "segments",
        "descriptors",
        "seconds",
        "GB/s",
        "vs per_token",
    ):
        t.add_column(col, justify="right")
    for prefix, unique in SHAPES:
        g = {r["mode"]: r for r in rows if (r["prefix"], r["unique"]) == (prefix, unique)}
        for mode in MODES:
            r = g[mode]
            t.add_row(
                f"{prefix:,} + {unique:,}",
                f"{r['bytes'] / 1e6:.0f}",
                mode,
                str(r["segments"]),
                f"{r['descriptors']:,}",
                f"{r['seconds']:.3f}",
                f"{r['gbps']:.2f}",
                f"{g['per_token']['seconds'] / r['seconds']:.1f}x",
            )
    console.print(t)
    tot = {
        m: (
            sum(r["bytes"] for r in rows if r["mode"] == m),
            sum(r["seconds"] for r in rows if r["mode"] == m),
        )
        for m in MODES
    }
    gb = {m: b / s / 1e9 for m, (b, s) in tot.items()}
    ratios = {
        "packed_over_per_token": gb["packed"] / gb["per_token"],
        "packed_over_tp": gb["packed"] / gb["tp"],
    }
    console.print(
        f"packed / per_token = {ratios['packed_over_per_token']:.1f}x (goal >= 10x; field 10.9x); "
        f"packed / tp = {ratios['packed_over_tp']:.1%} (goal >= 60% on this machine; field 95%) "
        "[total bytes / total seconds over the three shapes]"
    )
    console.print(
        "sender time (all runs): "
        + "; ".join(
            f"{m}: " + ", ".join(f"{k} {v:.2f}" for k, v in st.items() if k.endswith("_s"))
            for m, st in stats.items()
        )
    )
    pk, tp = stats.get("packed", {}), stats.get("tp", {})
    if pk.get("write_busy_s") and tp.get("write_busy_s") and pk.get("pack_busy_s"):
        # what perfect double buffering could reach in this run: the pack hidden entirely
        # behind writes that the gather's memory traffic slows down
        bound = tp["write_busy_s"] / max(pk["pack_busy_s"], pk["write_busy_s"])
        ratios["packed_over_tp_bound"] = bound
        console.print(
            f"overlap bound (busy clocks, all runs): packed writes took "
            f"{pk['write_busy_s'] / tp['write_busy_s']:.2f}x the tp writes of the same bytes "
            f"while the pack thread gathered; {pk['overlap_s'] / pk['pack_busy_s']:.0%} of the "
            f"pack time overlapped a write; with all of it hidden, packed / tp would be about "
            f"tp write / max(pack, packed write) = {bound:.1%} (busy sums over every run, "
            f"the ratio above uses medians)"
        )
    console.print(
        f"bytes: {'all checked rounds identical' if not failures else 'MISMATCH'} (every mode "
        "and shape; warm-up and final round, decode pages poisoned first)"
    )
    if json_path:
        write_json(
            json_path,
            {
                "byte_failures": failures,
                "rows": [
                    {k: r[k] for k in ("prefix", "unique", "dcp", "mode", "seconds", "gbps")}
                    for r in rows
                ],
                "ratios": ratios,
                "sender_stats": stats,
                "backend": backend,
                "layers": layers,
                "bytes_per_token_per_layer": ROW,
                "page_size": PAGE,
                "region_tokens_per_rank": REGION_TOKENS,
            },
        )
    if failures:
        raise click.ClickException("byte check failed: " + "; ".join(failures[:4]))
