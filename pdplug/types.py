"""Contracts shared by the core, the host and every plugin: msgspec Structs and KVPoll.

Two kinds of Struct live here:

* **Wire structs** (``Vote``, ``Decision``, ``PeerInfo``, ``DestInfo``, ``ChunkTag`` …) cross
  sockets. They hold only msgspec-encodable fields; page lists travel as little-endian int64
  ``bytes`` (see :func:`pages_to_bytes` / :func:`pages_from_bytes`) so a 10k-page list costs one
  memcpy, not a Python loop.
* **In-process structs** (``SendChunk``, ``Segment``, ``TransferPlan``) are frozen msgspec Structs
  that carry ``numpy.ndarray`` fields. They are never encoded; frozen means "do not rebind", the
  arrays themselves are treated as read-only by convention.

Names follow the field (SGLang / vLLM): page, page size, bootstrap room, KVPoll, PP rank,
TP/DCP rank, pack buffer, segment.
"""

from __future__ import annotations

import enum
from collections.abc import Iterable
from typing import Any

import msgspec
import numpy as np

__all__ = [
    "KVPoll",
    "merge_poll",
    "reduce_poll",
    "KVLayout",
    "SendChunk",
    "Segment",
    "TransferPlan",
    "PackRegion",
    "Vote",
    "Decision",
    "STREAMS",
    "PeerInfo",
    "DestInfo",
    "ChunkTag",
    "PdplugEvent",
    "ComponentSpec",
    "SchedulerSpec",
    "ConsensusSpec",
    "KVSenderSpec",
    "PackPlannerSpec",
    "pages_to_bytes",
    "pages_from_bytes",
    "LAYOUT_VERSION",
]

#: Bumped whenever the meaning of KVLayout or of a plan changes; checked at the handshake.
LAYOUT_VERSION = 1


class KVPoll(enum.IntEnum):
    """Status of one bootstrap room on one rank (SGLang ``KVPoll``; the order is the contract).

    ``Failed=0 < Bootstrapping=1 < WaitingForInput=2 < Transferring=3 < Success=4``.
    Inside a stage (TP/DCP ranks) statuses reduce with MIN (:func:`reduce_poll`): a room is as
    far as its slowest rank and failed if any rank failed. Over time a room's status only moves
    up the lattice (:func:`merge_poll`), and ``Failed`` is absorbing.
    """

    Failed = 0
    Bootstrapping = 1
    WaitingForInput = 2
    Transferring = 3
    Success = 4


def merge_poll(old: KVPoll, new: KVPoll) -> KVPoll:
    """Monotonic merge of a room's status: ``max(old, new)``, except ``Failed`` is absorbing.

    :param old: the current status.
    :param new: the proposed status.
    :returns: ``Failed`` if either is ``Failed``, else the larger of the two.
    """
    if old == KVPoll.Failed or new == KVPoll.Failed:
        return KVPoll.Failed
    return old if old >= new else new


def reduce_poll(polls: Iterable[KVPoll | int]) -> KVPoll:
    """MIN-reduce statuses across the TP/DCP ranks of one stage (SGLang ``poll_and_all_reduce``).

    :param polls: one status per rank; must not be empty.
    :raises ValueError: if ``polls`` is empty.
    """
    lo: int | None = None
    for p in polls:
        lo = int(p) if lo is None else min(lo, int(p))
    if lo is None:
        raise ValueError("reduce_poll: polls is empty; need one status per rank")
    return KVPoll(lo)


def pages_to_bytes(pages: Any) -> bytes:
    """Encode page ids (any int array-like, shape ``[n]``) as little-endian int64 bytes."""
    return np.ascontiguousarray(pages, dtype="<i8").tobytes()


