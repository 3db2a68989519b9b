"""Rank programs of the interface tests: one SGLang scheduler's transfer side, no model.

Each runs in its own spawned process, as an SGLang prefill or decode scheduler would: it sets
SGLang's parallel context (``get_parallel().override_permanently``), registers pdplug's
SGLang plugin and applies SGLang's ``HookRegistry`` exactly as ``load_plugins`` does, builds
SGLang's own ``KVArgs`` and ``MetadataBuffers``, asks SGLang's ``get_kv_class`` for the
``pdplug`` backend's classes and makes the calls SGLang's queues make, in their order
(``docs/sglang-backend.md`` section 2). KV, metadata and state buffers are real tensors with
known contents; the decode side reports what landed, byte for byte, to the test process.
"""

from __future__ import annotations

import os
import time
import traceback
from types import SimpleNamespace
from typing import Any

LAYERS = 2
HEADS = 2
HEAD_DIM = 16
STATE_ITEM = (48, 80)  # bytes per item of the two buffers of the test's state type


def _setup(cfg: dict[str, Any]) -> Any:
    os.environ.update(cfg.get("env", {}))
    from sglang.srt.runtime_context import get_parallel

    par = cfg["parallel"]
    fields = dict(
        tp_size=par["attn_tp_size"], tp_rank=par["attn_tp_rank"], attn_tp_size=par["attn_tp_size"],
        attn_tp_rank=par["attn_tp_rank"], attn_dcp_size=par.get("dcp_size", 1),
        attn_dcp_rank=par.get("dcp_rank", 0), attn_cp_size=1, attn_dp_size=1,
        pp_size=par.get("pp_size", 1), pp_rank=par.get("pp_rank", 0),
    )  # fmt: skip
    if par.get("pp_size", 1) > 1:
        import torch.distributed as dist

        dist.init_process_group(
            "gloo", init_method=par["dist_url"], world_size=par["pp_size"], rank=par["pp_rank"]
        )
        fields["pp_group"] = SimpleNamespace(cpu_group=dist.group.WORLD)
    get_parallel().override_permanently(**fields)
    from sglang.srt.plugins.hook_registry import HookRegistry

    import pdplug.adapters.sglang as adapter

    adapter.register()
    HookRegistry.apply_hooks()
    from sglang.srt.disaggregation import utils

    return utils


def _buffers(cfg: dict[str, Any], fill: bool) -> dict[str, Any]:
    import torch

    g = torch.Generator().manual_seed(1234)
    tokens = cfg["pool_pages"] * cfg["page_size"]
    layers = cfg.get("layers", LAYERS)

    def kv() -> torch.Tensor:
        if fill:
            return torch.randn(tokens, HEADS, HEAD_DIM, generator=g).to(torch.bfloat16)
        return torch.zeros(tokens, HEADS, HEAD_DIM, dtype=torch.bfloat16)

    k = [kv() for _ in range(layers)]
    v = [kv() for _ in range(layers)]
    slots = 8
    aux = [torch.zeros(slots, 64, dtype=torch.uint8), torch.zeros(slots, 16, dtype=torch.int64)]
    state = [torch.zeros(32, n, dtype=torch.uint8) for n in STATE_ITEM]
    return {"k": k, "v": v, "aux": aux, "state": state}


def _kv_args(utils: Any, cfg: dict[str, Any], bufs: dict[str, Any]) -> Any:
    args = utils.get_kv_class(utils.TransferBackend("pdplug"), utils.KVClassType.KVARGS)()
    kvs = bufs["k"] + bufs["v"]
    args.engine_rank = cfg["parallel"]["attn_tp_rank"]
    args.pp_rank = cfg["parallel"].get("pp_rank", 0)
    args.prefill_start_layer = cfg.get("first_layer", 0)
    args.kv_data_ptrs = [t.data_ptr() for t in kvs]
    args.kv_data_lens = [t.nbytes for t in kvs]
    args.kv_item_lens = [t[0].nbytes * cfg["page_size"] for t in kvs]
    args.num_draft_entries = 0
    args.page_size = cfg["page_size"]
    args.kv_cache_dtype_str = "bfloat16"
    args.gpu_id = 0
    args.aux_data_ptrs = [t.data_ptr() for t in bufs["aux"]]
    args.aux_data_lens = [t.nbytes for t in bufs["aux"]]
    args.aux_item_lens = [t[0].nbytes for t in bufs["aux"]]
    if cfg.get("state"):
        args.state_types = ["mamba"]
        args.state_data_ptrs = [[t.data_ptr() for t in bufs["state"]]]
        args.state_data_lens = [[t.nbytes for t in bufs["state"]]]
        args.state_item_lens = [[t[0].nbytes for t in bufs["state"]]]
        args.state_dim_per_tensor = [[0, 0]]
    else:
        args.state_types = []
    return args


