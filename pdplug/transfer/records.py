"""The engine-thread records of a prefill rank: a decode peer, a room lease, a job.

Plain mutable msgspec Structs owned by the sender's engine thread (never shared with host
threads). A decode peer is identified by its full position (:func:`peer_key`), so ranks of one
decode instance that differ only in TP or PP rank never collide.
"""

from __future__ import annotations

from typing import Any

import msgspec
import numpy as np

from pdplug.packing import page_array
from pdplug.packing.pages import PageIds
from pdplug.types import ChunkTag, DestInfo, KVLayout, PeerInfo, Segment, pages_from_bytes

__all__ = ["DST_LIST_MAX", "PeerKey", "peer_key", "describe", "failure_tag", "Peer", "Lease", "Job"]

#: a destination's page ids up to this many are kept as a list of Python ints too
#: (:attr:`Lease.dst_ids`): a room of ``n`` pages holds about ``40 * n`` bytes more while it lives
DST_LIST_MAX = 512

#: ``(decode instance, tp_rank, dcp_rank, pp_rank)``
PeerKey = tuple[str, int, int, int]


def peer_key(instance: str, layout: KVLayout) -> PeerKey:
    """The full position of a decode rank: instance, TP rank, DCP rank, PP rank."""
    return (instance, layout.tp_rank, layout.dcp_rank, layout.pp_rank)


def describe(key: PeerKey) -> str:
    """``"decode <instance> dcp <r>"`` (plus ``tp``/``pp`` when they are not 0), for reasons."""
    inst, tp, dcp, pp = key
    extra = (f" tp {tp}" if tp else "") + (f" pp {pp}" if pp else "")
    return f"decode {inst} dcp {dcp}{extra}"


def failure_tag(room: int, generation: int, rank: int, reason: str) -> ChunkTag:
    """The negative completion tag prefill rank ``rank`` sends a decode lease ``generation``
    of ``room`` when the room failed here (``reason`` cut to 512 characters)."""
    return ChunkTag(
        generation=generation,
        room=room,
        chunk_id=-1,
        is_last=True,
        src_rank=rank,
        ok=False,
        reason=reason[:512],
    )


class Peer(msgspec.Struct, kw_only=True):
    """A decode rank connected to a sender.

    :ivar ident: its authenticated sender identity (:func:`pdplug.wire.peer_identity` of its
        PeerInfo, checked at the Hello); ``key``: its position (:func:`peer_key`).
    :ivar route: the ZMQ routing id replies go to (from its latest accepted frame; an address,
        never an identity); ``epoch``: the codec epoch of the connection that said Hello.
    :ivar handle: the engine's peer handle; ``emap``: source -> destination entry;
        ``dst_base``: int64 destination entry bases; ``relayout``: sends to it are packed.
    :ivar inflight: writes (packing or posted) that use ``handle``; the handle is released
        only once it is 0 and the peer is gone.
    :ivar gone: dropped or replaced by a new handshake; ``released``: handle released.
    :ivar fed: decode TP ranks of the peer's instance this prefill rank writes
        (:func:`pdplug.heads.fed_ranks`): a room waits for a DestInfo from each of their DCP
        ranks.
    :ivar dst_table: int64 destination base address per source entry (``dst_base[emap]``),
        made once at the handshake for :func:`pdplug.packing.plan_addresses`.
    :ivar direct: the planner's direct template bound to this peer
        (:class:`pdplug.packing.DirectRuns`) once the first send looked for it; ``None``
        before, ``False`` when the planner has none for the pair.
    """

    ident: str
    route: bytes
    epoch: int
    info: PeerInfo
    key: PeerKey
    handle: Any
    emap: np.ndarray
    dst_base: np.ndarray
    relayout: bool
    last_seen: float
    alive: bool = True
    inflight: int = 0
    gone: bool = False
    released: bool = False
    fed: int = 1
    dst_table: np.ndarray
    direct: Any = None


