"""Which KV heads each TP rank holds, and which prefill TP rank sends which heads to which
decode TP rank (pure, deterministic; sender and receiver derive the same answer).

Head placement follows vLLM's tensor-parallel convention (Megatron attention sharding; the
NIXL connector's ``TpKVTopology`` "KV group", vLLM PRs #18833 and #26759, issue #45330): with
``H`` KV heads over ``tp`` ranks,

* ``tp <= H`` (``H % tp == 0``): rank ``r`` holds heads ``[r * H/tp, (r + 1) * H/tp)``;
* ``tp > H`` (``tp % H == 0``, GQA replication): rank ``r`` holds the single head
  ``r * H // tp``, so ``tp / H`` consecutive ranks hold the same head.

An MLA latent is one head every rank holds (``H = 1``). A layout without head information
(``num_kv_heads == 0``, opaque token rows) maps rank ``r`` to rank ``r`` and needs equal TP.

Routing (:func:`head_routes`): every decode rank receives each of its heads exactly once. When
several prefill ranks hold a head (prefill replication), the ``i``-th decode rank needing that
head (in rank order) takes it from the ``i % k``-th of its ``k`` holders, which spreads the
copies over the replicas and never sends one head twice to the same place.
"""

from __future__ import annotations

import functools
from typing import TYPE_CHECKING

import msgspec

if TYPE_CHECKING:
    from pdplug.kvtypes import KVLayout

__all__ = [
    "HeadRoute",
    "kv_head_range",
    "head_routes",
    "layout_heads",
    "routed_heads",
    "expected_sources",
    "fed_ranks",
]


class HeadRoute(msgspec.Struct, frozen=True, kw_only=True):
    """Prefill TP rank ``src_rank`` sends global KV heads ``[head_lo, head_hi)`` to decode TP
    rank ``dst_rank`` (``head_lo == head_hi == 0`` for opaque rows, which move whole)."""

    src_rank: int
    dst_rank: int
    head_lo: int
    head_hi: int


def kv_head_range(num_kv_heads: int, tp_size: int, tp_rank: int) -> tuple[int, int]:
    """Global KV heads ``[lo, hi)`` held by ``tp_rank`` of ``tp_size`` (see module docstring).

    :param num_kv_heads: KV heads of the model (> 0; 1 for an MLA latent).
    :raises ValueError: a non-positive size, a rank outside ``[0, tp_size)``, or ``tp_size`` and
        ``num_kv_heads`` not dividing one another (named with both values).
    """
    if num_kv_heads <= 0 or tp_size <= 0 or not 0 <= tp_rank < tp_size:
        raise ValueError(
            f"kv_head_range: num_kv_heads={num_kv_heads} and tp_size={tp_size} must be > 0 and "
            f"tp_rank={tp_rank} in [0, tp_size)"
        )
    if tp_size <= num_kv_heads:
        if num_kv_heads % tp_size:
            raise ValueError(f"num_kv_heads={num_kv_heads} is not a multiple of tp_size={tp_size}")
        per = num_kv_heads // tp_size
        return tp_rank * per, tp_rank * per + per
    if tp_size % num_kv_heads:
        raise ValueError(f"tp_size={tp_size} is not a multiple of num_kv_heads={num_kv_heads}")
    head = tp_rank * num_kv_heads // tp_size
    return head, head + 1


