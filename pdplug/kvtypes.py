"""KV layout and transfer-plan structs (frozen msgspec Structs; re-exported by :mod:`pdplug.types`).

:class:`KVLayout` and :class:`KVEntry` cross the wire inside ``PeerInfo``; ``SendChunk``,
``Segment``, ``PackRegion``, ``PackGroup`` and ``TransferPlan`` are in-process (they carry
``numpy.ndarray`` fields, treated as read-only).

Memory model of one KV entry (one buffer per layer for K, V, K|V or an MLA latent): byte ``b``
of head sub-row ``h`` of the token at in-page offset ``o`` of page ``p`` lives at::

    base + p * page_stride + o * token_stride + h * head_stride + b      (b < head_bytes)

``base`` is the entry's address of page 0, given at registration. NHD (heads contiguous in a
token row): ``head_stride = head_bytes``, ``token_stride = heads * head_bytes``; HND (head-major
pages, vLLM's ``(num_blocks, H, block_size, C)``): ``token_stride = head_bytes``,
``head_stride = page_tokens * head_bytes``; an MLA latent or an opaque token row is one
"head". A layout without :attr:`KVLayout.entries` means contiguous NHD token rows of
``entry_bytes_per_token[e]`` bytes (the original meaning).
"""

from __future__ import annotations

import msgspec
import numpy as np

from pdplug.heads import kv_head_range

__all__ = [
    "LAYOUT_VERSION",
    "CONTENTS",
    "KVEntry",
    "KVLayout",
    "SendChunk",
    "Segment",
    "PackRegion",
    "PackGroup",
    "TransferPlan",
    "DirectPages",
    "PageGrid",
]

#: Bumped whenever the meaning of KVLayout or of a plan changes; checked at the handshake.
LAYOUT_VERSION = 1

#: What a head sub-row holds: ``kv`` K then V of one head (vLLM's fused last dim), ``k`` / ``v``
#: one of them (K and V in separate entries, SGLang), ``latent`` an MLA latent, ``row`` an
#: opaque token row (layouts without entry geometry).
CONTENTS = ("row", "kv", "k", "v", "latent")


class KVEntry(msgspec.Struct, frozen=True, kw_only=True):
    """Geometry of one KV entry on one rank (all sizes in bytes; see the module docstring).

    :ivar content: one of :data:`CONTENTS`.
    :ivar heads: head sub-rows per token held here (1 for ``row`` and ``latent``).
    :ivar head_bytes: bytes of one head sub-row of one token (``(head_size + head_size_v) *
        dtype bytes`` when K|V are fused).
    :ivar head_stride: bytes from head ``h`` to ``h + 1`` of the same token.
    :ivar token_stride: bytes from token ``o`` to ``o + 1`` of the same head, in a page.
    :ivar page_stride: bytes from page ``p`` to ``p + 1`` (more than a page's bytes when other
        layers' or the other half's pages interleave in one storage).
    """

    content: str
    heads: int
    head_bytes: int
    head_stride: int
    token_stride: int
    page_stride: int

    @property
    def layout_kind(self) -> str:
        """``"hnd"`` (head-major), ``"nhd"`` or ``"row"`` (one sub-row per token)."""
        if self.heads == 1:
            return "row" if self.content in ("row", "latent") else "nhd"
        return "hnd" if self.head_stride > self.token_stride else "nhd"


def _check_entry(lay: KVLayout, e: int, g: KVEntry) -> None:
    name = f"KVLayout.entries[{e}]"
    if g.content not in CONTENTS:
        raise ValueError(f"{name}.content={g.content!r} is not one of {CONTENTS}")
    for f in ("heads", "head_bytes", "head_stride", "token_stride", "page_stride"):
        if getattr(g, f) <= 0:
            raise ValueError(f"{name}.{f} must be > 0, got {getattr(g, f)}")
    if g.content in ("row", "latent") and g.heads != 1:
        raise ValueError(f"{name}: content {g.content!r} has one sub-row, got heads={g.heads}")
    bpt = lay.entry_bytes_per_token[e]
    if g.heads * g.head_bytes != bpt:
        raise ValueError(
            f"{name}: heads={g.heads} x head_bytes={g.head_bytes} = {g.heads * g.head_bytes} "
            f"bytes differs from entry_bytes_per_token[{e}]={bpt}"
        )
    axes = sorted(
        [
            ("head_stride", g.heads, g.head_stride),
            ("token_stride", lay.page_tokens(e), g.token_stride),
        ],
        key=lambda a: a[2],
    )
    extent = g.head_bytes
    for field, count, stride in axes:
        if count > 1:
            if stride < extent:
                raise ValueError(
                    f"{name}.{field}={stride} overlaps: the sub-rows inside it span {extent} bytes"
                )
            extent += stride * (count - 1)
    if g.page_stride < extent:
        raise ValueError(
            f"{name}.page_stride={g.page_stride} is below one page's extent of {extent} bytes "
            f"({lay.page_tokens(e)} tokens x {g.heads} heads x {g.head_bytes} bytes)"
        )


