"""A prefill process and a decode process moving vLLM-shaped KV caches (:mod:`_vllmkv`) over
a real engine, several scenarios at once (one prefill and one decode instance each).

The test process runs the rendezvous and talks to both children over a Pipe of msgspec-JSON
dicts (:mod:`_kvharness`). The prefill child registers every rank, starts every room on the
ranks that feed the scenario's decode instance (:func:`pdplug.heads.fed_ranks`), sends each
room once it is ``WaitingForInput`` and reports the outcome with per-rank counters. The decode
child registers, connects, expects every room, and once they ended compares every byte of every
decode rank's storage with the reference.
"""

from __future__ import annotations

import os
import time
import traceback
from typing import Any

import _vllmkv as vk
import msgspec
from _kvharness import send

TERMINAL = (0, 4)  # KVPoll.Failed, KVPoll.Success


def _config(role: str, lay: Any, endpoint: str, instance: str) -> Any:
    from pdplug import KVConfig

    return KVConfig(
        instance=instance, role=role, layout=lay, bootstrap_endpoint=endpoint,
        bootstrap_timeout_s=30.0, waiting_timeout_s=30.0, transfer_timeout_s=10.0,
        pack_region_tokens=256, max_dst_dcp=2,
    )  # fmt: skip


def _guard(fn: Any, conn: Any, *args: Any) -> None:
    try:
        fn(conn, *args)
    except Exception:
        send(conn, event="error", trace=traceback.format_exc())
        raise
    conn.close()


def prefill_main(conn: Any, endpoint: str, backend: str, spec: dict[str, Any]) -> None:
    _guard(_prefill, conn, endpoint, backend, spec)


def decode_main(conn: Any, endpoint: str, backend: str, spec: dict[str, Any]) -> None:
    _guard(_decode, conn, endpoint, backend, spec)


def _quit(conn: Any, sessions: list[Any]) -> None:
    while True:
        if conn.poll(0.05):
            cmd = msgspec.json.decode(conn.recv_bytes())
            if cmd.get("op") == "quit":
                for s in sessions:
                    s.close()
                send(conn, event="stats", stats=[])
                return


