"""SGLang's transfer buffers (``KVArgs``) as pdplug layouts: one *plane* per index space.

An SGLang request moves three kinds of buffers, each addressed by its own indices:

* **KV** (``kv_data_ptrs``): one buffer per layer for K and one for V (MHA, K buffers first,
  then V: ``MHATokenToKVPool._pd_registerable_tensors``) or one latent buffer per layer
  (MLA); addressed by KV page ids. Item length = bytes of one page of one layer.
* **aux** (``aux_data_ptrs``, SGLang's ``MetadataBuffers``): one buffer per metadata field,
  ``[slots, ...]``; addressed by the request's metadata slot (``aux_index``). Every decode
  rank reads its own copy (the decode's metadata gate checks the row's ``bootstrap_room``).
* **state** (``state_data_ptrs[t]`` per state type ``t``: Mamba, SWA ...): addressed by the
  state indices SGLang computes per type.

A pdplug KV sender addresses every entry of its layout with the same page ids, so each index
space is one plane, served by its own KV sender/receiver session (its own rooms, the same room
ids): the KV plane as its layout says (rows, DCP-sharded when decode has DCP), the aux and
state planes as one-row pages (``page_size`` 1) of MLA-latent entries, which every decode rank
receives whole from one prefill replica (:func:`pdplug.heads.routed_heads`). Only the last
prefill PP stage holds the metadata SGLang sends (its sampler wrote it), so only it serves the
aux plane.

Layouts here carry no head geometry (``KVLayout.entries`` empty for KV: contiguous token
rows, SGLang's NHD slot rows): the KV plane moves between equal KV-TP sizes only (decode KV
heads are not in SGLang's decode ``KVArgs``).
"""

from __future__ import annotations

from collections.abc import Sequence

import msgspec

from pdplug.geometry import latent_entry
from pdplug.kvtypes import KVLayout
from pdplug.registration import KVRegion

__all__ = ["Plane", "RankShape", "kv_plane", "row_plane", "state_planes", "PLANE_KV", "PLANE_AUX"]

PLANE_KV = "kv"
PLANE_AUX = "aux"


