"""Launch tables of the Triton sub-row gather: a whole segment in one int64 table.

One table covers every plan of a segment (each destination DCP rank's region, every pack
group: whole rows and head sub-rows), so the segment is packed with one upload and one
launch. Host work per segment is numpy only and no Python loop runs over tokens or pages: the
per-entry part of the table (addresses, row sizes, token and column positions) and its checks
depend on the segment's *shape* (regions, token counts, first in-page offset, entries) and are
cached per shape; a cached segment only copies that part, concatenates the groups' token
offsets and range-checks them with one ``reduceat`` per bound.

Table layout (int64): ``meta [E, META]`` per gather (see
:func:`pdplug_dcp.triton_pack.gather_rows_kernel`), then every group's column offsets (words),
then every group's token offsets (units), group after group, plan after plan.

The kernel's tile comes from :func:`pdplug_dcp.tiles.tile_shape` (memory efficiency first).
"""

from __future__ import annotations

import operator
from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

import numpy as np
import torch

from pdplug.kvtypes import PackGroup
from pdplug.packing import pack_groups
from pdplug.types import TransferPlan
from pdplug_dcp.packers import check_disjoint, check_pack, entry_extent, widest
from pdplug_dcp.tiles import Tile, tile_shape

__all__ = ["META", "Launch", "LaunchTables"]

#: int64 fields per gather in the launch table.
META = 10


class Launch(NamedTuple):
    """One launch of the gather kernel.

    :ivar table: int64 ``[T]`` launch table (see module docstring).
    :ivar grid: ``(token blocks, gathers, columns)``.
    :ivar tile: :class:`Tile`; ``word_bytes``/``dtype``: the integer word the kernel copies.
    :ivar gathers: pack entries x groups x plans gathered; ``nbytes``: bytes written.
    :ivar cached: whether the segment's shape was cached (only token offsets were built).
    """

    table: np.ndarray
    grid: tuple[int, int, int]
    tile: Tile
    word_bytes: int
    dtype: torch.dtype
    gathers: int
    nbytes: int
    cached: bool


class _Template(NamedTuple):
    refs: tuple[Any, ...]  # the objects whose ids key the template (kept alive)
    head: np.ndarray  # meta + columns, read-only
    ntok: int
    starts: np.ndarray  # token start of every non-empty group (reduceat)
    lo: np.ndarray  # smallest / largest allowed token offset per non-empty group
    hi: np.ndarray
    grid: tuple[int, int, int]
    tile: Tile
    word_bytes: int
    dtype: torch.dtype
    gathers: int
    nbytes: int


_BIG = np.iinfo(np.int64).max