class Lease(msgspec.Struct, kw_only=True):
    """One room on a sender: its destinations, segments and writes.

    :ivar dests/peers: by destination position (:data:`PeerKey`).
    :ivar segments: chunk_id -> jobs of that segment not yet completed.
    :ivar inflight: writes posted (or packing) and not yet done.
    :ivar notified: failure notices sent: 0 none, 1 failed, 2 failed and drained.
    :ivar posted: a job of the room was dispatched (bytes may have moved).
    :ivar succeeded: the room ended ``Success`` here (it is never failed afterwards).
    :ivar order: destination positions in send order (sorted), set once every DestInfo
        arrived; ``dst_pages``: each one's checked int64 page ids (equal lists share one array);
        ``dst_ids``: the same ids as the direct lane reads them, a list of Python ints up to
        :data:`DST_LIST_MAX` pages (made here, at the bootstrap, not on the send path), else
        the array.
    :ivar stale: per destination, the newest decode lease generation of an earlier lease of
        the room here that failed and was cleared: an abort of it (or older) that arrives late
        is not for this lease.
    :ivar refused: per destination, the newest decode lease generation whose DestInfo came
        after this lease failed and was refused (that decode lease was told it failed).
    """

    room: int
    generation: int
    instance: str = ""
    expected: int = 0
    dests: dict[PeerKey, DestInfo] = {}
    peers: dict[PeerKey, Peer] = {}
    segments: dict[int, int] = {}
    inflight: int = 0
    failed: bool = False
    reason: str = ""
    notified: int = 0
    cleared: bool = False
    posted: bool = False
    succeeded: bool = False
    order: list[PeerKey] = []
    dst_pages: dict[PeerKey, np.ndarray] = {}
    dst_ids: dict[PeerKey, PageIds] = {}
    stale: dict[PeerKey, int] = {}
    refused: dict[PeerKey, int] = {}

    def complete(self) -> str:
        """Every DestInfo arrived: check that the decode DCP ranks agree and decode their page
        lists once (:attr:`order`, :attr:`dst_pages`; not again on every send). Returns why
        the room must fail, ``""`` when it may go ``WaitingForInput``."""
        ds = [self.dests[k] for k in sorted(self.dests)]
        if len({(x.decode_prefix_len, x.num_tokens) for x in ds}) != 1:
            return "DestInfo differs across decode DCP ranks: " + ", ".join(
                f"dcp {x.dcp_rank}: decode_prefix_len={x.decode_prefix_len} "
                f"num_tokens={x.num_tokens}"
                for x in ds
            )
        arrays: dict[bytes, np.ndarray] = {}  # equal page lists share one array
        try:
            for x in ds:
                if x.dst_pages not in arrays:
                    arrays[x.dst_pages] = page_array(
                        pages_from_bytes(x.dst_pages), "dst_pages", x.room
                    )
        except ValueError as e:
            return f"DestInfo: {e}"
        self.order = sorted(self.dests)
        self.dst_pages = {k: arrays[self.dests[k].dst_pages] for k in self.order}
        listed = {b: a.tolist() if a.shape[0] <= DST_LIST_MAX else a for b, a in arrays.items()}
        self.dst_ids = {k: listed[self.dests[k].dst_pages] for k in self.order}
        return ""

    def segment_error(self, keys: list[PeerKey], seg: Segment) -> str:
        """Why ``seg`` cannot go to destinations ``keys`` (it ends past, or as the last segment
        short of, a destination's declared ``num_tokens``; as the first, it starts after the
        destination's ``decode_prefix_len``); ``""`` when it can."""
        for key in keys:
            d = self.dests[key]
            if not seg.chunk_id and seg.token_start > d.decode_prefix_len:
                return (
                    f"token count: the first segment starts at token {seg.token_start} but "
                    f"{describe(key)} declared decode_prefix_len={d.decode_prefix_len} "
                    f"(KVReceiver.expect): tokens [{d.decode_prefix_len}, {seg.token_start}) "
                    "would never be written"
                )
            short = seg.is_last and seg.token_end < d.num_tokens
            if d.num_tokens and (seg.token_end > d.num_tokens or short):
                which = "the last segment" if seg.is_last else f"segment {seg.chunk_id}"
                return (
                    f"token count: {which} ends at token {seg.token_end} but {describe(key)} "
                    f"declared num_tokens={d.num_tokens} (KVReceiver.expect); both sides "
                    "must agree on the prompt length"
                )
        return ""


class Job(msgspec.Struct, kw_only=True):
    """One (segment, destination) of a lease; ``chunk`` is the planner's SendChunk (a job
    posted from a direct template carries its :class:`~pdplug.types.Segment` instead: after
    the post only ``chunk_id`` and ``is_last`` are read) and ``dst_rank`` the destination's DCP
    rank."""

    lease: Lease
    key: PeerKey
    dst_rank: int
    chunk: Any
