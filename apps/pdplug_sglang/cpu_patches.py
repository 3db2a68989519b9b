"""The harness's own SGLang plugin: what SGLang 0.5.23 needs to run on this CPU-only machine.

SGLang's CPU engine (``SGLANG_USE_CPU_ENGINE=1``) serves a tiny Llama, but its PD paths
assume CUDA in three places, measured here:

* ``--pp-size 2`` builds a PyNccl communicator for the PP group
  (``sglang/srt/distributed/parallel_state.py``, ``init_model_parallel_group``: ``use_pynccl``
  defaults to True off NPU/XPU), which needs a GPU: the PP group is built without it.
* SGLang's ``mooncake`` sender declares ``supports_host_tensor_indices``
  (``disaggregation/mooncake/conn.py``), so ``send_kv_chunk`` copies page indices into pinned
  memory and records a ``torch.cuda.Event`` (``disaggregation/prefill.py``): cleared, so the
  indices are taken on the host as every other backend does.
* SGLang's ``nixl`` backend registers the KV pool as ``VRAM`` (``disaggregation/decode.py``
  and ``nixl/conn.py``, ``_normalize_kv_mem_kinds``): the pools are host memory here, so they
  are registered as ``DRAM``.

With ``PDPLUG_SGLANG_TRACE_DIR`` set (``pdplug bench sglang``), SGLang's own PP bootstrap is
traced with the events pdplug's backend traces: a room turning WaitingForInput on a PP rank
(``CommonKVManager.update_status``) and the rank admitting it (``CommonKVSender.init``).

None of this is about pdplug: it lets the harness run SGLang's own backends (the baselines)
and SGLang itself on CPU. :func:`register` is the entry point of the ``sglang.srt.plugins``
group that :func:`pdplug_sglang.overlay.write_overlay` declares in the overlay folder, so
only engines the harness starts load it. It changes nothing unless ``SGLANG_USE_CPU_ENGINE``
is set.
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Callable
from typing import Any

__all__ = ["register"]

log = logging.getLogger(__name__)

_done = False


def _no_pynccl(original: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
    kwargs["use_pynccl"] = False
    return original(*args, **kwargs)


def _dram_kinds(kinds: list[str] | None, expected_len: int) -> list[str]:
    return ["DRAM"] * expected_len


def _cpu_kv_class(original: Callable[..., Any], backend: Any, class_type: Any) -> Any:
    cls = original(backend, class_type)
    name = getattr(backend, "name", str(backend))
    if name == "MOONCAKE" and getattr(cls, "supports_host_tensor_indices", False):
        cls.supports_host_tensor_indices = False
    elif name == "NIXL":
        from sglang.srt.disaggregation.nixl import conn

        if conn._normalize_kv_mem_kinds is not _dram_kinds:
            conn._normalize_kv_mem_kinds = _dram_kinds
    return cls


def _trace_ready(result: Any, mgr: Any, room: int, status: Any, *a: Any, **kw: Any) -> None:
    if int(status) == 2 and getattr(mgr, "pp_size", 1) > 1:  # KVPoll.WaitingForInput
        _trace(mgr).write(int(room), "ready", time.time())


def _trace_applied(result: Any, sender: Any, *a: Any, **kw: Any) -> None:
    mgr = sender.kv_mgr
    if getattr(mgr, "pp_size", 1) > 1:
        _trace(mgr).write(int(sender.bootstrap_room), "applied", time.time())


_traces: dict[int, Any] = {}


def _trace(mgr: Any) -> Any:
    from pdplug.adapters.sglang.consensus import TraceLog

    key = id(mgr)
    if key not in _traces:
        d = os.environ["PDPLUG_SGLANG_TRACE_DIR"]
        _traces[key] = TraceLog(d, int(mgr.pp_rank), int(getattr(mgr, "attn_tp_rank", 0)), "sglang")
    return _traces[key]


def register() -> None:
    """Register the CPU workarounds with SGLang's ``HookRegistry`` (once per process).

    Called by SGLang's ``load_plugins`` in every process it starts (server, scheduler,
    detokenizer); a no-op unless ``SGLANG_USE_CPU_ENGINE`` is set.
    """
    global _done
    if _done or os.environ.get("SGLANG_USE_CPU_ENGINE", "") not in ("1", "true", "True"):
        return
    _done = True
    from sglang.srt.plugins.hook_registry import HookRegistry, HookType

    HookRegistry.register(
        "sglang.srt.distributed.parallel_state.init_model_parallel_group",
        _no_pynccl,
        HookType.AROUND,
    )
    HookRegistry.register(
        "sglang.srt.disaggregation.utils.get_kv_class", _cpu_kv_class, HookType.AROUND
    )
    if os.environ.get("PDPLUG_SGLANG_TRACE_DIR"):
        # admission timestamps of SGLang's own PP bootstrap (PPConsensusStore), the same
        # events pdplug's backend traces (pdplug.adapters.sglang.consensus.TraceLog)
        common = "sglang.srt.disaggregation.common.conn"
        HookRegistry.register(
            f"{common}.CommonKVManager.update_status", _trace_ready, HookType.AFTER
        )
        HookRegistry.register(f"{common}.CommonKVSender.init", _trace_applied, HookType.AFTER)
    log.info("pdplug_sglang.cpu_patches: CPU workarounds registered")
