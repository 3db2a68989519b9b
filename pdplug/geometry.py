"""Builders of :class:`~pdplug.kvtypes.KVEntry` / :class:`~pdplug.kvtypes.KVLayout` for the
layouts real engines use (pure; no torch import).

* vLLM (PRs #18833, #26759): one tensor per layer, ``(num_blocks, H, block_size, C)`` with K
  and V fused in the last dim for the head-major ``HND`` cache layout its NIXL connector
  requires, or ``(num_blocks, block_size, H, C)`` for ``NHD``; several layers may be views of
  one storage (then ``page_stride`` spans the interleaved layers). :func:`entry_from_tensor`
  reads the strides of such a view.
* vLLM's CPU attention (``CPU_ATTN``, the only cache layout it accepts is ``LBHNC``): a layer's
  ``(num_blocks, H, block_size, 2 * head_size)`` tensor is used as ``(num_blocks, H,
  2 * block_size, head_size)``: per (block, head) a K slab of ``block_size`` rows, then a V slab
  (:func:`slab_entries`, :func:`slab_views`).
* SGLang: raw per-layer buffers (``kv_data_ptrs`` / ``kv_data_lens`` / ``kv_item_lens``, an
  item being one page of one layer), K and V as separate NHD entries per layer, or one MLA
  latent per layer.
"""

from __future__ import annotations

from typing import Any

from pdplug.heads import kv_head_range
from pdplug.kvtypes import KVEntry, KVLayout

__all__ = [
    "nhd_entry",
    "hnd_entry",
    "slab_entries",
    "slab_views",
    "latent_entry",
    "entry_from_tensor",
    "make_layout",
]


def nhd_entry(
    heads: int, head_bytes: int, page_size: int, *, content: str = "kv", page_stride: int = 0
) -> KVEntry:
    """Token-major entry: a token's ``heads`` sub-rows are contiguous (SGLang MHA buffers,
    vLLM ``NHD``).

    :param heads: head sub-rows per token on this rank.
    :param head_bytes: bytes of one sub-row.
    :param page_size: tokens per page.
    :param content: ``"kv"`` (fused K|V), ``"k"``, ``"v"``.
    :param page_stride: bytes between pages; 0 = contiguous pages.
    """
    row = heads * head_bytes
    return KVEntry(
        content=content,
        heads=heads,
        head_bytes=head_bytes,
        head_stride=head_bytes,
        token_stride=row,
        page_stride=page_stride or page_size * row,
    )


def hnd_entry(
    heads: int, head_bytes: int, page_size: int, *, content: str = "kv", page_stride: int = 0
) -> KVEntry:
    """Head-major entry: in a page, each head's tokens are contiguous (vLLM ``HND``,
    ``(num_blocks, H, block_size, C)``).

    :param page_stride: bytes between pages; 0 = contiguous pages.
    """
    return KVEntry(
        content=content,
        heads=heads,
        head_bytes=head_bytes,
        head_stride=page_size * head_bytes if heads > 1 else head_bytes,
        token_stride=head_bytes,
        page_stride=page_stride or page_size * heads * head_bytes,
    )


def slab_entries(
    heads: int, head_bytes: int, page_size: int, *, page_stride: int = 0
) -> tuple[KVEntry, KVEntry]:
    """The K and V entries of a head-major page that holds, per head, a K slab of
    ``page_size`` rows then a V slab of as many (vLLM ``CPU_ATTN``,
    ``vllm/v1/attention/backends/cpu_attn.py``). The V entry's page 0 starts
    ``page_size * head_bytes`` bytes after the K entry's (:func:`slab_views` gives both views).

    The entries describe where each slab lies, and token rows as in the V slab. vLLM's CPU
    attention (ISA ``vec``) stores the K slab transposed (``head_size`` rows of ``page_size``
    elements), so one token's K bytes are not one row: a transfer between two such caches must
    move whole pages (the vLLM connector does: ``RankPlacement.whole_blocks``), never a
    per-token relayout of the K entry.

    :param heads: KV heads on this rank.
    :param head_bytes: bytes of one K (or V) row of one head (``head_size * dtype bytes``).
    :param page_size: tokens per page (block size).
    :param page_stride: bytes between pages; 0 = contiguous pages (``2 * page_size * heads *
        head_bytes``).
    :returns: ``(k entry, v entry)``.
    """
    slab = page_size * head_bytes
    k, v = (
        KVEntry(
            content=c,
            heads=heads,
            head_bytes=head_bytes,
            head_stride=2 * slab,
            token_stride=head_bytes,
            page_stride=page_stride or 2 * slab * heads,
        )
        for c in ("k", "v")
    )
    return k, v