class RankShape(msgspec.Struct, frozen=True, kw_only=True):
    """Where an SGLang scheduler process sits (what SGLang's ``get_parallel()`` says).

    :ivar attn_tp_size/attn_tp_rank: attention TP group (DCP ranks included).
    :ivar dcp_size/dcp_rank: decode context parallel (``attn_dcp_size/rank``).
    :ivar pp_size/pp_rank: pipeline stages.
    :ivar first_layer/num_layers: model layers this rank holds (PP slices them).
    :ivar total_layers: layers of the whole model.
    :ivar dtype: KV dtype name (``kv_cache_dtype_str``).
    :ivar model: served model name (both engines must agree).
    :ivar engine_version: SGLang's version.
    :ivar is_mla: MLA latent KV (one buffer per layer) instead of K and V buffers.
    """

    attn_tp_size: int = 1
    attn_tp_rank: int = 0
    dcp_size: int = 1
    dcp_rank: int = 0
    pp_size: int = 1
    pp_rank: int = 0
    first_layer: int = 0
    num_layers: int = 0
    total_layers: int = 0
    dtype: str = ""
    model: str = ""
    engine_version: str = ""
    is_mla: bool = False

    @property
    def kv_tp_size(self) -> int:
        """TP ranks over which KV heads are split (DCP ranks share heads)."""
        return max(1, self.attn_tp_size // self.dcp_size)

    @property
    def kv_tp_rank(self) -> int:
        """This rank's KV-head TP rank."""
        return self.attn_tp_rank // self.dcp_size


class Plane(msgspec.Struct, frozen=True, kw_only=True):
    """One index space of an SGLang rank as a pdplug layout and the memory behind it.

    :ivar name: ``"kv"``, ``"aux"`` or ``"state:<type>"`` (its pdplug instance suffix).
    :ivar layout: the rank's layout of this plane.
    :ivar regions: one :class:`~pdplug.registration.KVRegion` per layout entry (same order).
    """

    name: str
    layout: KVLayout
    regions: tuple[KVRegion, ...]


def _check_lists(
    field: str, ptrs: Sequence[int], lens: Sequence[int], items: Sequence[int]
) -> None:
    if not (len(ptrs) == len(lens) == len(items)):
        raise ValueError(
            f"KVArgs.{field}: {len(ptrs)} pointers, {len(lens)} lengths and {len(items)} item "
            "lengths must be as many"
        )
    for i, (n, it) in enumerate(zip(lens, items)):
        if it <= 0 or n < it:
            raise ValueError(
                f"KVArgs.{field}[{i}]: item length {it} bytes must be > 0 and at most the "
                f"buffer's {n} bytes"
            )


def kv_plane(
    ptrs: Sequence[int],
    lens: Sequence[int],
    item_lens: Sequence[int],
    *,
    page_size: int,
    shape: RankShape,
    num_draft_entries: int = 0,
) -> Plane:
    """The KV plane of a rank from SGLang's ``kv_data_ptrs/lens/item_lens``.

    MHA buffers come K of every layer, then V of every layer; pdplug's entries go per layer,
    K then V, so both sides pair layer ``l``'s K and V whatever the PP split.

    :param page_size: tokens per KV page (``KVArgs.page_size``).
    :param shape: where the rank sits.
    :param num_draft_entries: speculative draft buffers after the target's (refused: not
        supported by this adapter yet).
    :raises ValueError: draft entries, inconsistent lists, an odd MHA buffer count, or an item
        length that is not a whole number of token rows (each names the values).
    """
    _check_lists("kv_data_ptrs", ptrs, lens, item_lens)
    if num_draft_entries:
        raise ValueError(
            f"KVArgs.num_draft_entries={num_draft_entries}: speculative draft KV is not "
            "supported by the pdplug transfer backend"
        )
    if page_size <= 0:
        raise ValueError(f"KVArgs.page_size={page_size} must be > 0")
    n = len(ptrs)
    if shape.is_mla:
        order = list(range(n))
        layers = n
    else:
        if n % 2:
            raise ValueError(f"KVArgs.kv_data_ptrs has {n} MHA buffers: expected K and V per layer")
        layers = n // 2
        order = [i for layer in range(layers) for i in (layer, layers + layer)]
    rows = []
    for i in order:
        if item_lens[i] % page_size:
            raise ValueError(
                f"KVArgs.kv_item_lens[{i}]={item_lens[i]} bytes is not a whole number of "
                f"{page_size}-token rows"
            )
        rows.append(item_lens[i] // page_size)
    layout = KVLayout(
        page_size=page_size,
        entry_bytes_per_token=tuple(rows),
        dtype=shape.dtype or "unknown",
        tp_size=shape.kv_tp_size,
        tp_rank=shape.kv_tp_rank,
        pp_size=shape.pp_size,
        pp_rank=shape.pp_rank,
        dcp_size=shape.dcp_size,
        dcp_rank=shape.dcp_rank,
        first_layer=shape.first_layer,
        num_layers=shape.num_layers or layers,
        kind="mla" if shape.is_mla else "nhd",
        model=shape.model,
        engine="sglang",
        engine_version=shape.engine_version,
    )
    regions = tuple(
        KVRegion(address=ptrs[i], nbytes=lens[i], page_stride=item_lens[i]) for i in order
    )
    return Plane(name=PLANE_KV, layout=layout, regions=regions)


def row_plane(
    name: str,
    ptrs: Sequence[int],
    lens: Sequence[int],
    item_lens: Sequence[int],
    *,
    shape: RankShape,
    replicated: bool = True,
) -> Plane:
    """A plane of one-item pages (aux rows, state items): entry ``i`` is buffer ``i`` and
    page ``p`` of it is item ``p`` (``item_lens[i]`` bytes at ``ptrs[i] + p * item_lens[i]``).

    :param name: ``"aux"`` or ``"state:<type>"``.
    :param shape: where the rank sits (its attention TP rank addresses the plane; DCP ranks
        are TP ranks of it: each decode rank receives every item whole).
    :param replicated: the items are the same on every TP rank (aux, replicated state): MLA
        latent entries, each decode rank fed by one prefill replica. False: TP-sharded state,
        decode TP rank ``r`` fed by prefill TP rank ``r`` (equal attention TP sizes only).
    :raises ValueError: inconsistent lists (named).
    """
    _check_lists(f"{name} buffers", ptrs, lens, item_lens)
    if not ptrs:
        raise ValueError(f"plane {name!r} has no buffers")
    common = dict(
        page_size=1,
        entry_bytes_per_token=tuple(item_lens),
        dtype="uint8",
        tp_size=shape.attn_tp_size,
        tp_rank=shape.attn_tp_rank,
        num_layers=1,
        model=shape.model,
        engine="sglang",
        engine_version=shape.engine_version,
    )
    if replicated:
        layout = KVLayout(
            entries=tuple(latent_entry(b, 1) for b in item_lens),
            num_kv_heads=1,
            kind="mla",
            **common,  # type: ignore[arg-type]
        )
    else:
        layout = KVLayout(**common)  # type: ignore[arg-type]
    regions = tuple(
        KVRegion(address=p, nbytes=n, page_stride=it) for p, n, it in zip(ptrs, lens, item_lens)
    )
    return Plane(name=name, layout=layout, regions=regions)


def state_planes(
    state_types: Sequence[str],
    ptrs: Sequence[Sequence[int]],
    lens: Sequence[Sequence[int]],
    item_lens: Sequence[Sequence[int]],
    dims: Sequence[Sequence[int]] | None,
    *,
    shape: RankShape,
) -> list[Plane]:
    """One plane per SGLang state type that has buffers (``KVArgs.state_*``).

    A type whose ``state_dim_per_tensor`` are all 0 (or not given) is replicated across the
    attention TP group; otherwise it is TP-sharded and moves rank to rank.

    :raises ValueError: lists of different lengths (named).
    """
    if not (len(state_types) == len(ptrs) == len(lens) == len(item_lens)):
        raise ValueError(
            f"KVArgs.state_*: {len(state_types)} types, {len(ptrs)} pointer lists, "
            f"{len(lens)} length lists, {len(item_lens)} item-length lists must be as many"
        )
    out = []
    for i, t in enumerate(state_types):
        if not ptrs[i]:
            continue
        sharded = bool(dims is not None and i < len(dims) and any(dims[i]))
        out.append(
            row_plane(
                f"state:{t}", ptrs[i], lens[i], item_lens[i], shape=shape, replicated=not sharded
            )
        )
    return out