class LaunchTables:
    """Builds launch tables (:meth:`build`), caching the per-shape part.

    A shape is keyed by the identity of the pack buffer, of every entry tensor (raw addresses
    by value), of each group's entry tuple, block offsets and columns (the ``dcp`` planner
    returns the same read-only objects for a repeated shape) and by the plans' token counts,
    regions and first in-page offsets. The template keeps those objects alive, so an id cannot
    be reused while its template is cached; the cache starts over when full, and when a
    different pack buffer is seen. A tensor's storage must not be swapped (``set_``) while
    cached. Plans in the original form (no ``pack_groups``), and groups whose block offsets
    are a writeable array (or whose entries or columns are not tuples), are never cached.

    :param max_templates: shapes kept (>= 1).
    """

    def __init__(self, max_templates: int = 64) -> None:
        self.max_templates = max(1, max_templates)
        self._templates: dict[tuple[Any, ...], _Template] = {}
        self._entry_tables: dict[tuple[int, ...], tuple[Any, ...]] = {}
        self._entry_tokens: dict[tuple[int, ...], int] = {}
        self._next_token = 0
        self._last_entries: tuple[Any, tuple[Any, ...], tuple[int, ...], int] | None = None
        self._buffer_id = 0
        #: cache statistics (tests, benchmarks)
        self.hits = 0
        self.misses = 0

    def clear(self) -> None:
        """Forget every cached shape and entry table (and the objects they keep alive)."""
        self._templates.clear()
        self._entry_tables.clear()
        self._entry_tokens.clear()
        self._last_entries = None

    def build(
        self,
        plans: Sequence[TransferPlan],
        entries: Sequence[torch.Tensor | int],
        pack_buffer: torch.Tensor,
        alloc: Callable[[int], np.ndarray] | None = None,
    ) -> Launch | None:
        """The launch table packing every plan of ``plans`` (one segment: one plan per
        destination DCP rank, regions disjoint) into ``pack_buffer``; None when nothing is
        packed.

        :param plans: packed plans (others are skipped).
        :param entries: every source KV entry (tensor, any dtype and strides; or a raw CPU
            address), on ``pack_buffer``'s device.
        :param pack_buffer: uint8 ``[nbytes]``.
        :param alloc: returns an int64 array of at least the given length to build the table
            in (a pinned staging buffer); default a new array.
        :raises ValueError: as :func:`pdplug_dcp.packers.check_pack` (every plan, every
            token offset checked on cached shapes too), plans writing overlapping bytes, or
            more than 65,535 gathers.
        """
        groups: list[PackGroup] = []
        gkeys: list[tuple[Any, ...]] = []
        refs: list[Any] = [pack_buffer]
        cacheable = True
        for pl in plans:
            if not pl.packed:
                continue
            gs = pl.pack_groups
            if not gs or pl.region is None:
                cacheable = False  # original form: groups are rebuilt on every call
                gs = pack_groups(pl)
            else:
                r = pl.region
                gkeys.append((r.offset, r.nbytes, id(pl.pack_row_bytes)))
                refs.append(pl.pack_row_bytes)
            for g in gs:
                groups.append(g)
                if (
                    type(g.entries) is not tuple
                    or type(g.cols) is not tuple
                    or getattr(g.offsets, "flags", None) is None
                    or g.offsets.flags.writeable
                ):
                    cacheable = False  # mutable in place: an id would not name the content
                gkeys.append(
                    (id(g.entries), id(g.offsets), id(g.cols), len(g.tokens), g.row_bytes,
                     g.unit, g.page_tokens, g.first_offset)
                )  # fmt: skip
        if not groups:
            return None
        ekey, etok = self._entries_key(entries)
        key = (id(pack_buffer), pack_buffer.data_ptr(), pack_buffer.numel(), etok, *gkeys)
        tpl = self._templates.get(key) if cacheable else None
        if tpl is None:
            self.misses += 1
            tpl = self._template(plans, entries, pack_buffer, ekey)
            if tpl is None:
                return None
            if cacheable:
                if id(pack_buffer) != self._buffer_id or len(self._templates) >= self.max_templates:
                    self._templates.clear()
                    self._buffer_id = id(pack_buffer)
                for g in groups:
                    refs += (g.entries, g.offsets, g.cols)
                refs += [t for t in entries if not isinstance(t, int)]
                tpl = tpl._replace(refs=tuple(refs))
                self._templates[key] = tpl
            checked = True
        else:
            self.hits += 1
            checked = False
        h = tpl.head.shape[0]
        size = h + tpl.ntok
        table = (alloc(size) if alloc is not None else np.empty(size, dtype=np.int64))[:size]
        table[:h] = tpl.head
        tok = table[h:]
        if tpl.ntok:
            np.concatenate([g.tokens for g in groups], out=tok, casting="same_kind")
            if not checked and tpl.starts.shape[0]:
                lo = np.minimum.reduceat(tok, tpl.starts)
                hi = np.maximum.reduceat(tok, tpl.starts)
                if (lo < tpl.lo).any() or (hi > tpl.hi).any():
                    for pl in plans:  # names the plan, entry and rows
                        if pl.packed:
                            check_pack(pl, entries, pack_buffer)
                    raise ValueError("pack: a token offset lies outside its KV entry")
        return Launch(table, tpl.grid, tpl.tile, tpl.word_bytes, tpl.dtype, tpl.gathers,
                      tpl.nbytes, not checked)  # fmt: skip

    def _entries_key(self, entries: Sequence[torch.Tensor | int]) -> tuple[tuple[int, ...], int]:
        """``(key, token)`` of an entry set: ids of its tensors (raw addresses by value) and a
        small int standing for them. The same sequence holding the same objects (the
        sender's registered entries, segment after segment) is recognised without building
        the key (identity checked element by element in C)."""
        last = self._last_entries
        if (
            last is not None
            and last[0] is entries
            and len(entries) == len(last[1])
            and all(map(operator.is_, entries, last[1]))
        ):
            return last[2], last[3]
        ekey = tuple(-1 - t if isinstance(t, int) else id(t) for t in entries)
        tok = self._entry_tokens.get(ekey)
        if tok is None:
            if len(self._entry_tokens) >= 64:
                self._entry_tokens.clear()
                self._templates.clear()  # their keys hold tokens that may be given again
            tok = self._entry_tokens[ekey] = self._next_token
            self._next_token += 1
        self._last_entries = (entries, tuple(entries), ekey, tok)
        return ekey, tok

    def _entry_table(
        self, entries: Sequence[torch.Tensor | int], ekey: tuple[int, ...]
    ) -> tuple[np.ndarray, np.ndarray, list[torch.device | None]]:
        """``(address, extent or -1, device)`` of every entry, cached per entry set.

        :raises ValueError: a negative stride.
        """
        hit = self._entry_tables.get(ekey)
        if hit is not None:
            return hit[1:]
        ext = [entry_extent(t) for t in entries]
        out = (
            tuple(t for t in entries if not isinstance(t, int)),
            np.array([a for a, _ in ext], dtype=np.int64).reshape(-1),
            np.array([x for _, x in ext], dtype=np.int64).reshape(-1),
            [None if isinstance(t, int) else t.device for t in entries],
        )
        if len(self._entry_tables) >= 8:
            self._entry_tables.clear()
        self._entry_tables[ekey] = out
        return out[1:]

    def _fail(
        self, plan: TransferPlan, entries: Sequence[torch.Tensor | int], pack_buffer: torch.Tensor
    ) -> None:
        """Raise the named error of a plan that failed a vectorised check."""
        check_pack(plan, entries, pack_buffer)
        raise ValueError(f"room {plan.room}: packed plan does not fit its region or entries")

    def _template(
        self,
        plans: Sequence[TransferPlan],
        entries: Sequence[torch.Tensor | int],
        pack_buffer: torch.Tensor,
        ekey: tuple[int, ...],
    ) -> _Template | None:
        """Check every plan (vectorised per group; a failure is named by
        :func:`~pdplug_dcp.packers.check_pack`) and build the shape's part of the table."""
        if pack_buffer.dtype != torch.uint8 or pack_buffer.dim() != 1:
            raise ValueError(
                f"pack_buffer must be uint8 [nbytes], got {pack_buffer.dtype} "
                f"{tuple(pack_buffer.shape)}"
            )
        addr, ext, devices = self._entry_table(entries, ekey)
        dev = pack_buffer.device
        on_dev = np.array([d is None or d == dev for d in devices], dtype=bool)
        nent = addr.shape[0]
        base = pack_buffer.data_ptr()
        size = pack_buffer.numel()
        blocks: list[np.ndarray] = []
        cols: list[np.ndarray] = []
        col_pos: list[int] = []
        starts: list[int] = []
        lo: list[int] = []
        hi: list[int] = []
        spans: list[tuple[int, int, int]] = []
        bits = base
        pos = 0  # token stream position
        ncols = 0
        nbytes = 0
        for i, pl in enumerate(plans):
            if not pl.packed:
                continue
            groups = pack_groups(pl)
            reg = pl.region
            n = len(groups[0].tokens) if groups else 0
            need = n * sum(pl.pack_row_bytes)
            if reg is None or need > reg.nbytes or reg.offset + reg.nbytes > size:
                self._fail(pl, entries, pack_buffer)
            assert reg is not None
            s0, s1 = size, 0
            for g in groups:
                at = pos
                pos += len(g.tokens)
                m = len(g.tokens) * len(g.cols)
                ents = np.asarray(g.entries, dtype=np.int64)
                offs = np.asarray(g.offsets, dtype=np.int64)
                if need == 0 or m == 0 or ents.shape[0] == 0:
                    continue
                rb, unit = g.row_bytes, g.unit
                c = np.asarray(g.cols, dtype=np.int64)
                tok = np.asarray(g.tokens)
                t_lo = -(int(c.min()) // unit)  # token offset * unit + min(cols) >= 0
                known = ext[ents.clip(0, nent - 1)]
                known = known[known >= 0]
                t_hi = (int(known.min()) - int(c.max()) - rb) // unit if known.size else _BIG
                if (
                    (ents < 0).any() or (ents >= nent).any()
                    or not on_dev[ents].all()
                    or offs.shape[0] != ents.shape[0]
                    or (offs < reg.offset).any()
                    or (offs + m * rb > reg.offset + reg.nbytes).any()
                    or int(tok.min()) < t_lo or int(tok.max()) > t_hi
                ):  # fmt: skip
                    self._fail(pl, entries, pack_buffer)
                k = ents.shape[0]
                blk = np.empty((k, META), dtype=np.int64)
                blk[:, 0] = addr[ents] - base
                blk[:, 2] = offs
                blk[:, 1] = rb
                blk[:, 3:] = (unit, at, len(g.tokens), len(g.cols), g.page_tokens,
                              g.first_offset, ncols)  # fmt: skip
                blocks.append(blk)
                cols.append(c)
                col_pos.append(ncols)
                ncols += c.shape[0]
                starts.append(at)
                lo.append(t_lo)
                hi.append(t_hi)
                bits |= int(np.bitwise_or.reduce(addr[ents])) | int(np.bitwise_or.reduce(offs))
                bits |= rb | unit | int(np.bitwise_or.reduce(c))
                s0 = min(s0, int(offs.min()))
                s1 = max(s1, int(offs.max()) + m * rb)
            if s1 > s0:
                nbytes += need
                spans.append((s0, s1, i))
        check_disjoint(spans)
        if not blocks:
            return None
        meta = np.concatenate(blocks)
        e = meta.shape[0]
        if e > 65535:
            raise ValueError(f"pack: {e} gathers in one launch, at most 65535")
        w = min(8, bits & -bits) if bits else 8
        w, dt = widest(w)
        head = np.empty(META * e + ncols, dtype=np.int64)
        head[: META * e] = meta.reshape(-1)
        meta = head[: META * e].reshape(e, META)
        meta[:, :4] //= w
        meta[:, 4] += META * e + ncols  # token and column positions: indices into the table
        meta[:, 9] += META * e
        cw = head[META * e :]
        cw[:] = np.concatenate(cols) // w
        vec = 16 // w
        if base % 16 or (meta[:, :4] % vec).any() or (cw % vec).any():
            vec = 1
        rw = meta[:, 1]
        uniform = bool((rw == rw[0]).all())
        tile = tile_shape(int(rw.max()), vec, w, uniform=uniform)
        grid = (-(-int(meta[:, 5].max()) // tile.rows), e, int(meta[:, 6].max()))
        head.flags.writeable = False
        return _Template(
            refs=(),
            head=head,
            ntok=pos,
            starts=np.asarray(starts, dtype=np.int64),
            lo=np.asarray(lo, dtype=np.int64),
            hi=np.asarray(hi, dtype=np.int64),
            grid=grid,
            tile=tile,
            word_bytes=w,
            dtype=dt,
            gathers=e,
            nbytes=nbytes,
        )
