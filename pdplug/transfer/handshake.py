"""The handshake between a decode rank and a prefill rank: the checks that refuse a peer.

A decode rank sends :class:`~pdplug.transfer.messages.Hello` (its
:class:`~pdplug.types.PeerInfo`) to every prefill rank it connects to; each answers
:class:`~pdplug.transfer.messages.HelloAck`, accepted or refused naming every mismatch. Both
sides check: role, backend, TP pairing (:func:`tp_pairing`), the host's compat function
(:data:`Compat`; :func:`layout_compat` when the builder of the session gives none — a plugin
manager passes its own ``check_compat``, layout checks plus every plugin's veto), and on the
prefill side what its planner and pack buffer can serve (:func:`check_decode_peer`). The
decode side merges its own findings with each prefill rank's refusal (:func:`merge_refusals`)
into one :class:`~pdplug.errors.CompatError`.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import numpy as np

from pdplug.errors import PlanError
from pdplug.layout import entry_map, layout_mismatches
from pdplug.protocols import PackPlanner
from pdplug.types import KVLayout, PdplugEvent, PeerInfo

__all__ = [
    "Compat",
    "Emit",
    "layout_compat",
    "tp_pairing",
    "check_decode_peer",
    "check_prefill_peer",
    "merge_refusals",
]

#: ``compat(local, remote) -> mismatches``; the handshake refuses a peer when it is non-empty.
Compat = Callable[[PeerInfo, PeerInfo], Sequence[str]]

#: ``emit(event)``: observer callback for room outcomes (once per room and rank).
Emit = Callable[[PdplugEvent], None]


def layout_compat(local: PeerInfo, remote: PeerInfo) -> list[str]:
    """The layout checks alone (:func:`pdplug.layout.layout_mismatches`): what a session uses
    when whoever built it passed no ``compat``."""
    return layout_mismatches(local.layout, remote.layout)


def tp_pairing(prefill: KVLayout, decode: KVLayout) -> str | None:
    """Why a prefill rank cannot feed a decode rank by TP position, or ``None``.

    A decode TP rank is fed by the prefill ranks of the same TP rank (equal TP sizes; each
    rank holds the same heads). Other TP ratios need a planner that maps heads between ranks
    (vLLM #45330) and are refused here.
    """
    if prefill.tp_size != decode.tp_size:
        return (
            f"tp_size: prefill {prefill.tp_size} vs decode {decode.tp_size} (a decode TP rank "
            "is fed by the prefill TP rank of the same index; other ratios are not supported)"
        )
    if prefill.tp_rank != decode.tp_rank:
        return (
            f"tp_rank: prefill {prefill.tp_rank} vs decode {decode.tp_rank} (connect a decode "
            "TP rank to the prefill ranks of its own TP rank)"
        )
    return None


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
    """The prefill side's check of a decode rank's Hello.

    :param local: this prefill rank's PeerInfo; ``remote``: the decode rank's.
    :param backend: this rank's engine name.
    :param compat: the host's compat function.
    :param planner: the pack planner (``needs_relayout``, ``capacity_tokens``).
    :param max_dst_dcp: ``KVConfig.max_dst_dcp`` (pack regions exist for that many ranks).
    :param region_nbytes: bytes of one pack region, ``None`` without a pack buffer.
    :returns: ``(mismatches, entry map, relayout)``; the map is ``None`` when refused.
    """
    tp = tp_pairing(local.layout, remote.layout)
    out = _identity(remote, "decode", backend, tp) + _compat(compat, local, remote)
    if out:
        return out, None, False
    rl, ll = remote.layout, local.layout
    if len(remote.entry_base) != rl.num_entries:
        out.append(f"entry_base: {len(remote.entry_base)} addresses for {rl.num_entries} entries")
    try:
        emap = entry_map(ll, rl)
        relayout = planner.needs_relayout(ll, rl)
        if relayout:
            if rl.dcp_size > max_dst_dcp:
                out.append(
                    f"dcp_size: remote {rl.dcp_size} exceeds this prefill rank's "
                    f"KVConfig.max_dst_dcp={max_dst_dcp}"
                )
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
    out = _identity(remote, "prefill", backend, tp_pairing(remote.layout, local.layout))
    if not remote.control_endpoint:
        out.append("control_endpoint: empty")
    return out + _compat(compat, local, remote)


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