@functools.lru_cache(maxsize=256)
def head_routes(src_tp: int, dst_tp: int, num_kv_heads: int) -> tuple[HeadRoute, ...]:
    """Every (prefill TP rank, decode TP rank, head range) that carries KV, sorted by
    ``(dst_rank, head_lo)``; each decode rank's heads are covered exactly once.

    ``num_kv_heads == 0`` (opaque rows): ``src_tp`` must equal ``dst_tp`` and rank ``r`` sends
    rank ``r`` everything (``head_lo == head_hi == 0``).

    :raises ValueError: as :func:`kv_head_range`, or unequal TP without head information.
    """
    if num_kv_heads == 0:
        if src_tp != dst_tp:
            raise ValueError(
                f"tp_size: prefill {src_tp} vs decode {dst_tp} needs num_kv_heads on both "
                "layouts to map heads (opaque token rows move only between equal TP)"
            )
        return tuple(HeadRoute(src_rank=r, dst_rank=r, head_lo=0, head_hi=0) for r in range(src_tp))
    holders: dict[int, list[int]] = {}
    for r in range(src_tp):
        lo, hi = kv_head_range(num_kv_heads, src_tp, r)
        for g in range(lo, hi):
            holders.setdefault(g, []).append(r)
    needers: dict[int, list[int]] = {}
    for d in range(dst_tp):
        lo, hi = kv_head_range(num_kv_heads, dst_tp, d)
        for g in range(lo, hi):
            needers.setdefault(g, []).append(d)
    out: list[HeadRoute] = []
    for d in range(dst_tp):
        lo, hi = kv_head_range(num_kv_heads, dst_tp, d)
        cur: list[int] = []  # [src, lo, hi] of the route being extended
        for g in range(lo, hi):
            reps = holders[g]
            src = reps[needers[g].index(d) % len(reps)]
            if cur and cur[0] == src and cur[2] == g:
                cur[2] = g + 1
                continue
            if cur:
                out.append(HeadRoute(src_rank=cur[0], dst_rank=d, head_lo=cur[1], head_hi=cur[2]))
            cur = [src, g, g + 1]
        if cur:
            out.append(HeadRoute(src_rank=cur[0], dst_rank=d, head_lo=cur[1], head_hi=cur[2]))
    return tuple(out)


def layout_heads(layout: KVLayout) -> int:
    """The head count routing uses for ``layout``: ``num_kv_heads`` for K/V entries, 1 for an
    MLA latent (every rank holds it), 0 for opaque token rows (legacy layouts)."""
    contents = {layout.entry(e).content for e in range(layout.num_entries)} - {"row"}
    if not contents:
        return 0
    if contents == {"latent"}:
        return 1
    return layout.num_kv_heads


def _route_heads(src: KVLayout, dst: KVLayout) -> int:
    hs, hd = layout_heads(src), layout_heads(dst)
    if hs != hd:
        raise ValueError(
            f"KV heads: prefill layout routes {hs} heads, decode layout {hd} "
            "(num_kv_heads or entry content differ)"
        )
    return hs


def routed_heads(src: KVLayout, dst: KVLayout) -> tuple[int, int] | None:
    """Global heads ``[lo, hi)`` the prefill rank ``src`` sends the decode rank ``dst`` (their
    ``tp_rank`` s), ``(0, 0)`` for opaque rows sent whole, or ``None`` when it sends nothing.

    :raises ValueError: the layouts cannot be routed (see :func:`head_routes`).
    """
    for r in head_routes(src.tp_size, dst.tp_size, _route_heads(src, dst)):
        if r.src_rank == src.tp_rank and r.dst_rank == dst.tp_rank:
            return r.head_lo, r.head_hi
    return None


def expected_sources(
    dst: KVLayout, src_tp_size: int, src: KVLayout | None = None
) -> tuple[int, ...]:
    """Prefill TP ranks (of ``src_tp_size``) that write to decode rank ``dst``; a decode rank
    waits for chunks from these ranks only (per prefill PP rank).

    :param src: any prefill rank's layout (for its head information); default ``dst``'s.
    :raises ValueError: the layouts cannot be routed (see :func:`head_routes`).
    """
    heads = layout_heads(dst) if src is None else _route_heads(src, dst)
    return tuple(
        sorted(
            {
                r.src_rank
                for r in head_routes(src_tp_size, dst.tp_size, heads)
                if r.dst_rank == dst.tp_rank
            }
        )
    )


def fed_ranks(src: KVLayout, dst_tp_size: int, dst: KVLayout | None = None) -> tuple[int, ...]:
    """Decode TP ranks (of ``dst_tp_size``) that prefill rank ``src`` writes: the mirror of
    :func:`expected_sources`. Empty when this prefill rank holds no head any decode rank takes
    from it (a replica the routing does not use): it has nothing to send to that decode
    instance, so a host does not start the instance's rooms there.

    :param dst: any decode rank's layout (for its head information); default ``src``'s.
    :raises ValueError: the layouts cannot be routed (see :func:`head_routes`).
    """
    heads = layout_heads(src) if dst is None else _route_heads(src, dst)
    return tuple(
        sorted(
            {
                r.dst_rank
                for r in head_routes(src.tp_size, dst_tp_size, heads)
                if r.src_rank == src.tp_rank
            }
        )
    )
