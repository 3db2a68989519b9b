"""The handshake between a decode rank and a prefill rank: the checks that refuse a peer.

A decode rank sends :class:`~pdplug.transfer.messages.Hello` (its
:class:`~pdplug.types.PeerInfo`) to every prefill rank it connects to; each answers
:class:`~pdplug.transfer.messages.HelloAck`, accepted or refused naming every mismatch. Both
sides check: role, backend, TP routing (:func:`tp_routing`), the host's compat function
(:data:`Compat`; :func:`layout_compat` when the builder of the session gives none — a plugin
manager passes its own ``check_compat``, layout checks plus every plugin's veto), and on the
prefill side what its planner and pack buffer can serve (:func:`check_decode_peer`). The
decode side merges its own findings with each prefill rank's refusal (:func:`merge_refusals`)
into one :class:`~pdplug.errors.CompatError`.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import numpy as np

from pdplug.bootstrap import rank_of
from pdplug.config import KVConfig
from pdplug.errors import PlanError
from pdplug.heads import expected_sources, routed_heads
from pdplug.layout import entry_map, layout_mismatches
from pdplug.protocols import PackPlanner
from pdplug.transfer.engine import TransferEngine
from pdplug.types import KVLayout, PdplugEvent, PeerInfo

__all__ = [
    "Compat",
    "Emit",
    "layout_compat",
    "tp_routing",
    "feeding_peers",
    "check_decode_peer",
    "check_prefill_peer",
    "check_prefill_instance",
    "merge_refusals",
]

#: ``compat(local, remote) -> mismatches``; the handshake refuses a peer when it is non-empty.
Compat = Callable[[PeerInfo, PeerInfo], Sequence[str]]

#: ``emit(event)``: observer callback for room outcomes (once per room and rank).
Emit = Callable[[PdplugEvent], None]


def rank_info(
    config: KVConfig,
    engine: TransferEngine,
    entry_base: Sequence[int] | np.ndarray,
    *,
    endpoint: str = "",
    pack: tuple[int, int] = (0, 0),
    extra: dict[str, str] | None = None,
) -> PeerInfo:
    """What a rank tells its peers about itself once its KV is registered: its layout, role
    and instance, the engine's connection blob and agent name, where each entry starts
    (``entry_base``: addresses), its control ``endpoint`` (prefill) and its pack buffer
    ``(address, bytes)``. ``extra`` also carries what the engine's optional ``info_extra()``
    returns (backend fields its peers' engines read at :meth:`TransferEngine.connect`)."""
    own = getattr(engine, "info_extra", None)
    return PeerInfo(
        instance=config.instance,
        role=config.role,
        layout=config.layout,
        control_endpoint=endpoint,
        backend=engine.name,
        agent=engine.agent(),
        entry_base=tuple(int(b) for b in entry_base),
        pack_base=pack[0],
        pack_nbytes=pack[1],
        extra={
            "agent_name": engine.agent_name(),
            **(own() if callable(own) else {}),
            **(extra or {}),
        },
    )


def layout_compat(local: PeerInfo, remote: PeerInfo) -> list[str]:
    """The layout checks alone (:func:`pdplug.layout.layout_mismatches`): what a session uses
    when whoever built it passed no ``compat``."""
    return layout_mismatches(local.layout, remote.layout)


def tp_routing(prefill: KVLayout, decode: KVLayout) -> str | None:
    """Why a prefill rank must not feed a decode rank by TP position, or ``None``.

    A decode TP rank is fed by exactly the prefill TP ranks that :func:`pdplug.heads.head_routes`
    routes its heads from (each head once; a replicated head from one replica), whatever the
    two TP sizes (vLLM #45330). A prefill rank that owes the decode rank no head is refused, so
    it is never planned for or notified. Layouts whose heads cannot be routed at all (opaque
    token rows at unequal TP, head counts that differ) are named by the layout check
    (:func:`pdplug.layout.layout_mismatches`) and the planner, not here.
    """
    try:
        heads = routed_heads(prefill, decode)
    except ValueError:
        return None  # reported by layout_mismatches / the planner
    if heads is not None:
        return None
    srcs = expected_sources(decode, prefill.tp_size, prefill)
    return (
        f"tp_rank: prefill tp_rank {prefill.tp_rank} of tp_size {prefill.tp_size} holds none of "
        f"the KV heads decode tp_rank {decode.tp_rank} of tp_size {decode.tp_size} takes from "
        f"it (it takes them from prefill tp_ranks {list(srcs)}: pdplug.heads.expected_sources)"
    )


def feeding_peers(
    decode: KVLayout, prefill: Sequence[PeerInfo]
) -> tuple[list[PeerInfo], list[str]]:
    """The ranks of one prefill instance that feed decode rank ``decode``, and what is missing.

    A rank feeds ``decode`` when its TP rank is in :func:`pdplug.heads.expected_sources` for its
    PP rank. Every PP rank of the instance (``pp_size`` of the given layouts) must be given with
    all of its feeding TP ranks, otherwise the room would complete without some layers or heads.
    When the heads cannot be routed at all every rank is returned, for the compat check to name
    why.

    :param decode: this decode rank's layout.
    :param prefill: the prefill instance's ranks (:func:`pdplug.bootstrap.resolve`).
    :returns: ``(feeding ranks, problems)``; a problem names the missing (PP, TP) rank.
    """
    peers = list(prefill)
    try:
        want = {
            (p.layout.pp_rank, p.layout.tp_rank)
            for p in peers
            if p.layout.tp_rank in expected_sources(decode, p.layout.tp_size, p.layout)
        }
    except ValueError:
        return peers, []
    keep = [p for p in peers if (p.layout.pp_rank, p.layout.tp_rank) in want]
    problems: list[str] = []
    sizes = {(p.layout.pp_size, p.layout.tp_size) for p in peers}
    if len(sizes) > 1:
        problems.append(
            f"prefill ranks: (pp_size, tp_size) differ across the ranks given: {sorted(sizes)}"
        )
        return keep, problems
    if not peers:
        return keep, problems
    pp_size, tp_size = sizes.pop()
    srcs = expected_sources(decode, tp_size, peers[0].layout)
    have = {(p.layout.pp_rank, p.layout.tp_rank) for p in peers}
    missing = [(k, t) for k in range(pp_size) for t in srcs if (k, t) not in have]
    if missing:
        problems.append(
            f"prefill ranks: (pp_rank, tp_rank) {missing} feed decode tp_rank {decode.tp_rank} "
            f"(tp_size {decode.tp_size}) but were not given to connect; pass every rank of the "
            "instance (pdplug.bootstrap.resolve)"
        )
    return keep, problems


def _identity(remote: PeerInfo, role: str, backend: str, tp: str | None) -> list[str]:
    out: list[str] = []
    if remote.role != role:
        out.append(f"role: expected {role!r}, got {remote.role!r}")
    if remote.backend != backend:
        out.append(f"backend: local {backend} vs remote {remote.backend or '?'}")
    if tp is not None:
        out.append(tp)
    return out


def _compat(compat: Compat, local: PeerInfo, remote: PeerInfo) -> list[str]:
    try:
        return list(compat(local, remote))
    except Exception as e:  # a plugin's veto hook failing is a refusal, not a crash
        return [f"compat check raised {type(e).__name__}: {e}"]


def _dcp_too_large(dcp: int, limit: int) -> str:
    return f"dcp_size: remote {dcp} exceeds this prefill rank's KVConfig.max_dst_dcp={limit}"


def check_decode_peer(
    local: PeerInfo,
    remote: PeerInfo,
    *,
    backend: str,
    compat: Compat,
    planner: PackPlanner,
    max_dst_dcp: int,
    region_nbytes: int | None,
) -> tuple[list[str], np.ndarray | None, bool]:
    """The prefill side's check of a decode rank's Hello: every reason it cannot serve the
    peer (identity, TP routing, the compat function, entry bases, DCP size), then what its
    planner and pack buffer find about the pair when nothing else did.

    :param local: this prefill rank's PeerInfo; ``remote``: the decode rank's.
    :param backend: this rank's engine name.
    :param compat: the host's compat function.
    :param planner: the pack planner (``needs_relayout``, ``capacity_tokens``).
    :param max_dst_dcp: ``KVConfig.max_dst_dcp`` (pack regions exist for that many ranks).
    :param region_nbytes: bytes of one pack region, ``None`` without a pack buffer.
    :returns: ``(mismatches, entry map, relayout)``; the map is ``None`` when refused.
    """
    tp = tp_routing(local.layout, remote.layout)
    out = _identity(remote, "decode", backend, tp) + _compat(compat, local, remote)
    rl, ll = remote.layout, local.layout
    if len(remote.entry_base) != rl.num_entries:
        out.append(f"entry_base: {len(remote.entry_base)} addresses for {rl.num_entries} entries")
    if out:  # the planner cannot judge such a pair; name what it would have found alone
        if rl.dcp_size > max_dst_dcp:  # a DCP destination is always packed
            out.append(_dcp_too_large(rl.dcp_size, max_dst_dcp))
        return out, None, False
    try:
        emap = entry_map(ll, rl)
        relayout = planner.needs_relayout(ll, rl)
        if relayout:
            if rl.dcp_size > max_dst_dcp:
                out.append(_dcp_too_large(rl.dcp_size, max_dst_dcp))
            elif region_nbytes is not None:
                planner.capacity_tokens(ll, rl, region_nbytes)
            else:
                out.append("pack buffer: none (no sharded entry) but the peer needs relayout")
    except (PlanError, ValueError) as e:
        out.append(str(e))
        return out, None, False
    return out, emap, relayout


def check_prefill_peer(
    local: PeerInfo, remote: PeerInfo, *, backend: str, compat: Compat
) -> list[str]:
    """The decode side's check of a prefill rank it is about to connect to (from the
    rendezvous): role, backend, a control endpoint, and the host's compat function."""
    out = _identity(remote, "prefill", backend, tp_routing(remote.layout, local.layout))
    if not remote.control_endpoint:
        out.append("control_endpoint: empty")
    return out + _compat(compat, local, remote)


def check_prefill_instance(
    local: PeerInfo, peers: Sequence[PeerInfo], *, backend: str, compat: Compat
) -> tuple[list[PeerInfo], list[str]]:
    """The decode side's check of one prefill instance before connecting: the ranks that
    feed ``local`` (:func:`feeding_peers`) and this side's mismatches with each, every one
    named with the instance and the rank. ``([], why)`` when no rank can feed it: a rank
    missing from ``peers``, or none holding a KV head of ``local``'s TP rank."""
    instance = peers[0].instance if peers else ""
    lay = local.layout
    feeding, gaps = feeding_peers(lay, peers)
    if not feeding or gaps:
        return [], [f"prefill {instance}: {m}" for m in gaps] or [
            f"tp_rank: no rank of prefill {instance} holds a KV head of decode tp_rank "
            f"{lay.tp_rank} (tp_size {lay.tp_size})"
        ]
    return feeding, [
        f"prefill {instance} rank {rank_of(p.layout)}: {m}"
        for p in feeding
        for m in check_prefill_peer(local, p, backend=backend, compat=compat)
    ]


def _field(mismatch: str) -> str:
    """The field a mismatch line names (text before the first ':' after any prefix)."""
    body = mismatch.split("refused: ", 1)[-1]
    if body.startswith("prefill "):
        body = body.split(": ", 1)[-1]
    return body.split(":", 1)[0].strip()


def merge_refusals(mine: list[str], theirs: list[str]) -> list[str]:
    """The decode side's findings merged with the prefill ranks' refusals: every refusal, and
    the local findings about a field no refusal already named."""
    fields = {_field(m) for m in theirs}
    return theirs + [m for m in mine if _field(m) not in fields]
