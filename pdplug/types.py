"""Contracts shared by the core, the host and every plugin: msgspec Structs and KVPoll.

Two kinds of Struct live here:

* **Wire structs** (``Vote``, ``Decision``, ``PeerInfo``, ``DestInfo``, ``ChunkTag`` …) cross
  sockets. They hold only msgspec-encodable fields; page lists travel as little-endian int64
  ``bytes`` (see :func:`pages_to_bytes` / :func:`pages_from_bytes`) so a 10k-page list costs one
  memcpy, not a Python loop.
* **In-process structs** (``SendChunk``, ``Segment``, ``TransferPlan``) are frozen msgspec Structs
  that carry ``numpy.ndarray`` fields. They are never encoded; frozen means "do not rebind", the
  arrays themselves are treated as read-only by convention.

The layout and plan structs (``KVLayout``, ``KVEntry``, ``SendChunk``, ``Segment``,
``PackRegion``, ``PackGroup``, ``TransferPlan``, ``LAYOUT_VERSION``) live in
:mod:`pdplug.kvtypes` and are re-exported here.

Names follow the field (SGLang / vLLM): page, page size, bootstrap room, KVPoll, PP rank,
TP/DCP rank, pack buffer, segment.
"""

from __future__ import annotations

import enum
from collections.abc import Iterable
from typing import Any

import msgspec
import numpy as np

from pdplug.kvtypes import (
    LAYOUT_VERSION,
    DirectPages,
    KVEntry,
    KVLayout,
    PackGroup,
    PackRegion,
    PageGrid,
    Segment,
    SendChunk,
    TransferPlan,
)

__all__ = [
    "KVPoll",
    "merge_poll",
    "reduce_poll",
    "KVLayout",
    "KVEntry",
    "PackGroup",
    "SendChunk",
    "Segment",
    "TransferPlan",
    "DirectPages",
    "PageGrid",
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


# --------------------------------------------------------------------------- consensus

#: Streams of per-request agreement between PP ranks; each has its own gap-free sequence.
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
    :ivar src_rank: the source's (PP, TP) position as its flat rank ``pp_rank * tp_size +
        tp_rank`` (:func:`pdplug.bootstrap.rank_of`); a decode rank completes a room when every
        source that feeds it (:func:`pdplug.heads.expected_sources`, per PP rank) sent its last.
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
