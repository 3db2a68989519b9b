"""Layouts, ideal run counts and plan checks of ``pdplug bench plan``.

``--layout`` mla (the default: one latent per layer, ``--row-bytes``), nhd or hnd (fused K|V
sub-rows of ``--head-bytes`` for ``--kv-heads`` heads); ``--tp P:D`` prefill and decode TP;
``--page-ratio`` prefill page / decode page (``--page`` is the prefill page). The benchmark
plans prefill TP rank 0's sends to every decode rank it routes heads to.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import numpy as np

from pdplug import KVLayout
from pdplug.geometry import make_layout
from pdplug.heads import routed_heads
from pdplug.packing import group_rows, pack_groups
from pdplug.types import TransferPlan

__all__ = ["parse_tp", "bench_layouts", "ideal_runs", "check_plans", "reference_pack"]


def parse_tp(text: str) -> tuple[int, int]:
    """``"P:D"`` -> ``(P, D)``.

    :raises ValueError: not two positive integers separated by ``:``.
    """
    try:
        p, d = (int(x) for x in text.split(":"))
    except ValueError as e:
        raise ValueError(f"--tp must be PREFILL:DECODE, e.g. 1:2, got {text!r}") from e
    if p <= 0 or d <= 0:
        raise ValueError(f"--tp sizes must be > 0, got {text!r}")
    return p, d


def _layout(args: dict[str, Any], kind: str, page: int, tp: int, rank: int, dcp: int) -> KVLayout:
    if kind == "mla":
        return make_layout(kind="mla", page_size=page, num_layers=args["layers"],
                           head_bytes=args["row_bytes"], tp_size=tp, tp_rank=rank,
                           dcp_size=dcp)  # fmt: skip
    return make_layout(kind=kind, page_size=page, num_layers=args["layers"],
                       head_bytes=args["head_bytes"], num_kv_heads=args["kv_heads"],
                       tp_size=tp, tp_rank=rank, dcp_size=dcp)  # fmt: skip


def bench_layouts(
    args: dict[str, Any], kind: str | None = None, tp: tuple[int, int] | None = None
) -> tuple[KVLayout, list[KVLayout]]:
    """Prefill TP rank 0's layout and the layouts of the decode TP ranks it sends to.

    :param kind: override ``args["layout"]``; ``tp``: override ``args["tp"]``.
    :raises ValueError: a decode page that is not a whole number of tokens, or layouts that
        cannot be built (named by :func:`pdplug.geometry.make_layout`).
    """
    kind = kind or args["layout"]
    p_tp, d_tp = tp or parse_tp(args["tp"])
    page = args["page"]
    ratio = args["page_ratio"]
    if not (ratio > 0 and math.isfinite(ratio)):
        raise ValueError(f"--page-ratio must be a positive number, got {ratio!r}")
    d_page = page / ratio
    if d_page != int(d_page) or d_page < 1:
        raise ValueError(
            f"--page {page} / --page-ratio {args['page_ratio']} = {d_page} is not a whole "
            "decode page"
        )
    src = _layout(args, kind, page, p_tp, 0, 1)
    dsts = [_layout(args, kind, int(d_page), d_tp, r, args["dcp"]) for r in range(d_tp)]
    return src, [d for d in dsts if routed_heads(src, d) is not None]


def ideal_runs(plans: Sequence[TransferPlan], dst: KVLayout) -> int:
    """One run per head range per destination page: the (entry, destination page) pairs the
    plans write (each decode rank receives one contiguous head range)."""
    total = 0
    for pl in plans:
        if pl.num_runs == 0:
            continue
        ps = np.array([dst.entry(int(e)).page_stride for e in range(dst.num_entries)])
        page = pl.dst_offset // ps[pl.entry]
        total += int(np.unique(pl.entry * (1 << 40) + page).shape[0])
    return total


def check_plans(plans: Sequence[TransferPlan], src: KVLayout, dst: KVLayout) -> list[str]:
    """Structural checks of one destination's plans: every run inside one destination page,
    no destination byte written twice, and the bytes a plan writes equal its tokens times the
    bytes per token it moves. Returns the failures (empty when all hold)."""
    bad: list[str] = []
    ps = np.array([dst.entry(e).page_stride for e in range(dst.num_entries)])
    moved = {}
    for e in range(src.num_entries):
        g = src.entry(e)
        heads = routed_heads(src, dst)
        n = (heads[1] - heads[0]) if heads and heads[1] > heads[0] else g.heads
        moved[e] = n * g.head_bytes
    seen: list[np.ndarray] = []
    for pl in plans:
        if pl.num_runs == 0:
            continue
        lo = pl.dst_offset // ps[pl.entry]
        hi = (pl.dst_offset + pl.length - 1) // ps[pl.entry]
        if (lo != hi).any():
            bad.append(f"chunk {pl.chunk_id} dcp {pl.dst_dcp_rank}: a run crosses a page")
        want = pl.num_tokens * sum(moved[e] for e in set(pl.entry.tolist()))
        if pl.nbytes != want:
            bad.append(
                f"chunk {pl.chunk_id} dcp {pl.dst_dcp_rank}: {pl.nbytes} bytes, {want} expected"
            )
        seen.append(
            np.stack([pl.entry + pl.dst_dcp_rank * (1 << 20), pl.dst_offset, pl.length], axis=1)
        )
    if seen:
        runs = np.concatenate(seen)
        runs = runs[np.lexsort((runs[:, 1], runs[:, 0]))]
        same = runs[1:, 0] == runs[:-1, 0]
        if (same & (runs[1:, 1] < runs[:-1, 1] + runs[:-1, 2])).any():
            bad.append("a destination byte is written twice")
    return bad


def reference_pack(plan: TransferPlan, entries: Sequence[Any], buf: np.ndarray) -> None:
    """Gather ``plan`` into ``buf`` (uint8 numpy) the slow, obvious way: sub-row by sub-row
    offsets from :func:`pdplug.packing.group_rows`, bytes copied with numpy fancy indexing
    from each entry's contiguous uint8 numpy array, in blocks of at most 4 Mi indices."""
    for g in pack_groups(plan):
        rows = group_rows(g)
        cols = np.arange(g.row_bytes)
        step = max(1, (1 << 22) // max(1, g.row_bytes))  # rows per block: bounded index memory
        for e, off in zip(g.entries, np.asarray(g.offsets).tolist()):
            src = entries[e]
            for lo in range(0, rows.shape[0], step):
                idx = rows[lo : lo + step, None] + cols
                at = off + lo * g.row_bytes
                buf[at : at + idx.size] = src[idx].reshape(-1)
