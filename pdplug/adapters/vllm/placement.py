"""Where a vLLM worker sits (its :class:`RankPlacement`) and what it reports per step.

Plain values the connector reads from vLLM's config and parallel state, so
:class:`pdplug.adapters.vllm.worker.PushWorker` needs no vLLM import.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import msgspec

__all__ = ["RankPlacement", "TransferResults", "ordered_layers"]


class RankPlacement(msgspec.Struct, frozen=True, kw_only=True):
    """Where a vLLM worker sits and what its KV holds.

    :ivar side: ``"prefill"`` or ``"decode"``.
    :ivar instance: this engine's pdplug instance id.
    :ivar model: model name (both engines must agree).
    :ivar engine_version: vLLM version string.
    :ivar num_kv_heads: KV heads of the whole model.
    :ivar head_size: elements per head.
    :ivar block_size: tokens per vLLM block (pdplug page).
    :ivar tp_size/tp_rank/pp_size/pp_rank/dcp_size/dcp_rank: placement of this worker.
    :ivar bootstrap: prefill: the rendezvous endpoint ``tcp://host:port`` its ranks publish at.
    :ivar kv_sender/pack_planner/scheduler: pdplug selections (None = default).
    :ivar chunk_tokens: split grid (tokens) of the selected scheduler.
    :ivar pack_region_tokens: pack region capacity (tokens).
    :ivar bootstrap_timeout_s/transfer_timeout_s/waiting_timeout_s: room deadlines (seconds).
    :ivar whole_blocks: move a request's last block whole, not only its prompt tokens: vLLM's
        CPU attention stores a block's K slab in its own tiled order, so a token is not a row
        of the slab and only whole blocks can be copied (as vLLM's NixlConnector does).
    """

    side: str
    instance: str
    model: str
    engine_version: str
    num_kv_heads: int
    head_size: int
    block_size: int
    tp_size: int = 1
    tp_rank: int = 0
    pp_size: int = 1
    pp_rank: int = 0
    dcp_size: int = 1
    dcp_rank: int = 0
    bootstrap: str = ""
    kv_sender: str | None = None
    pack_planner: str | None = None
    scheduler: str | None = None
    chunk_tokens: int = 2048
    pack_region_tokens: int = 2048
    bootstrap_timeout_s: float = 60.0
    transfer_timeout_s: float = 30.0
    waiting_timeout_s: float = 120.0
    whole_blocks: bool = True


class TransferResults(msgspec.Struct, kw_only=True):
    """Request ids one :meth:`PushWorker.results` call reports (vLLM's transfer results)."""

    finished_sending: set[str] = set()
    finished_recving: set[str] = set()
    failed_recving: set[str] = set()


def ordered_layers(kv_caches: Mapping[str, Any]) -> list[tuple[str, Any]]:
    """vLLM's ``{layer_name: tensor}`` in model layer order (the trailing layer index of
    ``model.layers.<i>.self_attn.attn``; names without one sort by name after)."""

    def key(name: str) -> tuple[int, str]:
        nums = [int(p) for p in name.split(".") if p.isdigit()]
        return (nums[0] if nums else 1 << 30, name)

    return sorted(kv_caches.items(), key=lambda kv: key(kv[0]))