def _server_args(cfg: dict[str, Any]) -> Any:
    return SimpleNamespace(
        host="127.0.0.1", port=cfg.get("http_port", 1), chunked_prefill_size=cfg.get("grid", 4096),
        disaggregation_bootstrap_port=cfg["bootstrap_port"], served_model_name="tiny-test",
        device="cpu", dist_init_addr=None,
    )  # fmt: skip


def _manager(utils: Any, cfg: dict[str, Any], args: Any, mode: str) -> Any:
    cls = utils.get_kv_class(utils.TransferBackend("pdplug"), utils.KVClassType.MANAGER)
    return cls(args, utils.DisaggregationMode(mode), _server_args(cfg), False)


def _wait(poll: Any, until: tuple[int, ...], timeout_s: float) -> int:
    deadline = time.monotonic() + timeout_s
    while True:
        s = int(poll())
        if s in until or time.monotonic() > deadline:
            return s
        time.sleep(0.005)


def prefill_rank(cfg: dict[str, Any], out: Any) -> None:
    """Prefill: per room of ``cfg["rooms"]``, SGLang's bootstrap, chunked sends, inflight."""
    try:
        utils = _setup(cfg)
        bufs = _buffers(cfg, fill=True)
        mgr = _manager(utils, cfg, _kv_args(utils, cfg, bufs), "prefill")
        sender_cls = utils.get_kv_class(utils.TransferBackend("pdplug"), utils.KVClassType.SENDER)
        results: dict[str, Any] = {}
        p = cfg["page_size"]
        for room in cfg["rooms"]:
            r = room["room"]
            addr = f"127.0.0.1:{cfg['bootstrap_port']}"
            s = sender_cls(mgr=mgr, bootstrap_addr=addr, bootstrap_room=r)
            t0 = time.monotonic()
            # PP: SGLang hands PP0's answer down its PP chain; the decision is on every rank
            poll = s.poll_pp_consensus if cfg["parallel"].get("pp_size", 1) > 1 else s.poll
            if room.get("fail_here"):
                s.abort()
            st = _wait(poll, (2, 0), cfg.get("bootstrap_wait_s", 60.0))
            res: dict[str, Any] = {"bootstrap": st, "bootstrap_s": time.monotonic() - t0}
            if st != 2:
                try:
                    s.failure_exception()
                except Exception as e:
                    res["reason"] = str(e)
                results[str(r)] = res
                continue
            prefix = s.pop_decode_prefix_len()
            res["capacity"] = mgr.sessions["kv"].capacity_tokens(r)
            n = room["prompt"]
            slot = room["aux_slot"]
            s.init(-(-(n - prefix) // p), slot)
            # the metadata row SGLang's set_buf writes before the last send
            bufs["aux"][0][slot] = (r + 7) % 251
            bufs["aux"][1][slot] = r
            for i, t in enumerate(bufs["state"]):
                for j in room.get("state_src", []):
                    t[j] = (j * 13 + i * 5 + r) % 256
            pages = room["src_pages"]  # page of token position k: pages[k // p]
            pos, grid = prefix, cfg.get("chunk", n)
            if room.get("abort_after_first_send"):
                grid = max(p, (n - prefix) // 2 // p * p)
            while pos < n:
                end = min(n, pos + grid)
                last = end == n
                if not last:
                    end -= end % p
                idx = pages[pos // p : -(-end // p)]
                state = [room.get("state_src", [])] if cfg.get("state") and last else None
                s.send(idx, state, num_kv_tokens=end - pos)
                pos = end
                if room.get("abort_after_first_send"):
                    s.abort()
                    break
            st = _wait(s.poll, (4, 0), cfg.get("transfer_wait_s", 60.0))
            res.update(end=st, prefix=prefix)
            if st == 0:
                try:
                    s.failure_exception()
                except Exception as e:
                    res["reason"] = str(e)
            else:
                s.clear()
            results[str(r)] = res
        results["stats"] = {
            k: v for k, v in mgr.stats()["planes"]["kv"].items() if isinstance(v, int)
        }
        out.put(("prefill", cfg["parallel"].get("pp_rank", 0), results))
        time.sleep(cfg.get("linger_s", 2.0))
        mgr.close()
    except Exception:
        out.put(("prefill-error", cfg["parallel"].get("pp_rank", 0), traceback.format_exc()))


def decode_rank(cfg: dict[str, Any], out: Any) -> None:
    """Decode: per room, SGLang's prealloc (init, send_metadata) then the transfer queue; the
    bytes that landed are reported (KV per token in this rank's DCP slots, aux row, state)."""
    try:
        utils = _setup(cfg)
        bufs = _buffers(cfg, fill=False)
        mgr = _manager(utils, cfg, _kv_args(utils, cfg, bufs), "decode")
        recv_cls = utils.get_kv_class(utils.TransferBackend("pdplug"), utils.KVClassType.RECEIVER)
        addr = f"127.0.0.1:{cfg['bootstrap_port']}"
        deadline = time.monotonic() + 60.0
        while not mgr.try_ensure_parallel_info(addr) and time.monotonic() < deadline:
            time.sleep(0.05)
        results: dict[str, Any] = {}
        for room in cfg["rooms"]:
            r = room["room"]
            rc = recv_cls(mgr=mgr, bootstrap_addr=addr, bootstrap_room=r)
            rc.init(0)
            st = _wait(rc.poll, (2, 0), 10.0)
            res: dict[str, Any] = {"init": st}
            if room.get("decode_abort_before_metadata"):
                rc.abort()
                res["end"] = int(rc.poll())
                results[str(r)] = res
                continue
            state = [room.get("state_dst", [])] if cfg.get("state") else None
            rc.send_metadata(
                room["dst_pages"], room["aux_slot"], state, decode_prefix_len=room["prefix"]
            )
            st = _wait(rc.poll, (4, 0), cfg.get("transfer_wait_s", 60.0))
            res["end"] = st
            if st == 0:
                try:
                    rc.failure_exception()
                except Exception as e:
                    res["reason"] = str(e)
                # the failure may arrive while the prefill's write is still in flight (its
                # drained=False report): SGLang's deferred release polls until it is safe
                t_fail, safe = time.monotonic(), False
                while not safe and time.monotonic() - t_fail < cfg.get("drain_wait_s", 10.0):
                    rc.poll()
                    safe = mgr.is_abort_release_safe(r, 0)
                    time.sleep(0 if safe else 0.005)
                res["drained"], res["drain_s"] = safe, round(time.monotonic() - t_fail, 3)
            else:
                slot = room["aux_slot"]
                res["aux"] = [bufs["aux"][0][slot].tolist(), bufs["aux"][1][slot].tolist()]
                res["state"] = [
                    [t[j].tolist() for j in room.get("state_dst", [])] for t in bufs["state"]
                ]
                # this rank's tokens: logical i (i % dcp == rank) at local offset i // dcp
                p, dcp, rank = (
                    cfg["page_size"],
                    cfg["parallel"].get("dcp_size", 1),
                    cfg["parallel"].get("dcp_rank", 0),
                )
                vp = p * dcp
                got = {}
                for i in range(room["prefix"], room["prompt"]):
                    if i % dcp != rank:
                        continue
                    rel = i - room["prefix"]
                    page = room["dst_pages"][rel // vp]
                    slot_i = page * p + (i % vp) // dcp
                    got[i] = [
                        [
                            t[slot_i].view(-1).view(__import__("torch").int16).tolist()
                            for t in bufs[kv]
                        ]
                        for kv in ("k", "v")
                    ]
                res["kv"] = got
            rc.clear()
            results[str(r)] = res
        out.put(("decode", cfg["parallel"].get("dcp_rank", 0), results))
        time.sleep(cfg.get("linger_s", 2.0))
        mgr.close()
    except Exception:
        out.put(("decode-error", cfg["parallel"].get("dcp_rank", 0), traceback.format_exc()))


def expected_kv(cfg: dict[str, Any], room: dict[str, Any]) -> dict[int, Any]:
    """What the prefill's buffers hold for each logical token of ``room`` (same seed)."""
    import torch

    bufs = _buffers(cfg, fill=True)
    p = cfg["page_size"]
    out = {}
    for i in range(room["prefix"], room["prompt"]):
        slot = room["src_pages"][i // p] * p + i % p
        out[i] = [
            [t[slot].view(-1).view(torch.int16).tolist() for t in bufs[kv]] for kv in ("k", "v")
        ]
    return out