class KVLayout(msgspec.Struct, frozen=True, kw_only=True):
    """Geometry of one rank's paged KV cache, as exchanged at the handshake.

    The cache is a list of *entries* (one per layer for MLA latents or fused K|V, two per
    layer for separate K and V, plus draft-model entries), grouped per layer in layer order.
    Token slot ``s = page * page_size + offset``. A decode DCP rank stores logical token ``i``
    of a request at local offset ``i // dcp_size`` when ``i % dcp_size == dcp_rank`` (SGLang DCP
    rule, PRs #35762/#40376); draft entries are not sharded and hold every token, in virtual
    pages of ``page_size * dcp_size`` tokens.

    Without :attr:`entries` entry ``e`` is one contiguous buffer of token rows of
    ``entry_bytes_per_token[e]`` bytes (content ``"row"``). With :attr:`entries` each entry's
    bytes lie as its :class:`KVEntry` says (build them with :mod:`pdplug.geometry`).

    :ivar page_size: tokens per physical page (block size; > 0).
    :ivar entry_bytes_per_token: bytes of one token per entry (all its heads on this rank).
    :ivar draft_entries: indices of entries copied whole (not DCP-sharded).
    :ivar dtype: KV dtype name (``"bfloat16"``, ``"float8_e4m3fn"``, ``"float32"`` …).
    :ivar tp_size/tp_rank/pp_size/pp_rank/dcp_size/dcp_rank: parallel placement of this rank.
    :ivar first_layer/num_layers: the model layers this rank holds (PP slices layers).
    :ivar memory: ``"DRAM"`` or ``"VRAM"``.
    :ivar layout_version: :data:`LAYOUT_VERSION` of the producer.
    :ivar entries: per-entry geometry; ``()`` = contiguous NHD token rows.
    :ivar num_kv_heads: KV heads of the whole model (0 = not given; 1 for MLA); this rank holds
        :func:`pdplug.heads.kv_head_range` of them.
    :ivar head_size: elements per head of K (0 = not given), for compatibility checks.
    :ivar kind: ``"nhd"``, ``"hnd"``, ``"mla"`` or ``""``: the host's layout name (informational).
    :ivar model/engine/engine_version: what the host runs, for hosts' own compatibility checks.
    :raises ValueError: a field out of range, or an entry geometry that is inconsistent or
        overlaps itself (each names the field and the value).
    """

    page_size: int
    entry_bytes_per_token: tuple[int, ...]
    draft_entries: tuple[int, ...] = ()
    dtype: str = "bfloat16"
    tp_size: int = 1
    tp_rank: int = 0
    pp_size: int = 1
    pp_rank: int = 0
    dcp_size: int = 1
    dcp_rank: int = 0
    first_layer: int = 0
    num_layers: int = 0
    memory: str = "DRAM"
    layout_version: int = LAYOUT_VERSION
    entries: tuple[KVEntry, ...] = ()
    num_kv_heads: int = 0
    head_size: int = 0
    kind: str = ""
    model: str = ""
    engine: str = ""
    engine_version: str = ""

    def __post_init__(self) -> None:
        if self.page_size <= 0:
            raise ValueError(f"KVLayout.page_size must be > 0, got {self.page_size}")
        if not self.entry_bytes_per_token:
            raise ValueError("KVLayout.entry_bytes_per_token is empty: a layout needs >= 1 entry")
        for i, b in enumerate(self.entry_bytes_per_token):
            if b <= 0:
                raise ValueError(f"KVLayout.entry_bytes_per_token[{i}] must be > 0, got {b}")
        for name in ("tp", "pp", "dcp"):
            size, rank = getattr(self, f"{name}_size"), getattr(self, f"{name}_rank")
            if size <= 0 or not 0 <= rank < size:
                raise ValueError(f"KVLayout.{name}_rank={rank} not in [0, {name}_size={size})")
        n = len(self.entry_bytes_per_token)
        for d in self.draft_entries:
            if not 0 <= d < n:
                raise ValueError(f"KVLayout.draft_entries has {d}, outside [0, {n})")
        if self.num_kv_heads < 0 or self.head_size < 0:
            raise ValueError(
                f"KVLayout.num_kv_heads={self.num_kv_heads} and head_size={self.head_size} "
                "must be >= 0"
            )
        if not self.entries:
            return
        if len(self.entries) != n:
            raise ValueError(
                f"KVLayout.entries has {len(self.entries)} items for {n} entry_bytes_per_token"
            )
        lo = hi = 0
        if self.num_kv_heads:
            lo, hi = kv_head_range(self.num_kv_heads, self.tp_size, self.tp_rank)
        drafts = set(self.draft_entries)
        for e, g in enumerate(self.entries):
            _check_entry(self, e, g)
            if e in drafts or g.content == "row":
                continue
            if g.content == "latent" and self.num_kv_heads > 1:
                raise ValueError(
                    f"KVLayout.entries[{e}] is an MLA latent but num_kv_heads="
                    f"{self.num_kv_heads} (an MLA latent is one head: use 1)"
                )
            if g.content != "latent" and self.num_kv_heads and g.heads != hi - lo:
                raise ValueError(
                    f"KVLayout.entries[{e}].heads={g.heads}, but num_kv_heads="
                    f"{self.num_kv_heads} over tp_size={self.tp_size} puts heads [{lo}, {hi}) "
                    f"on tp_rank {self.tp_rank}"
                )
            if g.content != "latent" and not self.num_kv_heads:
                raise ValueError(
                    f"KVLayout.entries[{e}] holds {g.content!r} heads: set num_kv_heads"
                )

    @property
    def num_entries(self) -> int:
        """Number of KV entries (buffers)."""
        return len(self.entry_bytes_per_token)

    @property
    def bytes_per_token(self) -> int:
        """Sum of ``entry_bytes_per_token`` (bytes of one token across all entries)."""
        return sum(self.entry_bytes_per_token)

    @property
    def virtual_page_size(self) -> int:
        """Tokens per decode virtual page: ``page_size * dcp_size``."""
        return self.page_size * self.dcp_size

    def page_tokens(self, e: int) -> int:
        """Tokens per page of entry ``e``: ``page_size``, or the virtual page for a draft
        entry of a DCP-sharded layout."""
        return self.virtual_page_size if e in self.draft_entries else self.page_size

    def entry(self, e: int) -> KVEntry:
        """Geometry of entry ``e``: ``entries[e]``, or contiguous token rows when not given.

        :raises IndexError: ``e`` outside ``[0, num_entries)``.
        """
        if self.entries:
            return self.entries[e]
        b = self.entry_bytes_per_token[e]
        return KVEntry(
            content="row",
            heads=1,
            head_bytes=b,
            head_stride=b,
            token_stride=b,
            page_stride=self.page_tokens(e) * b,
        )


