"""The typing.Protocols every component satisfies (structurally: no inheritance needed).

Hosts resolve one object per extension point through :class:`pdplug.manager.PluginManager`
and then call these methods directly; no pluggy hook sits on a per-step, per-page or
per-token path.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import TYPE_CHECKING, Any, Protocol, runtime_checkable

from pdplug.types import (
    Decision,
    DestInfo,
    KVLayout,
    KVPoll,
    PackRegion,
    PeerInfo,
    Segment,
    SendChunk,
    TransferPlan,
)

if TYPE_CHECKING:
    import numpy as np
    import torch

    from pdplug.config import WireConfig

__all__ = [
    "Consensus",
    "Scheduler",
    "PackPlanner",
    "Packer",
    "KVSender",
    "KVReceiver",
    "send_step",
    "decline_room",
    "find_instance",
]


@runtime_checkable
class Consensus(Protocol):
    """Per-PP-rank agreement on request ids (the field's PP consensus, e.g. SGLang #38206).

    Every rank applies the same gap-free sequence of immutable :class:`Decision` s per stream,
    exactly once, in order. All methods are non-blocking and called from the host's loop.
    """

    def offer(self, stream: str, good: Iterable[int] = (), bad: Iterable[int] = ()) -> None:
        """Vote: request ids ready on this rank (``good``) and failed on this rank (``bad``).

        A rank votes ``good`` for a room only when nothing of it is pending locally (e.g. no
        chunk of it still in flight). Re-offering an id already offered is a no-op.

        :raises ValueError: unknown ``stream``.
        """
        ...

    def poll(self) -> list[Decision]:
        """Advance the protocol one loop iteration and return newly applicable decisions.

        Decisions come in ``seq`` order per stream; the caller applies each exactly once.

        :raises pdplug.errors.ConsensusError: a sequence gap/duplicate, or a peer rank that
            stopped answering for ``peer_timeout_s``.
        """
        ...

    def abort(self, rid: int) -> None:
        """Abort ``rid``: it will be decided ``bad`` on every stream it is pending in."""
        ...

    def stats(self) -> dict[str, int]:
        """Counters: votes sent, decisions applied, messages dropped by reason."""
        ...

    def close(self) -> None:
        """Close sockets; idempotent."""
        ...


@runtime_checkable
class Scheduler(Protocol):
    """Send splitting and dynamic chunked-prefill sizing (SGLang PRs #30545/#40376)."""

    def split_send(
        self,
        *,
        token_start: int,
        token_end: int,
        decode_prefix_len: int,
        is_last_send: bool,
        capacity_tokens: int | None,
        first_chunk_id: int = 0,
    ) -> list[Segment]:
        """Split one send of tokens ``[token_start, token_end)`` into segments.

        Cuts at ``decode_prefix_len + k * min(grid, capacity_tokens)``; ``capacity_tokens=None``
        means the peer needs no relayout and the send is not split. Non-last segments end on a
        page boundary; the final segment carries the exact tokens of a partial last page and
        ``is_last`` when ``is_last_send``; a last send with no tokens yields one empty segment.
        """
        ...

    def fit_chunk_model(self, samples: Sequence[tuple[int, float]]) -> None:
        """Fit ``f(l) = a*l^2 + b*l + c`` to ``(prefill tokens, seconds)`` profiling samples."""
        ...

    def next_chunk_size(self, history_len: int) -> int:
        """Chunk size (tokens) for a request with ``history_len`` tokens already computed."""
        ...


@runtime_checkable
class Packer(Protocol):
    """Bit-exact row gather into a pack region (Triton on CUDA, torch on CPU)."""

    def pack(
        self,
        plan: TransferPlan,
        entries: Sequence[torch.Tensor],
        pack_buffer: torch.Tensor,
    ) -> None:
        """Gather ``plan.pack_src_slots`` rows of ``plan.pack_entries`` into ``plan.region``.

        :param entries: one tensor per KV entry, any dtype, contiguous, viewed as uint8 rows
            ``[num_slots, entry_bytes_per_token[e]]``.
        :param pack_buffer: uint8 ``[nbytes]`` registered pack buffer.
        :raises ValueError: the plan does not fit the region, or shapes disagree.
        """
        ...


@runtime_checkable
class PackPlanner(Protocol):
    """Pure planning of byte runs (+ gather indices) for one chunk and one destination rank.

    Optional (not part of the protocol): ``direct_pages(src, dst) -> DirectPages | None``,
    the closed form of a pair's direct plans (:class:`pdplug.types.DirectPages`), which a
    KV sender then applies to page-aligned chunks itself instead of calling :meth:`plan` for
    every send (issue 24); ``None``, or a planner without the method, plans every send.
    """

    def needs_relayout(self, src: KVLayout, dst: KVLayout) -> bool:
        """Whether sends from ``src`` to ``dst`` must be packed (e.g. decode DCP > 1)."""
        ...

    def capacity_tokens(self, src: KVLayout, dst: KVLayout, region_nbytes: int) -> int:
        """Tokens one pack region of ``region_nbytes`` holds, floored to whole pages."""
        ...

    def plan(
        self,
        chunk: SendChunk,
        src: KVLayout,
        dst: KVLayout,
        dst_dcp_rank: int,
        region: PackRegion | None = None,
    ) -> TransferPlan:
        """Plan the writes of ``chunk`` to decode DCP rank ``dst_dcp_rank``.

        :raises pdplug.errors.PlanError: geometry mismatch, unaligned ``decode_prefix_len``,
            too few destination pages, or a region that would overflow (never a silent
            per-token fallback).
        """
        ...

    def packer(self, device: str = "cpu", kind: str = "auto") -> Packer:
        """The packer for ``device`` (``kind``: ``"auto"``, ``"torch"``, ``"triton"``)."""
        ...


@runtime_checkable
class KVSender(Protocol):
    """Prefill-side data plane of one rank: owns registered KV and pack memory.

    Call order per request (room): :meth:`start` -> :meth:`poll` until ``WaitingForInput`` ->
    :meth:`dest` / :meth:`capacity_tokens` -> :meth:`send` each segment -> :meth:`poll` (or
    :meth:`wait`) until ``Success``/``Failed`` -> :meth:`drained` -> :meth:`clear`. Every wait
    ends within the configured timeouts (``KVConfig``); see :mod:`pdplug.transfer` for the
    default implementation and the full host walkthrough.

    **Room ids.** A room id names one request on a prefill instance for as long as either side
    holds it. Allocate ids so that two live requests can never share one — a random 63-bit id
    per request (SGLang's bootstrap room), or the decode instance's index in the high bits and
    a per-instance counter below (``room = decode_index << 40 | n``). A sender that sees two
    decode instances claim one room tells both at once (``Failed``, the reason names both): it
    fails the room if nothing was sent yet, else refuses the later claimant; it never writes one
    request's KV into another's pages (ray-project/ray #63741).

    **How rooms end** (each end reaches the decode side within one round trip):

    * ``transfer_timeout_s`` bounds *silence*, not queueing: while this rank keeps completing
      writes, a room whose work waits in the local send queue behind other rooms keeps its
      deadline re-armed, and its decode ranks are told so (vLLM #53095);
    * a write the engine still reports in flight after ``transfer_timeout_s`` fails its room
      but is never abandoned: the room stays ``Failed`` and not :meth:`drained`, its pack region
      and engine handle stay reserved, and ``stats()["stuck_writes"]`` counts it until the
      engine reports it done or failed (SGLang #32564);
    * a decode abort that comes before :meth:`start`, and a destination that comes after the
      room failed here, end the room on both sides at once (vLLM #41269);
    * a segment that ends past, or a last segment that ends short of, the ``num_tokens`` the
      decode declared fails the room on both sides, naming both numbers (vLLM #50558, #30358);
    * if the rank's engine thread dies, every room fails with the cause, :meth:`wait` returns,
      and ``stats()["engine_thread_died"]`` says why.

    **Peers and heads.** A decode rank is identified by its full position (instance, TP, DCP
    and PP rank). Prefill and decode TP sizes may differ: a prefill rank writes a decode rank
    exactly the KV heads :func:`pdplug.heads.routed_heads` says it owes it (each decode rank
    receives each of its heads once; a replicated head from one replica, vLLM #45330), and a
    decode rank it owes nothing is refused at the handshake, never planned for or notified. A
    room waits for a DestInfo from every DCP rank of every decode TP rank this rank feeds
    (:func:`pdplug.heads.fed_ranks`); a prefill rank that feeds no rank of a decode instance
    has nothing to send it: the host does not start that instance's rooms there (it reports
    the request finished at once). A peer that is slow, stops answering or
    handshakes again affects only its own rooms: destinations are served round-robin, a peer's
    writes hold at most its share of the pack regions, and a re-handshake from the same decode
    process keeps its rooms going.
    """

    def register_kv(self, entries: Sequence[Any]) -> None:
        """Register the rank's KV entries (``layout`` order) and the pack buffer once, without
        copies; publish the rank at ``KVConfig.bootstrap_endpoint`` when set.

        One item per entry (:func:`pdplug.registration.resolve_kv`): a tensor whose shape and
        strides match the entry's :class:`~pdplug.kvtypes.KVEntry` (vLLM per-layer views
        ``(num_blocks, H, block_size, C)``, several layers in one storage; vLLM CPU's K and V
        slab views, :func:`pdplug.geometry.slab_views`), or a raw region ``(address, nbytes[,
        page_stride])`` / :class:`pdplug.registration.KVRegion` (SGLang). Memory shared by
        several entries is registered with the engine once.

        :raises ValueError: entry count, strides that do not match the entry, a page stride
            that differs, an entry below one page (named).
        :raises pdplug.errors.TransferError: the engine or the rendezvous refused.
        """
        ...

    def peer_info(self) -> PeerInfo:
        """What this rank publishes at the rendezvous (after :meth:`register_kv`)."""
        ...

    def start(self, room: int) -> int:
        """Lease ``room``: ``Bootstrapping`` until the DestInfo of every decode rank this rank
        feeds arrived (``bootstrap_timeout_s``), then ``WaitingForInput``.

        :returns: the lease generation.

        :raises ValueError: ``room`` is already leased (clear it first).
        """
        ...

    def poll(self, room: int) -> KVPoll:
        """Room status on this rank; never blocks.

        :raises KeyError: ``room`` is not leased.
        """
        ...

    def wait(
        self,
        room: int,
        until: tuple[KVPoll, ...] = (KVPoll.Success, KVPoll.Failed),
        timeout_s: float | None = None,
    ) -> KVPoll:
        """Block (no polling) until ``room`` reaches a status in ``until`` (a single
        non-terminal status means "at least"); ``timeout_s=None`` is bounded by the room's
        deadlines.

        :returns: the status.
        """
        ...

    def dest(self, room: int) -> list[DestInfo]:
        """The DestInfos received for ``room``, one per destination (TP rank, DCP rank) this
        rank feeds (sorted); all carry the same ``decode_prefix_len`` and ``num_tokens``."""
        ...

    def capacity_tokens(self, room: int) -> int | None:
        """Largest segment (tokens) a send of ``room`` may have: the pack-region bound when a
        destination needs relayout (pass it to ``Scheduler.split_send``), ``None`` otherwise.

        :raises ValueError: the room has no destination yet.
        """
        ...

    def send(self, room: int, segment: Segment, src_pages: np.ndarray, ready: Any = None) -> None:
        """Plan, pack and post the writes of one segment to every destination rank.

        Non-blocking; segments go in ``chunk_id`` order (0, 1, … per rank), the last with
        ``is_last``. The room turns Success when the last segment completed on every
        destination (never while a chunk is pending), Failed on any error or timeout. A send
        for a failed room is ignored.

        Stream ordering (the host's forward may still be writing the KV when it calls
        ``send``, as with SGLang's indices event or vLLM's asynchronous KV writes):

        * no pack or write reads the segment's KV before ``ready.query()`` is true; the
          sender polls it without blocking other rooms, and a ``ready`` still false after
          ``KVConfig.transfer_timeout_s`` fails the room (``KVPoll.Failed``, its pack regions
          free);
        * the segment's relayout jobs are packed together (``Packer.pack_all`` when the packer
          has it: one launch for every destination rank), and their writes are posted only
          after the pack finished on the device (a CUDA event recorded after the pack).

        :param src_pages: int64 ``[n]`` source page ids from the segment's first page on.
        :param ready: ``None`` (the KV is complete) or an object with ``query() -> bool``
            (and usually ``synchronize()``): a ``torch.cuda.Event`` recorded after the KV
            writes of this segment, or the ``torch.cuda.Stream`` that writes them.
        :raises TypeError: ``ready`` has no ``query()``.
        :raises ValueError: the room is not ``WaitingForInput``/``Transferring``; a page id
            is outside the registered KV, or fewer pages than the segment's tokens span; the
            segment's fields disagree; its ``chunk_id`` is not the room's next one (a gap, a
            repeat, or a segment after the last: the decode could never complete the room); or
            it does not start at the token where the previous segment ended. The room is
            unchanged.
        """
        ...

    def send_many(self, sends: Sequence[tuple[Any, ...]]) -> None:
        """:meth:`send` for each ``(room, segment, src_pages[, ready])`` of one engine step.
        This default calls :meth:`send` for each (a sender that subclasses the Protocol gets
        it); a sender may post them with one hand-off instead (the default senders do: the
        field loses TTFT to per-send hand-off orchestration, vLLM RFC #50913). Hosts call
        :func:`send_step`, which falls back to :meth:`send` for senders without it.

        :raises KeyError, TypeError, ValueError: as :meth:`send`, for the first bad item (the
            items before it are sent).
        """
        for item in sends:
            self.send(*item)

    def abort(self, room: int, reason: str = "aborted") -> None:
        """Fail ``room`` here and tell every destination (again once in-flight writes
        drained)."""
        ...

    def drained(self, room: int) -> bool:
        """Whether no write of ``room`` is in flight here (its source pages may be reused):
        never while the engine still reports one in flight, however long ago it was posted."""
        ...

    def clear(self, room: int) -> None:
        """Forget ``room`` (after the host released it); an unfinished room is aborted first."""
        ...

    def failure_reason(self, room: int) -> str | None:
        """Why ``room`` failed, if it did."""
        ...

    def stats(self) -> dict[str, Any]:
        """Counters (bytes, runs posted, drops by reason, timings) and what the rank holds now
        (rooms, queued jobs, writes in flight, ``stuck_writes``, busy pack regions)."""
        ...

    def close(self) -> None:
        """Release handles, deregister memory, close sockets; idempotent. Every room not
        ended fails first (``"sender closed on prefill rank N"``: one ``transfer_failed``) and
        its decode ranks are told before the sockets go, so they fail it within a round trip,
        not at their timeout. Afterwards the process exits normally (no native crash at
        interpreter exit)."""
        ...


@runtime_checkable
class KVReceiver(Protocol):
    """Decode-side data plane of one rank (one per DCP rank): owns the registered destination
    KV.

    Call order: :meth:`register_kv` -> :meth:`connect` (peers from
    :func:`pdplug.bootstrap.resolve`; or, on the default receivers, ``find(instance,
    rendezvous)``, which connects in the background: hosts call :func:`find_instance`) -> per
    request :meth:`expect` -> :meth:`poll` (or
    :meth:`wait`) until ``Success``/``Failed`` -> (:meth:`drained` before reusing the pages
    of a failed room) -> :meth:`clear`.

    Room ids follow the rule of :class:`KVSender` (one live request per room id on a prefill
    instance; e.g. the decode instance's index in the high bits). A room fails at once, naming
    the reason, when the prefill side already failed it, another decode instance claims it, or
    the prefill's token count disagrees with ``num_tokens``. A failed room is :meth:`drained`
    only once every prefill rank it was sent to confirmed it stopped writing its pages, or is
    known dead — never by a timer (the receiver asks again until then, and
    ``stats()["undrained"]`` counts such rooms). If the rank's engine thread dies, every room
    fails with the cause and :meth:`wait` returns.
    """

    def register_kv(self, entries: Sequence[Any]) -> None:
        """Register the rank's KV entries (``layout`` order) once, without copies: items as
        for :meth:`KVSender.register_kv`; draft entries hold whole virtual pages
        (``page_size * dcp_size`` tokens each)."""
        ...

    def peer_info(self) -> PeerInfo:
        """What this rank sends to prefill ranks at the handshake."""
        ...

    def connect(
        self,
        prefill: Sequence[PeerInfo],
        timeout_s: float | None = None,
        *,
        rendezvous: str | None = None,
    ) -> None:
        """Handshake with the ranks of a prefill instance that feed this rank (bounded by
        ``timeout_s``, default ``bootstrap_timeout_s``). Pass every rank of the instance
        (:func:`pdplug.bootstrap.resolve`); the receiver keeps the (PP, TP) ranks that hold its
        heads (:func:`pdplug.transfer.handshake.feeding_peers`, whatever the two TP sizes) and
        completes a room once each of them delivered its chunks. Connecting to an instance
        again (a re-handshake) keeps the rooms in flight with the prefill processes that are
        still the same. After a refusal, rooms expected from that instance fail at once naming
        it. An instance whose ranks died or restarted is found again at ``rendezvous``
        (default ``KVConfig.bootstrap_endpoint``; ``""``: never) by the next room bound for it.

        :raises pdplug.errors.CompatError: naming every mismatch (model, dtype, head counts,
            head size, layers, page size, entry geometry, layout version, backend, DCP size,
            plugin vetoes, a feeding rank missing from ``prefill``) from both sides.
        :raises pdplug.errors.TransferError: a prefill rank did not answer.
        """
        ...

    def expect(
        self,
        room: int,
        dst_pages: np.ndarray,
        *,
        decode_prefix_len: int = 0,
        num_tokens: int = 0,
        instance: str | None = None,
    ) -> int:
        """Lease ``room`` (``WaitingForInput``) and send its DestInfo to every prefill rank of
        ``instance`` that feeds this rank (optional when it is the only one this rank knows:
        connected, found, even while found again, or refused); returns the generation.
        Every decode (TP, DCP) rank of the instance expects the room with the same
        ``decode_prefix_len`` and ``num_tokens`` and its own pages.

        :param dst_pages: int64 ``[n]`` this rank's destination (virtual) page ids from
            ``decode_prefix_len`` on.
        :param num_tokens: the prompt length (tokens); when non-zero the prefill must send
            exactly ``[decode_prefix_len, num_tokens)``, else the room fails on both sides.
        :raises ValueError: a page outside the registered KV, too few pages for
            ``num_tokens``, a prefix not aligned to the virtual page, a leased room.
        """
        ...

    def poll(self, room: int) -> KVPoll:
        """Room status on this rank (Success when every source rank's last chunk arrived).

        :raises KeyError: ``room`` is not leased.
        """
        ...

    def wait(
        self,
        room: int,
        until: tuple[KVPoll, ...] = (KVPoll.Success, KVPoll.Failed),
        timeout_s: float | None = None,
    ) -> KVPoll:
        """Block (no polling) until ``room`` reaches a status in ``until``; see
        :meth:`KVSender.wait`."""
        ...

    def abort(self, room: int, reason: str = "aborted") -> None:
        """Fail ``room`` here and tell every prefill rank to stop sending it."""
        ...

    def drained(self, room: int) -> bool:
        """Whether no prefill rank can still write into ``room``'s pages: it succeeded, or
        every source it was sent to confirmed it stopped or is known dead (never by a timer)."""
        ...

    def clear(self, room: int) -> None:
        """Forget ``room``; later tags of its generation are ignored (an unfinished room is
        aborted first)."""
        ...

    def failure_reason(self, room: int) -> str | None:
        """Why ``room`` failed, if it did."""
        ...

    def stats(self) -> dict[str, Any]:
        """Counters (chunks, drops by reason, engine counters such as lost notifications) and
        what the rank holds now (rooms, ``undrained`` failed rooms)."""
        ...

    def close(self) -> None:
        """Release everything; idempotent."""
        ...


def send_step(sender: Any, sends: Sequence[tuple[Any, ...]]) -> None:
    """Post one engine step's sends ``(room, segment, src_pages[, ready])``: with the sender's
    :meth:`KVSender.send_many` when it has one (one hand-off for the step), else one
    :meth:`KVSender.send` each, so a third-party sender written before ``send_many`` keeps
    working.

    :raises KeyError, TypeError, ValueError: as :meth:`KVSender.send`.
    """
    many = getattr(sender, "send_many", None)
    if callable(many):
        many(sends)
        return
    for item in sends:
        sender.send(*item)


def decline_room(receiver: Any, room: int, reason: str, *, instance: str | None = None) -> int:
    """The host dropped ``room`` before it had pages for it (SGLang's decode abort before its
    metadata): lease it ``Failed`` on ``receiver`` and tell every prefill rank of ``instance``
    to stop waiting for it. With the receiver's own ``decline(room, reason, *, instance)``
    (pdplug's receivers have it) no DestInfo is sent, so no prefill rank ever sees the room
    ``WaitingForInput`` and nothing can land (drained at once); a receiver without it expects
    the room without pages and aborts it (its prefill may see ``WaitingForInput`` first).
    Returns the generation; clear the room as any other.

    :raises ValueError: an unknown instance, a room outside ``[0, 2**63)`` or already leased.
    :raises TypeError: ``reason`` is not a str.
    """
    if not isinstance(reason, str):
        raise TypeError(f"decline_room: reason must be a str, got {reason!r}")
    dec = getattr(receiver, "decline", None)
    if callable(dec):
        return int(dec(room, reason, instance=instance))
    import numpy as np

    gen = int(receiver.expect(room, np.empty(0, dtype=np.int64), instance=instance))
    receiver.abort(room, reason)
    return gen


def find_instance(
    receiver: Any,
    instance: str,
    rendezvous: str,
    *,
    wire: WireConfig | None = None,
    timeout_s: float = 30.0,
) -> None:
    """Make prefill ``instance`` (registered at ``rendezvous``) known to ``receiver`` before
    the first :meth:`KVReceiver.expect` bound for it. A receiver with a ``find(instance,
    rendezvous)`` method (the default receivers: :meth:`pdplug.transfer.KVReceiverSession.find`)
    returns at once and connects it in the background when a room needs it, so the host's step
    never blocks on a dead, restarting or unknown instance (issue 22); any other receiver (a
    third-party one written before ``find``) is resolved and connected inline here.

    :param wire: socket rules of the inline lookup (its key); ``timeout_s``: its bound (s).
    :raises pdplug.errors.CompatError, pdplug.errors.TransferError: from an inline connect.
    """
    find = getattr(receiver, "find", None)
    if callable(find):
        find(instance, rendezvous)
        return
    from pdplug import bootstrap

    peers = bootstrap.resolve(rendezvous, instance, timeout_s=timeout_s, wire=wire)
    receiver.connect(peers, rendezvous=rendezvous)