def slab_views(t: Any, page_size: int) -> tuple[Any, Any]:
    """The K and V slab views (no copy) of one layer's vLLM CPU cache tensor.

    :param t: ``(num_blocks, H, page_size, 2 * head_size)`` (as allocated) or ``(num_blocks, H,
        2 * page_size, head_size)`` (as used); its last two dimensions contiguous, the first
        two any strides (several layers may share one storage).
    :returns: ``(k, v)``, each ``(num_blocks, H, page_size, head_size)``, registered as the two
        entries :func:`slab_entries` describes.
    :raises ValueError: ``t`` is not 4-d, or its last two dimensions are not contiguous or do
        not hold ``2 * page_size`` rows.
    """
    shape = tuple(int(x) for x in t.shape)
    if len(shape) != 4 or shape[2] * shape[3] % (2 * page_size):
        raise ValueError(
            f"slab_views: expected (num_blocks, H, {page_size}, 2 * head_size) or (num_blocks, "
            f"H, {2 * page_size}, head_size), got shape {shape}"
        )
    d = shape[2] * shape[3] // (2 * page_size)
    if t.stride(3) != 1 or t.stride(2) != shape[3]:
        raise ValueError(
            f"slab_views: the last two dimensions of shape {shape} must be contiguous, got "
            f"strides {tuple(t.stride())}"
        )
    rows = t.as_strided(
        (shape[0], shape[1], 2 * page_size, d),
        (t.stride(0), t.stride(1), d, 1),
        t.storage_offset(),
    )
    return rows[:, :, :page_size], rows[:, :, page_size:]


def latent_entry(row_bytes: int, page_size: int, *, page_stride: int = 0) -> KVEntry:
    """An MLA latent (one row per token, every TP rank holds it)."""
    return KVEntry(
        content="latent",
        heads=1,
        head_bytes=row_bytes,
        head_stride=row_bytes,
        token_stride=row_bytes,
        page_stride=page_stride or page_size * row_bytes,
    )


def entry_from_tensor(t: Any, dims: str, *, content: str = "kv", page_size: int = 0) -> KVEntry:
    """The :class:`KVEntry` of a strided tensor view, read from its shape and strides.

    ``dims`` names every dimension: ``P`` pages (blocks), ``T`` tokens in a page, ``H`` heads,
    ``C`` elements of a sub-row, or ``S`` token slots (``page * page_size + offset``, pages
    contiguous; needs ``page_size``). vLLM ``HND``: ``"PHTC"``; ``NHD``: ``"PTHC"``; SGLang
    ``(slots, H, D)``: ``"SHC"``; an MLA latent ``(slots, D)``: ``"SC"``.

    :param t: a torch tensor (anything with ``shape``, ``stride()``, ``element_size()``).
    :param content: ``"kv"``, ``"k"``, ``"v"`` or ``"latent"``.
    :raises ValueError: ``dims`` does not name each dimension once, the sub-row is not
        contiguous (``C`` stride 1), or ``S`` without ``page_size``.
    """
    shape, strides, es = tuple(t.shape), tuple(t.stride()), int(t.element_size())
    if len(dims) != len(shape) or len(set(dims)) != len(dims) or set(dims) - set("PTHCS"):
        raise ValueError(
            f"entry_from_tensor: dims={dims!r} must name each of the {len(shape)} dimensions "
            f"of shape {shape} once with P, T, H, C or S"
        )
    ax = {d: (shape[i], strides[i] * es) for i, d in enumerate(dims)}
    n_c, s_c = ax.get("C", (1, es))
    if n_c > 1 and s_c != es:
        raise ValueError(f"entry_from_tensor: the C dimension has stride {s_c // es}, not 1")
    hb = n_c * es
    heads, hs = ax.get("H", (1, hb))
    if "S" in ax:
        if page_size <= 0 or "P" in ax or "T" in ax:
            raise ValueError("entry_from_tensor: dims 'S' needs page_size > 0 and no P or T")
        ts = ax["S"][1]
        ps = page_size * ts
    else:
        ts = ax.get("T", (1, hb * heads))[1]
        ps = ax.get("P", (1, 0))[1]
        if ps == 0:
            ps = ax.get("T", (1, ts))[0] * ts
    if content == "latent":
        return KVEntry(
            content=content, heads=1, head_bytes=hb * heads, head_stride=hb * heads,
            token_stride=ts, page_stride=ps,
        )  # fmt: skip
    return KVEntry(
        content=content,
        heads=heads,
        head_bytes=hb,
        head_stride=hs if heads > 1 else hb,
        token_stride=ts,
        page_stride=ps,
    )