class SendChunk(msgspec.Struct, frozen=True, kw_only=True):
    """One chunk of a request's KV to send (in-process; SGLang ``TransferKVChunk``).

    Token positions are logical positions in the request. The chunk covers tokens
    ``[decode_prefix_len + rel_start, … + num_tokens)`` where ``rel_start`` defaults to
    ``src_page_offset * page_size`` (source page size). Source page ``src_pages[0]`` holds the
    chunk's first token at in-page offset ``(decode_prefix_len + rel_start) % page_size``
    (prefill pages hold a request's tokens from token 0, page after page).

    :ivar room: bootstrap room (request id).
    :ivar src_pages: int64 ``[n_src]`` source page ids of *this chunk* (prefill cache).
    :ivar dst_pages: int64 ``[n_dst]`` destination page ids for the *whole send range* starting
        at ``decode_prefix_len`` (decode virtual pages; the same local page id on every DCP rank).
    :ivar decode_prefix_len: tokens decode already holds (multiple of the decode virtual page).
    :ivar src_page_offset: whole source pages between ``decode_prefix_len`` and this chunk's
        first token.
    :ivar num_tokens: exact tokens in the chunk (a partial last page counts its real tokens).
    :ivar chunk_id: 0-based index of the chunk within the request, per source rank.
    :ivar is_last: only the last chunk carries state/metadata and completes the room.
    :ivar rel_start: tokens between ``decode_prefix_len`` and the chunk's first token, when
        that is not ``src_page_offset * page_size`` (prefill and decode page sizes differ);
        -1 = that default.
    """

    room: int
    src_pages: np.ndarray
    dst_pages: np.ndarray
    decode_prefix_len: int = 0
    src_page_offset: int = 0
    num_tokens: int = 0
    chunk_id: int = 0
    is_last: bool = True
    rel_start: int = -1


