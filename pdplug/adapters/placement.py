"""Where an engine's worker sits (:class:`RankPlacement`): the plain values an adapter reads
from its engine's config and parallel state, so the worker side needs no engine import.

One per worker process of either engine (each PP stage, TP rank and DCP rank); it carries
what building the rank's pdplug session needs (``KVConfig``, selections, split grid, room
deadlines, socket rules).
"""

from __future__ import annotations

import msgspec

from pdplug.config import WireConfig

__all__ = ["RankPlacement"]


class RankPlacement(msgspec.Struct, frozen=True, kw_only=True):
    """Where an engine worker sits and what its KV holds.

    :ivar side: ``"prefill"`` or ``"decode"``.
    :ivar instance: this engine's pdplug instance id.
    :ivar model: model name (both engines must agree).
    :ivar engine_version: the engine's version string.
    :ivar num_kv_heads: KV heads of the whole model.
    :ivar head_size: elements per head.
    :ivar block_size: tokens per page (vLLM block, SGLang page).
    :ivar tp_size/tp_rank/pp_size/pp_rank/dcp_size/dcp_rank: placement of this worker.
    :ivar bootstrap: prefill: the rendezvous endpoint ``tcp://host:port`` its ranks publish at.
    :ivar kv_sender/pack_planner/scheduler: pdplug selections (None = default).
    :ivar chunk_tokens: split grid (tokens) of the selected scheduler.
    :ivar pack_region_tokens: pack region capacity (tokens).
    :ivar bootstrap_timeout_s/transfer_timeout_s/waiting_timeout_s: room deadlines (seconds).
    :ivar whole_blocks: move a request's last page whole, not only its prompt tokens: vLLM's
        CPU attention stores a block's K slab in its own tiled order, so a token is not a row
        of the slab and only whole blocks can be copied (as vLLM's NixlConnector does).
    :ivar wire: socket rules of the rank's session and rendezvous calls
        (:func:`pdplug.adapters.wire.adapter_wire`; default loopback, no key).
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
    wire: WireConfig = WireConfig()
