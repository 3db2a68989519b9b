"""What a vLLM worker reports per step, and vLLM's KV caches in layer order.

Plain values, so :class:`pdplug.adapters.vllm.worker.PushWorker` needs no vLLM import; where
a worker sits is the shared :class:`pdplug.adapters.placement.RankPlacement`.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import msgspec

__all__ = ["TransferResults", "ordered_layers"]


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