class Segment(msgspec.Struct, frozen=True, kw_only=True):
    """One piece of a send after the scheduler split it at ``min(grid, pack capacity)``.

    :ivar token_start: first logical token (inclusive).
    :ivar token_end: end logical token (exclusive); ``token_end - token_start == num_tokens``.
    :ivar page_start: index of the first page within the request's source page list (for the
        host's slicing: ``KVSender.send`` takes ``src_pages`` from this page on and does not
        read it).
    :ivar num_tokens: exact tokens (may be 0 only for the final, metadata-only segment).
    :ivar chunk_id: index of this segment among all chunks of the request.
    :ivar is_last: carries state and metadata; completes the room.
    """

    token_start: int
    token_end: int
    page_start: int
    num_tokens: int
    chunk_id: int
    is_last: bool


class PackRegion(msgspec.Struct, frozen=True, kw_only=True):
    """A slice of a registered pack buffer reserved for one destination DCP rank.

    :ivar index: region index within the pack buffer.
    :ivar offset: byte offset of the region from the buffer base.
    :ivar nbytes: region size in bytes.
    :ivar capacity_tokens: tokens the region holds, page-aligned (all entries, layer-major).
    """

    index: int
    offset: int
    nbytes: int
    capacity_tokens: int


class PackGroup(msgspec.Struct, frozen=True, kw_only=True):
    """How a packer gathers the sub-rows of some entries that share one geometry.

    Entry ``entries[i]``'s block starts ``offsets[i]`` bytes after the pack-buffer base and
    holds ``n * len(cols)`` sub-rows of ``row_bytes`` bytes, where ``n = len(tokens)``. Sub-row
    ``(j, c)`` is read from ``entry base + tokens[j] * unit + cols[c]`` and written in
    destination order: token-major (``(j, c)`` order) when ``page_tokens == 0``; else
    head-major per destination page of ``page_tokens`` tokens, the first token sitting at
    in-page offset ``first_offset``: page by page, column by column, token by token
    (:func:`pdplug.packing.group_rows` expands it).

    :ivar entries: source entries gathered with this pattern (region order).
    :ivar offsets: int64 ``[E]`` byte offset of each entry's block from the pack-buffer base.
    :ivar tokens: int64 ``[n]``: source offset of each token (rank order) in ``unit`` s.
    :ivar cols: byte offsets of the ``C`` sub-rows of a token (ascending head order).
    :ivar row_bytes: bytes of one sub-row.
    :ivar unit: bytes; ``unit`` divides every source offset and every ``cols`` value.
    :ivar page_tokens: destination page size for head-major order (0: token-major).
    :ivar first_offset: in-page offset of token 0 (head-major order).
    """

    entries: tuple[int, ...]
    offsets: np.ndarray
    tokens: np.ndarray
    cols: tuple[int, ...]
    row_bytes: int
    unit: int
    page_tokens: int = 0
    first_offset: int = 0


