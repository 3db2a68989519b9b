"""Layout arithmetic shared by planners, senders and the handshake (pure functions).

Entries are grouped per layer: a layout with ``num_layers = L`` and ``E`` entries has
``E / L`` entries per layer (2 for K/V, 1 for an MLA latent), in layer order, followed by
nothing else; draft entries are listed by index. A prefill PP rank holds layers
``[first_layer, first_layer + num_layers)``; a decode rank usually holds them all, so a source
entry maps to a destination entry shifted by whole layers (:func:`entry_map`).
"""

from __future__ import annotations

import numpy as np

from pdplug.types import KVLayout

__all__ = ["entries_per_layer", "entry_map", "layout_mismatches"]


def entries_per_layer(layout: KVLayout) -> int:
    """Entries per layer (``num_entries // num_layers``; all entries if ``num_layers == 0``).

    :raises ValueError: ``num_entries`` is not a multiple of ``num_layers``.
    """
    if layout.num_layers <= 0:
        return layout.num_entries
    if layout.num_entries % layout.num_layers:
        raise ValueError(
            f"KVLayout: {layout.num_entries} entries are not a multiple of "
            f"num_layers={layout.num_layers}"
        )
    return layout.num_entries // layout.num_layers


def entry_map(src: KVLayout, dst: KVLayout) -> np.ndarray:
    """Destination entry index of every source entry: int64 ``[src.num_entries]``.

    Layers are matched by absolute layer id; with ``num_layers == 0`` on either side entries
    map one to one.

    :raises ValueError: the source layers are not all held by the destination.
    """
    if src.num_layers <= 0 or dst.num_layers <= 0:
        if src.num_entries != dst.num_entries:
            raise ValueError(
                f"entry count differs: source {src.num_entries} vs destination {dst.num_entries}"
            )
        return np.arange(src.num_entries, dtype=np.int64)
    epl = entries_per_layer(src)
    if epl != entries_per_layer(dst):
        raise ValueError(
            f"entries per layer differ: source {epl} vs destination {entries_per_layer(dst)}"
        )
    lo, hi = src.first_layer, src.first_layer + src.num_layers
    if lo < dst.first_layer or hi > dst.first_layer + dst.num_layers:
        raise ValueError(
            f"source layers [{lo}, {hi}) not held by destination layers "
            f"[{dst.first_layer}, {dst.first_layer + dst.num_layers})"
        )
    return np.arange(src.num_entries, dtype=np.int64) + (lo - dst.first_layer) * epl


def _layers(lay: KVLayout) -> str:
    if lay.num_layers <= 0:
        return f"{lay.num_entries} entries (no layer range)"
    return f"[{lay.first_layer}, {lay.first_layer + lay.num_layers})"


def layout_mismatches(local: KVLayout, remote: KVLayout) -> list[str]:
    """Every reason two layouts cannot exchange KV, each naming the field and both values.

    Checked: dtype, layout version, model (when both name one), KV heads and head size (when
    both give them), whether heads route between the two TP sizes, entries per layer, the
    layers held, draft entries, and per mapped entry its content and head bytes (layouts
    with entry geometry) or bytes per token (layouts without). Page sizes may differ when both
    layouts describe their entries and one page size divides the other; layouts without entry
    geometry need equal page sizes (as before). DCP/PP sizes may differ; NHD vs HND, page
    strides and TP ratios are mapped by the planner. ``engine``/``engine_version``/``kind``
    are carried for hosts' own checks (``pdplug_check_compat``) and not compared here.
    """
    from pdplug.heads import head_routes, layout_heads

    out: list[str] = []
    geo = bool(local.entries) and bool(remote.entries)
    a, b = local.page_size, remote.page_size
    if a != b and (not geo or (a % b and b % a)):
        why = " (neither divides the other)" if geo else ""
        out.append(f"page_size: local {a} vs remote {b} tokens{why}")
    if local.dtype != remote.dtype:
        out.append(f"dtype: local {local.dtype} vs remote {remote.dtype}")
    if local.layout_version != remote.layout_version:
        out.append(
            f"layout_version: local {local.layout_version} vs remote {remote.layout_version}"
        )
    for f in ("model", "num_kv_heads", "head_size"):
        x, y = getattr(local, f), getattr(remote, f)
        if x and y and x != y:
            out.append(f"{f}: local {x!r} vs remote {y!r}")
    if bool(local.entries) != bool(remote.entries):
        side = "local" if local.entries else "remote"
        out.append(
            f"entries: only the {side} layout describes its entry geometry (both or neither)"
        )
        return out
    hl, hr = layout_heads(local), layout_heads(remote)
    if hl != hr:
        out.append(f"KV heads routed: local {hl} vs remote {hr}")
    else:
        try:
            head_routes(local.tp_size, remote.tp_size, hl)
        except ValueError as e:
            out.append(str(e))
    src, dst = (local, remote) if local.num_layers <= remote.num_layers else (remote, local)
    try:
        emap = entry_map(src, dst)
    except ValueError as e:
        held = str(e).startswith("source layers")
        out.append(
            f"layers: local {_layers(local)} vs remote {_layers(remote)} ({e})" if held else str(e)
        )
        return out
    names = ("local", "remote") if src is local else ("remote", "local")
    if geo:
        for i, j in enumerate(emap.tolist()):
            gs, gd = src.entry(i), dst.entry(j)
            for f in ("content", "head_bytes"):
                if getattr(gs, f) != getattr(gd, f):
                    out.append(
                        f"entries[{i}].{f}: {names[0]} {getattr(gs, f)!r} vs {names[1]} "
                        f"{getattr(gd, f)!r}"
                    )
    else:
        s_bpt = np.asarray(src.entry_bytes_per_token)
        d_bpt = np.asarray(dst.entry_bytes_per_token)[emap]
        for i in np.flatnonzero(s_bpt != d_bpt).tolist():
            out.append(
                f"entry_bytes_per_token[{i}]: {names[0]} {s_bpt[i]} vs {names[1]} {d_bpt[i]} bytes"
            )
    s_draft = set(src.draft_entries)
    d_draft = {i for i, j in enumerate(emap.tolist()) if j in set(dst.draft_entries)}
    if s_draft != d_draft:
        out.append(f"draft_entries: {sorted(s_draft)} vs {sorted(d_draft)} (source indices)")
    return out