def make_layout(
    *,
    kind: str,
    page_size: int,
    num_layers: int,
    head_bytes: int,
    num_kv_heads: int = 1,
    split_kv: bool = False,
    slabs: bool = False,
    first_layer: int = 0,
    tp_size: int = 1,
    tp_rank: int = 0,
    page_stride: int = 0,
    **kw: Any,
) -> KVLayout:
    """A :class:`KVLayout` of ``num_layers`` layers of one kind.

    :param kind: ``"nhd"``, ``"hnd"`` or ``"mla"``.
    :param head_bytes: bytes of one head sub-row (K|V fused: both halves; split: one of them;
        MLA: the latent row).
    :param num_kv_heads: KV heads of the model (MLA: 1).
    :param split_kv: K and V in separate entries (two per layer, K first).
    :param slabs: with ``kind="hnd"``: per (page, head) a K slab then a V slab, two entries per
        layer (:func:`slab_entries`; vLLM ``CPU_ATTN``); ``head_bytes`` is one of K or V.
    :param page_stride: bytes between pages of every entry; 0 = contiguous pages.
    :param kw: any other :class:`KVLayout` field (``dcp_size``, ``dtype``, ``model`` …).
    :raises ValueError: unknown ``kind``, ``slabs`` with another kind, or as :class:`KVLayout`.
    """
    if kind == "mla":
        per_layer = [latent_entry(head_bytes, page_size, page_stride=page_stride)]
        num_kv_heads = 1
    elif slabs:
        if kind != "hnd":
            raise ValueError(f"make_layout: slabs needs kind 'hnd', got {kind!r}")
        lo, hi = kv_head_range(num_kv_heads, tp_size, tp_rank)
        per_layer = list(slab_entries(hi - lo, head_bytes, page_size, page_stride=page_stride))
    elif kind in ("nhd", "hnd"):
        lo, hi = kv_head_range(num_kv_heads, tp_size, tp_rank)
        build = nhd_entry if kind == "nhd" else hnd_entry
        contents = ("k", "v") if split_kv else ("kv",)
        per_layer = [
            build(hi - lo, head_bytes, page_size, content=c, page_stride=page_stride)
            for c in contents
        ]
    else:
        raise ValueError(f"make_layout: kind must be 'nhd', 'hnd' or 'mla', got {kind!r}")
    entries = tuple(per_layer * num_layers)
    return KVLayout(
        page_size=page_size,
        entry_bytes_per_token=tuple(g.heads * g.head_bytes for g in entries),
        entries=entries,
        num_kv_heads=num_kv_heads,
        kind=kind,
        first_layer=first_layer,
        num_layers=num_layers,
        tp_size=tp_size,
        tp_rank=tp_rank,
        **kw,
    )
