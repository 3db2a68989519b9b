"""Check the memory a host registers against its :class:`~pdplug.kvtypes.KVLayout` and say
what to register (pure; no copies, no torch import).

A host hands one item per KV entry, in layout order:

* a strided tensor view (vLLM: one view per layer, e.g. ``(num_blocks, H, block_size, C)``
  bf16 with element strides ``(32768, 16384, 128, 1)``; several layers may be views of one
  storage), checked against the entry's geometry by its shape and strides; or
* a raw region :class:`KVRegion` / ``(address, nbytes, page_stride)`` (SGLang's
  ``kv_data_ptrs`` / ``kv_data_lens`` / ``kv_item_lens``).

:func:`resolve_kv` returns each entry's base address (page 0), the pages every entry holds and
the de-duplicated ``(address, nbytes)`` regions to register: layers sharing one storage, or
interleaved in it, are registered once (engines refuse overlapping registrations,
Mooncake#3153 / PR #3174).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import msgspec
import numpy as np

from pdplug.kvtypes import KVEntry, KVLayout

__all__ = ["KVRegion", "RegisteredKV", "resolve_kv", "dedup_regions", "page_extent"]


class KVRegion(msgspec.Struct, frozen=True, kw_only=True):
    """Raw memory of one KV entry.

    :ivar address: address of the entry's page 0 (bytes).
    :ivar nbytes: bytes from ``address`` that belong to the entry's pages.
    :ivar page_stride: bytes between pages (SGLang ``kv_item_lens``); 0 = the layout's.
    """

    address: int
    nbytes: int
    page_stride: int = 0


class RegisteredKV(msgspec.Struct, frozen=True, kw_only=True):
    """What :func:`resolve_kv` found.

    :ivar base: address of page 0 of every entry (``PeerInfo.entry_base``).
    :ivar pages: whole pages each entry holds (a decode draft entry counts virtual pages).
    :ivar num_pages: ``min(pages)``: page ids valid for every entry.
    :ivar regions: sorted, disjoint ``(address, nbytes)`` to register with the engine.
    """

    base: tuple[int, ...]
    pages: tuple[int, ...]
    num_pages: int
    regions: tuple[tuple[int, int], ...]


def page_extent(layout: KVLayout, e: int) -> int:
    """Bytes from the start of a page of entry ``e`` to the end of its last sub-row."""
    g = layout.entry(e)
    return (
        (layout.page_tokens(e) - 1) * g.token_stride
        + (g.heads - 1) * g.head_stride
        + (g.head_bytes)
    )


def _canonical(axes: list[tuple[int, int]]) -> list[tuple[int, int]]:
    """(count, byte stride) axes without size-1 axes, innermost first, contiguous ones merged."""
    out: list[tuple[int, int]] = []
    for n, s in sorted(((n, s) for n, s in axes if n > 1), key=lambda a: a[1]):
        if out and out[-1][0] * out[-1][1] == s:
            out[-1] = (out[-1][0] * n, out[-1][1])
        else:
            out.append((n, s))
    return out


def _tensor(layout: KVLayout, e: int, t: Any) -> tuple[int, int, int]:
    """(base, span bytes, pages) of a tensor entry."""
    g = layout.entry(e)
    es = int(t.element_size())
    shape = tuple(int(x) for x in t.shape)
    strides = tuple(int(x) for x in t.stride())
    name = f"entries[{e}]"
    if any(s < 0 for s in strides):
        raise ValueError(f"register_kv: {name} has a negative stride {strides}")
    numel = int(np.prod(shape)) if shape else 1
    if numel == 0:
        raise ValueError(f"register_kv: {name} is empty (shape {shape})")
    axes = _canonical([(n, s * es) for n, s in zip(shape, strides)] + [(es, 1)])
    span = sum((n - 1) * s for n, s in axes) + 1
    base = int(t.data_ptr())
    ext = page_extent(layout, e)
    if len(axes) == 1 and axes[0][1] == 1:  # one contiguous block: pages lie inside it
        pages = (span - ext) // g.page_stride + 1 if span >= ext else 0
        return base, span, pages
    tokens = layout.page_tokens(e)
    page_bytes = tokens * g.heads * g.head_bytes
    pages = numel * es // page_bytes
    want = _canonical(
        [
            (pages, g.page_stride),
            (tokens, g.token_stride),
            (g.heads, g.head_stride),
            (g.head_bytes, 1),
        ]
    )
    if numel * es % page_bytes or axes != want:
        raise ValueError(
            f"register_kv: {name} of shape {shape}, strides {strides} (x {es} bytes) does not "
            f"match the layout's entry geometry page_stride={g.page_stride}, token_stride="
            f"{g.token_stride}, head_stride={g.head_stride}, heads={g.heads}, head_bytes="
            f"{g.head_bytes}, {tokens} tokens per page: tensor axes (count, byte stride) "
            f"{axes} vs layout axes {want}"
        )
    return base, span, pages


def _region(layout: KVLayout, e: int, r: Any) -> tuple[int, int, int]:
    if isinstance(r, KVRegion):
        addr, nbytes, ps = r.address, r.nbytes, r.page_stride
    else:
        vals = tuple(int(x) for x in r)
        if len(vals) not in (2, 3):
            raise ValueError(
                f"register_kv: entries[{e}] = {r!r}: give a tensor, a KVRegion or "
                "(address, nbytes[, page_stride])"
            )
        addr, nbytes, ps = (*vals, 0) if len(vals) == 2 else vals
    g: KVEntry = layout.entry(e)
    if addr <= 0 or nbytes <= 0:
        raise ValueError(
            f"register_kv: entries[{e}]: address={addr} and nbytes={nbytes} must be > 0"
        )
    if ps and ps != g.page_stride:
        raise ValueError(
            f"register_kv: entries[{e}].page_stride={ps} bytes differs from the layout's "
            f"{g.page_stride} bytes"
        )
    ext = page_extent(layout, e)
    pages = (nbytes - ext) // g.page_stride + 1 if nbytes >= ext else 0
    return addr, nbytes, pages


def resolve_kv(layout: KVLayout, entries: Sequence[Any]) -> RegisteredKV:
    """Validate one item per entry against ``layout`` (see module docstring); no data moves.

    A contiguous tensor or a raw region may be longer than its whole pages (the tail is
    ignored, as before); a strided tensor must be exactly ``pages`` pages of the entry's
    geometry.

    :param entries: per entry, a tensor (any dtype; ``data_ptr``, ``shape``, ``stride()``,
        ``element_size()``), a :class:`KVRegion`, or ``(address, nbytes[, page_stride])``.
    :returns: base addresses, pages per entry, and the regions to register.
    :raises ValueError: wrong entry count, a tensor whose strides do not match the entry
        geometry, a region with another page stride, an entry below one page, or a negative
        stride (each names the entry index, the field and the value).
    """
    if len(entries) != layout.num_entries:
        raise ValueError(
            f"register_kv: got {len(entries)} entries, layout has {layout.num_entries}"
        )
    base, pages, spans = [], [], []
    for e, item in enumerate(entries):
        b, span, n = (_tensor if hasattr(item, "data_ptr") else _region)(layout, e, item)
        if n <= 0:
            raise ValueError(
                f"register_kv: entries[{e}] has {span} bytes, below one page of "
                f"{layout.page_tokens(e)} tokens ({page_extent(layout, e)} bytes)"
            )
        base.append(b)
        pages.append(n)
        spans.append((b, span))
    return RegisteredKV(
        base=tuple(base),
        pages=tuple(pages),
        num_pages=min(pages),
        regions=tuple(dedup_regions(spans)),
    )


def dedup_regions(regions: Sequence[tuple[int, int]]) -> list[tuple[int, int]]:
    """Merge duplicate, overlapping and touching ``(address, nbytes)`` regions (sorted).

    Engines reject re-registration of an overlapping range (Mooncake#3153), and a unified pool
    can report one buffer twice. Zero-length regions are dropped.

    :raises ValueError: a negative address or size (named).
    """
    if not regions:
        return []
    arr = np.asarray(regions, dtype=np.int64).reshape(-1, 2)
    if (arr < 0).any():
        i = int(np.flatnonzero((arr < 0).any(axis=1))[0])
        raise ValueError(f"dedup_regions: region {i} = {tuple(arr[i].tolist())} is negative")
    arr = arr[arr[:, 1] > 0]
    if arr.shape[0] == 0:
        return []
    arr = arr[np.argsort(arr[:, 0], kind="stable")]
    starts, ends = arr[:, 0], arr[:, 0] + arr[:, 1]
    run_end = np.maximum.accumulate(ends)
    new = np.concatenate(([True], starts[1:] > run_end[:-1]))
    idx = np.flatnonzero(new)
    last = np.concatenate((idx[1:] - 1, [arr.shape[0] - 1]))
    return [(int(s), int(e - s)) for s, e in zip(starts[idx], run_end[last])]
