"""The KV that ``pdplug bench cluster`` moves, and the byte check of what landed (numpy, no
torch).

Geometry and traffic are the reference host's demo (:mod:`pdplug_host`): its tiny model's
layers and K/V rows (:class:`pdplug_host.config.ModelConfig`), PP 2 prefill, DCP 2 decode,
16-token pages, the demo's grid and pack regions (:class:`pdplug_host.options.DemoOptions`),
and the prompt lengths of its bundled trace (:func:`pdplug_host.trace.load_trace`, scaled as
the demo scales it).

Source bytes are seeded (values 1..255) and never change, so every process can recompute
them: a prefill rank's entry ``e`` is ``default_rng([seed, pp_rank, e])`` and room ``r``
reads source pages ``default_rng([seed, r])``'s choice. A decode rank checks a room that
succeeded against them, vectorised over the room's rows: with DCP size ``D``, prompt token
``t`` lives on DCP rank ``t % D`` at local token ``t // D`` (the DCP rule of
:mod:`pdplug.packing`), in the room's ``local // page_size``-th destination page.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from pdplug_bench.cluster_wire import Geometry

__all__ = [
    "POISON",
    "demo_geometry",
    "demo_prompts",
    "layer_range",
    "src_layout",
    "dst_layout",
    "src_entries",
    "src_pages",
    "dst_pages_needed",
    "room_kv_bytes",
    "wrong_bytes",
]

#: the byte every free decode page holds (pages are filled with it before each room)
POISON = 0xA5


def demo_geometry(**overrides: Any) -> Geometry:
    """The reference host demo's KV geometry (``overrides`` replace fields)."""
    from pdplug_host.config import ModelConfig
    from pdplug_host.options import DemoOptions

    cfg, opts = ModelConfig(), DemoOptions()
    base = dict(
        page_size=opts.page_size,
        num_layers=cfg.num_layers,
        entry_bytes=cfg.kv_bytes_per_token,
        pp_size=opts.prefill_pp,
        dcp_size=opts.decode_dcp,
        chunk_size=opts.chunk_size,
        pack_region_tokens=opts.pack_region_tokens,
    )
    base.update(overrides)
    return Geometry(**base)


def demo_prompts(n: int, scale: int | None = None) -> list[int]:
    """Prompt lengths (tokens) of ``n`` rooms: the bundled trace's requests in order, cycled,
    scaled as the demo scales them (``DemoOptions.scale`` unless ``scale``)."""
    from pdplug_host.options import DemoOptions
    from pdplug_host.trace import load_trace

    reqs = load_trace(scale=scale or DemoOptions().scale)
    return [int(reqs[i % len(reqs)].input_len) for i in range(n)]


def layer_range(g: Geometry, pp_rank: int) -> tuple[int, int]:
    """Layers ``[lo, hi)`` of prefill PP rank ``pp_rank`` (the reference host's split)."""
    from pdplug_host.config import layer_split

    return layer_split(g.num_layers, g.pp_size)[pp_rank]


def src_layout(g: Geometry, pp_rank: int) -> Any:
    """The :class:`pdplug.KVLayout` of prefill PP rank ``pp_rank``: K and V of its layers."""
    from pdplug import KVLayout

    lo, hi = layer_range(g, pp_rank)
    return KVLayout(
        page_size=g.page_size,
        entry_bytes_per_token=(g.entry_bytes,) * 2 * (hi - lo),
        dtype="float32",
        pp_size=g.pp_size,
        pp_rank=pp_rank,
        first_layer=lo,
        num_layers=hi - lo,
    )


def dst_layout(g: Geometry, dcp_rank: int) -> Any:
    """The :class:`pdplug.KVLayout` of decode DCP rank ``dcp_rank``: every layer's K and V."""
    from pdplug import KVLayout

    return KVLayout(
        page_size=g.page_size,
        entry_bytes_per_token=(g.entry_bytes,) * 2 * g.num_layers,
        dtype="float32",
        dcp_size=g.dcp_size,
        dcp_rank=dcp_rank,
        num_layers=g.num_layers,
    )


def src_entries(g: Geometry, pp_rank: int) -> list[np.ndarray]:
    """Prefill PP rank ``pp_rank``'s KV: uint8 ``[src_pages * page_size, entry_bytes]`` per
    entry (its layers' K, V in order), seeded values 1..255."""
    lo, hi = layer_range(g, pp_rank)
    rows = g.src_pages * g.page_size
    return [
        np.random.default_rng([g.seed, pp_rank, e]).integers(
            1, 256, size=(rows, g.entry_bytes), dtype=np.uint8
        )
        for e in range(2 * (hi - lo))
    ]


def src_pages(g: Geometry, room: int, tokens: int) -> np.ndarray:
    """Source pages (int64 ``[ceil(tokens / page_size)]``, distinct) room ``room`` reads.

    :raises ValueError: the prompt needs more pages than a prefill rank holds.
    """
    n = -(-tokens // g.page_size)
    if n > g.src_pages:
        raise ValueError(f"room {room}: {tokens} tokens need {n} pages, src_pages={g.src_pages}")
    rng = np.random.default_rng([g.seed, room])
    return rng.choice(g.src_pages, size=n, replace=False).astype(np.int64)


def dst_pages_needed(g: Geometry, tokens: int) -> int:
    """Pages each decode DCP rank needs for a prompt of ``tokens`` (virtual pages of
    ``page_size * dcp_size`` tokens)."""
    return -(-tokens // (g.page_size * g.dcp_size))


def room_kv_bytes(g: Geometry, tokens: int) -> int:
    """KV bytes a room of ``tokens`` prompt tokens moves (every layer's K and V)."""
    return tokens * 2 * g.num_layers * g.entry_bytes


def wrong_bytes(
    g: Geometry,
    kv: list[np.ndarray],
    dcp_rank: int,
    room: int,
    tokens: int,
    dst: np.ndarray,
    src: list[list[np.ndarray]],
) -> int:
    """Bytes of room ``room`` on decode DCP rank ``dcp_rank`` that differ from the source.

    :param kv: this rank's KV, uint8 ``[dst_pages * page_size, entry_bytes]`` per entry
        (every layer's K, V in order).
    :param dst: the room's destination pages on this rank (int64).
    :param src: :func:`src_entries` of every PP rank.
    """
    p, d = g.page_size, g.dcp_size
    t = np.arange(dcp_rank, tokens, d, dtype=np.int64)
    local = t // d
    d_rows = dst[local // p] * p + local % p
    sp = src_pages(g, room, tokens)
    s_rows = sp[t // p] * p + t % p
    bad = 0
    for k in range(g.pp_size):
        lo, _hi = layer_range(g, k)
        for e, s in enumerate(src[k]):
            bad += int(np.count_nonzero(kv[2 * lo + e][d_rows] != s[s_rows]))
    return bad