def _prefill(conn: Any, endpoint: str, backend: str, spec: dict[str, Any]) -> None:
    from pdplug import KVPoll, PluginManager, SchedulerConfig
    from pdplug.heads import fed_ranks

    pm = PluginManager()
    planner = pm.make_pack_planner()
    memory: list[Any] = []  # registered storages outlive the sessions
    ranks: list[dict[str, Any]] = []
    for sc in spec["scenarios"]:
        model, src, dst = sc["model"], sc["src"], sc["dst"]
        sched = pm.make_scheduler(SchedulerConfig(page_size=src["page"], chunk_size=sc["grid"]))
        for t in range(src["tp"]):
            lay = vk.layout(model, src, t)
            st = vk.storage(model, src, t)
            vk.fill_source(model, src, st, t, sc["seed"])
            memory.append(st)
            s = pm.make_kv_sender(
                _config("prefill", lay, endpoint, f"p-{sc['name']}"), planner, name=backend
            )
            s.register_kv(vk.entries(st, src, lay))
            feeds = fed_ranks(lay, dst["tp"], vk.layout(model, dst, 0))
            ranks.append({"sc": sc, "s": s, "tp": t, "feeds": list(feeds), "sched": sched})
    send(conn, event="ready", pid=os.getpid())
    todo: list[tuple[dict[str, Any], int, int, int]] = []
    for r in ranks:
        if r["feeds"]:
            for room, total, _prefix in r["sc"]["rooms"]:
                r["s"].start(room)
                todo.append((r, room, total, 0))
    t_end = time.monotonic() + 120
    while todo and time.monotonic() < t_end:
        left = []
        for r, room, total, sent in todo:
            s = r["s"]
            st = s.poll(room)
            if st == KVPoll.WaitingForInput and not sent:
                d = s.dest(room)[0]
                pages = vk.src_pages(r["sc"]["src"], room, total)
                ps = r["sc"]["src"]["page"]
                for seg in r["sched"].split_send(
                    token_start=d.decode_prefix_len, token_end=total,
                    decode_prefix_len=d.decode_prefix_len, is_last_send=True,
                    capacity_tokens=s.capacity_tokens(room),
                ):  # fmt: skip
                    s.send(room, seg, pages[seg.token_start // ps :])
                sent = 1
            if int(st) in TERMINAL and s.drained(room):
                continue
            left.append((r, room, total, sent))
        todo = left
        time.sleep(0.002)
    out: dict[str, list[dict[str, Any]]] = {}
    for r in ranks:
        s, stats = r["s"], r["s"].stats()
        rooms = [room for room, _t, _p in r["sc"]["rooms"]] if r["feeds"] else []
        out.setdefault(r["sc"]["name"], []).append(
            {
                "tp": r["tp"],
                "feeds": r["feeds"],
                "status": [int(s.poll(room)) for room in rooms],
                "reasons": [s.failure_reason(room) for room in rooms],
                "peers": stats.get("peers", 0),
                "refused": stats.get("refused", 0),
                "posts": stats.get("posts", 0),
                "notify_only": stats.get("notify_only", 0),
                "bytes": stats.get("bytes", 0),
            }
        )
    send(conn, event="done", ranks=out, timed_out=bool(todo))
    _quit(conn, [r["s"] for r in ranks])


def _decode(conn: Any, endpoint: str, backend: str, spec: dict[str, Any]) -> None:
    import torch

    from pdplug import PluginManager
    from pdplug.bootstrap import resolve

    pm = PluginManager()
    ranks: list[dict[str, Any]] = []
    for sc in spec["scenarios"]:
        model, dst = sc["model"], sc["dst"]
        peers = resolve(endpoint, f"p-{sc['name']}", timeout_s=30)
        for t in range(dst["tp"]):
            for c in range(dst.get("dcp", 1)):
                lay = vk.layout(model, dst, t, c)
                st = vk.storage(model, dst, t)
                st.view(-1).view(torch.uint8).fill_(vk.POISON)
                rc = pm.make_kv_receiver(
                    _config("decode", lay, endpoint, f"d-{sc['name']}"), name=backend
                )
                rc.register_kv(vk.entries(st, dst, lay))
                rc.connect(peers)
                ranks.append({"sc": sc, "rc": rc, "tp": t, "dcp": c, "st": st})
    send(conn, event="ready", pid=os.getpid())
    for r in ranks:
        dst = r["sc"]["dst"]
        rank = r["tp"] * dst.get("dcp", 1) + r["dcp"]
        for room, total, prefix in r["sc"]["rooms"]:
            dp = vk.dst_pages(dst, r["sc"]["rooms"], room, rank)
            r["rc"].expect(room, dp, decode_prefix_len=prefix, num_tokens=total)
    t_end = time.monotonic() + 120
    while time.monotonic() < t_end:
        if all(
            int(r["rc"].poll(room)) in TERMINAL for r in ranks for room, _t, _p in r["sc"]["rooms"]
        ):
            break
        time.sleep(0.005)
    out: dict[str, list[dict[str, Any]]] = {}
    for r in ranks:
        sc, rc = r["sc"], r["rc"]
        rooms = [room for room, _t, _p in sc["rooms"]]
        want = vk.expected_storage(
            sc["model"], sc["src"], sc["dst"], sc["rooms"], r["tp"], r["dcp"], sc["seed"]
        )
        got_b, want_b = r["st"].view(-1).view(torch.uint8), want.view(-1).view(torch.uint8)
        bad = torch.nonzero(got_b != want_b).reshape(-1)
        out.setdefault(sc["name"], []).append(
            {
                "tp": r["tp"],
                "dcp": r["dcp"],
                "status": [int(rc.poll(room)) for room in rooms],
                "reasons": [rc.failure_reason(room) for room in rooms],
                "bad_bytes": int(bad.numel()),
                "first_bad": int(bad[0]) if bad.numel() else -1,
                "poison_left": int((want_b == vk.POISON).sum()),
            }
        )
    send(conn, event="done", ranks=out)
    _quit(conn, [r["rc"] for r in ranks])