def pages_from_bytes(buf: bytes) -> np.ndarray:
    """Decode :func:`pages_to_bytes` output into a read-only int64 array of shape ``[n]``.

    :raises ValueError: if ``len(buf)`` is not a multiple of 8.
    """
    if len(buf) % 8:
        raise ValueError(f"pages: byte length {len(buf)} is not a multiple of 8 (int64 page ids)")
    return np.frombuffer(buf, dtype="<i8")


# --------------------------------------------------------------------------- layouts and plans


class KVLayout(msgspec.Struct, frozen=True, kw_only=True):
    """Geometry of one rank's paged KV cache, as exchanged at the handshake.

    The cache is a list of *entries* (one per layer for MLA latents, two per layer for K and V,
    plus draft-model entries). Entry ``e`` is one contiguous buffer of token rows: token slot
    ``s = page * page_size + offset`` lives at byte ``s * entry_bytes_per_token[e]`` from the
    entry's base address. A decode DCP rank stores logical token ``i`` of a request at local
    offset ``i // dcp_size`` when ``i % dcp_size == dcp_rank`` (SGLang DCP rule); draft entries
    are not sharded and hold every token, in virtual pages of ``page_size * dcp_size`` tokens.

    :ivar page_size: tokens per physical page (> 0).
    :ivar entry_bytes_per_token: bytes of one token row per entry, ``len == num entries``.
    :ivar draft_entries: indices of entries copied whole (not DCP-sharded).
    :ivar dtype: KV dtype name (``"bfloat16"``, ``"float8_e4m3fn"``, ``"float32"`` …).
    :ivar tp_size/tp_rank/pp_size/pp_rank/dcp_size/dcp_rank: parallel placement of this rank.
    :ivar first_layer/num_layers: the model layers this rank holds (PP slices layers).
    :ivar memory: ``"DRAM"`` or ``"VRAM"``.
    :ivar layout_version: :data:`LAYOUT_VERSION` of the producer.
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


class SendChunk(msgspec.Struct, frozen=True, kw_only=True):
    """One chunk of a request's KV to send (in-process; SGLang ``TransferKVChunk``).

    Token positions are logical positions in the request. The chunk covers tokens
    ``[decode_prefix_len + src_page_offset * page_size, … + num_tokens)``.

    :ivar room: bootstrap room (request id).
    :ivar src_pages: int64 ``[n_src]`` source page ids of *this chunk* (prefill cache).
    :ivar dst_pages: int64 ``[n_dst]`` destination page ids for the *whole send range* starting
        at ``decode_prefix_len`` (decode virtual pages; the same local page id on every DCP rank).
    :ivar decode_prefix_len: tokens decode already holds (multiple of the decode virtual page).
    :ivar src_page_offset: pages between ``decode_prefix_len`` and this chunk's first token.
    :ivar num_tokens: exact tokens in the chunk (a partial last page counts its real tokens).
    :ivar chunk_id: 0-based index of the chunk within the request, per source rank.
    :ivar is_last: only the last chunk carries state/metadata and completes the room.
    """

    room: int
    src_pages: np.ndarray
    dst_pages: np.ndarray
    decode_prefix_len: int = 0
    src_page_offset: int = 0
    num_tokens: int = 0
    chunk_id: int = 0
    is_last: bool = True


class Segment(msgspec.Struct, frozen=True, kw_only=True):
    """One piece of a send after the scheduler split it at ``min(grid, pack capacity)``.

    :ivar token_start: first logical token (inclusive).
    :ivar token_end: end logical token (exclusive); ``token_end - token_start == num_tokens``.
    :ivar page_start: index of the first page within the send's source page list.
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