class TransferPlan(msgspec.Struct, frozen=True, kw_only=True):
    """What to write for one (chunk, destination DCP rank): merged byte runs (+ gather indices).

    Runs are parallel int64 arrays of shape ``[R]``. ``entry[r]`` picks the KV entry; the
    destination address is ``dst_entry_base[entry] + dst_offset``. The source address is
    ``src_entry_base[entry] + src_offset`` when ``packed`` is False, else
    ``pack_buffer_base + src_offset`` (the offset already includes the region's offset). Runs are
    merged wherever both sides are contiguous; on the destination side a run never crosses a page.

    When ``packed``, the packer first gathers the rank's bytes into the region, laid out in
    destination order per entry: entry ``e`` starts at ``region.offset + n * sum(pack_row_bytes
    [j] for pack entries j before e)``. ``pack_groups`` says how (sub-rows of heads, or whole
    rows); a plan without groups gathers whole token rows ``pack_src_slots`` (the original
    form). Runs of entries not in ``pack_entries`` (draft entries, never packed) read
    ``src_entry_base[entry] + src_offset`` even in a packed plan
    (``pdplug.packing.run_addresses`` applies this rule).

    :ivar room/chunk_id/is_last: as in :class:`SendChunk`.
    :ivar dst_dcp_rank: the destination DCP rank this plan writes.
    :ivar num_tokens: tokens this rank receives in this chunk.
    :ivar packed: whether the source is the pack region.
    :ivar region: the pack region used (``None`` when not packed).
    :ivar pack_src_slots: int64 ``[n]`` source token slots of the rank's tokens when the gather
        moves whole token rows from contiguous pages (then they are its row indices); empty
        when not packed or when ``pack_groups`` gather head sub-rows.
    :ivar pack_entries: entry indices gathered into the region, in region order.
    :ivar pack_row_bytes: bytes per token of each ``pack_entries`` entry in the region (same
        order), so a packer needs no layout.
    :ivar pack_groups: the gather, group by group (empty: whole rows at ``pack_src_slots``).
    :ivar entry/src_offset/dst_offset/length: the byte runs (int64 ``[R]``; bytes).
    """

    room: int
    chunk_id: int
    is_last: bool
    dst_dcp_rank: int
    num_tokens: int
    packed: bool
    entry: np.ndarray
    src_offset: np.ndarray
    dst_offset: np.ndarray
    length: np.ndarray
    region: PackRegion | None = None
    pack_src_slots: np.ndarray | None = None
    pack_entries: tuple[int, ...] = ()
    pack_row_bytes: tuple[int, ...] = ()
    pack_groups: tuple[PackGroup, ...] = ()

    @property
    def num_runs(self) -> int:
        """Number of byte runs (descriptors) this plan posts."""
        return int(self.length.shape[0])

    @property
    def nbytes(self) -> int:
        """Total bytes written by this plan."""
        return int(self.length.sum())


class DirectPages(msgspec.Struct, frozen=True, kw_only=True):
    """The closed form of a layout pair's direct plans, declared once per pair by a pack
    planner (optional ``PackPlanner.direct_pages``) so a KV sender computes a send's
    descriptors in a few array operations instead of planning each send (issue 24).

    For a chunk whose first token starts a page on both sides (``rel_start == -1`` and
    ``decode_prefix_len`` a multiple of ``page_size``), of ``n`` tokens on ``P = ceil(n /
    page_size)`` pages, the plan is exactly these runs, entry-major (entry ``entries[0]``'s
    ``P`` pages, then the next entry's): for page ``i`` of entry ``e``,

    * source offset ``src_pages[i] * src_page_bytes + src_offset`` in entry ``e``,
    * destination offset ``dst_pages[src_page_offset + i] * dst_page_bytes + dst_offset`` in
      the destination entry of ``e``,
    * ``page_size * row_bytes`` bytes, the last page's ``(n - (P - 1) * page_size) *
      row_bytes``.

    Any other chunk is planned with ``PackPlanner.plan`` (which also names every error).

    :ivar page_size: tokens per page, the same on both sides.
    :ivar entries: source entries the runs read, in plan order.
    :ivar src_page_bytes/dst_page_bytes: bytes from one page's start to the next (strides).
    :ivar src_offset/dst_offset: bytes from a page's start to its first moved byte.
    :ivar row_bytes: bytes moved per token and entry (a whole row on both sides).
    """

    page_size: int
    entries: tuple[int, ...]
    src_page_bytes: int
    dst_page_bytes: int
    src_offset: int
    dst_offset: int
    row_bytes: int


class PageGrid(msgspec.Struct, frozen=True, kw_only=True):
    """Where a direct template's pages lie in both sides' memory, bound to one peer: what an
    engine needs to prepare the descriptors of every page once (NIXL ``prep_xfer_dlist``, as
    vLLM's NixlConnector prepares its block lists) and then post a send by page ids
    (optional ``TransferEngine.prepare_pages`` / ``post_pages``; issue 24).

    Page ``p`` of entry ``i`` (``i``-th of the template's entries) moves from
    ``src_first[i] + p * src_stride`` to ``dst_first[i] + p * dst_stride``: ``run_bytes``
    bytes for a whole page, fewer for a send's last page.

    :ivar src_first/dst_first: absolute address (bytes) of page 0's first moved byte, per entry.
    :ivar src_stride/dst_stride: bytes from one page to the next.
    :ivar run_bytes: bytes moved per whole page and entry.
    """

    src_first: tuple[int, ...]
    dst_first: tuple[int, ...]
    src_stride: int
    dst_stride: int
    run_bytes: int
