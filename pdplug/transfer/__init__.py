"""Engine-neutral KV transfer machinery shared by every KV sender/receiver plugin.

A backend plugin implements only :class:`~pdplug.transfer.engine.TransferEngine` (register,
agent blob, connect, post, check, release, notify, poll notifications) and returns
``KVSenderSession(config, planner, packer, engine)`` / ``KVReceiverSession(config, engine)``
from its factories. The sessions implement :class:`pdplug.protocols.KVSender` /
:class:`pdplug.protocols.KVReceiver`: control channel (ZMQ + :class:`~pdplug.wire.Codec`,
never pickle), rendezvous publishing, handshake with compat checks, DestInfo intake, room
bookkeeping (:mod:`pdplug.rooms`), strict chunk tags with generations, timeouts and heartbeats,
and the plan -> pack -> post pipeline with double-buffered pack regions (:mod:`pdplug.packing`).

How a host uses it
------------------
Start one rendezvous per deployment (any process; it is a thread)::

    from pdplug.bootstrap import RendezvousServer, resolve
    endpoint = RendezvousServer(wire).start().endpoint

Prefill rank (one :class:`~pdplug.config.KVConfig` with ``role="prefill"`` and
``bootstrap_endpoint=endpoint``)::

    sender = pm.make_kv_sender(cfg)            # planner: the selected pack planner
    sender.register_kv(kv_entries)             # views / raw regions, no copy (resolve_kv);
                                               # registers KV + pack buffer, publishes the rank
    # per request (room) for a decode instance of TP size dtp:
    if not pdplug.heads.fed_ranks(cfg.layout, dtp, decode_layout):
        ...                                    # this rank owes that instance nothing: done
    sender.start(room)                         # Bootstrapping until decode's DestInfos arrive
    ... sender.poll(room) == KVPoll.WaitingForInput     # (with PP: decided by consensus;
                                               #  or sender.wait(room, (WaitingForInput,)))
    d = sender.dest(room)[0]                   # d.decode_prefix_len, d.num_tokens
    cap = sender.capacity_tokens(room)         # None: no relayout, do not split
    for seg in scheduler.split_send(token_start=d.decode_prefix_len, token_end=n,
                                    decode_prefix_len=d.decode_prefix_len,
                                    is_last_send=True, capacity_tokens=cap):
        sender.send(room, seg, pages[seg.token_start // page_size:])
    ... sender.poll(room) in (Success, Failed)  # or sender.wait(room): blocks, no spinning
                                               # Failed: sender.failure_reason(room)
    ... sender.drained(room)                   # no write still reads the pages
    sender.clear(room)

Decode rank (``role="decode"``, one per (TP rank, DCP rank))::

    recv = pm.make_kv_receiver(cfg)
    recv.register_kv(kv_entries)
    recv.connect(resolve(endpoint, "prefill-0", timeout_s=cfg.bootstrap_timeout_s))
    # every rank of the instance: keeps the (PP, TP) ranks holding this rank's KV heads;
    # raises CompatError naming every mismatch (page size, heads, dtype, layers, …)
    # per request (room):
    recv.expect(room, dst_pages, decode_prefix_len=p, num_tokens=n)   # sends DestInfo
    ... recv.poll(room) in (Success, Failed)
    ... recv.drained(room)                     # before freeing the pages of a Failed room
    recv.clear(room)
    recv.abort(room, "reason")                 # any time: prefill ranks stop and report back

Segments of a room go in order with ``chunk_id`` 0, 1, … (the scheduler numbers them); the
decode side completes a room when every prefill rank that feeds it delivered chunks ``0..last``.
Prefill and decode TP sizes may differ: each decode rank receives exactly its KV heads, each
once, from the prefill ranks :mod:`pdplug.heads` routes them from (``ChunkTag.src_rank`` is the
source's flat ``pp_rank * tp_size + tp_rank``). A prefill
rank with several PP ranks runs one sender per rank; each publishes itself and is a separate
source for the decode ranks.

``poll`` never blocks; every other call is bounded (``bootstrap_timeout_s`` for connect, a few
seconds for calls answered by the engine thread). Rooms end ``Success`` or ``Failed`` — a failed
post, an abort on either side, a silent peer (``transfer_timeout_s``), a token count the two
sides disagree on, or a stuck state (``bootstrap_timeout_s`` / ``waiting_timeout_s`` /
``transfer_timeout_s``, which bound silence, not time queued behind other rooms) — never hang;
see :class:`pdplug.protocols.KVSender` for how each end reaches the other side and what
``drained`` promises. The handshake compat check and the room-outcome observer are whatever the
builder passes (``compat=``, ``emit=``; :meth:`pdplug.manager.PluginManager.make_kv_sender`
passes its own ``check_compat`` and ``emit``); without them a session checks layouts only
(:func:`~pdplug.transfer.handshake.layout_compat`) and emits nothing. There is no process-wide
default.

Threads: each session runs one engine thread (the only caller of its engine and sockets) and,
when it packs, one pack thread. Host calls are thread-safe.
"""

from __future__ import annotations

from pdplug.transfer.engine import TransferEngine, dedup_regions, hard_exit
from pdplug.transfer.faults import FaultyEngine
from pdplug.transfer.handshake import Compat, Emit, layout_compat
from pdplug.transfer.messages import Abort, Done, Heartbeat, Hello, HelloAck, control_codec
from pdplug.transfer.receiver import KVReceiverSession
from pdplug.transfer.sender import KVSenderSession

__all__ = [
    "TransferEngine",
    "dedup_regions",
    "hard_exit",
    "KVSenderSession",
    "KVReceiverSession",
    "FaultyEngine",
    "Compat",
    "Emit",
    "layout_compat",
    "Hello",
    "HelloAck",
    "Abort",
    "Done",
    "Heartbeat",
    "control_codec",
]