class TransferPlan(msgspec.Struct, frozen=True, kw_only=True):
    """What to write for one (chunk, destination DCP rank): merged byte runs (+ gather indices).

    Runs are parallel int64 arrays of shape ``[R]``. ``entry[r]`` picks the KV entry; the
    destination address is ``dst_entry_base[entry] + dst_offset``. The source address is
    ``src_entry_base[entry] + src_offset`` when ``packed`` is False, else
    ``pack_buffer_base + src_offset`` (the offset already includes the region's offset). Runs are
    merged wherever both sides are contiguous; on the destination side a run never crosses a page.

    When ``packed``, the packer first gathers rows ``pack_src_slots`` (int64 ``[n]`` source token
    slots, pack order) of every sharded entry into the region, layer-major: entry ``e`` starts at
    ``region.offset + n * sum(bpt[j] for sharded j < e)``. Runs of entries not in
    ``pack_entries`` (draft entries, never packed) read ``src_entry_base[entry] + src_offset``
    even in a packed plan (``pdplug.packing.run_addresses`` applies this rule).

    :ivar room/chunk_id/is_last: as in :class:`SendChunk`.
    :ivar dst_dcp_rank: the destination DCP rank this plan writes.
    :ivar num_tokens: tokens this rank receives in this chunk.
    :ivar packed: whether the source is the pack region.
    :ivar region: the pack region used (``None`` when not packed).
    :ivar pack_src_slots: int64 ``[n]`` source token slots to gather (empty when not packed).
    :ivar pack_entries: entry indices gathered into the region, in region order.
    :ivar pack_row_bytes: bytes per token of each ``pack_entries`` entry (same order), so a
        packer needs no layout.
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

    @property
    def num_runs(self) -> int:
        """Number of byte runs (descriptors) this plan posts."""
        return int(self.length.shape[0])

    @property
    def nbytes(self) -> int:
        """Total bytes written by this plan."""
        return int(self.length.sum())


# --------------------------------------------------------------------------- consensus

#: Streams of per-request agreement (DESIGN.md §3); each has its own gap-free sequence.
STREAMS: tuple[str, ...] = ("bootstrap", "release", "prealloc", "transfer", "retract")


class Vote(msgspec.Struct, frozen=True, kw_only=True, tag="vote"):
    """One rank's offer for a stream: request ids ready here (``good``) and failed here (``bad``).

    :ivar stream: one of :data:`STREAMS` (or a host-defined stream name).
    :ivar rank: the voting PP rank.
    :ivar seq: per-(rank, stream) vote counter, for de-duplication.
    """

    stream: str
    rank: int
    seq: int
    good: tuple[int, ...] = ()
    bad: tuple[int, ...] = ()


class Decision(msgspec.Struct, frozen=True, kw_only=True, tag="decision"):
    """An immutable, gap-free numbered decision, applied exactly once, in order, on every rank.

    ``good`` = ready on every rank; ``bad`` = failed or aborted on some rank (bad wins).
    Carries request ids, never queue positions.

    :ivar stream: the stream it belongs to.
    :ivar seq: 0-based, gap-free per stream.
    """

    stream: str
    seq: int
    good: tuple[int, ...] = ()
    bad: tuple[int, ...] = ()


# --------------------------------------------------------------------------- rendezvous / KV


class PeerInfo(msgspec.Struct, frozen=True, kw_only=True, tag="peer"):
    """What one rank publishes at the rendezvous (prefill) or sends at the handshake (decode).

    :ivar instance: instance id (e.g. ``"prefill-0"``).
    :ivar role: ``"prefill"`` or ``"decode"``.
    :ivar layout: the rank's :class:`KVLayout` (compat fields: page size, bytes per token …).
    :ivar control_endpoint: ZMQ endpoint of the rank's control socket (``tcp://host:port``).
    :ivar backend: KV sender name (``"nixl"``, ``"mooncake"`` …).
    :ivar agent: backend connection blob (NIXL agent metadata, Mooncake session id …).
    :ivar entry_base: base address of each KV entry (decode: write targets).
    :ivar pack_base/pack_nbytes: registered pack buffer (prefill), 0 if none.
    :ivar extra: backend- or plugin-specific compat fields, checked by ``pdplug_check_compat``.
    """

    instance: str
    role: str
    layout: KVLayout
    control_endpoint: str = ""
    backend: str = ""
    agent: bytes = b""
    entry_base: tuple[int, ...] = ()
    pack_base: int = 0
    pack_nbytes: int = 0
    extra: dict[str, str] = {}


class DestInfo(msgspec.Struct, frozen=True, kw_only=True, tag="dest"):
    """Per-request destination sent by a decode rank to every prefill rank that feeds it.

    :ivar room: bootstrap room.
    :ivar generation: lease generation of the room on the decode side; stale tags are ignored.
    :ivar decode_instance: decode instance id; ``dcp_rank``: the sending decode DCP rank.
    :ivar dst_pages: :func:`pages_to_bytes` of the destination (virtual) page ids from
        ``decode_prefix_len`` on.
    :ivar decode_prefix_len: tokens decode already holds (multiple of its virtual page).
    :ivar num_tokens: total tokens of the request's prompt (so the sender knows the last page).
    """

    room: int
    generation: int
    decode_instance: str
    dcp_rank: int
    dst_pages: bytes
    decode_prefix_len: int = 0
    num_tokens: int = 0


class ChunkTag(msgspec.Struct, frozen=True, kw_only=True, array_like=True, tag="chunk"):
    """Completion (or failure) tag of one chunk, validated strictly by the receiver.

    :ivar generation/room/chunk_id/is_last: identify the chunk and its room lease.
    :ivar src_rank: the source PP rank (a room completes when every source rank sent its last).
    :ivar ok: False for an explicit failure notification (the negative twin of a completion).
    :ivar reason: failure reason (empty when ok).
    """

    generation: int
    room: int
    chunk_id: int
    is_last: bool
    src_rank: int
    ok: bool = True
    reason: str = ""


class PdplugEvent(msgspec.Struct, frozen=True, kw_only=True):
    """An observer event passed to ``pdplug_on_event`` (metrics, tracing).

    :ivar kind: e.g. ``"decision"``, ``"transfer_done"``, ``"transfer_failed"``, ``"drop"``.
    :ivar source: component name (``"pp0"``, ``"nixl"`` …).
    :ivar room: request id when the event concerns one, else -1.
    :ivar fields: free-form numeric/string fields (bytes, seconds, reason …).
    """

    kind: str
    source: str
    room: int = -1
    fields: dict[str, Any] = {}


# --------------------------------------------------------------------------- registry records


class ComponentSpec(msgspec.Struct, frozen=True, kw_only=True):
    """A named component a plugin offers at one extension point.

    :ivar name: selection name (``"pp0"``, ``"nixl"`` …).
    :ivar factory: lazy ``"module:attr"``; imported only when the component is selected, so a
        plugin's entry-point module stays free of torch/nixl/mooncake/triton imports.
    :ivar summary: one line for ``pdplug plugins``.
    :ivar overrides: True to replace a same-named component of another distribution (a default).
        Any other duplicate name is an error naming both distributions.
    :ivar capabilities: free-form capability flags (``"async"``, ``"notifications"`` …).
    """

    name: str
    factory: str
    summary: str = ""
    overrides: bool = False
    capabilities: tuple[str, ...] = ()


class SchedulerSpec(ComponentSpec, frozen=True, kw_only=True):
    """Record yielded by ``pdplug_register_schedulers``; factory builds a ``Scheduler``."""


class ConsensusSpec(ComponentSpec, frozen=True, kw_only=True):
    """Record yielded by ``pdplug_register_consensus``; factory builds a ``Consensus``."""


class PackPlannerSpec(ComponentSpec, frozen=True, kw_only=True):
    """Record yielded by ``pdplug_register_pack_planners``; factory builds a ``PackPlanner``."""


class KVSenderSpec(ComponentSpec, frozen=True, kw_only=True):
    """Record yielded by ``pdplug_register_kv_senders``.

    :ivar factory: builds the prefill-side ``KVSender``.
    :ivar receiver_factory: builds the decode-side ``KVReceiver``.
    """

    receiver_factory: str = ""
